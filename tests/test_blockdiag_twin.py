"""CPU twin of the GPU's block-diagonal products (spchain/blockdiag.py): the arguments of the
one strided-batched cuBLAS GEMM that ``batched_matmul`` gives cuBLAS (``gemm_plan``) are run
here by a NumPy emulation of ``gemmStridedBatched`` on the very views (column-major, as cuBLAS
reads memory), and must give the product, for the forward, the input gradient (a transposed
weight view) and the weight gradient (a transposed input view): no operand copied."""

import numpy as np
import pytest
import reference

from spchain import blockdiag
from spchain._op import Saved

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
    with np.errstate(invalid="ignore"):  # cuBLAS raises no flags; whether NumPy's BLAS does for an inf varies
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


def emulate_indexed(plan, a, b, out):
    """cuBLAS ``gemmBatched(alpha=1, beta=0)``: chunk c reads its A at ``offsets_a[c]`` elements
    from ``b``'s first element, its B from ``a``'s and writes its C from ``out``'s, column-major."""
    item = out.itemsize

    def matrix(v, offset, op, rows, cols, ld):
        stored = (rows, cols) if op == 0 else (cols, rows)
        start = np.lib.stride_tricks.as_strided(v, (offset + 1,), (item,))[offset:]
        return OPS[op](np.lib.stride_tricks.as_strided(start, stored, (item, ld * item), writeable=False))

    for c in range(plan["batch"]):
        first = matrix(b, plan["offsets_a"][c], plan["transa"], plan["m"], plan["k"], plan["lda"])
        second = matrix(a, plan["offsets_b"][c], plan["transb"], plan["k"], plan["n"], plan["ldb"])
        start = np.lib.stride_tricks.as_strided(out, (plan["offsets_c"][c] + 1,), (item,))[plan["offsets_c"][c]:]
        with np.errstate(invalid="ignore"):  # cuBLAS raises no flags; whether NumPy's BLAS does for an inf varies
            np.lib.stride_tricks.as_strided(start, (plan["m"], plan["n"]), (item, plan["ldc"] * item))[...] = first @ second


def per_group(x, w, sizes, grad):
    """The per-group loop, in float64: the product and both gradients."""
    return (reference.grouped_matmul(x, w, sizes), reference.grouped_matmul(grad, w.swapaxes(1, 2), sizes),
            reference.grouped_weight_grad(x, grad, sizes))


@pytest.mark.parametrize("sizes", [[1, 3, 2], [0, 3, 3], [6], [0, 0, 6, 0], [9, 0, 1, 1, 0, 2], [1, 1, 1, 1, 1, 14]])
def test_ragged_groups_are_one_batched_gemm_on_the_gpu_branch(monkeypatch, rng, sizes):
    import contextlib

    import scipy.sparse

    from spchain import _backend

    sizes = np.array(sizes)
    rows, groups = int(sizes.sum()), len(sizes)
    calls = []

    def indexed(xp, a, b, index, out):
        assert np.shares_memory(b, w) or b.shape[1] == 0, "the weight is read where it lies, never copied"
        assert a.shape[0] * a.shape[1] <= 2 * rows + groups and len(index) <= 2 * groups, "padding bounded"
        calls.append("indexed")
        emulate_indexed(blockdiag.indexed_gemm_plan(a, b, index, out), a, b, out)

    def batched(xp, a, b, out):
        calls.append("batched")
        emulate(blockdiag.gemm_plan(a, b, out), a, b, out)

    gpu = _backend.Backend(np, scipy.sparse, 0)
    monkeypatch.setattr(blockdiag, "indexed_matmul", indexed)
    monkeypatch.setattr(blockdiag, "batched_matmul", batched)
    monkeypatch.setattr(blockdiag, "backend_of", lambda *arrays, **kwargs: gpu)
    monkeypatch.setattr(_backend.Backend, "use", lambda self: contextlib.nullcontext())
    x, w, grad = rng.normal(size=(rows, 4)), rng.normal(size=(groups, 4, 3)), rng.normal(size=(rows, 3))
    x[0, 1] = np.inf  # stays in its own group's gradient
    with np.errstate(invalid="ignore"):  # the inf row's products: inf - inf (NumPy 2.4's BLAS flags it)
        want = per_group(x, w, sizes, grad)
    y = blockdiag.grouped_matmul(x, w, sizes.tolist())
    grad_x, grad_w = grouped_backward(x, w, sizes, grad)
    for got, expected in zip((y, grad_x, grad_w), want):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert calls == ["indexed", "indexed", "batched"] if len(set(sizes.tolist())) > 1 else ["batched"] * 3


def grouped_backward(x, w, sizes, grad):
    """``(grad_x, grad_w)`` by :data:`blockdiag.GROUPED`'s backward, prepared as the registered
    operator's backward prepares (trusted operands)."""
    problem = blockdiag.GROUPED.prepare(x, w, sizes, check=False)
    return blockdiag.GROUPED.backward(problem, Saved(), (grad,), (True, True)).ordered()


def test_ragged_plan_pads_at_most_twice_the_rows():
    for sizes in ([1, 3, 2], [0, 0, 7], [100, 1, 1, 1], [3, 3, 4]):
        sizes = np.array(sizes)
        plan = blockdiag.ragged_plan(sizes)
        rows, nonempty = sizes.sum(), np.count_nonzero(sizes)
        assert plan.chunk_group.size <= 2 * nonempty and plan.chunk_group.size * plan.rows <= 2 * rows + nonempty
        assert np.unique(plan.dest).size == rows and np.all(plan.dest < plan.chunk_group.size * plan.rows)
        assert np.array_equal(np.bincount(plan.chunk_group[plan.dest // plan.rows], minlength=sizes.size), sizes)


def test_cpu_keeps_one_blas_product_per_group(monkeypatch, rng):
    def fail(*args):
        raise AssertionError("the CPU path takes no padded chunks")

    monkeypatch.setattr(blockdiag, "indexed_matmul", fail)
    monkeypatch.setattr(blockdiag, "_ragged_weight_grad", fail)
    sizes = np.array([2, 0, 5, 1])
    x, w, grad = rng.normal(size=(8, 3)), rng.normal(size=(4, 3, 2)), rng.normal(size=(8, 2))
    y = blockdiag.grouped_matmul(x, w, sizes.tolist())
    got = (y,) + grouped_backward(x, w, sizes, grad)
    for g, want in zip(got, per_group(x, w, sizes, grad)):
        np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-12)
