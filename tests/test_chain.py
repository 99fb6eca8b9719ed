"""chain_logsumexp and chain_marginals (spchain/chain.py) against float64 references."""

import math
import warnings

import numpy as np
import pytest
import scipy.sparse
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import positional
import reference
import spchain as sc


@pytest.fixture(params=["gemm", "kernel"])
def algorithm(request):
    """Every test runs both exact sweeps: the scaled GEMM one and the Numba log-space one."""
    with sc.chain_sweep(request.param):
        yield request.param


def random_chain(rng, batch, v, c, *, per_step=True, trans_batch=None, dtype=np.float64, scale=1.0):
    """Random inputs; per-step transitions shared by the batch unless ``trans_batch`` says otherwise."""
    x = rng.normal(scale=scale, size=batch + (v, c)).astype(dtype)
    if trans_batch is None:
        trans_batch = (1,) * len(batch) if per_step else ()
    shape = trans_batch + ((v - 1,) if per_step else ()) + (c, c)
    trans = np.log(rng.dirichlet(np.ones(c), size=shape[:-1])).astype(dtype)
    init = np.log(rng.dirichlet(np.ones(c))).astype(dtype)
    return x, trans, init


def assert_close(got, want, rtol=1e-10, atol=1e-10):
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "x_batch, trans_batch, per_step",
    [
        ((5,), (), False),
        ((5,), (1,), True),
        ((5,), (5,), True),
        ((5,), (5,), False),
        ((3, 4), (1, 4), True),
        ((), (), True),
        ((2, 1), (3,), False),
    ],
    ids=["shared", "per-step", "per-row-per-step", "per-row-shared", "n-t-broadcast", "unbatched", "broadcast-x"],
)
def test_matches_reference_recursion(algorithm, rng, xp, x_batch, trans_batch, per_step):
    v, c = 6, 5
    x, trans, init = random_chain(rng, x_batch, v, c, per_step=per_step, trans_batch=trans_batch)
    got = sc.chain_logsumexp(xp.asarray(x), xp.asarray(trans), xp.asarray(init))
    want = reference.chain_logsumexp(x, trans, init)
    assert got.shape == want.shape
    assert_close(got.get() if hasattr(got, "get") else got, want)


def test_user_shapes_n_t_v_c_work_unchanged(algorithm, rng):
    n, t, v, c = 3, 2, 5, 4
    x = rng.normal(size=(n, t, v, c))
    trans = np.log(rng.dirichlet(np.ones(c), size=(1, t, v - 1, c)))
    init = np.log(rng.dirichlet(np.ones(c), size=(1, t)))
    got = sc.chain_logsumexp(x, trans, init)
    assert got.shape == (n, t)
    assert_close(got, reference.chain_logsumexp(x, trans, init))


@pytest.mark.parametrize("v", range(1, 10))
def test_every_length_matches_brute_force(algorithm, rng, v):
    c = 3
    x, trans, init = random_chain(rng, (), v, c, scale=2.0)
    scores, _ = reference.chain_paths(x, trans, init)
    assert_close(sc.chain_logsumexp(x, trans, init), reference.log_sum_exp(scores))
    assert_close(sc.chain_marginals(x, trans, init), reference.chain_marginals_by_paths(x, trans, init))


def test_v1_is_logsumexp_of_init_plus_x0(algorithm):
    x = np.array([[0.5, -1.0, 2.0]])
    init = np.array([0.1, 0.2, -0.3])
    got = sc.chain_logsumexp(x, np.zeros((0, 3, 3)), init)
    assert_close(got, reference.log_sum_exp(init + x[0]))


def test_lengths_end_chains_early(algorithm, rng):
    x, trans, init = random_chain(rng, (6,), 7, 4)
    lengths = np.array([1, 7, 3, 4, 2, 7])
    got = sc.chain_logsumexp(x, trans, init, lengths=lengths)
    assert_close(got, reference.chain_logsumexp(x, trans, init, lengths))
    marg = sc.chain_marginals(x, trans, init, lengths=lengths)
    for b, length in enumerate(lengths):
        assert_close(marg[b], reference.chain_marginals_by_paths(x[b], trans[0], init, length))


def test_positions_past_lengths_are_ignored_even_if_nan(algorithm, rng):
    x, trans, init = random_chain(rng, (3,), 5, 3)
    lengths = np.array([2, 5, 3])
    padded = x.copy()
    for b, length in enumerate(lengths):
        padded[b, length:] = np.nan
    assert_close(sc.chain_logsumexp(padded, trans, init, lengths=lengths),
                 reference.chain_logsumexp(x, trans, init, lengths))
    marg = sc.chain_marginals(padded, trans, init, lengths=lengths)
    assert np.isfinite(marg).all()
    assert_close(marg, sc.chain_marginals(x, trans, init, lengths=lengths))


def test_marginals_sum_to_one_per_position(algorithm, rng):
    x, trans, init = random_chain(rng, (4,), 8, 6, scale=3.0)
    marg = sc.chain_marginals(x, trans, init)
    assert_close(marg.sum(axis=-1), np.ones((4, 8)))


def test_marginals_of_broadcast_x_are_the_gradient(algorithm, rng):
    # x shared by 3 transition batches: its gradient sums the three chains' marginals
    x = rng.normal(size=(1, 4, 3))
    trans = np.log(rng.dirichlet(np.ones(3), size=(3, 3)))  # (3, 3, 3): three shared matrices
    marg = sc.chain_marginals(x, trans)
    want = sum(reference.chain_marginals_by_paths(x[0], trans[k][None]) for k in range(3))[None]
    assert marg.shape == x.shape
    assert_close(marg, want)


def test_left_to_right_chain_with_minus_inf_transitions(algorithm, rng):
    c, v = 4, 6
    trans = np.full((c, c), -np.inf)
    for i in range(c):
        trans[i, i] = math.log(0.5)
        if i + 1 < c:
            trans[i, i + 1] = math.log(0.5)
    init = np.array([0.0, -np.inf, -np.inf, -np.inf])
    x = rng.normal(size=(3, v, c))
    got = sc.chain_logsumexp(x, trans, init)
    assert_close(got, reference.chain_logsumexp(x, trans, init))
    marg = sc.chain_marginals(x, trans, init)
    assert np.isfinite(marg).all()
    assert_close(marg[0], reference.chain_marginals_by_paths(x[0], trans, init))
    assert (marg[:, 0, 1:] == 0).all()  # the chain starts in state 0


def test_impossible_sequence_is_minus_inf_with_zero_marginals(algorithm, rng):
    x = rng.normal(size=(2, 5, 3))
    x[0, 2, :] = -np.inf  # no state possible at position 2
    trans = np.log(rng.dirichlet(np.ones(3), size=3))
    got = sc.chain_logsumexp(x, trans)
    assert got[0] == -np.inf and np.isfinite(got[1])
    marg = sc.chain_marginals(x, trans)
    assert (marg[0] == 0).all() and not np.isnan(marg).any()
    assert_close(marg[1].sum(-1), np.ones(5))


def test_all_minus_inf_transitions_give_minus_inf(algorithm):
    x = np.zeros((2, 3, 2))
    got = sc.chain_logsumexp(x, np.full((2, 2), -np.inf))
    assert (got == -np.inf).all()
    assert (sc.chain_marginals(x, np.full((2, 2), -np.inf)) == 0).all()


def test_nan_reaches_only_the_affected_chains(algorithm, rng):
    x, trans, init = random_chain(rng, (3,), 4, 3)
    x[1, 2, 0] = np.nan
    got = sc.chain_logsumexp(x, trans, init)
    assert np.isnan(got[1]) and np.isfinite(got[[0, 2]]).all()
    marg = sc.chain_marginals(x, trans, init)
    assert np.isnan(marg[1]).any() and np.isfinite(marg[[0, 2]]).all()


def test_nan_on_no_possible_path_is_nan_on_either_sweep(algorithm):
    """A NaN on a transition out of a state of weight 0 lies on no possible path, but the chain
    reads it: NaN log-partition, marginals, entropy and x gradient on either sweep (the kernel
    sweep gave log 2, the GEMM sweep NaN, so the answer hung on the batch size), the other
    chains untouched; a NaN in a step past a chain's length is not read."""
    x = np.zeros((3, 3, 2))
    x[:, 0, 0] = -np.inf
    trans = np.zeros((3, 2, 2, 2))  # per row and step
    trans[1, 0, 0, 0] = np.nan
    trans[2, 1, 0, 0] = np.nan  # chain 2 takes one step only
    lengths = np.array([3, 3, 2])
    got = sc.chain_logsumexp(x, trans, lengths=lengths)
    assert np.isnan(got[1]) and np.allclose(got[[0, 2]], [2 * np.log(2), np.log(2)])
    marg = sc.chain_marginals(x, trans, lengths=lengths)
    assert np.isnan(marg[1]).all() and not np.isnan(marg[[0, 2]]).any()
    entropy = sc.chain_entropy(x, trans, lengths=lengths)
    assert np.isnan(entropy[1]) and not np.isnan(entropy[[0, 2]]).any()


@pytest.mark.parametrize("dtype, offset", [(np.float32, -1e4), (np.float64, -1e300)])
def test_very_negative_logs_stay_finite_and_accurate(algorithm, rng, dtype, offset):
    x, trans, init = random_chain(rng, (3,), 5, 4)
    x = (x + offset).astype(dtype)
    got = sc.chain_logsumexp(x, trans.astype(dtype), init.astype(dtype))
    want = reference.chain_logsumexp(x, trans.astype(dtype), init.astype(dtype))
    assert np.isfinite(got).all()
    assert_close(got, want, rtol=1e-6, atol=0)


def test_long_float32_chain_is_accurate(algorithm, rng):
    v, c = 10_000, 3
    x, trans, init = random_chain(rng, (2,), v, c, per_step=False)
    got = sc.chain_logsumexp(x.astype(np.float32), trans.astype(np.float32), init.astype(np.float32))
    want = reference.chain_logsumexp(x.astype(np.float32), trans.astype(np.float32), init.astype(np.float32))
    assert got.dtype == np.float32
    assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("per_step", [False, True])
def test_long_float32_chain_marginals_do_not_drift(algorithm, rng, per_step):
    """Per-position marginals (and the gradient) stay within 1e-5 of float64 at v = 10⁴."""
    v, c = 10_000, 4
    x, trans, init = random_chain(rng, (2,), v, c, per_step=per_step)
    want = sc.chain_marginals(x, trans, init)
    got = sc.chain_marginals(x.astype(np.float32), trans.astype(np.float32), init.astype(np.float32))
    assert got.dtype == np.float32
    assert np.abs(got.sum(axis=-1) - 1).max() < 1e-5
    assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype, gap", [(np.float32, -200.0), (np.float64, -1000.0)])
def test_scaled_gemm_underflow_is_recomputed_exactly(dtype, gap):
    # state 1 starts `gap` nats below state 0, the states never change, and only state 1 is
    # allowed at the end: the scaled product for state 1 underflows to 0 (the row's maximum
    # sits at state 0) while the answer, `gap`, is finite; the GEMM sweep must recompute it
    with sc.chain_sweep("gemm"):
        trans = np.array([[0.0, -np.inf], [-np.inf, 0.0]], dtype)
        x = np.array([[[0.0, gap], [-np.inf, 0.0]]] * 4, dtype)
        assert_close(sc.chain_logsumexp(x, trans), np.full(4, gap), rtol=1e-7, atol=0)
        assert_close(sc.chain_marginals(x, trans), np.array([[[0.0, 1.0], [0.0, 1.0]]] * 4))


def test_mixed_float32_and_float64_compute_in_float64(algorithm, rng):
    x, trans, init = random_chain(rng, (2,), 4, 3)
    got = sc.chain_logsumexp(x.astype(np.float32), trans, init)
    assert got.dtype == np.float64
    assert_close(got, reference.chain_logsumexp(x.astype(np.float32), trans, init))


def test_odd_layouts_and_read_only_inputs(algorithm, rng):
    x, trans, init = random_chain(rng, (4,), 5, 3)
    x_f = np.asfortranarray(x)
    trans_t = np.ascontiguousarray(trans.swapaxes(-1, -2)).swapaxes(-1, -2)
    init_rev = init[::-1].copy()[::-1]
    for a in (x_f, trans_t, init_rev):
        a.flags.writeable = False
    before = x_f.copy()
    assert_close(sc.chain_logsumexp(x_f, trans_t, init_rev), reference.chain_logsumexp(x, trans, init))
    assert_close(sc.chain_marginals(x_f[:, ::-1][:, ::-1], trans_t, init_rev),
                 sc.chain_marginals(x, trans, init))
    np.testing.assert_array_equal(x_f, before)


def test_empty_batch_and_single_state(algorithm, rng):
    got = sc.chain_logsumexp(np.zeros((0, 4, 3)), np.zeros((3, 3)))
    assert got.shape == (0,)
    assert sc.chain_marginals(np.zeros((0, 4, 3)), np.zeros((3, 3))).shape == (0, 4, 3)
    x = rng.normal(size=(2, 5, 1))
    assert_close(sc.chain_logsumexp(x, np.zeros((1, 1))), x.sum(axis=(1, 2)))
    assert_close(sc.chain_marginals(x, np.zeros((1, 1))), np.ones((2, 5, 1)))


def test_scalars_and_lists_broadcast(algorithm, rng):
    """A number is a 0-d array: a scalar log_trans is a (c, c) matrix filled with it, a scalar
    log_init a (c,) vector; lists become arrays; the dtype stays x's."""
    x = rng.normal(size=(2, 4, 3)).astype(np.float32)
    want = sc.chain_logsumexp(x, np.full((3, 3), -1.0, np.float32), np.full(3, 0.5, np.float32))
    got = sc.chain_logsumexp(x, -1.0, 0.5)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(sc.chain_logsumexp(x.tolist(), np.full((3, 3), -1.0).tolist(), [0.5] * 3),
                               want, rtol=1e-6)
    np.testing.assert_allclose(sc.chain_marginals(x, -1.0), sc.chain_marginals(x, np.full((3, 3), -1.0)),
                               rtol=1e-6)
    score, path = sc.viterbi([[0.0]], 0.0)
    assert score == 0.0 and path.tolist() == [0]


@pytest.mark.parametrize("x_shape, trans_shape, init_shape", [
    ((0, 5, 4), (0, 4, 4), (4,)),
    ((0, 5, 4), (4, 4), (0, 4)),
    ((0, 5, 4), (0, 4, 4, 4), (4,)),
    ((2, 0, 5, 4), (2, 1, 4, 4), (4,)),
    ((3, 1, 2), (3, 0, 2, 2), (2,)),
    ((3, 5, 0), (0, 0), (0,)),
])
def test_empty_batches_and_broadcast_layouts(algorithm, x_shape, trans_shape, init_shape):
    x, trans, init = np.zeros(x_shape), np.zeros(trans_shape), np.zeros(init_shape)
    batch = np.broadcast_shapes(x_shape[:-2], trans_shape[:-3] if len(trans_shape) == len(x_shape) + 1
                                else trans_shape[:-2], init_shape[:-1])
    v, c = x_shape[-2:]
    with np.errstate(divide="ignore"):
        want = np.full(batch, v * np.log(c))  # c**v paths of weight 1
    assert_close(sc.chain_logsumexp(x, trans, init), want)
    assert_close(sc.chain_marginals(x, trans, init), np.full(x_shape, 1.0 / c if c else 0.0))
    score, path = sc.viterbi(x, trans, init)
    assert score.shape == batch and path.shape == batch + (x_shape[-2],)


def test_zero_states_is_minus_inf(algorithm):
    got = sc.chain_logsumexp(np.zeros((2, 3, 0)), np.zeros((0, 0)))
    assert (got == -np.inf).all()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"lengths": np.array([0, 3])}, ValueError, r"lengths must lie in 1\.\.v = 1\.\.4, got values from 0"),
        ({"lengths": np.array([2, 5])}, ValueError, r"lengths must lie in 1\.\.v = 1\.\.4, got values from 2 to 5"),
        ({"lengths": np.array([2, 2**64 - 1], np.uint64)}, ValueError, r"got values from 2 to 18446744073709551615"),
        ({"lengths": np.array([1, 2, 3])}, ValueError, r"batch shapes do not broadcast.*lengths \(3,\)"),
        ({"lengths": np.array([1.0, 2.0])}, TypeError, "lengths must hold integers, got dtype float64"),
    ],
)
def test_bad_lengths(kwargs, error, match):
    with pytest.raises(error, match=match):
        sc.chain_logsumexp(np.zeros((2, 4, 3)), np.zeros((3, 3)), **kwargs)


@pytest.mark.parametrize(
    "x, trans, init, error, match",
    [
        (np.zeros(3), np.zeros((3, 3)), None, ValueError, r"x must have shape \(\.\.\., v, c\), got \(3,\)"),
        (np.zeros((2, 0, 3)), np.zeros((3, 3)), None, ValueError, "at least one position"),
        (np.zeros((2, 4, 3)), np.zeros((3, 2)), None, ValueError, r"log_trans must end in \(c, c\) = \(3, 3\)"),
        (np.zeros((2, 4, 3)), np.zeros((2, 2, 3, 3)), None, ValueError, r"axis -3 must be v - 1 = 3"),
        (np.zeros((500, 4, 3)), np.zeros((3, 3, 3)), None, ValueError,
         r"batch shapes do not broadcast: x \(500,\), log_trans \(3,\).*shared by all steps"),
        (np.zeros((2, 4, 3)), np.zeros((3, 3)), np.zeros(2), ValueError, r"log_init must have shape \(\.\.\., c\)"),
        (np.zeros((2, 4, 3), np.int64), np.zeros((3, 3)), None, TypeError, "x has dtype int64"),
        (np.zeros((2, 4, 3)), np.zeros((3, 3), np.float16), None, TypeError, "log_trans has dtype float16"),
        (np.zeros((2, 4, 3)), [[0.0]], None, ValueError, r"log_trans must end in \(c, c\) = \(3, 3\)"),
        (np.zeros((2, 4, 3)), None, None, TypeError, "log_trans is required"),
        (None, np.zeros((3, 3)), None, TypeError, "x is required"),
        (np.zeros((2, 4, 3)), "0", None, TypeError, "log_trans must be an array.*not str"),
        (np.zeros((2, 4, 3)), np.zeros((3, 3)), {0: 1}, TypeError, "log_init must be an array.*not dict"),
        (scipy.sparse.eye(3, format="csr"), np.zeros((3, 3)), None, TypeError,
         "x must be a dense array, not a sparse"),
        (0.0, 0.0, None, ValueError, r"x must have shape \(\.\.\., v, c\), got \(\)"),
    ],
)
def test_bad_inputs(x, trans, init, error, match):
    with pytest.raises(error, match=match):
        sc.chain_logsumexp(x, trans, init)


log_values = st.one_of(st.just(-np.inf), st.floats(-30, 30))


@given(
    data=st.data(),
    batch=st.integers(0, 3),
    v=st.integers(1, 6),
    c=st.integers(1, 4),
    per_step=st.booleans(),
    algorithm=st.sampled_from(["gemm", "kernel"]),
)
def test_random_shapes_and_minus_inf_match_reference(data, batch, v, c, per_step, algorithm):
    x = data.draw(hnp.arrays(np.float64, (batch, v, c), elements=log_values))
    trans = data.draw(hnp.arrays(np.float64, ((v - 1,) if per_step else ()) + (c, c), elements=log_values))
    if per_step:
        trans = trans[None]
    init = data.draw(hnp.arrays(np.float64, (c,), elements=log_values))
    with sc.chain_sweep(algorithm):
        got = sc.chain_logsumexp(x, trans, init)
        marg = sc.chain_marginals(x, trans, init)
    want = reference.chain_logsumexp(x, trans, init)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    assert not np.isnan(marg).any()
    for b in range(batch):
        one_trans = trans[0] if per_step else trans
        np.testing.assert_allclose(marg[b], reference.chain_marginals_by_paths(x[b], one_trans, init),
                                   rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("v", range(1, 7))
def test_viterbi_matches_brute_force(rng, v):
    x, trans, init = random_chain(rng, (3,), v, 3, scale=2.0)
    score, path = sc.viterbi(x, trans, init)
    assert path.dtype == np.int64 and path.shape == (3, v)
    for b in range(3):
        want_score, want_path = reference.viterbi_by_paths(x[b], trans[0], init)
        np.testing.assert_allclose(score[b], want_score, rtol=1e-12)
        np.testing.assert_array_equal(path[b], want_path)


def test_viterbi_ties_go_to_the_lowest_state_from_the_end():
    # integer scores: many exactly tied paths
    x = np.array([[0.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    trans = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    score, path = sc.viterbi(x, trans)
    want_score, want_path = reference.viterbi_by_paths(x, trans)
    assert score == want_score
    np.testing.assert_array_equal(path, want_path)


def test_viterbi_left_to_right_chain_and_lengths(rng):
    c, v = 4, 7
    trans = np.full((c, c), -np.inf)
    for i in range(c):
        trans[i, i] = -0.1
        if i + 1 < c:
            trans[i, i + 1] = -1.0
    init = np.array([0.0, -np.inf, -np.inf, -np.inf])
    x = rng.normal(size=(4, v, c))
    lengths = np.array([7, 3, 1, 5])
    score, path = sc.viterbi(x, trans, init, lengths=lengths)
    for b, length in enumerate(lengths):
        want_score, want_path = reference.viterbi_by_paths(x[b], trans, init, length)
        np.testing.assert_allclose(score[b], want_score, rtol=1e-12)
        np.testing.assert_array_equal(path[b], want_path)
        assert (np.diff(path[b][:length]) >= 0).all() and (path[b][length:] == -1).all()


def test_viterbi_impossible_chain_and_nan(rng):
    x = rng.normal(size=(3, 4, 3))
    x[0, 2] = -np.inf
    x[1, 1, 2] = np.nan
    score, path = sc.viterbi(x, np.zeros((3, 3)))
    assert score[0] == -np.inf and np.isnan(score[1]) and np.isfinite(score[2])
    assert (path[:2] == -1).all()  # no path to report: none possible, or one that reads a NaN
    assert ((path[2] >= 0) & (path[2] < 3)).all()


def test_viterbi_user_shapes_and_empty_batch(rng):
    n, t, v, c = 2, 3, 4, 3
    x = rng.normal(size=(n, t, v, c))
    trans = rng.normal(size=(1, t, v - 1, c, c))
    init = rng.normal(size=(1, t, c))
    score, path = sc.viterbi(x, trans, init)
    assert score.shape == (n, t) and path.shape == (n, t, v)
    want_score, want_path = reference.viterbi_by_paths(x[1, 2], trans[0, 2], init[0, 2])
    np.testing.assert_allclose(score[1, 2], want_score, rtol=1e-12)
    np.testing.assert_array_equal(path[1, 2], want_path)
    score, path = sc.viterbi(np.zeros((0, 4, 3)), np.zeros((3, 3)))
    assert score.shape == (0,) and path.shape == (0, 4)


INF = np.inf


@pytest.mark.parametrize("x, trans, want, marginals, path", [
    ([[INF, 0], [0, 0]], np.zeros((2, 2)), INF, [[1, 0], [0.5, 0.5]], [0, 0]),
    ([[0, 0], [0, 0]], [[INF, 0], [0, 0]], INF, [[1, 0], [1, 0]], [0, 0]),
    ([[INF, INF], [0, -INF]], np.zeros((2, 2)), INF, [[0.5, 0.5], [1, 0]], [0, 0]),
    ([[INF, 0], [0, 0]], [[0, -INF], [-INF, 0]], INF, [[1, 0], [1, 0]], [0, 0]),
    ([[INF, 0], [-INF, -INF]], np.zeros((2, 2)), -INF, [[0, 0], [0, 0]], [-1, -1]),  # +inf on impossible paths
    ([[INF, 0], [0, 0]], [[0, -INF], [0, 0]], INF, [[1, 0], [1, 0]], [0, 0]),
])
def test_plus_inf_gives_plus_inf_never_nan(algorithm, x, trans, want, marginals, path):
    x, trans = np.array([x], float), np.array(trans, float)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning either
        assert sc.chain_logsumexp(x, trans)[0] == want
        assert_close(sc.chain_marginals(x, trans)[0], marginals)
        score, got_path = sc.viterbi(x, trans)
    assert score[0] == want and got_path[0].tolist() == path


def test_plus_inf_leaves_other_rows_and_nan_alone(algorithm, rng):
    x = rng.normal(size=(3, 4, 2)).astype(np.float32)
    want = sc.chain_logsumexp(x, np.zeros((2, 2), np.float32))
    x[1, 2, 1] = INF
    x[2, 1, 0] = np.nan
    got = sc.chain_logsumexp(x, np.zeros((2, 2), np.float32))
    assert got[0] == want[0] and got[1] == INF and np.isnan(got[2])
    marg = sc.chain_marginals(x, np.zeros((2, 2), np.float32))
    assert_close(marg[1, 2], [0, 1])
    assert np.isfinite(marg[:2]).all()


def test_chain_sweep_forces_a_sweep_and_restores_the_previous_one(monkeypatch):
    from spchain import _chain_sweep

    used = []
    monkeypatch.setattr(_chain_sweep, "_forward_gemm_fused", lambda *args: used.append("gemm") or None)
    x, trans = np.zeros((2, 3, 4)), np.full((4, 4), -np.log(4))
    with sc.chain_sweep("gemm"):
        sc.chain_logsumexp(x, trans)
        with sc.chain_sweep("kernel"):
            assert sc.chain_logsumexp(x, trans) == pytest.approx(np.log(4))
        sc.chain_logsumexp(x, trans)
    assert used == ["gemm", "gemm"]
    with pytest.raises(ValueError, match="sweep must be one of"):
        with sc.chain_sweep("fast"):
            pass


def test_broadcast_and_read_only_inputs_reuse_the_compiled_kernels(rng):
    """A broadcast or read-only input reaches the kernels as the same type as a fresh array
    (the prepared chain's inputs are read-only views), so it compiles no new signature."""
    import importlib
    import pkgutil

    import spchain.kernels.cpu as cpu

    modules = [importlib.import_module(f"{cpu.__name__}.{m.name}") for m in pkgutil.iter_modules(cpu.__path__)]

    def signatures():
        return {(m.__name__, name): len(f.signatures) for m in modules for name, f in vars(m).items()
                if hasattr(f, "signatures")}

    x, t = rng.normal(size=(3, 5, 4)), rng.normal(size=(4, 4))
    for f in (sc.chain_logsumexp, sc.chain_marginals, sc.viterbi):
        f(x, t)
    before = signatures()
    frozen = x.copy()
    frozen.flags.writeable = False
    for f in (sc.chain_logsumexp, sc.chain_marginals, sc.viterbi):
        f(x[:1], rng.normal(size=(3, 4, 4)))  # x broadcast over the transitions' batch
        f(frozen, t, 0.0, lengths=np.array([5, 3, 2]))  # read-only x, a broadcast log_init
    assert signatures() == before


@pytest.mark.parametrize("dtype, scale", [(np.float32, 1.0), (np.float32, 40.0), (np.float32, 1000.0),
                                          (np.float64, 1.0), (np.float64, 1e10)])
def test_gemm_backward_counts_are_exact_at_any_magnitude(rng, dtype, scale):
    """The GEMM sweep's transition gradient reads each scaled product from the saved forward
    messages (to their rounding, as the marginals); it matches the log-space kernels' float64
    gradients at small and large magnitudes, with ``-inf`` transitions, lengths 1 and odd
    lengths."""
    x, trans, init = random_chain(rng, (6,), 7, 5, dtype=dtype, scale=scale)
    trans = (trans * scale).astype(dtype)
    trans[0, 2, 1, :] = -np.inf
    trans[..., 3] = -np.inf
    lengths = np.array([7, 1, 4, 5, 7, 3])
    weight = rng.normal(size=6)

    def grads(sweep, *args):
        with sc.chain_sweep(sweep):
            results = positional.chain_logsumexp_forward(*args, lengths)
            return positional.chain_logsumexp_backward((*args, lengths), results, (weight.astype(args[0].dtype),),
                                              (True, True, True))

    got = grads("gemm", x, trans, init)
    want = grads("kernel", *(a.astype(np.float64) for a in (x, trans, init)))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())


@pytest.mark.parametrize("sparse", [False, True])
def test_the_backward_sweeps_take_fresh_and_read_only_messages_as_one_signature(rng, sparse):
    """The backward sweeps read ``pre``, ``norm`` and the weights as read-only views: the
    messages fresh from ``chain_marginals``' own forward sweep and the read-only ones of a
    gradient (as torch's saved results come back) compile one signature of each kernel."""
    import importlib
    import pkgutil

    import spchain.kernels.cpu as cpu
    from positional import chain_logsumexp_backward, chain_logsumexp_forward

    modules = [importlib.import_module(f"{cpu.__name__}.{m.name}") for m in pkgutil.iter_modules(cpu.__path__)]

    def signatures():
        return {(m.__name__, name): len(f.signatures) for m in modules for name, f in vars(m).items()
                if hasattr(f, "signatures")}

    x, t = rng.normal(size=(8, 5, 4)), rng.normal(size=(4, 4))
    trans = scipy.sparse.csr_matrix(np.where(rng.random((4, 4)) < 0.6, t, 0)) if sparse else t
    results = chain_logsumexp_forward(x, trans)
    weight = np.ones(8)
    for a in (*results, weight):
        a.flags.writeable = False
    chain_logsumexp_backward((x, trans, None, None), results, (weight,), (True, True, False))
    before = signatures()
    sc.chain_marginals(x, trans)
    assert signatures() == before
