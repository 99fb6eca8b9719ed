"""The dense CPU E-step of spchain.hmm in probability space (``_chain_scaled.hmm_posteriors``)
against the log-space chain functions in float64, and its fallback to them."""

import numpy as np
import pytest

from spchain import _backend, _chain_scaled, hmm
from spchain.hmm import _sequences

LENGTHS = [np.array([1]), np.array([7]), np.array([7, 12, 1, 9, 5, 2]), np.array([1, 1, 3])]


def model(start, trans):
    m = hmm.CategoricalHMM(len(start))
    m.startprob_, m.transmat_, m.emissionprob_ = start, trans, np.ones((len(start), 1))
    m._check(_backend.NUMPY)
    m._log_likelihood = lambda backend, frame: frame  # the data are the emission log-likelihoods
    return m


def reference(m, frame, lengths):
    """The log-space E-step, the float64 reference."""
    return m._posteriors_log(_backend.NUMPY, frame, _sequences(np, frame.shape[0], lengths), True)


def scaled(m, frame, lengths, weights=None, posteriors=True):
    seqs = _sequences(np, frame.shape[0], lengths)
    return _chain_scaled.hmm_posteriors(_backend.NUMPY, frame, weights, seqs.starts, m.startprob_, m.transmat_,
                                        True, True, posteriors)


def problem(rng, lengths, c=5, zeros=True):
    start = rng.dirichlet(np.ones(c))
    trans = rng.dirichlet(np.ones(c), size=c)
    frame = 3 * rng.normal(size=(int(lengths.sum()), c))
    if zeros:  # forbidden moves and starts, impossible emissions
        trans[0, 1] = trans[2, :2] = 0
        trans /= trans.sum(axis=1, keepdims=True)
        start[3] = 0
        start /= start.sum()
        frame[::4, 2] = -np.inf
    return model(start, trans), frame


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_scaled_estep_matches_log_space(rng, lengths, zeros):
    m, frame = problem(rng, lengths, zeros=zeros)
    log_prob, posteriors, first, counts, sums = scaled(m, frame, lengths)
    total, expected, expected_first, expected_counts = reference(m, frame, lengths)
    assert not np.isnan(log_prob).any()
    np.testing.assert_allclose(log_prob.sum(), total, rtol=1e-12)
    np.testing.assert_allclose(posteriors, expected, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(first, expected_first, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(counts, expected_counts, rtol=1e-10, atol=1e-13)
    if zeros:
        assert counts[0, 1] == 0
    else:  # the M-step's sums (of features, which are finite)
        np.testing.assert_allclose(sums, expected.T @ frame, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lengths", LENGTHS[2:], ids=str)
def test_scaled_estep_of_a_product(rng, lengths):
    """Emission log-likelihoods given as ``features @ weights`` (a Gaussian's with diagonal
    covariances): the same E-step, and the M-step's sums ``posteriors.T @ features``."""
    m, _ = problem(rng, lengths, zeros=True)
    features = rng.normal(size=(int(lengths.sum()), 4))
    weights = rng.normal(size=(4, 5))
    log_prob, posteriors, first, counts, sums = scaled(m, features, lengths, weights)
    expected = scaled(m, features @ weights, lengths)
    np.testing.assert_allclose(log_prob, expected[0], rtol=1e-12)
    np.testing.assert_allclose(posteriors, expected[1], rtol=1e-10, atol=1e-13)
    for a, b in zip((first, counts), expected[2:4]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(sums, posteriors.T @ features, rtol=1e-10, atol=1e-10)
    unkept = scaled(m, features, lengths, weights, posteriors=False)  # what a fit needs
    assert unkept[1] is None
    for a, b in zip(unkept[2:], (first, counts, sums)):
        np.testing.assert_array_equal(a, b)


def test_scaled_estep_leaves_out_sequences_it_cannot_do(rng):
    """A scale factor below float64's safe range (the only state that explains a sample is
    unreachable but for a path of probability e-400) marks its sequence NaN; ``_posteriors``
    computes it in log space, the others in probability space, and the result is the log-space one."""
    lengths = np.array([6, 4, 5])
    m, frame = problem(rng, lengths, c=3, zeros=False)
    m = model(np.array([0.5, 0.5, 0.0]),
              np.array([[0.5, 0.5, 0.0], [0.5, 0.5 - np.exp(-400), np.exp(-400)], [0.0, 0.0, 1.0]]))
    frame[7, :2] -= 1000.0  # the second sequence's second sample: only state 2 explains it
    log_prob = scaled(m, frame, lengths)[0]
    assert np.isnan(log_prob).tolist() == [False, True, False]
    seqs = _sequences(np, frame.shape[0], lengths)
    got = m._posteriors(_backend.NUMPY, frame, seqs, True)
    expected = reference(m, frame, lengths)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-12)
    for a, b in zip(got[1:4], expected[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


def test_dead_sequence_falls_back(rng):
    """A sequence with no path (an impossible sample) gets the log-space chain's answer."""
    lengths = np.array([3, 4])
    m, frame = problem(rng, lengths, c=3, zeros=False)
    frame[4] = -np.inf
    log_prob = scaled(m, frame, lengths)[0]
    assert np.isnan(log_prob).tolist() == [False, True]
    got = m._posteriors(_backend.NUMPY, frame, _sequences(np, frame.shape[0], lengths), True)
    expected = reference(m, frame, lengths)
    assert got[0] == expected[0] == -np.inf
    for a, b in zip(got[1:4], expected[1:]):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


def test_large_backward_message_falls_back(rng):
    """A start state of probability e-400, kept (no moves), that the later samples favour by
    e40 a step: its backward message passes 1e130, the scaled sweep gives that sequence up, and
    ``_posteriors`` gives the log-space result (the state's posterior is 1/2)."""
    lengths = np.array([12, 3])
    m = model(np.array([1.0 - np.exp(-400.0), np.exp(-400.0)]), np.eye(2))
    frame = np.zeros((15, 2))
    frame[2:12, 0] = -40.0
    log_prob = scaled(m, frame, lengths)[0]
    assert np.isnan(log_prob).tolist() == [True, False]
    got = m._posteriors(_backend.NUMPY, frame, _sequences(np, frame.shape[0], lengths), True)
    expected = reference(m, frame, lengths)
    np.testing.assert_allclose(expected[1][:12, 1], 0.5)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-12)
    for a, b in zip(got[1:4], expected[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


def test_fit_estep_falls_back_with_sums(rng):
    """A diagonal Gaussian's E-step in a fit (the M-step's sums instead of the posteriors), one
    sequence computed in log space: the sums, counts and first posteriors are the log-space ones."""
    lengths = np.array([5, 4, 6])
    m = hmm.GaussianHMM(3, init_params="")
    m.startprob_ = np.array([0.5, 0.5, 0.0])
    m.transmat_ = np.array([[0.5, 0.5, 0.0], [0.5, 0.5 - np.exp(-400), np.exp(-400)], [0.0, 0.0, 1.0]])
    m.means_ = np.array([[0.0, 0.0], [1.0, 1.0], [40.0, 40.0]])
    m.covars_ = rng.uniform(0.5, 2.0, (3, 2))
    X = rng.normal(size=(15, 2))
    X[6:9] += 40.0  # the second sequence moves to state 2 at its second sample
    m._check(_backend.NUMPY)
    seqs = _sequences(np, 15, lengths)
    data = m._prepare(_backend.NUMPY, X, fitting=True)
    log_prob = _chain_scaled.hmm_posteriors(_backend.NUMPY, *m._emission_product(_backend.NUMPY, data), seqs.starts,
                                            m.startprob_, m.transmat_, True, True)[0]
    assert np.isnan(log_prob).tolist() == [False, True, False]
    total, posteriors, first, counts, sums = m._posteriors(_backend.NUMPY, data, seqs, True, fitting=True)
    expected = m._posteriors_log(_backend.NUMPY, m._log_likelihood(_backend.NUMPY, data), seqs, True)
    assert posteriors is None
    np.testing.assert_allclose(total, expected[0], rtol=1e-12)
    for a, b in zip((first, counts, sums), expected[2:] + (expected[1].T @ data.features,)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
