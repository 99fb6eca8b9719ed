"""The sparse kernels on raw arrays: CPU (``@njit``) directly, CUDA under the simulator."""

import numpy as np
import pytest
import scipy.sparse
from numba import njit

import reference
from spchain.kernels.cpu import sparse as cpu_sparse
from spchain.kernels.cpu import team


def random_csr(rng, m, n, density, index_dtype=np.int32):
    """A CSR structure with empty rows, duplicates and unsorted indices, and its values."""
    indptr, cols = reference.messy_csr(rng, m, n, density, duplicates=3)
    return indptr.astype(index_dtype), cols.astype(index_dtype), rng.standard_normal(cols.size)


def spmm(threads, indptr, indices, data, b, bias, out, transposed=False, out_transposed=False):
    """``sparse_spmm`` on the calling thread (threads 0) or on a team (``team.run``); ``b`` given
    as its transpose with ``transposed``, ``out`` written transposed (C-contiguous (n, m), read
    back as its (m, n) view) with ``out_transposed``."""
    b = np.ascontiguousarray(b.T) if transposed else b
    target = np.ascontiguousarray(out.T) if out_transposed else out
    if threads:
        team.run(cpu_sparse.sparse_spmm, indptr, indices, data, b, bias, target, threads, transposed, out_transposed)
    else:
        cpu_sparse.sparse_spmm(0, 1, indptr, indices, data, b, bias, target, 1, transposed, out_transposed)
    out[...] = target.T if out_transposed else target


@pytest.mark.parametrize("layout", ["b", "b.T", "b, out.T", "b.T, out.T"])
@pytest.mark.parametrize("threads", [0, 1, 2, 3])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [9, 16, 40, 64, 100, 257, 0])
@pytest.mark.parametrize("k", [23, 37])
def test_spmm_matches_scipy_with_bias(rng, index_dtype, dtype, threads, n, k, layout):
    """Whole tiles of 2 vectors, partial ones (1 vector) and columns past the last vector
    (n = 9, 100, 257), empty rows, duplicates; ``sparse_spmm`` on the calling thread
    (threads 0) and on a team with more runs of rows than some rows have entries; ``b`` as
    it is or transposed (``b.T``: its tiles transposed into the buffer in 16 x 16 blocks and
    edges: k = 23, 37); ``out`` as it is or transposed (``out.T``: two whole 16-row blocks and
    the rows past them)."""
    m = 37
    indptr, indices, data = random_csr(rng, m, k, 0.2, index_dtype)
    data = data.astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    bias = rng.standard_normal(m).astype(dtype)
    out = np.full((m, n), np.nan, dtype)
    spmm(threads, indptr, indices, data, b, bias, out, "b.T" in layout, "out.T" in layout)
    want = scipy.sparse.csr_matrix((data.astype(np.float64), indices, indptr), shape=(m, k)) @ b + bias[:, None]
    np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("writeable", [True, False])
def test_spmm_reads_a_wide_b_in_place(rng, threads, writeable):
    """Fewer stored entries than rows of ``b`` (no tile of ``b`` copied: each row is read at
    most about once), ``b`` read-only."""
    indptr, indices, data = random_csr(rng, 5, 300, 0.02)
    b = rng.standard_normal((300, 70))
    b.setflags(write=writeable)
    bias = rng.standard_normal(5)
    out = np.full((5, 70), np.nan)
    spmm(threads, indptr, indices, data, b, bias, out)
    want = scipy.sparse.csr_matrix((data, indices, indptr), shape=(5, 300)) @ b + bias[:, None]
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("threads", [0, 2])
def test_spmm_without_entries_is_the_bias(threads):
    """nnz 0 (every row empty) and a single row: the bias alone."""
    for m in (5, 1):
        indptr, indices = np.zeros(m + 1, np.int32), np.zeros(0, np.int32)
        bias = np.arange(m, dtype=np.float32)
        out = np.full((m, 70), np.nan, np.float32)
        spmm(threads, indptr, indices, np.zeros(0, np.float32), np.ones((4, 70), np.float32), bias, out)
        np.testing.assert_array_equal(out, np.broadcast_to(bias[:, None], (m, 70)))


def test_group_by_is_a_stable_counting_sort(rng):
    keys = rng.integers(0, 7, 50).astype(np.int32)
    keys[keys == 3] = 4  # an empty group
    indptr, order = np.empty(8, np.int32), np.empty(50, np.int32)
    cpu_sparse.group_by(keys, indptr, order)
    np.testing.assert_array_equal(order, np.argsort(keys, kind="stable"))
    np.testing.assert_array_equal(indptr, np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=7))]))


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("count", [0, 1, 2**14, 2**14 + 3, 50_000])
def test_gather_is_values_at_order(rng, threads, count):
    """Whole runs of ``_RUN`` entries and a partial last one, on the calling thread or a team."""
    values = rng.standard_normal(count).astype(np.float32)
    order = rng.permutation(count).astype(np.int32)
    out = np.full(count, np.nan, np.float32)
    if threads:
        team.run(cpu_sparse.gather, values, order, out)
    else:
        cpu_sparse.gather(0, 1, values, order, out)
    np.testing.assert_array_equal(out, values[order])


@pytest.mark.parametrize("density", [0.02, 0.9])
def test_transposed_product_takes_the_values_in_the_transposes_order(rng, density):
    """``W.T @ b`` (a layer's input gradient) gathers the values into the transpose's order: by
    NumPy's ``take`` below ``SERIAL_WORK`` entries, by the gather kernel on the team above."""
    from spchain import _backend, _csr

    indptr, indices, values = random_csr(rng, 600, 300, density)
    assert (indices.size < _backend.SERIAL_WORK) == (density < 0.5)
    csr = _csr.Csr(indptr, indices, None, (600, 300))
    b = rng.standard_normal((600, 2))
    got = csr.matmul(_backend.NUMPY, values, b, np.dtype(np.float64), transpose=True)
    want = scipy.sparse.csr_matrix((values, indices, indptr), shape=(600, 300)).T @ b
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@njit
def _aligned(rows, columns, like):
    return cpu_sparse.aligned_empty((rows, columns), like)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [0, 1, 5, 4096])
def test_aligned_empty_starts_on_a_64_byte_boundary(rows, dtype):
    """Whatever the 32-byte-aligned allocation Numba returns, one of 64-byte rows of ``rows``."""
    for _ in range(8):  # allocations at varying addresses
        buffer = _aligned(rows, 64 // np.dtype(dtype).itemsize, np.empty(0, dtype))
        assert buffer.shape == (rows, 64 // np.dtype(dtype).itemsize) and buffer.dtype == dtype
        assert buffer.flags.c_contiguous and buffer.ctypes.data % 64 == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.bool_])
@pytest.mark.parametrize("shape", [(5, 3), (40, 37), (1, 70), (33, 16), (32, 48), (0, 4), (4, 0)])
def test_transpose(rng, shape, dtype):
    """16 x 16 blocks go through vector shuffles of the stored bytes (a bool is a byte)."""
    a = (rng.standard_normal(shape) * 50).astype(dtype)
    out = np.empty(shape[::-1], dtype)
    team.run(cpu_sparse.transpose, a, out)
    np.testing.assert_array_equal(out, a.T)


# --- SDDMM on both targets: CUDA under the simulator (NUMBA_ENABLE_CUDASIM=1) or on a GPU ----

TARGETS = ["cpu", "cpu serial", pytest.param("cuda", marks=pytest.mark.cuda_kernel)]


def sddmm(target, indptr, indices, a, b, out):
    if target == "cpu serial":
        cpu_sparse.sparse_sddmm(0, 1, indptr, indices, a, b, out, 1, False)
    elif target == "cpu":
        team.run(cpu_sparse.sparse_sddmm, indptr, indices, a, b, out, 2, False)
    else:
        from spchain.kernels.cuda import sparse as cuda_sparse

        cuda_sparse.launch_sparse_sddmm(indptr, indices, a, b, out)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sddmm_matches_dense_product_sampled_at_the_pattern(rng, small_launch, target, dtype):
    indptr, indices, _ = random_csr(rng, 9, 7, 0.4)  # more entries than 3 blocks x 4 threads
    assert indices.size > small_launch.MAX_BLOCKS * small_launch.THREADS_PER_BLOCK
    a = rng.standard_normal((9, 5)).astype(dtype)
    b = rng.standard_normal((7, 5)).astype(dtype)
    out = np.full(indices.size, np.nan, dtype)
    sddmm(target, indptr, indices, a, b, out)
    rows, cols = reference.entries(indptr, indices)
    np.testing.assert_allclose(out, reference.sampled_product(rows, cols, a, b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", TARGETS)
def test_float32_sddmm_over_a_long_inner_dimension_is_within_1e_5(rng, target):
    """Both kernels accumulate in float32: benchmark-like dot
    products of 1024 terms, error relative to the sum of the terms' magnitudes."""
    indptr, indices, _ = random_csr(rng, 6, 5, 0.5)
    a = rng.standard_normal((6, 1024)).astype(np.float32)
    b = rng.standard_normal((5, 1024)).astype(np.float32)
    out = np.empty(indices.size, np.float32)
    sddmm(target, indptr, indices, a, b, out)
    rows, cols = reference.entries(indptr, indices)
    scale = reference.sampled_product(rows, cols, np.abs(a), np.abs(b))
    assert np.abs(out - reference.sampled_product(rows, cols, a, b)).max() <= 1e-5 * scale.min()


@pytest.mark.parametrize("target", TARGETS)
def test_sddmm_finds_rows_past_empty_ones(small_launch, target):
    indptr = np.array([0, 0, 2, 2, 2, 3, 3], np.int64)  # rows 0, 2, 3 and 5 are empty
    indices = np.array([1, 0, 1], np.int64)
    a = np.arange(12.0).reshape(6, 2)
    b = np.array([[1.0, 0.0], [0.0, 1.0]])
    out = np.empty(3)
    sddmm(target, indptr, indices, a, b, out)
    np.testing.assert_array_equal(out, [a[1, 1], a[1, 0], a[4, 1]])


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("threads", [0, 1, 2, 3])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [9, 16, 40, 64, 100, 257, 0])
@pytest.mark.parametrize("n", [20, 300])
def test_sddmm_slabs_match_float64(rng, index_dtype, dtype, threads, k, n, transposed):
    """Whole slabs of 2 vectors, a last slab of 1 (k = 16, 40 in float32), columns past the last
    vector (k = 9, 100, 257), groups of 8 entries and the rest one by one, empty rows and
    duplicates; more entries than rows of ``b`` (its slab copied, n = 20) and fewer (read in
    place, n = 300); ``sparse_sddmm`` on the calling thread (threads 0) and on a team
    with more runs of rows than some rows have entries; ``a`` and ``b`` as they are or ``transposed`` (their slabs
    transposed into the buffers, 16 x 16 blocks and edges, from a run's first row on)."""
    indptr, indices, _ = random_csr(rng, 53, n, 0.6 if n == 20 else 0.01, index_dtype)
    a = rng.standard_normal((53, k)).astype(dtype)
    b = rng.standard_normal((n, k)).astype(dtype)
    out = np.full(indices.size, np.nan, dtype)
    given = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)) if transposed else (a, b)
    if threads:
        team.run(cpu_sparse.sparse_sddmm, indptr, indices, *given, out, threads, transposed)
    else:
        cpu_sparse.sparse_sddmm(0, 1, indptr, indices, *given, out, 1, transposed)
    rows, cols = reference.entries(indptr, indices)
    want = reference.sampled_product(rows, cols, a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
