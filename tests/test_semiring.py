"""logmatmul, maxmatmul and log_chain_product (spchain/semiring.py) against float64 references."""

import numpy as np
import scipy.sparse
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import reference
import spchain as sc
from spchain import semiring


def to_numpy(a):
    return a.get() if hasattr(a, "get") else a


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)), ((1, 4), (4, 1)), ((3, 1), (1, 3))],
)
def test_logmatmul_matches_broadcasting_reference(xp, rng, a_shape, b_shape):
    a, b = rng.normal(scale=3, size=a_shape), rng.normal(scale=3, size=b_shape)
    got = to_numpy(sc.logmatmul(xp.asarray(a), xp.asarray(b)))
    np.testing.assert_allclose(got, reference.log_matmul(a, b), rtol=1e-12)


def test_logmatmul_float32_is_within_1e_5(rng):
    a = rng.normal(scale=5, size=(8, 64, 64)).astype(np.float32)
    b = rng.normal(scale=5, size=(8, 64, 64)).astype(np.float32)
    got = sc.logmatmul(a, b)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference.log_matmul(a, b), rtol=1e-5, atol=1e-5)


def test_logmatmul_recomputes_underflowed_entries_exactly():
    # row maxima at k = 0, column maxima at k = 1, 300 nats apart: exp-space products of
    # every entry underflow, the exact answers are finite
    a = np.array([[0.0, -300.0]], np.float32)
    b = np.array([[-np.inf], [0.0]], np.float32)
    np.testing.assert_allclose(sc.logmatmul(a, b), [[-300.0]])
    a64, b64 = np.array([[0.0, -1000.0]]), np.array([[-np.inf], [0.0]])
    np.testing.assert_allclose(sc.logmatmul(a64, b64), [[-1000.0]])


def test_many_lost_entries_with_structural_zeros(monkeypatch, rng):
    # a banded (structurally sparse) matrix with far-apart values: many lost entries go
    # through the 0/1 support product first
    monkeypatch.setattr("spchain._logspace.FIXUP_CHUNK", 8)
    a = rng.normal(scale=200, size=(6, 7))
    b = np.full((7, 6), -np.inf)
    for k in range(6):
        b[k, k] = rng.normal(scale=200)
    np.testing.assert_allclose(sc.logmatmul(a, b), reference.log_matmul(a, b), rtol=1e-12)


def test_minus_inf_rows_and_columns_and_nan():
    a = np.array([[-np.inf, -np.inf], [0.0, 1.0], [np.nan, 0.0]])
    b = np.array([[0.0, -np.inf], [1.0, -np.inf]])
    got = sc.logmatmul(a, b)
    assert np.isneginf(got[0]).all() and np.isneginf(got[:2, 1]).all()
    np.testing.assert_allclose(got[1, 0], np.logaddexp(0.0, 2.0))
    assert np.isnan(got[2, 0])


def test_log_identity_and_associativity(rng):
    a = rng.normal(size=(3, 5, 5))
    with np.errstate(divide="ignore"):
        log_eye = np.log(np.eye(5))
    np.testing.assert_allclose(sc.logmatmul(a, log_eye), a, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(sc.logmatmul(log_eye, a), a, rtol=1e-13, atol=1e-15)
    b, c = rng.normal(size=(3, 5, 5)), rng.normal(size=(3, 5, 5))
    np.testing.assert_allclose(sc.logmatmul(sc.logmatmul(a, b), c), sc.logmatmul(a, sc.logmatmul(b, c)), rtol=1e-12)


def test_empty_shapes():
    assert sc.logmatmul(np.zeros((0, 3)), np.zeros((3, 2))).shape == (0, 2)
    assert np.isneginf(sc.logmatmul(np.zeros((2, 0)), np.zeros((0, 3)))).all()
    values, argmax = sc.maxmatmul(np.zeros((2, 0)), np.zeros((0, 3)))
    assert np.isneginf(values).all() and (argmax == 0).all()
    assert sc.maxmatmul(np.zeros((4, 0, 3)), np.zeros((3, 2)))[0].shape == (4, 0, 2)


@pytest.mark.parametrize("fn", [sc.logmatmul, sc.maxmatmul])
@pytest.mark.parametrize(
    "a, b, error, match",
    [
        (np.zeros(3), np.zeros((3, 3)), ValueError, r"at least two axes, got shapes \(3,\) and \(3, 3\)"),
        (np.zeros((2, 3)), np.zeros((4, 2)), ValueError, r"shapes \(2, 3\) and \(4, 2\) do not match"),
        (np.zeros((2, 2, 3)), np.zeros((3, 3, 2)), ValueError, "batch shapes of .* do not broadcast"),
        (np.zeros((2, 3), np.int32), np.zeros((3, 2)), TypeError, "a has dtype int32"),
        (np.zeros((2, 3)), np.zeros((3, 2), np.complex64), TypeError, "b has dtype complex64"),
    ],
)
def test_bad_operands(fn, a, b, error, match):
    with pytest.raises(error, match=match):
        fn(a, b)


def test_mixed_dtypes_compute_in_float64(rng):
    a, b = rng.normal(size=(2, 3)).astype(np.float32), rng.normal(size=(3, 2))
    assert sc.logmatmul(a, b).dtype == np.float64
    np.testing.assert_allclose(sc.logmatmul(a, b), reference.log_matmul(a, b), rtol=1e-12)


def test_odd_layouts(rng):
    a = np.asfortranarray(rng.normal(size=(4, 3)))
    b = rng.normal(size=(5, 3)).T
    a.flags.writeable = False
    np.testing.assert_allclose(sc.logmatmul(a, b), reference.log_matmul(a, b), rtol=1e-12)
    np.testing.assert_array_equal(sc.maxmatmul(a[::-1], b)[1], reference.max_matmul(a[::-1], b)[1])


@pytest.mark.parametrize("a_shape, b_shape", [((3, 4), (4, 5)), ((2, 3, 4), (1, 4, 5)), ((6, 1), (1, 2))])
def test_maxmatmul_matches_reference(xp, rng, a_shape, b_shape):
    a, b = rng.normal(size=a_shape), rng.normal(size=b_shape)
    values, argmax = sc.maxmatmul(xp.asarray(a), xp.asarray(b))
    want_values, want_argmax = reference.max_matmul(a, b)
    np.testing.assert_allclose(to_numpy(values), want_values, rtol=1e-14)
    np.testing.assert_array_equal(to_numpy(argmax), want_argmax)
    assert argmax.dtype == np.int64


def test_maxmatmul_ties_go_to_the_lowest_index_and_nan_wins():
    a = np.array([[1.0, 1.0, 0.0], [0.0, np.nan, np.nan], [-np.inf, -np.inf, -np.inf]])
    b = np.zeros((3, 2))
    values, argmax = sc.maxmatmul(a, b)
    np.testing.assert_array_equal(argmax, [[0, 0], [1, 1], [0, 0]])
    assert np.isnan(values[1]).all() and np.isneginf(values[2]).all()


@pytest.mark.parametrize("length", range(1, 18))
def test_log_chain_product_matches_sequential_reference(xp, rng, length):
    m = rng.normal(scale=2, size=(3, length, 4, 4))
    got = to_numpy(sc.log_chain_product(xp.asarray(m)))
    np.testing.assert_allclose(got, reference.log_chain_product(m), rtol=1e-11)


def test_log_chain_product_is_not_fooled_by_odd_levels():
    # the seed code padded odd levels with a zero log-matrix (all ones); three identities
    # must multiply to the identity
    with np.errstate(divide="ignore"):
        log_eye = np.log(np.eye(3))
    np.testing.assert_array_equal(sc.log_chain_product(np.stack([log_eye] * 3)), log_eye)


def test_log_chain_product_chunks_and_leaves_the_input_alone(monkeypatch, rng):
    monkeypatch.setattr(semiring, "CHAIN_CHUNK_BYTES", 1)  # one row of the batch at a time
    m = rng.normal(size=(2, 3, 5, 3, 3)).astype(np.float32)
    before = m.copy()
    got = sc.log_chain_product(m)
    np.testing.assert_allclose(got, reference.log_chain_product(m), rtol=1e-5)
    np.testing.assert_array_equal(m, before)


def test_log_chain_product_edge_shapes():
    assert sc.log_chain_product(np.zeros((0, 3, 2, 2))).shape == (0, 2, 2)
    assert sc.log_chain_product(np.zeros((4, 0, 0))).shape == (0, 0)
    np.testing.assert_allclose(sc.log_chain_product(np.ones((6, 1, 1))), [[6.0]])
    with pytest.raises(ValueError, match=r"at least one matrix \(L >= 1\)"):
        sc.log_chain_product(np.zeros((0, 2, 2)))
    with pytest.raises(ValueError, match=r"must have shape \(\.\.\., L, c, c\), got \(3, 2, 4\)"):
        sc.log_chain_product(np.zeros((3, 2, 4)))


log_values = st.one_of(st.just(-np.inf), st.floats(-50, 50))


@given(data=st.data(), m=st.integers(0, 4), k=st.integers(0, 4), n=st.integers(0, 4), batch=st.integers(0, 2))
def test_random_shapes_with_minus_inf(data, m, k, n, batch):
    a = data.draw(hnp.arrays(np.float64, (batch, m, k), elements=log_values))
    b = data.draw(hnp.arrays(np.float64, (k, n), elements=log_values))
    np.testing.assert_allclose(sc.logmatmul(a, b), reference.log_matmul(a, b), rtol=1e-12, atol=1e-12)
    values, argmax = sc.maxmatmul(a, b)
    want_values, want_argmax = reference.max_matmul(a, b)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(argmax, want_argmax)


infinite_log_values = st.one_of(st.just(-np.inf), st.just(np.inf), st.floats(-50, 50))


@given(data=st.data(), m=st.integers(0, 4), k=st.integers(0, 4), n=st.integers(0, 4), batch=st.integers(0, 2))
def test_plus_inf_gives_plus_inf_never_nan(data, m, k, n, batch):
    a = data.draw(hnp.arrays(np.float64, (batch, m, k), elements=infinite_log_values))
    b = data.draw(hnp.arrays(np.float64, (k, n), elements=infinite_log_values))
    want, _, _ = reference.log_matmul_and_grads(a, b, np.zeros((batch, m, n)))
    got = sc.logmatmul(a, b)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    terms = reference.semiring_terms(a, b)
    values, argmax = sc.maxmatmul(a, b)
    if k:
        np.testing.assert_array_equal(argmax, np.argmax(terms, axis=-2))
        np.testing.assert_array_equal(values, terms.max(axis=-2))
    assert not np.isnan(values).any()


def test_plus_inf_examples():
    inf = np.inf
    a, b = np.array([[inf, 0.0], [inf, np.nan]]), np.array([[-inf, 1.0], [0.0, inf]])
    # row 0: inf + -inf is a structural zero, so column 0 is finite; column 1 has two +inf terms
    np.testing.assert_array_equal(sc.logmatmul(a, b), [[0.0, inf], [np.nan, np.nan]])
    np.testing.assert_array_equal(sc.maxmatmul(a, b)[0], [[0.0, inf], [np.nan, np.nan]])
    np.testing.assert_array_equal(sc.maxmatmul(a, b)[1], [[1, 0], [1, 1]])  # NaN wins
    np.testing.assert_array_equal(sc.logmatmul(np.array([[inf]]), np.array([[-inf]])), [[-inf]])
    m = np.array([[[0.0, inf], [0.0, 0.0]], [[-inf, 0.0], [0.0, -inf]], [[0.0, 0.0], [-inf, 0.0]]])
    np.testing.assert_array_equal(sc.log_chain_product(m), reference.log_chain_product_and_grad(m, np.zeros((2, 2)))[0])
    assert np.isposinf(sc.log_chain_product(m)[0]).all() and np.isfinite(sc.log_chain_product(m)[1]).all()


@pytest.mark.parametrize("length", [1, 2, 3, 4, 7])
def test_log_chain_product_with_plus_and_minus_inf(rng, length):
    m = rng.normal(size=(3, length, 3, 3))
    m[rng.random(m.shape) < 0.2] = np.inf
    m[rng.random(m.shape) < 0.3] = -np.inf
    got = sc.log_chain_product(m)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, reference.log_chain_product_and_grad(m, np.zeros((3, 3, 3)))[0], rtol=1e-12)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_np_matrix_operands_work_as_ndarrays(rng):
    a, b = rng.normal(size=(3, 4)), rng.normal(size=(4, 2))
    got = sc.logmatmul(np.matrix(a), np.matrix(b))
    assert type(got) is np.ndarray
    np.testing.assert_allclose(got, reference.log_matmul(a, b), rtol=1e-12)
    values, argmax = sc.maxmatmul(np.matrix(a), b)
    np.testing.assert_array_equal(values, reference.max_matmul(a, b)[0])
    np.testing.assert_array_equal(argmax, reference.max_matmul(a, b)[1])


@pytest.mark.parametrize("fn", [sc.logmatmul, sc.maxmatmul])
@pytest.mark.parametrize(
    "a, b, match",
    [
        (0.0, np.zeros((2, 2)), "a must be an array, not float"),
        (np.zeros((2, 2)), None, "b must be an array, not NoneType"),
        ([[0.0]], np.zeros((1, 1)), "a must be an array, not list"),
        (np.zeros((2, 2)), np.float64(1.0), "b must be an array, not float64"),
        (scipy.sparse.eye(2, format="csr"), np.zeros((2, 2)), "a is a sparse csr matrix; it must be a dense array"),
    ],
)
def test_scalars_none_lists_and_sparse_matrices_are_type_errors_naming_the_argument(fn, a, b, match):
    with pytest.raises(TypeError, match=rf"spchain\.{fn.__name__}: {match}"):
        fn(a, b)


@pytest.mark.parametrize("m, match", [(1.0, "m must be an array, not float"), (None, "m must be an array, not NoneType"),
                                      ([[[0.0]]], "m must be an array, not list")])
@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_log_chain_product_scalar_none_or_list_is_a_type_error(m, match):
    with pytest.raises(TypeError, match=rf"spchain\.log_chain_product: {match}"):
        sc.log_chain_product(m)
    np.testing.assert_array_equal(sc.log_chain_product(np.matrix([[1.0]])[None]), [[1.0]])


@pytest.mark.parametrize("dtype, low", [(np.float32, -1e4), (np.float64, -1e300)])
def test_very_negative_logs_stay_finite_and_accurate(rng, dtype, low):
    a = (low + rng.normal(size=(3, 4))).astype(dtype)
    b = rng.normal(size=(4, 2)).astype(dtype)
    got = sc.logmatmul(a, b)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, reference.log_matmul(a, b), rtol=1e-6 if dtype == np.float32 else 1e-12)
    m = np.stack([a[:, :3], b[:3].repeat(2, axis=1)[:, :3]]).astype(dtype)
    assert np.isfinite(sc.log_chain_product(m)).all()
    np.testing.assert_allclose(sc.log_chain_product(m), reference.log_chain_product(m), rtol=1e-6 if dtype == np.float32 else 1e-12)


def test_zero_stride_read_only_operands_are_read_correctly_and_never_written(rng):
    a = np.broadcast_to(rng.normal(size=(1, 4)), (3, 4))  # 0-stride rows, read-only
    b = np.asfortranarray(rng.normal(size=(4, 5)))
    b.flags.writeable = False
    m = np.broadcast_to(rng.normal(size=(1, 3, 3)), (4, 3, 3))
    np.testing.assert_allclose(sc.logmatmul(a, b), reference.log_matmul(a, b), rtol=1e-12)
    np.testing.assert_array_equal(sc.maxmatmul(a, b)[1], reference.max_matmul(a, b)[1])
    np.testing.assert_allclose(sc.log_chain_product(m), reference.log_chain_product(m), rtol=1e-12)
    np.testing.assert_allclose(sc.log_chain_product(m.transpose(0, 2, 1)[::-1]), reference.log_chain_product(m.transpose(0, 2, 1)[::-1]), rtol=1e-12)


def test_log_chain_product_all_minus_inf_and_nan():
    m = np.zeros((2, 3, 2, 2))
    m[0, 1] = -np.inf  # an impossible chain
    m[1, 2, 0, 1] = np.nan
    got = sc.log_chain_product(m)
    assert np.isneginf(got[0]).all()
    assert np.isnan(got[1, :, 1]).all() and np.isfinite(got[1, :, 0]).all()
