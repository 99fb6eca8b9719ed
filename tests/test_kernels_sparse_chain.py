"""The sparse chain kernels: CPU (spchain/kernels/cpu/sparse_chain.py) against the dense CPU chain
kernels with -inf at absent entries, and their CUDA twins (spchain/kernels/cuda/sparse_chain.py)
against the CPU ones, under NUMBA_ENABLE_CUDASIM=1 with tiny launch sizes."""

import numpy as np
import pytest
import scipy.sparse

from kernel_calls import entry
from spchain.kernels.cpu import chain as cpu_chain
from spchain.kernels.cpu import sparse_chain as cpu_sparse
from spchain.kernels.cpu import team


def problem(rng, rows=7, v=5, c=6, dtype=np.float64):
    x = rng.normal(scale=2.0, size=(rows, v, c)).astype(dtype)
    mask = rng.random((c, c)) < 0.5
    mask[1] = False  # no successor
    values = rng.normal(size=(c, c))
    values[mask.nonzero()[0][0], mask.nonzero()[1][0]] = -np.inf
    matrix = scipy.sparse.csr_matrix(np.where(mask, 1.0, 0.0))
    matrix.data = values[mask].astype(dtype)
    dense = np.where(mask, values, -np.inf).astype(dtype)
    x[1, 2, :3] = -np.inf
    x[2, 1, :] = -np.inf  # an impossible chain
    init = rng.normal(size=(rows, c)).astype(dtype)
    lengths = rng.integers(1, v + 1, size=rows).astype(np.int64)
    lengths[:3] = v
    transpose = matrix.T.tocsr()  # entries of each column of matrix, in order of their row
    return x, matrix, transpose, dense, init, lengths


def run(module, prefix, x, matrix, transpose, init, lengths, chunks=3):
    rows, v, c = x.shape
    pre, norm, beta = np.empty_like(x), np.empty((rows, v), x.dtype), np.empty_like(x)
    getattr(module, prefix + "sparse_chain_forward")(x, transpose.indptr, transpose.indices, transpose.data, init,
                                                     lengths, pre, norm)
    getattr(module, prefix + "sparse_chain_backward")(x, matrix.indptr, matrix.indices, matrix.data, lengths, norm,
                                                      beta)
    inside = (np.arange(v)[None, :] < lengths[:, None])[..., None]
    offset = np.where(np.isfinite(norm), norm, 0)[..., None]
    with np.errstate(invalid="ignore"):
        marg = np.where(inside, np.exp(pre + x - offset + beta), 0).astype(x.dtype)
    weight = np.linspace(0.5, 2.0, rows).astype(x.dtype)
    partial = np.empty((chunks, matrix.nnz), x.dtype)
    entry(module, prefix, "sparse_chain_values_grad")(x, matrix.indptr, matrix.indices, matrix.data, lengths, pre,
                                                         norm, marg, weight, partial)
    score, path = np.empty(rows, x.dtype), np.empty((rows, v), np.int64)
    entry(module, prefix, "sparse_chain_viterbi")(x, transpose.indptr, transpose.indices, transpose.data, init,
                                                     lengths, np.empty((rows, 2, c), x.dtype),
                                                     np.empty((rows, v, c), np.int32), score, path)
    return pre, norm, marg, partial.sum(0), score, path


def test_cpu_kernels_equal_the_dense_kernels(rng):
    x, matrix, transpose, dense, init, lengths = problem(rng)
    pre, norm, marg, grad, score, path = run(cpu_sparse, "", x, matrix, transpose, init, lengths)
    trans = dense[None, None]
    want_pre, want_norm = np.empty_like(x), np.empty_like(norm)
    team.run(cpu_chain.chain_forward, x, trans, 7, init, lengths, want_pre, want_norm)
    np.testing.assert_allclose(pre, want_pre, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-12, atol=1e-12)
    want_grad = np.empty_like(trans)
    team.run(cpu_chain.chain_transition_grad, x, trans, 7, lengths, pre, norm, marg, np.linspace(0.5, 2.0, 7), want_grad)
    entry_rows = np.repeat(np.arange(6), np.diff(matrix.indptr))
    np.testing.assert_allclose(grad, want_grad[0, 0][entry_rows, matrix.indices], rtol=1e-12, atol=1e-12)
    want_score, want_path = np.empty_like(score), np.empty_like(path)
    team.run(cpu_chain.chain_viterbi, x, trans, 7, init, lengths, np.empty((7, 2, 6)), np.empty((7, 5, 6), np.int32), want_score,
                            want_path)
    np.testing.assert_array_equal(score, want_score)
    np.testing.assert_array_equal(path[score > -np.inf], want_path[score > -np.inf])


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cuda_kernels_match_cpu_twins(small_launch, rng, dtype):
    from spchain.kernels.cuda import sparse_chain as cuda_sparse

    x, matrix, transpose, _, init, lengths = problem(rng, dtype=dtype)
    want = run(cpu_sparse, "", x, matrix, transpose, init, lengths)
    got = run(cuda_sparse, "launch_", x, matrix, transpose, init, lengths)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.cuda_kernel
def test_cuda_kernels_skip_empty_launches(small_launch):
    from spchain.kernels.cuda import sparse_chain as cuda_sparse

    x = np.zeros((0, 3, 2))
    index = np.zeros(3, np.int32)
    cuda_sparse.launch_sparse_chain_forward(x, index, index[:0], np.zeros(0), np.zeros((0, 2)), np.zeros(0, np.int64),
                                            x.copy(), np.zeros((0, 3)))
    cuda_sparse.launch_sparse_chain_values_grad(x, index, index[:0], np.zeros(0), np.zeros(0, np.int64), x,
                                                np.zeros((0, 3)), x, np.zeros(0), np.zeros((0, 0)))
