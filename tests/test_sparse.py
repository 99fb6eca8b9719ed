"""spmm, sddmm and prune at the array level (spchain/sparse.py), against SciPy and float64 references.

Each test body runs on NumPy/SciPy, and on CuPy/cupyx under the ``gpu`` marker (the ``xp``
fixture); the bad-input rules of docs/design.rst are named in the test names.
"""

import numpy as np
import pytest
import scipy.sparse
from hypothesis import given
from hypothesis import strategies as st

import reference
import spchain as sc
from spchain import _backend, _csr, _selection

FORMATS = ["csr", "csc", "coo"]


def sparse_of(xp):
    if xp is np:
        return scipy.sparse
    import cupyx.scipy.sparse

    return cupyx.scipy.sparse


def on(xp, matrix, kind="array"):
    """A SciPy matrix as a SciPy ``*_array`` / ``*_matrix`` (NumPy) or a cupyx matrix (CuPy),
    keeping its exact structure (duplicates, order)."""
    fmt = matrix.format
    if xp is not np:
        return getattr(sparse_of(xp), f"{fmt}_matrix")(matrix)
    cls = getattr(scipy.sparse, f"{fmt}_{kind}")
    if fmt == "coo":
        return cls((matrix.data, (matrix.row, matrix.col)), shape=matrix.shape)
    return cls((matrix.data, matrix.indices, matrix.indptr), shape=matrix.shape)


def host(a):
    return a.get() if hasattr(a, "get") else a


def messy(rng, m, n, density=0.3, dtype=np.float64):
    """A COO matrix with duplicates, explicit zeros and shuffled entries."""
    base = scipy.sparse.random(m, n, density=density, format="coo", random_state=rng, dtype=dtype)
    row, col, data = base.row, base.col, base.data
    if data.size:
        row, col = np.concatenate([row, row[:2]]), np.concatenate([col, col[:2]])
        data = np.concatenate([data, data[:2] * 0.5]).astype(dtype)
        data[-1] = 0.0  # an explicit zero
    order = rng.permutation(data.size)
    return scipy.sparse.coo_matrix((data[order], (row[order], col[order])), shape=(m, n))


def as_format(coo, fmt):
    """``coo`` in ``fmt`` without summing duplicates or sorting (entries keep their order)."""
    if fmt == "coo":
        return coo
    major, minor = (coo.row, coo.col) if fmt == "csr" else (coo.col, coo.row)
    order = np.argsort(major, kind="stable")
    indptr = np.searchsorted(major[order], np.arange(coo.shape[fmt == "csc"] + 1))
    cls = scipy.sparse.csr_matrix if fmt == "csr" else scipy.sparse.csc_matrix
    return cls((coo.data[order], minor[order], indptr), shape=coo.shape)


def tolerance(dtype):
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-12}


# --- spmm ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["array", "matrix"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_spmm_matches_scipy_with_duplicates_unsorted_indices_and_explicit_zeros(xp, rng, fmt, kind, dtype):
    a = as_format(messy(rng, 41, 29, dtype=dtype), fmt)
    b = rng.standard_normal((29, 11)).astype(dtype)
    out = sc.spmm(on(xp, a, kind), xp.asarray(b))
    assert out.dtype == dtype and out.shape == (41, 11)
    np.testing.assert_allclose(host(out), reference.dense(a) @ b.astype(np.float64), **tolerance(dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_spmm_of_a_vector(xp, rng, fmt):
    a = as_format(messy(rng, 13, 8), fmt)
    b = rng.standard_normal(8)
    out = sc.spmm(on(xp, a), xp.asarray(b))
    assert out.shape == (13,)
    np.testing.assert_allclose(host(out), reference.dense(a) @ b, rtol=1e-12)


@given(m=st.integers(0, 9), k=st.integers(0, 9), n=st.integers(0, 5), density=st.floats(0, 1),
       fmt=st.sampled_from(FORMATS), seed=st.integers(0, 2**16))
def test_spmm_any_shape_including_empty(m, k, n, density, fmt, seed):
    rng = np.random.default_rng(seed)
    a = as_format(messy(rng, m, k, density), fmt)
    b = rng.standard_normal((k, n))
    np.testing.assert_allclose(sc.spmm(a, b), reference.dense(a) @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "layout",
    [
        lambda b: np.asfortranarray(b),
        lambda b: np.ascontiguousarray(b.T).T,
        lambda b: np.repeat(b, 2, axis=1)[:, ::2],
        lambda b: b[::-1][::-1],
        lambda b: np.ascontiguousarray(b[::-1])[::-1],
        lambda b: np.broadcast_to(b[:, :1], b.shape),
    ],
    ids=["fortran-order", "transposed", "sliced", "reversed-twice", "negative-stride", "zero-stride"],
)
def test_spmm_non_contiguous_dense_operands(rng, layout):
    a = messy(rng, 12, 9).tocsr()
    b = layout(rng.standard_normal((9, 6)))
    np.testing.assert_allclose(sc.spmm(a, b), reference.dense(a) @ np.asarray(b), rtol=1e-12)


def test_spmm_nan_and_inf_propagate_as_in_scipy(rng):
    a = scipy.sparse.csr_array(np.array([[1.0, 0.0, 2.0], [0.0, 0.0, 1.0], [np.nan, 0.0, 0.0]]))
    b = np.array([[1.0, np.inf], [np.nan, 1.0], [1.0, 1.0]])
    np.testing.assert_array_equal(sc.spmm(a, b), a @ b)


def test_spmm_mixed_float32_and_float64_computes_in_float64(rng):
    a = messy(rng, 6, 5, dtype=np.float32).tocsr()
    b = rng.standard_normal((5, 3))
    out = sc.spmm(a, b)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, reference.dense(a) @ b, rtol=1e-12)


def test_spmm_mixed_int32_and_int64_index_arrays_are_promoted(rng):
    a = messy(rng, 8, 7).tocsr()
    mixed = scipy.sparse.csr_array((a.data, a.indices.astype(np.int64), a.indptr.astype(np.int32)), shape=a.shape)
    mixed.indptr = a.indptr.astype(np.int32)  # scipy would unify them; force the mix
    b = rng.standard_normal((7, 2))
    np.testing.assert_allclose(sc.spmm(mixed, b), reference.dense(a) @ b, rtol=1e-12)
    csr = _csr.to_csr(_backend.NUMPY, "csr", a.shape, None, mixed.indptr, mixed.indices, "test")
    assert csr.indptr.dtype == csr.indices.dtype == np.int64


def test_sizes_past_int32_promote_int32_indices_to_int64():
    indptr, indices = np.array([0, 1, 2], np.int32), np.array([5, 2**31 + 3 - 2**31], np.int32)
    csr = _csr.to_csr(_backend.NUMPY, "csr", (2, 2**31 + 7), None, indptr, indices, "test")
    assert csr.indices.dtype == np.int64 and csr.indptr.dtype == np.int64


def test_spmm_never_writes_to_the_callers_arrays(rng):
    a = as_format(messy(rng, 10, 8), "csr")
    b = np.asfortranarray(rng.standard_normal((8, 4)))
    saved = [x.copy() for x in (a.data, a.indices, a.indptr, b)]
    for x in (a.data, a.indices, a.indptr, b):
        x.flags.writeable = False
    sc.spmm(a, b)
    sc.sddmm(a, np.ones((10, 4)), b)
    for x, s in zip((a.data, a.indices, a.indptr, b), saved):
        np.testing.assert_array_equal(x, s)


# --- malformed structures (docs/design.rst, bad input) ------------------------------------------------


def csr_with(**arrays):
    """A 3 x 4 CSR matrix whose arrays are then replaced (SciPy does not re-check attributes)."""
    a = scipy.sparse.csr_array((np.array([1.0, 2.0, 3.0]), np.array([0, 3, 1]), np.array([0, 2, 2, 3])), shape=(3, 4))
    for name, value in arrays.items():
        setattr(a, name, value)
    return a


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"indptr": np.array([0, 2, 3])}, r"indptr has length 3; expected 4 \(the rows \+ 1\)"),
        ({"indptr": np.array([1, 2, 2, 3])}, r"indptr starts at 1, not 0"),
        ({"indptr": np.array([0, 2, 1, 3])}, r"indptr decreases at position 2: 2 -> 1"),
        ({"indptr": np.array([0, 2, 2, 2])}, r"indptr ends at 2 but there are 3 stored entries"),
        ({"data": np.array([1.0, 2.0])}, r"data has 2 entries but the indices have 3"),
        ({"indices": np.array([[0, 3, 1]])}, r"indices must be 1-D, got shape \(1, 3\)"),
        ({"indptr": np.array([[0, 2, 2, 3]])}, r"indptr must be 1-D"),
        ({"data": np.ones((3, 1))}, r"data must be 1-D"),
        ({"indices": np.array([0, 4, 1])}, r"indices holds 4, out of range for a dimension of size 4"),
        ({"indices": np.array([0, -1, 1])}, r"indices holds -1, out of range"),
    ],
    ids=["indptr-length", "indptr-start", "indptr-decreasing", "indptr-end", "data-length", "indices-2d",
         "indptr-2d", "data-2d", "index-too-large", "index-negative"],
)
def test_malformed_csr_is_a_value_error_before_any_kernel(arrays, message):
    a = csr_with(**arrays)
    with pytest.raises(ValueError, match=message):
        sc.spmm(a, np.ones((4, 2)))
    if "data" not in arrays:  # sddmm reads only the pattern's structure
        with pytest.raises(ValueError, match=message):
            sc.sddmm(a, np.ones((3, 2)), np.ones((4, 2)))


@pytest.mark.parametrize("name, bad", [("row", np.array([0, 3, 1])), ("col", np.array([0, 1, -2]))])
def test_coo_index_out_of_range_is_a_value_error(name, bad):
    a = scipy.sparse.coo_array((np.ones(3), (np.array([0, 1, 2]), np.array([0, 1, 2]))), shape=(3, 3))
    setattr(a, name, bad)
    with pytest.raises(ValueError, match=rf"{name} holds -?\d, out of range for a dimension of size 3"):
        sc.spmm(a, np.ones((3, 1)))


def test_coo_rows_and_columns_of_different_lengths_are_a_value_error():
    a = scipy.sparse.coo_array((np.ones(3), (np.array([0, 1, 2]), np.array([0, 1, 2]))), shape=(3, 3))
    a.col = np.array([0, 1])
    with pytest.raises(ValueError, match="row has 3 entries but col has 2"):
        sc.spmm(a, np.ones((3, 1)))


def test_csc_structure_is_checked_against_columns():
    a = scipy.sparse.csc_array(np.eye(3))
    a.indices = np.array([0, 1, 3])
    with pytest.raises(ValueError, match="indices holds 3, out of range for a dimension of size 3"):
        sc.spmm(a, np.ones((3, 1)))
    a = scipy.sparse.csc_array(np.ones((2, 3)))
    a.indptr = np.array([0, 2, 4])
    with pytest.raises(ValueError, match=r"expected 4 \(the columns \+ 1\)"):
        sc.spmm(a, np.ones((3, 1)))


@pytest.mark.parametrize("dtype", [np.float64, np.bool_, object])
def test_non_integer_index_dtype_is_a_type_error(dtype):
    a = csr_with(indices=np.array([0, 3, 1]).astype(dtype))
    with pytest.raises(TypeError, match=r"indices has dtype .*; index arrays must be integers"):
        sc.spmm(a, np.ones((4, 1)))


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"shapes \(3, 4\) and \(5, 2\) do not match"):
        sc.spmm(csr_with(), np.ones((5, 2)))
    with pytest.raises(ValueError, match=r"pattern \(3, 4\), a \(3, 2\) and b \(4, 3\) do not match"):
        sc.sddmm(csr_with(), np.ones((3, 2)), np.ones((4, 3)))


@pytest.mark.parametrize("dtype", [np.float16, np.int64, np.complex128])
def test_unsupported_value_dtypes_are_a_type_error_naming_the_dtype(dtype):
    a = csr_with(data=np.array([1, 2, 3], dtype=dtype))
    with pytest.raises(TypeError, match=np.dtype(dtype).name):
        sc.spmm(a, np.ones((4, 1)))
    with pytest.raises(TypeError, match=np.dtype(dtype).name):
        sc.spmm(csr_with(), np.ones((4, 1), dtype=dtype))


def test_unsupported_operands_are_type_errors():
    with pytest.raises(TypeError, match="takes a sparse matrix"):
        sc.spmm(np.eye(3), np.ones(3))
    with pytest.raises(TypeError, match="CSR, CSC or COO matrices, not DIA"):
        sc.spmm(scipy.sparse.dia_array(np.eye(4)), np.ones(4))
    with pytest.raises(TypeError, match="b must be a dense array"):
        sc.spmm(csr_with(), scipy.sparse.csr_array(np.ones((4, 2))))
    with pytest.raises(ValueError, match=r"b must be 1-D or 2-D, got shape \(4, 1, 1\)"):
        sc.spmm(csr_with(), np.ones((4, 1, 1)))


@pytest.mark.parametrize("bad", [None, 2.0, 3, True, [1.0, 2.0, 3.0, 4.0], (1.0, 2.0), np.float64(1.0)],
                         ids=["None", "float", "int", "bool", "list", "tuple", "numpy-scalar"])
def test_non_array_dense_operands_are_type_errors_naming_the_argument(bad):
    with pytest.raises(TypeError, match=rf"spchain.spmm: b must be a NumPy or CuPy array, not {type(bad).__name__}"):
        sc.spmm(csr_with(), bad)
    with pytest.raises(TypeError, match=rf"spchain.sddmm: a must be a NumPy or CuPy array, not {type(bad).__name__}"):
        sc.sddmm(csr_with(), bad, np.ones((4, 2)))
    with pytest.raises(TypeError, match=rf"spchain.sddmm: b must be a NumPy or CuPy array, not {type(bad).__name__}"):
        sc.sddmm(csr_with(), np.ones((3, 2)), bad)
    with pytest.raises(TypeError, match=rf"spchain.prune: w must be a NumPy or CuPy array, not {type(bad).__name__}"):
        sc.prune(bad, 0.5)


def test_np_matrix_dense_operands_give_the_ndarray_results(rng):
    a = csr_with()
    b, x, y = rng.standard_normal((4, 2)), rng.standard_normal((3, 2)), rng.standard_normal((4, 2))
    np.testing.assert_array_equal(sc.spmm(a, np.matrix(b)), sc.spmm(a, b))
    np.testing.assert_array_equal(sc.sddmm(a, np.matrix(x), np.matrix(y)).toarray(), sc.sddmm(a, x, y).toarray())
    w = rng.standard_normal((3, 4))
    np.testing.assert_array_equal(sc.prune(np.matrix(w), 0.5).toarray(), sc.prune(w, 0.5).toarray())


def test_torch_tensors_point_to_spchain_torch():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"requires grad.*spchain\.torch\.spmm.*detach\(\)"):
        sc.spmm(csr_with(), torch.ones(4, 2, requires_grad=True))
    with pytest.raises(TypeError, match=r"spchain\.torch\.sddmm"):
        sc.sddmm(csr_with(), torch.ones(3, 2), np.ones((4, 2)))


def test_empty_products_launch_no_kernel(monkeypatch):
    from spchain.kernels import cpu

    for op in ("sparse_spmm", "sparse_sddmm"):
        def no_kernel(*args, op=op):
            raise AssertionError(f"kernel {op} launched for an empty product")

        monkeypatch.setattr(cpu.sparse, op, no_kernel)
    empty = scipy.sparse.csr_array((3, 4))
    np.testing.assert_array_equal(sc.sddmm(empty, np.ones((3, 2)), np.ones((4, 2))).toarray(), np.zeros((3, 4)))
    np.testing.assert_array_equal(sc.sddmm(csr_with(), np.ones((3, 0)), np.ones((4, 0))).data, np.zeros(3))
    assert sc.spmm(csr_with(), np.ones((4, 0))).shape == (3, 0)
    assert sc.spmm(scipy.sparse.csr_array((0, 4)), np.ones(4)).shape == (0,)


# --- sddmm --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sddmm_matches_the_dense_product_sampled_at_the_pattern(xp, rng, fmt, dtype):
    pattern = as_format(messy(rng, 23, 17, density=0.3), fmt)
    a = rng.standard_normal((23, 6)).astype(dtype)
    b = rng.standard_normal((17, 6)).astype(dtype)
    out = sc.sddmm(on(xp, pattern), xp.asarray(a), xp.asarray(b))
    assert out.format == "csr" and out.dtype == dtype and out.nnz == pattern.nnz
    rows, cols = reference.entries(host(out.indptr), host(out.indices))
    np.testing.assert_allclose(host(out.data), reference.sampled_product(rows, cols, a, b), **tolerance(dtype))
    coo = pattern.tocoo()
    want = sorted(zip(coo.row.tolist(), coo.col.tolist()))
    assert sorted(zip(rows.tolist(), cols.tolist())) == want  # exactly the pattern's entries


def test_sddmm_keeps_a_csr_patterns_structure_and_order_without_aliasing_it(rng):
    pattern = as_format(messy(rng, 9, 8), "csr")
    a, b = rng.standard_normal((9, 3)), rng.standard_normal((8, 3))
    out = sc.sddmm(pattern, a, b)
    np.testing.assert_array_equal(out.indptr, pattern.indptr)
    np.testing.assert_array_equal(out.indices, pattern.indices)  # duplicates and order kept
    assert not np.shares_memory(out.indices, pattern.indices)
    assert isinstance(out, scipy.sparse.csr_matrix)
    assert isinstance(sc.sddmm(scipy.sparse.csr_array(pattern), a, b), scipy.sparse.csr_array)
    canonical = scipy.sparse.csr_array(np.eye(3)[:, :2] + 0.0)
    np.testing.assert_allclose(sc.sddmm(canonical, np.ones((3, 4)), np.ones((2, 4))).toarray(), 4 * np.eye(3)[:, :2])


@given(m=st.integers(0, 8), n=st.integers(0, 8), k=st.integers(0, 4), density=st.floats(0, 1),
       fmt=st.sampled_from(FORMATS), seed=st.integers(0, 2**16))
def test_sddmm_any_shape_including_empty(m, n, k, density, fmt, seed):
    rng = np.random.default_rng(seed)
    pattern = as_format(messy(rng, m, n, density), fmt)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((n, k))
    out = sc.sddmm(pattern, a, b)
    rows, cols = reference.entries(out.indptr, out.indices)
    np.testing.assert_allclose(out.data, reference.sampled_product(rows, cols, a, b), rtol=1e-12, atol=1e-12)


def test_sddmm_non_contiguous_operands_and_nan(rng):
    pattern = scipy.sparse.csr_array(np.array([[1, 0], [1, 1]]))
    a = np.asfortranarray(rng.standard_normal((2, 3)))
    b = np.broadcast_to(np.array([1.0, np.nan, 2.0]), (2, 3))
    out = sc.sddmm(pattern, a, b)
    assert np.isnan(out.data).all()
    out = sc.sddmm(pattern, a, np.ones((2, 3))[:, ::1])
    np.testing.assert_allclose(out.toarray(), np.array([[1, 0], [1, 1]]) * a.sum(1)[:, None], rtol=1e-12)



@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sddmm_of_column_major_operands_reads_their_transposes(rng, dtype):
    """Both operands column-major (a layer's gradient and input, transposed): the kernel reads
    their transposes through its buffers, with NaN still propagating."""
    pattern = messy(rng, 40, 33).tocsr()
    a = np.asfortranarray(rng.standard_normal((40, 70))).astype(dtype, order="F")
    b = np.asfortranarray(rng.standard_normal((33, 70))).astype(dtype, order="F")
    a[3, 65] = np.nan
    out = sc.sddmm(pattern, a, b)
    rows, cols = reference.entries(out.indptr, out.indices)
    want = reference.sampled_product(rows, cols, a, b)
    np.testing.assert_allclose(out.data, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
    assert np.isnan(out.data[rows == 3]).all() and not np.isnan(out.data[rows != 3]).any()

# --- prune --------------------------------------------------------------------------------------


@given(m=st.integers(0, 7), n=st.integers(0, 7), sparsity=st.floats(0, 1), seed=st.integers(0, 2**16),
       method=st.sampled_from(["magnitude", "random"]))
def test_prune_keeps_exactly_size_minus_round_sparsity_size(m, n, sparsity, seed, method):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((m, n))
    w[rng.random((m, n)) < 0.3] = 0.0
    out = sc.prune(w, sparsity, method=method, seed=seed)
    keep = w.size - round(sparsity * w.size)
    assert out.nnz == keep and out.has_canonical_format and isinstance(out, scipy.sparse.csr_array)
    rows, cols = reference.entries(out.indptr, out.indices)
    np.testing.assert_array_equal(out.data, w[rows, cols])  # kept zeros stay stored
    if method == "magnitude":
        np.testing.assert_array_equal(rows * n + cols, reference.largest_positions(w, keep))


def test_prune_magnitude_keeps_the_largest_not_the_smallest_and_breaks_ties_by_position(xp):
    w = np.array([[0.1, -5.0, 3.0, 0.2], [-3.0, 0.0, 4.0, 3.0]], np.float32)
    out = sc.prune(xp.asarray(w), 0.5)
    np.testing.assert_array_equal(host(out.toarray()), [[0, -5, 3, 0], [-3, 0, 4, 0]])  # 3 of 3 ties
    assert out.dtype == np.float32


def test_prune_keeps_nan_first(xp):
    w = np.array([[1.0, np.nan], [-2.0, 0.5]])
    out = host(sc.prune(xp.asarray(w), 0.5).toarray())
    assert np.isnan(out[0, 1]) and out[1, 0] == -2.0 and out[0, 0] == 0 and out[1, 1] == 0


def test_prune_random_is_seeded_and_uniform(xp):
    w = xp.ones((10, 10))
    first = sc.prune(w, 0.7, method="random", seed=3)
    again = sc.prune(w, 0.7, method="random", seed=3)
    np.testing.assert_array_equal(host(first.indices), host(again.indices))
    counts = sum(host(sc.prune(w, 0.7, method="random", seed=s).toarray()) for s in range(300))
    assert counts.min() > 60 and counts.max() < 120  # each position kept with probability 0.3


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: sc.prune(np.ones((2, 2)), 1.5), ValueError, r"sparsity must be in \[0, 1\], got 1.5"),
        (lambda: sc.prune(np.ones((2, 2)), float("nan")), ValueError, r"sparsity must be in \[0, 1\]"),
        (lambda: sc.prune(np.ones((2, 2)), "0.5"), TypeError, r"sparsity must be a number"),
        (lambda: sc.prune(np.ones((2, 2)), 0.5, method="smallest"), ValueError, "'magnitude' or 'random'"),
        (lambda: sc.prune(np.ones(4), 0.5), ValueError, r"w must be 2-D, got shape \(4,\)"),
        (lambda: sc.prune(np.ones((2, 2), np.int64), 0.5), TypeError, "int64"),
        (lambda: sc.prune(scipy.sparse.csr_array(np.ones((2, 2))), 0.5), TypeError, "w must be a dense array"),
    ],
    ids=["sparsity-too-large", "sparsity-nan", "sparsity-string", "bad-method", "1-d", "int-dtype", "sparse-w"],
)
def test_prune_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_prune_never_writes_to_a_read_only_input(rng):
    w = rng.standard_normal((5, 6))
    w.flags.writeable = False
    saved = w.copy()
    sc.prune(w, 0.5)
    np.testing.assert_array_equal(w, saved)


# --- the helpers behind SparseLinear -------------------------------------------------------------


@given(st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.0, 3.0, 1.5e-5, 6e4, np.nan]), max_size=12), st.integers(0, 12),
       st.sampled_from([np.float16, np.float32, np.float64]))
def test_largest_magnitudes_match_a_plain_sort(scores, count, dtype):
    scores = np.array(scores, dtype)
    count = min(count, scores.size)
    got = _selection.largest(_backend.NUMPY, scores, count)
    np.testing.assert_array_equal(got, reference.largest_positions(scores, count))


@given(st.lists(st.sampled_from([0.0, -0.0, 1.0, -1.0, -2.0, 3.0, -1.5e-5, np.inf, -np.inf, np.nan]), max_size=12),
       st.integers(0, 12), st.sampled_from([np.float16, np.float32, np.float64]))
def test_largest_of_signed_scores_orders_by_value(scores, count, dtype):
    """Negative scores (every bit of their keys flipped) rank below the others; NaN above all."""
    scores = np.array(scores, dtype)
    count = min(count, scores.size)
    np.testing.assert_array_equal(_selection.largest(_backend.NUMPY, scores, count),
                                  reference.largest_values(scores, count))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nan_ranks_above_inf_and_every_nan_alike(dtype):
    """NaN counts as the largest value: above +inf (which it used to tie with, the earlier
    position winning), a negative NaN too, NaNs' ties going to the earlier position."""
    nan = np.array(np.nan, dtype)
    scores = np.array([np.inf, nan, np.inf, -nan], dtype)  # -nan: the sign bit set
    assert np.signbit(scores[3])
    for count, kept in ((1, [1]), (2, [1, 3]), (3, [0, 1, 3])):
        np.testing.assert_array_equal(_selection.largest(_backend.NUMPY, scores, count), kept)
    if dtype != np.float16:  # prune takes float32 and float64
        pruned = sc.prune(np.array([[np.inf, np.nan], [-np.inf, 1.0]], dtype), 0.75)
        assert pruned.nnz == 1 and pruned.indices[0] == 1 and np.isnan(pruned.data[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_largest_of_a_weight_already_mostly_zero_matches_a_plain_sort(rng, dtype):
    """An iterative pruning loop scores a weight whose pruned entries tie at zero."""
    scores = np.abs(rng.standard_normal(20_000)).astype(dtype)
    scores[rng.random(scores.size) < 0.9] = 0.0
    for count in (100, int((scores > 0).sum()), 5_000, 19_999):
        got = _selection.largest(_backend.NUMPY, scores, count)
        np.testing.assert_array_equal(got, reference.largest_positions(scores, count))


@pytest.mark.parametrize("total, count, taken", [(1000, 30, 40), (100, 30, 60), (50, 20, 0), (30, 10, 20)])
def test_random_positions_avoid_taken_ones_and_are_distinct(rng, total, count, taken):
    taken = np.sort(rng.choice(total, taken, replace=False))
    got = _selection.random_positions(_backend.NUMPY, total, count, taken=taken, seed=1)
    assert got.shape == (count,) and np.all(np.diff(got) > 0)
    assert not np.isin(got, taken).any() and got.min() >= 0 and got.max() < total


def canonical(rng, m, n, density):
    matrix = scipy.sparse.random(m, n, density=density, format="csr", random_state=rng)
    return _csr.Csr(matrix.indptr, matrix.indices, None, (m, n)), matrix.data


def test_drop_and_grow_keeps_nnz_drops_the_smallest_and_grows_at_free_positions(rng):
    csr, values = canonical(rng, 30, 20, 0.2)
    n_move = 17
    indptr, indices, old, new = _selection.drop_and_grow(_backend.NUMPY, csr, values, n_move, seed=0, caller="t")
    assert indices.shape == (csr.nnz,) and indptr[-1] == csr.nnz
    old_rows, old_cols = reference.entries(csr.indptr, csr.indices)
    new_rows, new_cols = reference.entries(indptr, indices)
    assert np.all(np.diff(new_rows * 20 + new_cols) > 0)  # canonical
    np.testing.assert_array_equal(old, reference.largest_positions(values, csr.nnz - n_move))
    np.testing.assert_array_equal(new_rows[new] * 20 + new_cols[new], old_rows[old] * 20 + old_cols[old])


@pytest.mark.parametrize("scores", ["distinct", "tied", "nan"])
def test_drop_and_grow_by_gradient_picks_the_largest_dense_gradient_outside_the_kept_entries(rng, monkeypatch, scores):
    """Scored a row block at a time, each later block passing only what beats the least kept
    score: ties go to the earlier position and NaN counts as the largest, as for one block."""
    monkeypatch.setattr(_selection, "_SCORE_BLOCK", 37)  # several row blocks
    csr, values = canonical(rng, 12, 9, 0.3)
    grad_y, x = rng.standard_normal((5, 12)), rng.standard_normal((5, 9))
    if scores == "tied":
        grad_y, x = np.sign(grad_y), np.sign(x)  # a handful of distinct products
    elif scores == "nan":
        grad_y[:, [2, 9]] = np.nan  # two rows of NaN scores, one in a late block
    n_move = 6 if scores != "nan" else 20
    indptr, indices, old, new = _selection.drop_and_grow(
        _backend.NUMPY, csr, values, n_move, grad_y=grad_y, x=x, caller="t")
    rows, cols = reference.entries(csr.indptr, csr.indices)
    kept = (rows * 9 + cols)[old]
    scores = (grad_y.T @ x).ravel()
    free = np.setdiff1d(np.arange(scores.size), kept)
    new_rows, new_cols = reference.entries(indptr, indices)
    grown = np.setdiff1d(new_rows * 9 + new_cols, kept)
    np.testing.assert_array_equal(grown, free[reference.largest_positions(scores[free], n_move)])


def test_drop_and_grow_needs_a_canonical_structure():
    csr = _csr.Csr(np.array([0, 2]), np.array([1, 1]), None, (1, 3))
    with pytest.raises(ValueError, match="needs a canonical structure"):
        _selection.drop_and_grow(_backend.NUMPY, csr, np.ones(2), 1, caller="t")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(7, 19), (16, 16), (48, 32), (33, 50), (256, 17), (1, 40), (0, 5), (5, 0)])
def test_contiguous_copies_fortran_order_through_the_transpose_kernel(rng, shape, dtype):
    """Whole 16 x 16 blocks go through vector shuffles, the edges element by element: every
    bit must arrive where it belongs, NaN, infinities and -0.0 included."""
    a = rng.standard_normal(shape).astype(dtype)
    a.flat[::7] = np.resize([np.nan, -np.inf, -0.0, np.inf], a.flat[::7].size)
    a = np.asfortranarray(a)
    out = _csr.contiguous(_backend.NUMPY, a)
    assert out.flags.c_contiguous
    np.testing.assert_array_equal(out.view(f"u{out.itemsize}"), np.ascontiguousarray(a).view(f"u{out.itemsize}"))
