"""chain_sample, chain_entropy, chain_kbest and chain_path_score (spchain/paths.py) against
brute-force enumeration over all paths (tests/reference.py)."""

import numpy as np
import scipy.sparse
import pytest
from scipy import stats

import reference
import spchain as sc


@pytest.fixture(params=["gemm", "kernel"])
def algorithm(request):
    """The forward messages come from either exact sweep."""
    with sc.chain_sweep(request.param):
        yield request.param


def problem(seed, v, c, batch=4, per_step=True, holes=True, dtype=np.float64):
    """A batch of small chains with ``-inf`` transitions and emissions, ragged lengths and one
    impossible chain (row 1: every state of position 0 is ``-inf``)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, v, c))
    trans = rng.normal(size=((1, v - 1) if per_step else ()) + (c, c))
    init = rng.normal(size=c)
    if holes:
        trans[rng.random(trans.shape) < 0.25] = -np.inf
        x[rng.random(x.shape) < 0.15] = -np.inf
        x[1, 0] = -np.inf
    lengths = rng.integers(1, v + 1, size=batch)
    lengths[0] = v
    return x.astype(dtype), trans.astype(dtype), init.astype(dtype), lengths


def chain_of(row, x, trans, init, lengths):
    """The arguments of the references for one row."""
    return x[row], trans[0] if trans.ndim == 4 else trans, init, lengths[row]


CASES = [(seed, v, c, per_step) for seed, (v, c) in enumerate([(1, 1), (1, 3), (2, 2), (3, 3), (4, 2), (5, 3), (7, 2)])
         for per_step in (True, False)]


@pytest.mark.parametrize("seed, v, c, per_step", CASES)
def test_entropy_matches_enumeration(seed, v, c, per_step, algorithm):
    x, trans, init, lengths = problem(seed, v, c, per_step=per_step)
    got = sc.chain_entropy(x, trans, init, lengths=lengths)
    want = [reference.chain_entropy_by_paths(*chain_of(b, x, trans, init, lengths)) for b in range(len(x))]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    assert got[1] == 0.0, "a chain without paths has entropy 0"


@pytest.mark.parametrize("seed, v, c, per_step", CASES)
@pytest.mark.parametrize("k", [1, 3, 20])
def test_kbest_matches_enumeration(seed, v, c, per_step, k):
    x, trans, init, lengths = problem(seed, v, c, per_step=per_step)
    scores, paths = sc.chain_kbest(x, trans, init, k=k, lengths=lengths)
    assert scores.shape == (k, len(x)) and paths.shape == (k, len(x), v) and paths.dtype == np.int64
    for b in range(len(x)):
        want_scores, want_paths = reference.chain_kbest_by_paths(*chain_of(b, x, trans, init, lengths), k=k)
        np.testing.assert_allclose(scores[:, b], want_scores, rtol=1e-12)
        np.testing.assert_array_equal(paths[:, b], want_paths)


def test_kbest_ties_follow_viterbi():
    x = np.zeros((5, 3))  # every path ties
    scores, paths = sc.chain_kbest(x, np.zeros((3, 3)), k=4)
    np.testing.assert_array_equal(paths, [[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [0, 1, 0, 0, 0]])
    score, path = sc.viterbi(x, np.zeros((3, 3)))
    np.testing.assert_array_equal(paths[0], path)
    assert scores[0] == score


@pytest.mark.parametrize("seed", range(4))
def test_kbest_with_k_1_is_viterbi(seed):
    x, trans, init, lengths = problem(seed, 6, 5, batch=8, holes=False, dtype=np.float32)
    scores, paths = sc.chain_kbest(x, trans, init, k=1, lengths=lengths)
    score, path = sc.viterbi(x, trans, init, lengths=lengths)
    np.testing.assert_array_equal(paths[0], path)
    np.testing.assert_array_equal(scores[0], score)


@pytest.mark.parametrize("seed, v, c, per_step", CASES)
def test_path_score_matches_enumeration(seed, v, c, per_step):
    x, trans, init, lengths = problem(seed, v, c, per_step=per_step)
    for b in range(len(x)):
        want, paths = reference.chain_paths(*chain_of(b, x, trans, init, lengths))
        padded = np.pad(paths, ((0, 0), (0, v - paths.shape[1])), constant_values=-1)
        got = sc.chain_path_score(x[b], trans[0] if per_step else trans, init, padded, lengths=lengths[b])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_path_score_broadcasts_paths_against_the_batch():
    x, trans, init, lengths = problem(0, 4, 3, batch=2, holes=False)
    paths = np.array([[0, 1, 2, 0], [2, 2, 1, 0], [1, 0, 0, 2]])[:, None, :]  # (3, 1, v)
    got = sc.chain_path_score(x, trans, init, paths, lengths=lengths)
    assert got.shape == (3, 2)
    for n in range(3):
        np.testing.assert_array_equal(got[n], sc.chain_path_score(x, trans, init, np.repeat(paths[n], 2, 0),
                                                                  lengths=lengths))


@pytest.mark.parametrize("path, error, match", [
    (np.array([0, 3, 1]), ValueError, "path states must lie in 0..c-1"),
    (np.array([0, -1, 1]), ValueError, "path states must lie in 0..c-1"),
    (np.array([0, 1]), ValueError, "path must have shape"),
    (np.array([0.0, 1.0, 1.0]), TypeError, "path must be an integer array"),
    (np.zeros((2, 3), np.int64), ValueError, "does not broadcast"),
])
def test_bad_paths_are_errors(path, error, match):
    with pytest.raises(error, match=match):
        sc.chain_path_score(np.zeros((3, 3, 3)), np.zeros((3, 3)), None, path)


def test_states_past_the_length_are_ignored():
    x, trans, init, _ = problem(1, 4, 3, batch=1, holes=False)
    a = sc.chain_path_score(x, trans, init, np.array([[1, 2, 7, -5]]), lengths=np.array([2]))
    b = sc.chain_path_score(x, trans, init, np.array([[1, 2, 0, 0]]), lengths=np.array([2]))
    assert a == b


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint8, np.uint16, np.uint32, np.uint64])
def test_paths_of_any_integer_dtype_score_as_int64_ones(dtype):
    x, trans, init, _ = problem(2, 5, 3, batch=3, holes=False)
    path, lengths = np.array([[0, 2, 1, 1, 0], [2, 2, 0, 1, 1], [1, 0, 0, 2, 2]]), np.array([5, 3, 1])
    expected = sc.chain_path_score(x, trans, init, path, lengths=lengths)
    np.testing.assert_array_equal(sc.chain_path_score(x, trans, init, path.astype(dtype), lengths=lengths), expected)


def sample_frequencies(paths, all_paths):
    index = {tuple(p): i for i, p in enumerate(all_paths)}
    counts = np.zeros(len(all_paths))
    for p in paths:
        counts[index[tuple(p[:all_paths.shape[1]])]] += 1
    return counts


@pytest.mark.parametrize("seed, v, c, per_step", [(0, 3, 3, True), (1, 4, 2, False), (2, 1, 4, True), (3, 5, 2, True)])
def test_samples_follow_the_posterior(seed, v, c, per_step, algorithm):
    x, trans, init, lengths = problem(seed, v, c, per_step=per_step)
    n = 4000
    paths = sc.chain_sample(x, trans, init, lengths=lengths, num_samples=n, seed=seed)
    assert paths.shape == (n, len(x), v) and paths.dtype == np.int64
    np.testing.assert_array_equal(paths[:, 1], -1)  # the impossible chain
    for b in (0, 2, 3):
        scores, all_paths = reference.chain_paths(*chain_of(b, x, trans, init, lengths))
        np.testing.assert_array_equal(paths[:, b, lengths[b]:], -1)
        if reference.log_sum_exp(scores) == -np.inf:
            np.testing.assert_array_equal(paths[:, b], -1)
            continue
        counts = sample_frequencies(paths[:, b], all_paths)
        p = np.exp(scores - reference.log_sum_exp(scores))
        assert counts[p == 0].sum() == 0, "a path of weight 0 was drawn"
        if (p > 0).sum() > 1:
            assert stats.chisquare(counts[p > 0], p[p > 0] * n).pvalue > 1e-3


def test_samples_are_reproducible_and_broadcast():
    x, trans, init, lengths = problem(5, 4, 3, batch=3, per_step=False, holes=False, dtype=np.float32)
    a = sc.chain_sample(x[:, None], trans, init, lengths=lengths[:, None], num_samples=3, seed=7)
    b = sc.chain_sample(x[:, None], trans, init, lengths=lengths[:, None], num_samples=3, seed=7)
    assert a.shape == (3, 3, 1, 4)
    np.testing.assert_array_equal(a, b)
    assert sc.chain_sample(x, trans, init, num_samples=0).shape == (0, 3, 4)


@pytest.mark.parametrize("call, match", [
    (lambda: sc.chain_sample(np.zeros((2, 2)), np.zeros((2, 2)), num_samples=-1), "num_samples must be >= 0"),
    (lambda: sc.chain_sample(np.zeros((2, 2)), np.zeros((2, 2)), num_samples=1.5), "num_samples must be an int"),
    (lambda: sc.chain_kbest(np.zeros((2, 2)), np.zeros((2, 2)), k=0), "k must be >= 1"),
    (lambda: sc.chain_entropy(np.zeros((2, 2)), np.zeros((3, 3))), "log_trans must end in"),
])
def test_bad_arguments_are_errors(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_nan_propagates():
    x = np.zeros((2, 3, 2))
    x[0, 1, 1] = np.nan
    h = sc.chain_entropy(x, np.zeros((2, 2)))
    assert np.isnan(h[0]) and h[1] == pytest.approx(3 * np.log(2))
    np.testing.assert_array_equal(sc.chain_sample(x, np.zeros((2, 2)), seed=0)[0, 0], -1)


def test_empty_batch():
    x = np.zeros((0, 3, 2))
    assert sc.chain_entropy(x, np.zeros((2, 2))).shape == (0,)
    assert sc.chain_sample(x, np.zeros((2, 2)), num_samples=2).shape == (2, 0, 3)
    scores, paths = sc.chain_kbest(x, np.zeros((2, 2)), k=2)
    assert scores.shape == (2, 0) and paths.shape == (2, 0, 3)
    assert sc.chain_path_score(x, np.zeros((2, 2)), None, np.zeros((0, 3), np.int64)).shape == (0,)


def test_no_states():
    """c = 0: no path, as the chain functions give it (log Z -inf): entropy 0, scores -inf, paths -1."""
    x, trans = np.zeros((2, 3, 0)), np.zeros((0, 0))
    np.testing.assert_array_equal(sc.chain_entropy(x, trans), [0.0, 0.0])
    np.testing.assert_array_equal(sc.chain_sample(x, trans, num_samples=2, seed=0), np.full((2, 2, 3), -1))
    scores, paths = sc.chain_kbest(x, trans, k=2)
    np.testing.assert_array_equal(scores, np.full((2, 2), -np.inf))
    np.testing.assert_array_equal(paths, np.full((2, 2, 3), -1))


@pytest.mark.parametrize("dtype, scale", [(np.float32, 100.0), (np.float64, 700.0)])
def test_samples_of_underflowing_weights_are_drawn_in_log_space(dtype, scale):
    """Every weight of the draw at position 0 underflows once scaled: exp(-scale) and exp(-scale - 1)."""
    x = np.array([[0.0, -scale], [0.0, -np.inf]], dtype)
    trans = np.array([[-scale, 0.0], [-1.0, 0.0]], dtype)
    paths = sc.chain_sample(x, trans, num_samples=20000, seed=0)
    np.testing.assert_array_equal(paths[:, 1], 0)
    assert abs((paths[:, 0] == 0).mean() - 1 / (1 + np.exp(-1))) < 0.01


def test_paths_that_do_not_broadcast_with_lengths_are_errors():
    with pytest.raises(ValueError, match="does not broadcast with the chains' \\(2,\\)"):
        sc.chain_path_score(np.zeros((3, 2)), np.zeros((2, 2)), None, np.zeros((3, 3), np.int64),
                            lengths=np.array([1, 2]))


def limit_paths(x, trans, init, length):
    """Brute force under the ``+inf`` limit rule, in float64: ``(finite, count, paths)`` of every
    path, its finite terms' sum (``-inf`` where a term is ``-inf``, whatever its ``+inf`` terms)
    and its number of ``+inf`` terms. The limit as the ``+inf`` terms grow together ranks paths
    by ``count``, then ``finite``."""
    x, trans, init = (np.asarray(a, np.float64) for a in (x, trans, init))
    c = x.shape[-1]
    paths = np.array(list(np.ndindex(*(c,) * int(length))), dtype=np.int64).reshape(-1, int(length))
    finite, count = np.zeros(len(paths)), np.zeros(len(paths), np.int64)
    for n, p in enumerate(paths):
        terms = [init[p[0]], x[0, p[0]]]
        for t in range(1, len(p)):
            terms += [(trans[t - 1] if trans.ndim == 3 else trans)[p[t - 1], p[t]], x[t, p[t]]]
        terms = np.array(terms)
        count[n] = np.isposinf(terms).sum()
        finite[n] = -np.inf if np.isneginf(terms).any() else terms[np.isfinite(terms)].sum()
    return finite, count, paths


def limit_posterior(finite, count):
    """The limit posterior over the paths of :func:`limit_paths` (all 0 where none is possible)."""
    possible = finite > -np.inf
    if not possible.any():
        return np.zeros(len(finite))
    keep = possible & (count == count[possible].max())
    w = np.where(keep, np.exp(finite - finite[keep].max()), 0)
    return w / w.sum()


def plus_inf_problem(seed, v, c, per_step, batch=4, dtype=np.float64):
    """:func:`problem` with ``+inf`` in x, the transitions and init, some on impossible paths."""
    rng = np.random.default_rng(seed + 100)
    x, trans, init, lengths = problem(seed, v, c, batch=batch, per_step=per_step, dtype=dtype)
    x[rng.random(x.shape) < 0.12] = np.inf
    trans[rng.random(trans.shape) < 0.1] = np.inf
    init[rng.random(init.shape) < 0.2] = np.inf
    return x, trans, init, lengths


@pytest.mark.parametrize("seed, v, c, per_step", CASES)
@pytest.mark.parametrize("k", [1, 4, 30])
def test_kbest_with_plus_inf_ranks_by_the_limit(seed, v, c, per_step, k):
    x, trans, init, lengths = plus_inf_problem(seed, v, c, per_step)
    scores, paths = sc.chain_kbest(x, trans, init, k=k, lengths=lengths)
    for b in range(len(x)):
        finite, count, all_paths = limit_paths(*chain_of(b, x, trans, init, lengths))
        order = [n for n in np.lexsort(tuple(all_paths.T) + (-finite, -count)) if finite[n] > -np.inf][:k]
        want_scores = np.full(k, -np.inf)
        want_scores[:len(order)] = np.where(count[order] > 0, np.inf, finite[order])
        want_paths = np.full((k, v), -1)
        want_paths[:len(order), :lengths[b]] = all_paths[order]
        np.testing.assert_allclose(scores[:, b], want_scores, rtol=1e-12)
        np.testing.assert_array_equal(paths[:, b], want_paths)


def test_kbest_of_a_plus_inf_emission_or_transition():
    x = np.zeros((2, 2))
    x[1, 1] = np.inf
    scores, paths = sc.chain_kbest(x, np.zeros((2, 2)), k=4)
    np.testing.assert_array_equal(scores, [np.inf, np.inf, 0, 0])
    np.testing.assert_array_equal(paths, [[0, 1], [1, 1], [0, 0], [1, 0]])
    trans = np.zeros((2, 2))
    trans[0, 1] = np.inf
    scores, paths = sc.chain_kbest(np.zeros((2, 2)), trans, k=4)
    np.testing.assert_array_equal(scores, [np.inf, 0, 0, 0])
    np.testing.assert_array_equal(paths, [[0, 1], [0, 0], [1, 0], [1, 1]])


@pytest.mark.parametrize("seed, v, c, per_step", CASES)
def test_path_score_with_plus_inf_follows_the_limit(seed, v, c, per_step):
    x, trans, init, lengths = plus_inf_problem(seed, v, c, per_step)
    for b in range(len(x)):
        finite, count, paths = limit_paths(*chain_of(b, x, trans, init, lengths))
        padded = np.pad(paths, ((0, 0), (0, v - paths.shape[1])), constant_values=-1)
        got = sc.chain_path_score(x[b], trans[0] if per_step else trans, init, padded, lengths=lengths[b])
        np.testing.assert_allclose(got, np.where((count > 0) & (finite > -np.inf), np.inf, finite), rtol=1e-12)


@pytest.mark.parametrize("seed, v, c, per_step", CASES)
def test_entropy_with_plus_inf_is_that_of_the_limit_posterior(seed, v, c, per_step, algorithm):
    x, trans, init, lengths = plus_inf_problem(seed, v, c, per_step)
    got = sc.chain_entropy(x, trans, init, lengths=lengths)
    for b in range(len(x)):
        p = limit_posterior(*limit_paths(*chain_of(b, x, trans, init, lengths))[:2])
        np.testing.assert_allclose(got[b], -(p[p > 0] * np.log(p[p > 0])).sum(), rtol=1e-8, atol=1e-8)


def nan_reading_chains():
    """``(x, trans, lengths)`` of four chains: 0 and 2 read a NaN (0 one on no possible path, on
    a transition out of a state of weight 0), 1 one past its length, 3 one in a step it does
    not take."""
    x = np.zeros((4, 3, 2))
    x[0, 0, 0] = -np.inf
    x[1, 2, 1] = np.nan
    x[2, 1, 0] = np.nan
    trans = np.zeros((4, 2, 2, 2))  # per row and step
    trans[0, 0, 0, 0] = np.nan
    trans[3, 1, 1, 1] = np.nan
    return x, trans, np.array([3, 2, 3, 2])


def test_sample_is_minus_one_for_every_draw_of_a_chain_that_reads_a_nan():
    """A NaN input makes every draw of its chain -1, also a NaN off every possible path (on a
    transition out of a state of weight 0, where draws mixed -1 and paths); a NaN past a
    chain's length or in a step it does not take leaves it alone."""
    x, trans, lengths = nan_reading_chains()
    paths = sc.chain_sample(x, trans, lengths=lengths, num_samples=50, seed=0)
    np.testing.assert_array_equal(paths[:, [0, 2]], -1)
    assert (paths[:, [1, 3], :2] >= 0).all() and (paths[:, [1, 3], 2] == -1).all()
    sparse = scipy.sparse.csr_matrix(np.array([[np.nan, 1.0], [1.0, 1.0]]))
    np.testing.assert_array_equal(sc.chain_sample(x[:1], sparse, num_samples=5, seed=0), -1)
    assert (sc.chain_sample(x[:1, :1], sparse, num_samples=5, seed=0) >= 0).all()  # one position: no step


def test_viterbi_and_kbest_of_a_chain_that_reads_a_nan_are_nan_and_minus_one():
    """A chain that reads a NaN scores NaN with path -1 (a real-looking path came back before),
    in ``viterbi`` and ``chain_kbest``, dense per step and sparse, its torch ``x`` gradient NaN;
    a NaN past a chain's length or in a step it does not take leaves it alone."""
    x, trans, lengths = nan_reading_chains()
    score, path = sc.viterbi(x, trans, lengths=lengths)
    scores, paths = sc.chain_kbest(x, trans, lengths=lengths, k=2)
    for s, p in ((score, path), (scores, paths)):
        assert np.isnan(s[..., [0, 2]]).all() and (p[..., [0, 2], :] == -1).all()
        assert np.isfinite(s[..., [1, 3]]).all() and (p[..., [1, 3], :2] >= 0).all()
    sparse = scipy.sparse.csr_matrix(np.array([[np.nan, 1.0], [1.0, 1.0]]))
    for s, p in (sc.viterbi(x[:1], sparse), sc.chain_kbest(x[:1], sparse, k=2)):
        assert np.isnan(s).all() and (p == -1).all()
    torch = pytest.importorskip("torch")
    import spchain.torch as st

    xt = torch.tensor(x, requires_grad=True)
    st.viterbi(xt, torch.tensor(trans), lengths=torch.tensor(lengths))[0].sum().backward()
    assert xt.grad[[0, 2]].isnan().all() and not xt.grad[[1, 3]].isnan().any()


@pytest.mark.parametrize("v", [1, 2, 4])
def test_entropy_with_plus_inf_at_the_last_position_is_exact(v):
    """``+inf`` in states of each chain's last position, where the expected scores carry
    ``2**20`` a term and the weights summing to 1 decide the bits: the limit entropy to 1e-9
    (it was 2.6e-5 off) and a gradient for ``log_init`` whose entries sum to 0 (to 1e-8 of the
    largest; 1.6e-5 before)."""
    torch = pytest.importorskip("torch")
    import spchain.torch as st

    rng = np.random.default_rng(v)
    x, trans, init = rng.normal(size=(3, v, 3)), rng.normal(size=(3, 3)), rng.normal(size=3)
    lengths = np.array([v, max(v - 1, 1), v])
    for b, last in enumerate(lengths - 1):
        x[b, last, : 3 - b % 2] = np.inf  # two or three states of the last position
    got = sc.chain_entropy(x, trans, init, lengths=lengths)
    for b in range(3):
        p = limit_posterior(*limit_paths(*chain_of(b, x, trans, init, lengths))[:2])
        np.testing.assert_allclose(got[b], -(p[p > 0] * np.log(p[p > 0])).sum(), rtol=1e-9)
    log_init = torch.tensor(init, requires_grad=True)
    st.chain_entropy(torch.tensor(x), torch.tensor(trans), log_init, lengths=torch.tensor(lengths)).sum().backward()
    assert abs(float(log_init.grad.sum())) < 1e-8 * float(log_init.grad.abs().max())


@pytest.mark.parametrize("seed, v, c, per_step", [(0, 3, 3, True), (1, 4, 2, False), (3, 5, 2, True)])
def test_samples_with_plus_inf_follow_the_limit_posterior(seed, v, c, per_step):
    x, trans, init, lengths = plus_inf_problem(seed, v, c, per_step)
    n = 4000
    paths = sc.chain_sample(x, trans, init, lengths=lengths, num_samples=n, seed=seed)
    for b in range(len(x)):
        finite, count, all_paths = limit_paths(*chain_of(b, x, trans, init, lengths))
        p = limit_posterior(finite, count)
        if not p.any():
            np.testing.assert_array_equal(paths[:, b], -1)
            continue
        np.testing.assert_array_equal(paths[:, b, lengths[b]:], -1)
        counts = sample_frequencies(paths[:, b], all_paths)
        assert counts[p == 0].sum() == 0, "a path outside the limit posterior was drawn"
        if (p > 0).sum() > 1:
            assert stats.chisquare(counts[p > 0], p[p > 0] * n).pvalue > 1e-3


def test_entropy_gradient_with_plus_inf_is_the_limit_one():
    """The gradient of the limit entropy: that of the brute-force entropy (torch autograd)
    with ``+inf`` as ``2**20``, in float64, the limit's posterior being that chain's."""
    torch = pytest.importorskip("torch")
    import spchain.torch as st

    x, trans, init, lengths = plus_inf_problem(3, 3, 3, False, batch=2)  # row 1 has no path
    x[0, 1, 2] = np.inf
    assert np.isposinf(sc.chain_logsumexp(x, trans, init, lengths=lengths)[0])
    got_x, got_t, got_i = (torch.tensor(a, requires_grad=True) for a in (x, trans, init))
    st.chain_entropy(got_x, got_t, got_i, lengths=torch.tensor(lengths)).sum().backward()
    big = [torch.tensor(np.where(np.isposinf(a), 2.0**20, a), requires_grad=True) for a in (x[0], trans, init)]
    reference.chain_entropy_torch(*big, lengths[0]).backward()
    for got, want in zip((got_x.grad[0], got_t.grad, got_i.grad), big):
        np.testing.assert_allclose(got.numpy(), want.grad.numpy(), atol=1e-7)
