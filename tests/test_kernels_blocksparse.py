"""The block-sparse kernels on raw arrays: CPU (``@njit``) and CUDA (under the simulator or on a GPU)."""

import numpy as np
import pytest
import scipy.sparse

import reference
from kernel_calls import entry
from spchain.kernels.cpu import blocksparse as cpu_blocksparse
from spchain.kernels.cpu import team

TARGETS = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda_kernel)]


def cpu_spmm(indptr, indices, slots, data, b, bias, out):
    """``blocksparse_spmm`` on ``data`` (nnzb, R, C) given row-major or as a transposed view of
    row-major blocks (which the kernel reads with ``transpose``)."""
    transpose = not data.flags.c_contiguous and data.transpose(0, 2, 1).flags.c_contiguous
    blocks = data.transpose(0, 2, 1) if transpose else np.ascontiguousarray(data)
    team.run(cpu_blocksparse.blocksparse_spmm, indptr, indices, slots, blocks, transpose, b, bias, out)


def kernel(target, op):
    if target == "cpu":
        return cpu_spmm if op == "blocksparse_spmm" else entry(cpu_blocksparse, "", op)
    from spchain.kernels.cuda import blocksparse as cuda_blocksparse

    return getattr(cuda_blocksparse, f"launch_{op}")


def random_bsr(rng, grid, blocksize, density, dtype, index_dtype):
    """Empty block rows, duplicate and unsorted blocks."""
    indptr, indices = reference.messy_csr(rng, *grid, density, duplicates=2)
    data = rng.standard_normal((indices.size, *blocksize)).astype(dtype)
    return indptr.astype(index_dtype), indices.astype(index_dtype), data


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("blocksize", [(2, 3), (3, 9), (1, 1), (5, 7), (8, 4)])  # 4 x 4 register tiles and leftovers
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_spmm_matches_the_dense_product_with_bias(rng, small_launch, target, blocksize, index_dtype, dtype):
    indptr, indices, data = random_bsr(rng, (5, 4), blocksize, 0.4, dtype, index_dtype)
    r, c = blocksize
    b = rng.standard_normal((4 * c, 3)).astype(dtype)
    bias = rng.standard_normal(5 * r).astype(dtype)
    out = np.full((5 * r, 3), np.nan, dtype)
    slots = np.arange(indices.size, dtype=index_dtype)
    kernel(target, "blocksparse_spmm")(indptr, indices, slots, data, b, bias, out)
    want = reference.bsr_dense(data, indices, indptr, (5 * r, 4 * c)) @ b + bias[:, None]
    np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)


@pytest.mark.parametrize("blocksize", [(4, 4), (9, 6), (8, 5), (3, 16)])  # whole 4-row panels and row edges
@pytest.mark.parametrize("n", [8, 16, 19, 40])  # 64-byte lane panels (16 float32, 8 float64) and column edges
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("transposed", [False, True])
def test_cpu_spmm_register_panels_match_scipy_with_edges_and_inf(rng, blocksize, n, dtype, transposed):
    """The vector-register panels (n of at least one lane panel) and their row and column
    edges, on row-major or transposed (strided view) blocks; inf and NaN propagate."""
    indptr, indices, data = random_bsr(rng, (4, 3), blocksize, 0.6, dtype, np.int64)
    if transposed:
        data = np.ascontiguousarray(data.transpose(0, 2, 1)).transpose(0, 2, 1)
    r, c = blocksize
    b = rng.standard_normal((3 * c, n)).astype(dtype)
    b[0, n - 1], b[c - 1, 0] = -np.inf, np.nan
    bias = rng.standard_normal(4 * r).astype(dtype)
    out = np.full((4 * r, n), np.nan, dtype)
    cpu_spmm(indptr, indices, np.arange(indices.size), data, b, bias, out)
    want = scipy.sparse.bsr_array((data.astype(np.float64), indices, indptr), shape=(4 * r, 3 * c)) @ b + bias[:, None]
    np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
def test_float32_spmm_over_long_block_rows_is_within_1e_5(rng, target):
    """The CUDA kernel accumulates in float32 (the CPU one in float64): ~500 terms an output,
    error relative to the sum of the terms' magnitudes."""
    indptr, indices, data = random_bsr(rng, (2, 64), (2, 16), 0.5, np.float32, np.int64)
    b = rng.standard_normal((64 * 16, 2)).astype(np.float32)
    out = np.empty((4, 2), np.float32)
    kernel(target, "blocksparse_spmm")(indptr, indices, np.arange(indices.size), data, b, np.zeros(4, np.float32), out)
    w = reference.bsr_dense(data, indices, indptr, (4, 64 * 16))
    scale = np.abs(w) @ np.abs(b.astype(np.float64))
    assert np.abs(out - w @ b.astype(np.float64)).max() <= 1e-5 * scale.min()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("blocksize", [(2, 5), (9, 6)])
def test_spmm_by_the_transpose_reads_transposed_blocks_through_slots(rng, small_launch, target, blocksize):
    r, c = blocksize
    indptr, indices, data = random_bsr(rng, (4, 3), blocksize, 0.6, np.float64, np.int64)
    w = reference.bsr_dense(data, indices, indptr, (4 * r, 3 * c))
    rows = np.repeat(np.arange(4), np.diff(indptr))
    order = np.argsort(indices, kind="stable")
    t_indptr = np.concatenate([[0], np.cumsum(np.bincount(indices, minlength=3))])
    b = rng.standard_normal((4 * r, 2))
    out = np.empty((3 * c, 2))
    blocks = data.transpose(0, 2, 1)  # the CPU kernel reads the blocks transposed; CUDA gets a contiguous copy
    blocks = blocks if target == "cpu" else np.ascontiguousarray(blocks)
    kernel(target, "blocksparse_spmm")(t_indptr, rows[order], order, blocks, b, np.zeros(3 * c), out)
    np.testing.assert_allclose(out, w.T @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("blocksize", [(2, 3), (4, 1), (3, 8)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sddmm_is_the_dense_product_at_each_block(rng, small_launch, target, blocksize, dtype):
    indptr, indices, _ = random_bsr(rng, (4, 5), blocksize, 0.5, dtype, np.int32)
    r, c = blocksize
    a = rng.standard_normal((4 * r, 7)).astype(dtype)
    b = rng.standard_normal((5 * c, 7)).astype(dtype)
    out = np.full((indices.size, r, c), np.nan, dtype)
    kernel(target, "blocksparse_sddmm")(indptr, indices, a, b, out)
    product = a.astype(np.float64) @ b.astype(np.float64).T
    rows = np.repeat(np.arange(4), np.diff(indptr))
    want = np.stack([product[i * r:(i + 1) * r, j * c:(j + 1) * c] for i, j in zip(rows, indices)])
    np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)


@pytest.mark.parametrize("blocksize", [(4, 8), (4, 16), (9, 20), (8, 32), (3, 16)])  # panels, row and column edges
@pytest.mark.parametrize("k", [0, 1, 33])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_sddmm_register_panels_match_the_dense_product_with_edges_and_inf(rng, blocksize, k, dtype):
    """The vector-register panels (a block of at least 4 rows and one 64-byte lane panel of
    columns), their row and column edges, an empty reduction; inf and NaN propagate."""
    indptr, indices, _ = random_bsr(rng, (3, 4), blocksize, 0.6, dtype, np.int64)
    r, c = blocksize
    a = rng.standard_normal((3 * r, k)).astype(dtype)
    b = rng.standard_normal((4 * c, k)).astype(dtype)
    if k > 1:
        a[0, 1], b[c - 1, 0] = np.inf, np.nan
    out = np.full((indices.size, r, c), np.nan, dtype)
    team.run(cpu_blocksparse.blocksparse_sddmm, indptr, indices, a, b, out)
    product = a.astype(np.float64) @ b.astype(np.float64).T
    rows = np.repeat(np.arange(3), np.diff(indptr))
    want = np.stack([product[i * r:(i + 1) * r, j * c:(j + 1) * c] for i, j in zip(rows, indices)])
    np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
