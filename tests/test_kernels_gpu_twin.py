"""The CUDA kernels of the GPU paths of issue 23 against their CPU twins, on NumPy arrays under
NUMBA_ENABLE_CUDASIM=1 with tiny launch sizes (several blocks, grid-stride loops): the masked
exact transition counts (spchain/kernels/cuda/chain.py) and the device-side fix-up of a scaled
log-space product (spchain/kernels/cuda/logspace.py)."""

import numpy as np
import pytest

from spchain import _logspace
from spchain.kernels.cpu import chain as cpu_chain
from test_kernels_chain import normalised_problem, run


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("per_step", [True, False])
def test_masked_transition_grad_fills_only_flagged_matrices(small_launch, rng, per_step):
    from spchain.kernels.cuda import chain as cuda_chain

    x, trans, group, init, lengths = normalised_problem(rng, rows=6, group=3, per_step=per_step)
    pre, norm, marg, want = run(cpu_chain, "", x, trans, group, init, lengths)
    weight = np.linspace(0.5, 2.0, x.shape[0])
    ok = np.zeros(trans.shape[:2], bool)
    ok[0, 0] = True
    got = np.full_like(want, 7.0)
    cuda_chain.launch_chain_transition_grad_masked(x, trans, group, lengths, pre, norm, marg, weight, ok, got)
    np.testing.assert_allclose(got[~ok], want[~ok], rtol=1e-12, atol=1e-12)
    assert (got[ok] == 7.0).all()


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_log_product_fixup_matches_numpy_twin(small_launch, rng, dtype):
    from spchain.kernels.cuda import logspace as cuda_logspace

    a = (rng.normal(size=(2, 3, 5)) * 300).astype(dtype)
    b = (rng.normal(size=(1, 5, 4)) * 300).astype(dtype)
    a[0, 1] = -np.inf
    b[0, :, 2] = -np.inf
    b[0, 3, 1] = np.nan
    lost = rng.random((2, 3, 4)) < 0.6
    want = np.full((2, 3, 4), 5.0, dtype)
    with np.errstate(all="ignore"):  # the NaN entry: NumPy's shift is 0, its exp overflows
        _logspace._recompute_lost(np, a, b, want, lost.copy())
    got = np.full((2, 3, 4), 5.0, dtype)
    cuda_logspace.launch_log_product_fixup(a, b, np.arange(2), np.zeros(2, np.int64), lost.astype(np.uint8), got)
    tol = 1e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(got, want, rtol=tol)
    assert (got[~lost] == 5.0).all()


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("d", [16, 45])  # from WARP_FROM columns on: a warp an entry
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_warp_sddmm_matches_cpu_twin(small_launch, rng, d, dtype):
    from spchain.kernels.cpu import sparse as cpu_sparse
    from spchain.kernels.cuda import sparse as cuda_sparse

    indptr = np.array([0, 0, 3, 3, 7, 9], np.int64)  # empty rows first and between
    indices = rng.integers(0, 6, size=9).astype(np.int64)
    assert indices.size > small_launch.MAX_BLOCKS, "more entries than warps: the grid-stride loop"
    a = rng.standard_normal((5, d)).astype(dtype)
    b = rng.standard_normal((6, d)).astype(dtype)
    want, got = np.empty(9, dtype), np.full(9, np.nan, dtype)
    cpu_sparse.sparse_sddmm(0, 1, indptr, indices, a, b, want, 1, False)
    cuda_sparse.launch_sparse_sddmm(indptr, indices, a, b, got)
    np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("scale", [1.0, 60.0, 400.0])  # 60 and 400: scaled sums underflow, the log-space fallback
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_scaled_sparse_sweeps_match_cpu_log_space_sweeps(small_launch, rng, scale, dtype):
    from spchain.kernels.cpu import sparse_chain as cpu_sparse_chain
    from spchain.kernels.cuda import sparse_chain as cuda_sparse_chain
    from test_kernels_sparse_chain import problem

    x, matrix, transpose, _, init, lengths = problem(rng, c=9, dtype=dtype)
    x = (x * scale).astype(dtype)
    transpose.data = (transpose.data * scale).astype(dtype)
    transpose.data[2] = np.nan if scale == 60.0 else transpose.data[2]  # NaN propagates from one entry
    rows, v, c = x.shape
    want_pre, want_norm = np.empty_like(x), np.empty((rows, v), dtype)
    with np.errstate(invalid="ignore"):
        cpu_sparse_chain.sparse_chain_forward(x, transpose.indptr, transpose.indices, transpose.data, init, lengths,
                                              want_pre, want_norm)
    cmax, t_e = np.empty(c, dtype), np.empty(transpose.nnz, dtype)
    with np.errstate(all="ignore"):
        cuda_sparse_chain.launch_sparse_chain_shifted_exp(transpose.indptr, transpose.data, cmax, t_e)
        got_pre, got_norm = np.full_like(x, 7.0), np.full((rows, v), 7.0, dtype)
        cuda_sparse_chain.launch_sparse_chain_forward_scaled(x, transpose.indptr, transpose.indices, transpose.data,
                                                             t_e, cmax, init, lengths, np.empty((rows, c), dtype),
                                                             got_pre, got_norm)
    tol = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_array_equal(np.isnan(got_pre), np.isnan(want_pre))
    np.testing.assert_allclose(got_pre, want_pre, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(got_norm, want_norm, rtol=tol, atol=tol * scale)
    matrix.data = transpose.T.tocsr().data  # the same values, in the matrix's own order
    want_beta, got_beta = np.empty_like(x), np.full_like(x, 7.0)
    rmax, row_e = np.empty(c, dtype), np.empty(matrix.nnz, dtype)
    with np.errstate(all="ignore"):
        cpu_sparse_chain.sparse_chain_backward(x, matrix.indptr, matrix.indices, matrix.data, lengths, want_norm,
                                               want_beta)
        cuda_sparse_chain.launch_sparse_chain_shifted_exp(matrix.indptr, matrix.data, rmax, row_e)
        cuda_sparse_chain.launch_sparse_chain_backward_scaled(x, matrix.indptr, matrix.indices, matrix.data, row_e,
                                                              rmax, lengths, want_norm, np.empty((rows, c), dtype),
                                                              got_beta)
    np.testing.assert_array_equal(np.isnan(got_beta), np.isnan(want_beta))
    np.testing.assert_allclose(got_beta, want_beta, rtol=tol, atol=tol * scale)


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("scale", [1.0, 300.0])  # 300: underflowed scaled sums, the exact terms
@pytest.mark.parametrize("posinf", [False, True])
def test_log_matmul_gpu_branches_match_numpy(small_launch, monkeypatch, rng, scale, posinf):
    """The GPU branches of ``log_matmul`` and ``log_matmul_grads`` (flags on the device, the
    fix-ups by kernels with atomics), run whole on NumPy arrays with the simulated kernels,
    give what the NumPy branches give: ``+inf``, ``-inf`` and NaN entries, a broadcast batch."""
    a = rng.normal(size=(2, 1, 3, 5)) * scale
    b = rng.normal(size=(4, 5, 3)) * scale
    a[0, 0, 1] = -np.inf
    b[1, :, 2] = -np.inf
    b[2, 3, 0] = np.nan
    if posinf:
        a[1, 0, 0, 2] = np.inf
        b[3, 4, 1] = np.inf
        b[3, 1, 1] = np.inf  # two +inf terms of one output: equal shares
    grad = rng.normal(size=(2, 4, 3, 3))
    with np.errstate(all="ignore"):
        want = _logspace.log_matmul(np, a, b)
        want_grads = _logspace.log_matmul_grads(np, a, b, want, grad)
        monkeypatch.setattr(_logspace, "on_device", lambda xp: True)
        got = _logspace.log_matmul(np, a, b)
        got_grads = _logspace.log_matmul_grads(np, a, b, want, grad)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert (np.isposinf(got) == np.isposinf(want)).all() and (np.isposinf(got).any() == posinf)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def on_simulated_gpu(monkeypatch, chain):
    """``chain`` with a backend that takes every GPU branch, on its NumPy arrays: kernels run
    under Numba's simulator (``_backend.device_kernel``)."""
    import contextlib
    import dataclasses

    import scipy.sparse

    from spchain import _backend

    monkeypatch.setattr(_backend.Backend, "use", lambda self: contextlib.nullcontext())
    return dataclasses.replace(chain, backend=_backend.Backend(np, scipy.sparse, 0))


def assert_simulated_gpu_sweeps_match(monkeypatch, chain, weight, rtol):
    """The forward and backward sweeps of ``chain`` on the simulated GPU give the CPU path's results."""
    from spchain import _chain_sweep

    with np.errstate(all="ignore"):
        _, pre, norm = _chain_sweep.forward_finite(chain)
        want = _chain_sweep.backward_finite(chain, pre, norm, weight)
        gpu = on_simulated_gpu(monkeypatch, chain)
        _, got_pre, got_norm = _chain_sweep.forward_finite(gpu)
        got = _chain_sweep.backward_finite(gpu, got_pre, got_norm, weight)
    np.testing.assert_allclose(got_norm, norm, rtol=1e-12, atol=1e-12)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-10)


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("sweep", ["kernel", "gemm"])
@pytest.mark.parametrize("per_step", [False, True])
@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_chain_gpu_path_end_to_end_matches_cpu(small_launch, monkeypatch, rng, sweep, per_step, scale):
    """The whole GPU path of a chain (the GPU's sweep choice forced either way, the batched
    transition counts, the masked exact kernel, the device fix-ups) on NumPy arrays under the
    simulator gives the CPU path's results."""
    import spchain
    from spchain import _chain_layout

    B, v, c = 4, 4, 5
    x = rng.normal(size=(B, v, c)) * scale
    trans = rng.normal(size=(B, v - 1, c, c) if per_step else (c, c)) * scale  # a matrix a row and step, or one
    trans[..., 0, 2] = -np.inf
    x[1, 2] = -np.inf  # an impossible chain
    lengths = np.array([4, 4, 2, 3])
    chain = _chain_layout.prepare(x, trans, None, lengths, "t")
    with spchain.chain_sweep(sweep):  # as the public functions run them
        assert_simulated_gpu_sweeps_match(monkeypatch, chain, np.linspace(0.5, 2.0, B), rtol=1e-10)


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_sparse_chain_gpu_path_end_to_end_matches_cpu(small_launch, monkeypatch, rng, scale):
    """The GPU path of a sparse-transition chain (scaled forward and backward messages, the
    log-space value gradient) on NumPy arrays under the simulator gives the CPU path's results."""
    import scipy.sparse

    from spchain import _chain_layout

    B, v, c = 3, 4, 6
    x = rng.normal(size=(B, v, c)) * scale
    dense = np.where(rng.random((c, c)) < 0.5, rng.normal(size=(c, c)) * scale, 0.0)
    dense[1] = 0.0  # a state without successors
    trans = scipy.sparse.csr_matrix(dense)
    lengths = np.array([4, 2, 3])
    chain = _chain_layout.prepare(x, trans, None, lengths, "t")
    assert_simulated_gpu_sweeps_match(monkeypatch, chain, np.linspace(0.5, 2.0, B), rtol=1e-9)
