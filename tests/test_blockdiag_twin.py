"""CPU twin of the GPU's block-diagonal products (spchain/blockdiag.py): the arguments of the
one strided-batched cuBLAS GEMM that ``batched_matmul`` gives cuBLAS (``gemm_plan``) are run
here by a NumPy emulation of ``gemmStridedBatched`` on the very views (column-major, as cuBLAS
reads memory), and must give the product, for the forward, the input gradient (a transposed
weight view) and the weight gradient (a transposed input view): no operand copied."""

import numpy as np
import pytest

from spchain import blockdiag

OPS = {0: lambda m: m, 1: lambda m: m.swapaxes(-1, -2)}


def emulate(plan, a, b, out):
    """cuBLAS ``gemmStridedBatched(alpha=1, beta=0)`` on the memory of ``b`` (its A), ``a`` (its
    B) and ``out`` (its C), each read column-major from its first element by the plan's
    leading dimensions and batch strides."""
    item = out.itemsize

    def matrices(v, op, rows, cols, ld, stride):
        stored = (rows, cols) if op == 0 else (cols, rows)
        view = np.lib.stride_tricks.as_strided(v, (plan["batch"],) + stored, (stride * item, item, ld * item),
                                               writeable=False)
        return OPS[op](view)

    first = matrices(b, plan["transa"], plan["m"], plan["k"], plan["lda"], plan["stride_a"])
    second = matrices(a, plan["transb"], plan["k"], plan["n"], plan["ldb"], plan["stride_b"])
    c = np.lib.stride_tricks.as_strided(out, (plan["batch"], plan["m"], plan["n"]),
                                        (plan["stride_c"] * item, item, plan["ldc"] * item))
    c[...] = first @ second


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, groups, d_in, d_out", [(5, 3, 4, 6), (1, 2, 3, 1), (7, 1, 1, 2), (4, 3, 2, 2)])
def test_gemm_plan_computes_every_block_diag_product_on_views(rng, dtype, rows, groups, d_in, d_out):
    x = rng.normal(size=(rows, groups, d_in)).astype(dtype)
    w = rng.normal(size=(groups, d_in, d_out)).astype(dtype)
    grad = rng.normal(size=(rows, groups, d_out)).astype(dtype)
    cases = [  # (a, b, the result): forward, input gradient, weight gradient, as the GPU branch calls them
        (x.swapaxes(0, 1), w, np.einsum("rgi,gio->rgo", x, w)),
        (grad.swapaxes(0, 1), w.swapaxes(1, 2), np.einsum("rgo,gio->rgi", grad, w)),
        (x.transpose(1, 2, 0), grad.swapaxes(0, 1), np.einsum("rgi,rgo->gio", x, grad)),
    ]
    for a, b, want in cases:
        result = np.full(want.shape, np.nan, dtype)
        out = result.swapaxes(0, 1) if result.shape[:2] == (rows, groups) else result
        plan = blockdiag.gemm_plan(a, b, out)
        assert plan is not None, "every view the products make is a cuBLAS operand"
        emulate(plan, a, b, out)
        np.testing.assert_allclose(result, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)


def test_gemm_plan_declines_what_cublas_cannot_read(rng):
    a, b = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 4, 5))
    out = np.empty((2, 3, 5))
    assert blockdiag.gemm_plan(a[:, :, ::2], b[:, ::2], out[:, :, :]) is None  # no unit stride
    assert blockdiag.gemm_plan(a, b, np.empty((2, 5, 3)).swapaxes(1, 2)) is None  # out's rows strided
    assert blockdiag.gemm_plan(a.astype(np.float32), b, out) is None  # mixed dtypes


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_plan_computes_equal_grouped_products_on_views(rng, dtype):
    groups, n, d_in, d_out = 3, 4, 5, 2
    x = rng.normal(size=(groups * n, d_in)).astype(dtype)
    w = rng.normal(size=(groups, d_in, d_out)).astype(dtype)
    grad = rng.normal(size=(groups * n, d_out)).astype(dtype)
    x3, grad3 = x.reshape(groups, n, d_in), grad.reshape(groups, n, d_out)
    cases = [  # forward, input gradient, weight gradient: the views the GPU branch passes
        (x3, w, np.empty((groups * n, d_out), dtype).reshape(groups, n, d_out), x3 @ w),
        (grad3, w.swapaxes(1, 2), np.empty((groups * n, d_in), dtype).reshape(groups, n, d_in),
         grad3 @ w.swapaxes(1, 2)),
        (x3.swapaxes(1, 2), grad3, np.empty((groups, d_in, d_out), dtype), x3.swapaxes(1, 2) @ grad3),
    ]
    for a, b, out, want in cases:
        plan = blockdiag.gemm_plan(a, b, out)
        assert plan is not None
        emulate(plan, a, b, out)
        np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)


def test_grouped_gpu_branch_batches_equal_groups_only(monkeypatch, rng):
    import contextlib

    import scipy.sparse

    from spchain import _backend

    calls = []

    def batched(xp, a, b, out):
        calls.append(a.shape)
        emulate(blockdiag.gemm_plan(a, b, out), a, b, out)

    monkeypatch.setattr(blockdiag, "batched_matmul", batched)
    monkeypatch.setattr(_backend.Backend, "use", lambda self: contextlib.nullcontext())
    gpu = _backend.Backend(np, scipy.sparse, 0)
    x, w = rng.normal(size=(6, 4)), rng.normal(size=(3, 4, 2))
    for sizes, batched_calls in (([2, 2, 2], 1), ([1, 3, 2], 0), ([0, 3, 3], 0)):
        calls.clear()
        got = blockdiag._grouped_product(gpu, x, w, np.array(sizes), np.dtype(np.float64))
        np.testing.assert_allclose(got, blockdiag.grouped_matmul(x, w, sizes), rtol=1e-12)
        assert len(calls) == batched_calls
