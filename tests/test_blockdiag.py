"""Block-diagonal and grouped matmul at the array level (spchain/blockdiag.py)."""

import doctest
import tracemalloc

import numpy as np
import pytest
import scipy.sparse
from hypothesis import given
from hypothesis import strategies as st

import reference
import spchain as sc
from spchain import blockdiag

DTYPES = [np.float32, np.float64]


def host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def assert_close(got, want, dtype):
    tol = 1e-5 if np.dtype(dtype) == np.float32 else 1e-12
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1.0)
    np.testing.assert_allclose(host(got), want, rtol=tol, atol=tol * scale)


def test_docstring_examples():
    assert doctest.testmod(blockdiag, raise_on_error=True).attempted >= 2


# block_diag_matmul ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lead, groups, d_in, d_out",
    [((7,), 3, 4, 5), ((), 2, 3, 3), ((2, 3), 4, 2, 6), ((5,), 1, 8, 3), ((33,), 8, 16, 16)],
    ids=["rows", "no-leading-axes", "two-leading-axes", "one-group", "square"],
)
def test_block_diag_matmul_matches_scipy_block_diag(xp, rng, dtype, lead, groups, d_in, d_out):
    x = rng.standard_normal(lead + (groups, d_in)).astype(dtype)
    w = rng.standard_normal((groups, d_in, d_out)).astype(dtype)
    y = sc.block_diag_matmul(xp.asarray(x), xp.asarray(w))
    assert type(y) is type(xp.asarray(x)) and y.dtype == dtype and y.shape == lead + (groups, d_out)
    assert y.flags.c_contiguous
    assert_close(y, reference.block_diag_matmul(x, w), dtype)


@given(
    lead=st.lists(st.integers(0, 3), max_size=2).map(tuple),
    groups=st.integers(0, 3),
    d_in=st.integers(0, 3),
    d_out=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_block_diag_matmul_any_shape_including_empty(lead, groups, d_in, d_out, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (groups, d_in))
    w = rng.standard_normal((groups, d_in, d_out))
    y = sc.block_diag_matmul(x, w)
    assert y.shape == lead + (groups, d_out)
    assert_close(y, reference.block_diag_matmul(x, w), np.float64)
    assert_close(blockdiag._block_diag_weight_grad(x, y), reference.block_diag_weight_grad(x, y), np.float64)


LAYOUTS = {
    "transposed": lambda a: np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2),
    "fortran": np.asfortranarray,
    "sliced": lambda a: np.repeat(a, 2, axis=-1)[..., ::2],
    "reversed": lambda a: np.ascontiguousarray(a[::-1])[::-1],
    "zero-stride": lambda a: np.broadcast_to(a[:1], a.shape),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_diag_matmul_any_layout(xp, rng, layout):
    x = LAYOUTS[layout](rng.standard_normal((6, 3, 4)))
    w = LAYOUTS[layout](rng.standard_normal((3, 4, 5)))
    assert_close(sc.block_diag_matmul(xp.asarray(x), xp.asarray(w)), reference.block_diag_matmul(x, w), np.float64)
    grad = LAYOUTS[layout](rng.standard_normal((6, 3, 5)))
    assert_close(blockdiag._block_diag_weight_grad(xp.asarray(x), xp.asarray(grad)),
                 reference.block_diag_weight_grad(x, grad), np.float64)


def test_block_diag_weight_grad_matches_reference(xp, rng):
    x = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    grad = rng.standard_normal((2, 5, 3, 6)).astype(np.float32)
    got = blockdiag._block_diag_weight_grad(xp.asarray(x), xp.asarray(grad))
    assert got.shape == (3, 4, 6) and got.dtype == np.float32
    assert_close(got, reference.block_diag_weight_grad(x, grad), np.float32)


def test_mixed_float32_float64_computes_in_float64(xp, rng):
    x = rng.standard_normal((4, 2, 3)).astype(np.float32)
    w = rng.standard_normal((2, 3, 3))
    y = sc.block_diag_matmul(xp.asarray(x), xp.asarray(w))
    assert y.dtype == np.float64
    assert_close(y, reference.block_diag_matmul(x, w), np.float64)


def test_nan_and_inf_propagate_like_a_dense_product(xp):
    x = np.ones((2, 2, 2))
    x[0, 1, 0] = np.nan
    x[1, 0, 1] = np.inf
    w = np.ones((2, 2, 2))
    with np.errstate(invalid="ignore"):  # NumPy's BLAS matmul may warn on inf, as for a dense product
        y = host(sc.block_diag_matmul(xp.asarray(x), xp.asarray(w)))
    assert np.isnan(y[0, 1]).all() and np.isinf(y[1, 0]).all()
    assert np.isfinite(y[0, 0]).all() and np.isfinite(y[1, 1]).all()


def test_read_only_inputs_are_never_written(rng):
    x = rng.standard_normal((4, 2, 3))
    w = rng.standard_normal((2, 3, 3))
    x_copy, w_copy = x.copy(), w.copy()
    x.flags.writeable = w.flags.writeable = False
    sc.block_diag_matmul(x, w)
    sc.grouped_matmul(x[:, 0], w, [1, 3])
    np.testing.assert_array_equal(x, x_copy)
    np.testing.assert_array_equal(w, w_copy)


@pytest.mark.parametrize(
    "x_shape, w_shape",
    [((4, 2, 3), (3, 3, 5)), ((4, 2, 3), (2, 4, 5)), ((4, 6), (2, 3, 5)), ((3,), (1, 3, 2)), ((4, 2, 3), (2, 3))],
    ids=["groups", "d_in", "flat-x", "1-d-x", "2-d-w"],
)
def test_block_diag_shape_mismatch_names_both_shapes(x_shape, w_shape):
    with pytest.raises(ValueError, match=rf"do not match: x has shape \({x_shape[0]},.*w has shape \({w_shape[0]},"):
        sc.block_diag_matmul(np.ones(x_shape), np.ones(w_shape))


@pytest.mark.parametrize("dtype", [np.float16, np.int64, np.complex128, np.bool_])
def test_unsupported_dtypes_are_type_errors_naming_the_dtype(dtype):
    good = np.ones((2, 2, 2))
    with pytest.raises(TypeError, match=rf"x has dtype {np.dtype(dtype)}"):
        sc.block_diag_matmul(good.astype(dtype), good)
    with pytest.raises(TypeError, match=rf"w has dtype {np.dtype(dtype)}"):
        sc.grouped_matmul(good[0], good.astype(dtype), [1, 1])


def test_torch_tensors_point_to_spchain_torch():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"requires grad.*spchain\.torch\.block_diag_matmul.*detach"):
        sc.block_diag_matmul(torch.ones(2, 2, 2, requires_grad=True), np.ones((2, 2, 2)))
    with pytest.raises(TypeError, match=r"spchain\.torch\.grouped_matmul"):
        sc.grouped_matmul(np.ones((2, 2)), np.ones((2, 2, 2)), torch.tensor([1, 1]))


def test_lists_are_type_errors():
    with pytest.raises(TypeError, match="not list"):
        sc.block_diag_matmul([[[1.0]]], np.ones((1, 1, 1)))


def test_block_diag_matmul_never_copies_the_weight_per_row_or_the_input(rng):
    x = rng.standard_normal((2048, 8, 16)).astype(np.float32)
    w = rng.standard_normal((8, 16, 16)).astype(np.float32)
    grad = rng.standard_normal((2048, 8, 16)).astype(np.float32)
    for run, result_bytes in [(lambda: sc.block_diag_matmul(x, w), x.nbytes),
                              (lambda: sc.block_diag_matmul(grad, w.swapaxes(1, 2)), x.nbytes),
                              (lambda: blockdiag._block_diag_weight_grad(x, grad), w.nbytes)]:
        assert traced_peak(run) <= result_bytes + 64 * 1024


def traced_peak(run) -> int:
    """Peak bytes NumPy allocates while ``run()`` runs (NumPy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# grouped_matmul ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "group_sizes",
    [[3, 1, 4], [0, 5, 0, 2, 0], [6], [0, 0], [1] * 9],
    ids=["uneven", "empty-groups", "one-group", "no-rows", "one-row-each"],
)
def test_grouped_matmul_matches_per_group_loop(xp, rng, dtype, group_sizes):
    n, groups = sum(group_sizes), len(group_sizes)
    x = rng.standard_normal((n, 5)).astype(dtype)
    w = rng.standard_normal((groups, 5, 3)).astype(dtype)
    y = sc.grouped_matmul(xp.asarray(x), xp.asarray(w), group_sizes)
    assert type(y) is type(xp.asarray(x)) and y.dtype == dtype and y.shape == (n, 3)
    assert_close(y, reference.grouped_matmul(x, w, group_sizes), dtype)
    grad = rng.standard_normal((n, 3)).astype(dtype)
    sizes = blockdiag._check_group_sizes("f", group_sizes, groups, n)
    gw = blockdiag._grouped_weight_grad(xp.asarray(x), xp.asarray(grad), sizes)
    assert gw.shape == w.shape and gw.dtype == dtype
    assert_close(gw, reference.grouped_weight_grad(x, grad, group_sizes), dtype)


@given(
    group_sizes=st.lists(st.integers(0, 4), max_size=5),
    d_in=st.integers(0, 3),
    d_out=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_grouped_matmul_any_shape_including_empty(group_sizes, d_in, d_out, seed):
    rng = np.random.default_rng(seed)
    n = sum(group_sizes)
    x = rng.standard_normal((n, d_in))
    w = rng.standard_normal((len(group_sizes), d_in, d_out))
    assert_close(sc.grouped_matmul(x, w, group_sizes), reference.grouped_matmul(x, w, group_sizes), np.float64)


@pytest.mark.parametrize(
    "as_sizes",
    [tuple, np.array, lambda s: np.array(s, np.uint8), lambda s: np.array(s, np.int32), range],
    ids=["tuple", "int64-array", "uint8-array", "int32-array", "range"],
)
def test_group_sizes_may_be_any_integer_sequence(xp, rng, as_sizes):
    x = rng.standard_normal((6, 2))
    w = rng.standard_normal((4, 2, 2))
    sizes = as_sizes([0, 1, 2, 3]) if as_sizes is not range else range(4)
    if isinstance(sizes, np.ndarray):
        sizes = xp.asarray(sizes)
    assert_close(sc.grouped_matmul(xp.asarray(x), xp.asarray(w), sizes),
                 reference.grouped_matmul(x, w, [0, 1, 2, 3]), np.float64)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_matmul_any_layout(xp, rng, layout):
    x = LAYOUTS[layout](rng.standard_normal((7, 4)))
    w = LAYOUTS[layout](rng.standard_normal((3, 4, 5)))
    assert_close(sc.grouped_matmul(xp.asarray(x), xp.asarray(w), [2, 0, 5]),
                 reference.grouped_matmul(x, w, [2, 0, 5]), np.float64)


@pytest.mark.parametrize(
    "group_sizes, error, message",
    [
        ([2, 2], ValueError, r"group_sizes sum to 4 but x has 5 rows"),
        ([3, 3], ValueError, r"group_sizes sum to 6 but x has 5 rows"),
        ([6, -1], ValueError, r"group_sizes must be non-negative, got \[6, -1\]"),
        ([5], ValueError, r"group_sizes has shape \(1,\) but w has 2 groups"),
        ([[2, 3]], ValueError, r"group_sizes has shape \(1, 2\) but w has 2 groups"),
        (5, ValueError, r"group_sizes has shape \(\) but w has 2 groups"),
        ([2.0, 3.0], TypeError, r"group_sizes must hold integers, not float64"),
        ([True, True], TypeError, r"group_sizes must hold integers, not bool"),
        ([True, 4], TypeError, r"group_sizes must hold integers, not bool"),
        ((np.True_, 4), TypeError, r"group_sizes must hold integers, not bool"),
        ([2**62, 2**62 + 5], ValueError, r"group_sizes must each be at most the 5 rows of x"),
        (np.array([2**63 - 1, 2**63 - 1, 7], np.int64)[1:], ValueError, r"group_sizes must each be at most the 5 rows of x"),
        (np.array([2**64 - 1, 6], np.uint64), ValueError, r"group_sizes must each be at most the 5 rows of x, got \[18446744073709551615, 6\]"),
        ([2**70, 5], ValueError, r"group_sizes must each be at most the 5 rows of x"),
        ([2, 3.0], TypeError, r"group_sizes must hold integers, not float64"),
    ],
    ids=["short-sum", "long-sum", "negative", "too-few", "2-d", "scalar", "floats", "bools", "bool-and-int", "numpy-bool-and-int",
         "int64-wraps", "int64-max", "uint64-max", "past-int64", "mixed"],
)
def test_bad_group_sizes(group_sizes, error, message):
    with pytest.raises(error, match=rf"spchain\.grouped_matmul: {message}"):
        sc.grouped_matmul(np.ones((5, 3)), np.ones((2, 3, 4)), group_sizes)


def test_group_sizes_whose_int64_sum_wraps_to_n_are_rejected():
    # the int64 sum of these is 6 = N: every row went to w[0] before the per-size check
    x, w = np.ones((6, 4)), np.ones((4, 4, 4))
    with pytest.raises(ValueError, match=r"at most the 6 rows of x"):
        sc.grouped_matmul(x, w, [2**62, 2**62, 2**62, 2**62 + 6])
    with pytest.raises(ValueError, match=r"at most the 6 rows of x"):
        sc.grouped_matmul(x, w, np.array([2**62, 2**62, 2**62, 2**62 + 6], np.int64))


@pytest.mark.parametrize(
    "x_shape, w_shape",
    [((5, 3), (2, 4, 4)), ((5, 1, 3), (2, 3, 4)), ((5,), (2, 5, 4)), ((5, 3), (3, 4))],
    ids=["d_in", "3-d-x", "1-d-x", "2-d-w"],
)
def test_grouped_shape_mismatch_names_both_shapes(x_shape, w_shape):
    with pytest.raises(ValueError, match=rf"do not match: x has shape \({x_shape[0]},.*w has shape \({w_shape[0]},"):
        sc.grouped_matmul(np.ones(x_shape), np.ones(w_shape), [5])


def test_grouped_matmul_allocates_nothing_proportional_to_groups_times_rows(rng):
    group_sizes = rng.multinomial(4096, np.ones(256) / 256)
    x = rng.standard_normal((4096, 32)).astype(np.float32)
    w = rng.standard_normal((256, 32, 32)).astype(np.float32)
    grad = rng.standard_normal((4096, 32)).astype(np.float32)
    sizes = blockdiag._check_group_sizes("f", group_sizes, 256, 4096)
    slack = 64 * 1024
    assert traced_peak(lambda: sc.grouped_matmul(x, w, group_sizes)) <= x.nbytes + slack
    assert traced_peak(lambda: sc.grouped_matmul(grad, w.swapaxes(1, 2), group_sizes)) <= x.nbytes + slack
    assert traced_peak(lambda: blockdiag._grouped_weight_grad(x, grad, sizes)) <= w.nbytes + slack


# GPU-only: CuPy inputs ------------------------------------------------------------------------


@pytest.mark.gpu
def test_numpy_and_cupy_inputs_together_are_a_value_error():
    from spchain import _backend

    cp = _backend.cupy()
    with pytest.raises(ValueError, match=r"different devices: cpu \(numpy\) and cuda:0 \(cupy\)"):
        sc.block_diag_matmul(np.ones((2, 2, 2)), cp.ones((2, 2, 2)))
    with pytest.raises(ValueError, match=r"different devices"):
        sc.grouped_matmul(np.ones((2, 2)), cp.ones((1, 2, 2)), [2])


@pytest.mark.gpu
def test_cupy_group_sizes_are_read_back_once_and_host_sizes_work_with_cupy_inputs(rng):
    from spchain import _backend

    cp = _backend.cupy()
    x = rng.standard_normal((5, 3))
    w = rng.standard_normal((2, 3, 2))
    want = reference.grouped_matmul(x, w, [2, 3])
    for sizes in ([2, 3], np.array([2, 3]), cp.array([2, 3])):
        assert_close(sc.grouped_matmul(cp.asarray(x), cp.asarray(w), sizes), want, np.float64)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_np_matrix_operands_work_as_ndarrays(rng):
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((2, 3, 4))
    got = sc.block_diag_matmul(np.matrix(x), w)
    assert type(got) is np.ndarray
    np.testing.assert_allclose(got, reference.block_diag_matmul(x, w), rtol=1e-12)
    x = rng.standard_normal((5, 3))
    got = sc.grouped_matmul(np.matrix(x), w, [2, 3])
    assert type(got) is np.ndarray
    np.testing.assert_allclose(got, reference.grouped_matmul(x, w, [2, 3]), rtol=1e-12)


@pytest.mark.parametrize("fn", [sc.block_diag_matmul, lambda x, w: sc.grouped_matmul(x, w, [1])],
                         ids=["block_diag_matmul", "grouped_matmul"])
@pytest.mark.parametrize(
    "x, w, match",
    [
        (1.0, np.ones((1, 1, 1)), "x must be an array, not float"),
        (np.ones((1, 1)), None, "w must be an array, not NoneType"),
        ([[1.0]], np.ones((1, 1, 1)), "x must be an array, not list"),
        (scipy.sparse.eye(1, format="coo"), np.ones((1, 1, 1)), "x is a sparse coo matrix; it must be a dense array"),
    ],
)
def test_scalars_none_lists_and_sparse_matrices_are_type_errors_naming_the_argument(fn, x, w, match):
    with pytest.raises(TypeError, match=match):
        fn(x, w)
