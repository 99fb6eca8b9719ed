"""Block-sparse (BSR) products and block / N:M pruning (spchain/blocksparse.py)."""

import numpy as np
import pytest
import scipy.sparse

import reference
import spchain as sc
from spchain import _backend, _csr, blocksparse


def random_bsr(rng, grid, blocksize, density, dtype=np.float64, duplicates=0):
    """``((data, indices, indptr), shape)`` with empty block rows, unsorted blocks within a row
    and the first ``duplicates`` blocks stored twice."""
    indptr, indices = reference.messy_csr(rng, *grid, density, duplicates)
    data = rng.standard_normal((indices.size, *blocksize)).astype(dtype)
    return (data, indices, indptr), (grid[0] * blocksize[0], grid[1] * blocksize[1])


def dense(a):
    return reference.bsr_dense(*a[0], a[1])


@pytest.mark.parametrize("blocksize", [(2, 2), (3, 5), (16, 16), (9, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_spmm_matches_scipy_bsr(rng, blocksize, dtype):
    (data, indices, indptr), shape = random_bsr(rng, (7, 5), blocksize, 0.3, dtype)
    b = rng.standard_normal((shape[1], 11)).astype(dtype)
    for a in (scipy.sparse.bsr_array((data, indices, indptr), shape=shape),
              scipy.sparse.bsr_matrix((data, indices, indptr), shape=shape)):
        out = sc.spmm(a, b)
        assert out.dtype == dtype and out.shape == (shape[0], 11)
        want = a.astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)


def test_spmm_of_a_tuple_with_duplicate_and_unsorted_blocks_and_a_vector(rng):
    a = random_bsr(rng, (9, 6), (4, 3), 0.4, duplicates=3)
    b = rng.standard_normal(a[1][1])
    np.testing.assert_allclose(sc.spmm(a, b), dense(a) @ b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sc.spmm(a, b[:, None])[:, 0], dense(a) @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("grid, n", [((0, 3), 4), ((3, 0), 4), ((3, 3), 0), ((5, 4), 3)])
def test_spmm_empty_shapes_and_no_blocks(grid, n):
    indptr = np.zeros(grid[0] + 1, np.int32)
    a = ((np.zeros((0, 2, 2)), np.zeros(0, np.int32), indptr), (2 * grid[0], 2 * grid[1]))
    np.testing.assert_array_equal(sc.spmm(a, np.ones((2 * grid[1], n))), np.zeros((2 * grid[0], n)))


@pytest.mark.parametrize("layout", ["fortran", "transposed", "strided", "broadcast"])
def test_spmm_non_contiguous_b(rng, layout):
    a = random_bsr(rng, (4, 6), (3, 2), 0.5)
    base = rng.standard_normal((12, 7))
    b = {"fortran": np.asfortranarray(base), "transposed": base.T.copy().T,
         "strided": rng.standard_normal((12, 14))[:, ::2], "broadcast": np.broadcast_to(base[:1], (12, 7))}[layout]
    np.testing.assert_allclose(sc.spmm(a, b), dense(a) @ b, rtol=1e-12, atol=1e-12)


def test_spmm_nan_inf_and_mixed_dtypes(rng):
    (data, indices, indptr), shape = random_bsr(rng, (3, 3), (2, 2), 0.6)
    data[0, 0, 0] = np.nan
    b = rng.standard_normal((6, 2)).astype(np.float32)
    b[1, 0] = np.inf
    out = sc.spmm(((data, indices, indptr), shape), b)
    assert out.dtype == np.float64
    want = scipy.sparse.bsr_array((data, indices, indptr), shape=shape) @ b.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_allclose(out[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-12)


def test_spmm_never_writes_to_the_callers_arrays(rng):
    (data, indices, indptr), shape = random_bsr(rng, (4, 4), (2, 2), 0.5)
    b = rng.standard_normal((8, 3))
    for x in (data, indices, indptr, b):
        x.flags.writeable = False
    sc.spmm(((data, indices, indptr), shape), b)


def bsr(data, indices, indptr, shape=(4, 4)):
    return (np.asarray(data, float), np.asarray(indices), np.asarray(indptr)), shape


@pytest.mark.parametrize("a, error, message", [
    (bsr(np.ones((1, 2, 2)), [0], [0, 1]), ValueError, "indptr has length 2; expected 3"),
    (bsr(np.ones((1, 2, 2)), [2], [0, 1, 1]), ValueError, "indices holds 2, out of range"),
    (bsr(np.ones((1, 2, 2)), [-1], [0, 1, 1]), ValueError, "indices holds -1"),
    (bsr(np.ones((1, 2, 2)), [0], [0, 1, 2]), ValueError, "indptr ends at 2"),
    (bsr(np.ones((1, 2, 2)), [0], [1, 1, 1]), ValueError, "indptr starts at 1"),
    (bsr(np.ones((2, 2, 2)), [0], [0, 1, 1]), ValueError, "data has 2 blocks but the indices have 1"),
    (bsr(np.ones((1, 4)), [0], [0, 1, 1]), ValueError, "BSR data must be 3-D"),
    (bsr(np.ones((1, 3, 3)), [0], [0, 1, 1]), ValueError, r"not a whole number of \(3, 3\) blocks"),
    (bsr(np.ones((1, 2, 2)), [0.0], [0, 1, 1]), TypeError, "indices has dtype float64"),
    (((np.ones((1, 2, 2)), np.array([0])), (4, 4)), ValueError, "a BSR tuple is"),
])
def test_malformed_bsr_is_an_error_before_any_kernel(a, error, message):
    with pytest.raises(error, match=message):
        sc.spmm(a, np.ones((4, 2)))


def test_shape_mismatch_and_bad_operands():
    a = bsr(np.ones((1, 2, 2)), [0], [0, 1, 1])
    with pytest.raises(ValueError, match=r"shapes \(4, 4\) and \(3, 2\) do not match"):
        sc.spmm(a, np.ones((3, 2)))
    with pytest.raises(TypeError, match="must be a dense array"):
        sc.spmm(a, scipy.sparse.eye(4, format="csr"))
    with pytest.raises(TypeError, match="dtype int64"):
        sc.spmm(a, np.ones((4, 2), np.int64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("blocksize", [(2, 3), (16, 16), (1, 7)])
def test_sddmm_is_the_dense_product_at_the_patterns_blocks(rng, dtype, blocksize):
    (data, indices, indptr), shape = random_bsr(rng, (5, 3), blocksize, 0.5, duplicates=2)
    a = rng.standard_normal((shape[0], 13)).astype(dtype)
    b = rng.standard_normal((shape[1], 13)).astype(dtype)
    pattern = scipy.sparse.bsr_array((data, indices, indptr), shape=shape)
    out = sc.sddmm(pattern, a, b)
    assert isinstance(out, scipy.sparse.bsr_array) and out.dtype == dtype
    np.testing.assert_array_equal(out.indices, indices)
    np.testing.assert_array_equal(out.indptr, indptr)
    product = a.astype(np.float64) @ b.astype(np.float64).T
    r, c = blocksize
    rows = np.repeat(np.arange(5), np.diff(indptr))
    want = np.stack([product[i * r:(i + 1) * r, j * c:(j + 1) * c] for i, j in zip(rows, indices)])
    np.testing.assert_allclose(out.data, want.reshape(out.data.shape), rtol=1e-5 if dtype == np.float32 else 1e-12,
                               atol=1e-5)
    assert not np.shares_memory(out.indices, indices)


def test_sddmm_of_a_tuple_pattern_empty_k_and_no_blocks(rng):
    (data, indices, indptr), shape = random_bsr(rng, (4, 4), (2, 2), 0.5)
    (out, out_indices, _), out_shape = sc.sddmm(((data, indices, indptr), shape), np.ones((8, 0)), np.ones((8, 0)))
    assert out_shape == shape and out.shape == data.shape and not out.any()
    empty = bsr(np.zeros((0, 2, 2)), np.zeros(0, int), np.zeros(3, int))
    assert sc.sddmm(empty, np.ones((4, 3)), np.ones((4, 3)))[0][0].shape == (0, 2, 2)
    with pytest.raises(ValueError, match=r"pattern \(4, 4\), a \(4, 3\) and b \(5, 3\) do not match"):
        sc.sddmm(empty, np.ones((4, 3)), np.ones((5, 3)))


# --- pruning -------------------------------------------------------------------------------


def block_norms(w, r, c):
    return np.square(w.reshape(w.shape[0] // r, r, w.shape[1] // c, c)).sum(axis=(1, 3))


@pytest.mark.parametrize("shape, block, sparsity", [((8, 12), (2, 3), 0.5), ((6, 6), (3, 3), 0.1),
                                                    ((32, 48), (16, 16), 0.9), ((4, 4), (2, 2), 1.0),
                                                    ((0, 4), (2, 2), 0.5), ((10, 7), (5, 1), 0.0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_block_prune_keeps_the_blocks_of_largest_norm(rng, shape, block, sparsity, dtype):
    w = rng.standard_normal(shape).astype(dtype)
    out = sc.prune(w, sparsity, block=block)
    assert isinstance(out, scipy.sparse.bsr_array) and out.blocksize == block and out.dtype == dtype
    nblocks = (shape[0] // block[0]) * (shape[1] // block[1])
    keep = nblocks - round(sparsity * nblocks)
    assert out.data.shape[0] == keep and out.has_sorted_indices
    kept = reference.largest_positions(np.sqrt(block_norms(w.astype(np.float64), *block)), keep)
    mask = np.zeros(nblocks, bool)
    mask[kept] = True
    want = w * np.kron(mask.reshape(shape[0] // block[0], shape[1] // block[1]), np.ones(block))
    np.testing.assert_array_equal(out.toarray(), want)


def test_block_prune_breaks_ties_by_position_and_keeps_nan_first():
    w = np.kron(np.array([[1.0, -1.0], [1.0, 0.5]]), np.ones((2, 2)))
    np.testing.assert_array_equal(sc.prune(w, 0.5, block=(2, 2)).toarray()[::2, ::2], [[1.0, -1.0], [0.0, 0.0]])
    w[3, 3] = np.nan
    assert np.isnan(sc.prune(w, 0.75, block=(2, 2)).toarray()[3, 3])


def test_block_prune_random_is_seeded(rng):
    w = rng.standard_normal((12, 12))
    a, b = (sc.prune(w, 0.5, method="random", seed=3, block=(3, 3)) for _ in range(2))
    np.testing.assert_array_equal(a.toarray(), b.toarray())
    assert a.data.shape[0] == 8
    other = sc.prune(w, 0.5, method="random", seed=4, block=(3, 3))
    assert not np.array_equal(a.toarray() != 0, other.toarray() != 0)


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (4, 8), (0, 3), (3, 3), (1, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_n_m_prune_keeps_the_n_largest_of_every_m(rng, n, m, dtype):
    w = rng.standard_normal((7, 5 * m)).astype(dtype)
    w[0, :m] = 1.0  # ties go to the earlier entries
    w[1, 0] = np.nan
    out = sc.prune(w, method="n:m", n=n, m=m)
    assert isinstance(out, scipy.sparse.csr_array) and out.dtype == dtype and out.has_sorted_indices
    assert out.nnz == 7 * 5 * n
    np.testing.assert_array_equal(np.diff(out.indptr), 5 * n)
    mask = reference.n_m_mask(w, n, m)
    got = np.zeros(w.shape, bool)
    got[np.repeat(np.arange(7), np.diff(out.indptr)), out.indices] = True
    np.testing.assert_array_equal(got, mask)
    np.testing.assert_array_equal(out.data, w[mask])
    if n:
        assert sc.prune(w, 1 - n / m, method="n:m", n=n, m=m).nnz == out.nnz


def test_n_m_indices_widen_where_the_entry_count_passes_int32(monkeypatch, rng):
    # 2:4 over a 40 x 40 weight: 800 entries; sizes up to 100 "fit int32" here
    monkeypatch.setattr(_csr, "_INT32_MAX", 100)
    w = rng.standard_normal((40, 40))
    indptr, indices, data = blocksparse.n_m_parts(_backend.NUMPY, w, None, 2, 4, "test")
    assert indptr.dtype == indices.dtype == np.int64 and indptr[-1] == 800
    mask = reference.n_m_mask(w, 2, 4)
    np.testing.assert_array_equal(indices, np.nonzero(mask)[1])
    np.testing.assert_array_equal(data, w[mask])


@pytest.mark.parametrize("kwargs, error, message", [
    ({"sparsity": 0.5, "block": (3, 3)}, ValueError, r"shape \(4, 6\) is not a whole number of \(3, 3\) blocks"),
    ({"sparsity": 0.5, "block": (0, 2)}, ValueError, "not a whole number"),
    ({"sparsity": 0.5, "block": 2}, TypeError, "block must be a pair of ints"),
    ({"block": (2, 2)}, ValueError, "needs a sparsity"),
    ({"sparsity": 1.5, "block": (2, 2)}, ValueError, r"sparsity must be in \[0, 1\]"),
    ({"sparsity": 0.5, "block": (2, 2), "method": "best"}, ValueError, "method must be"),
    ({"method": "n:m", "n": 2, "m": 5}, ValueError, "length 6 do not split into groups of m = 5"),
    ({"method": "n:m", "n": 3, "m": 2}, ValueError, "0 <= n <= m"),
    ({"method": "n:m", "n": 2.0, "m": 4}, TypeError, "n must be an int"),
    ({"method": "n:m", "n": 1, "m": 2, "sparsity": 0.9}, ValueError, "has sparsity 0.5, not 0.9"),
    ({"method": "n:m", "n": 1, "m": 2, "block": (2, 2)}, ValueError, "takes no block"),
    ({}, ValueError, "needs a sparsity"),
])
def test_prune_bad_input(kwargs, error, message):
    with pytest.raises(error, match=message):
        sc.prune(np.ones((4, 6)), **kwargs)


def test_prune_never_writes_to_a_read_only_input(rng):
    w = rng.standard_normal((4, 8))
    w.flags.writeable = False
    sc.prune(w, 0.5, block=(2, 2))
    sc.prune(w, method="n:m", n=2, m=4)


def test_transposed_structure_reads_the_same_blocks(rng):
    a = random_bsr(rng, (5, 4), (2, 3), 0.5, duplicates=1)
    (data, indices, indptr), shape = a
    structure = blocksparse.to_bsr(sc._backend.NUMPY, shape, data, indptr, indices, "t")
    b = rng.standard_normal((10, 4))
    out = structure.matmul(sc._backend.NUMPY, data, b, np.float64, transpose=True)
    np.testing.assert_allclose(out, dense(a).T @ b, rtol=1e-12, atol=1e-12)


def host(a):
    return a.get() if hasattr(a, "get") else a


def test_both_backends_take_bsr_tuples_and_give_their_arrays(xp, rng):
    (data, indices, indptr), shape = random_bsr(rng, (5, 4), (3, 2), 0.5, duplicates=1)
    a = ((xp.asarray(data), xp.asarray(indices), xp.asarray(indptr)), shape)
    b = rng.standard_normal((shape[1], 6))
    out = sc.spmm(a, xp.asarray(b))
    assert isinstance(out, xp.ndarray)
    np.testing.assert_allclose(host(out), dense(((data, indices, indptr), shape)) @ b, rtol=1e-12, atol=1e-12)
    left, right = rng.standard_normal((15, 3)), rng.standard_normal((8, 3))
    (values, _, _), _ = sc.sddmm(a, xp.asarray(left), xp.asarray(right))
    assert isinstance(values, xp.ndarray)
    np.testing.assert_allclose(host(values), sc.sddmm(((data, indices, indptr), shape), left, right)[0][0], rtol=1e-12)
    pruned = sc.prune(xp.asarray(b.T.copy()), 0.5, block=(2, 2))
    blocks = pruned[0][0] if xp is not np else pruned.data
    assert isinstance(blocks, xp.ndarray) and blocks.shape == (6, 2, 2)


def test_bsr_products_check_their_dense_operands_and_shape_as_the_csr_ones():
    """``None``, a number or a one-element shape get the CSR path's TypeError / ValueError (they
    raised AttributeError and IndexError)."""
    bsr = scipy.sparse.bsr_array(np.eye(4), blocksize=(2, 2))
    for call, error, match in [(lambda: sc.spmm(bsr, None), TypeError, "b must be a NumPy or CuPy array"),
                               (lambda: sc.spmm(bsr, 2.0), TypeError, "b must be a NumPy or CuPy array"),
                               (lambda: sc.sddmm(bsr, None, np.ones((4, 2))), TypeError, "a must be"),
                               (lambda: sc.spmm(((bsr.data, bsr.indices, bsr.indptr), (4,)), np.ones(4)), ValueError,
                                "shape must be a pair")]:
        with pytest.raises(error, match=match):
            call()
