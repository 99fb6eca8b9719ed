"""spchain.hmm against hmmlearn 0.3: the same EM steps from the same parameters, the same
scores, posteriors and decodings; sparse transitions against the dense model; errors."""

import logging

import numpy as np
import pytest
import scipy.sparse

from spchain import hmm

H = pytest.importorskip("hmmlearn.hmm")

COVARIANCE_TYPES = ["spherical", "diag", "full", "tied"]
LENGTHS = [None, np.array([7, 12, 1, 9, 5])]


@pytest.fixture(autouse=True)
def _quiet_hmmlearn(caplog):
    """hmmlearn logs warnings about degenerate fits of these tiny problems."""
    caplog.set_level(logging.ERROR, logger="hmmlearn")


def host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def close(a, b, rtol=1e-6):
    a, b = host(a), np.asarray(b)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


def gaussian_problem(rng, covariance_type, c=3, f=2, n=34):
    X = rng.normal(size=(n, f)) + 2.0 * rng.integers(0, 3, size=(n, 1))
    trans = rng.dirichlet(np.ones(c), size=c)
    means = 2 * rng.normal(size=(c, f))
    a = rng.normal(size=(c, f, f))
    full = a @ a.transpose(0, 2, 1) + np.eye(f)
    covars = {"spherical": rng.uniform(0.5, 2, c), "diag": rng.uniform(0.5, 2, (c, f)),
              "full": full, "tied": full[0]}[covariance_type]
    return X, (rng.dirichlet(np.ones(c)), trans, means, covars)


def gaussian(module, covariance_type, parameters, **kwargs):
    model = module.GaussianHMM(len(parameters[0]), covariance_type=covariance_type, init_params="",
                               tol=-np.inf, **kwargs)
    model.startprob_, model.transmat_, model.means_, model.covars_ = parameters
    return model


def categorical_problem(rng, c=4, symbols=5, n=34):
    trans = rng.dirichlet(np.ones(c), size=c)
    trans[0, 2] = 0  # a forbidden move stays forbidden
    trans /= trans.sum(axis=1, keepdims=True)
    X = rng.integers(0, symbols, (n, 1))
    return X, (rng.dirichlet(np.ones(c)), trans, rng.dirichlet(np.ones(symbols), size=c))


def categorical(module, parameters, **kwargs):
    model = module.CategoricalHMM(len(parameters[0]), init_params="", tol=-np.inf, **kwargs)
    model.startprob_, model.transmat_, model.emissionprob_ = parameters
    return model


def hmmlearn_covars(model):
    """hmmlearn's covariances in the shape they are set in (its ``covars_`` getter gives full
    matrices, and for a fitted spherical model a broken shape)."""
    covars = model._covars_
    return covars[:, 0] if model.covariance_type == "spherical" and covars.ndim == 2 else covars


def assert_same_model(ours, theirs, X, lengths, xp):
    """Fitted parameters, history and every inference method agree with hmmlearn's."""
    close(ours.startprob_, theirs.startprob_)
    close(ours.transmat_, theirs.transmat_)
    close(ours.monitor_.history, theirs.monitor_.history)
    assert ours.monitor_.iter == theirs.monitor_.iter
    X_ours = xp.asarray(X)
    log_prob, posteriors = ours.score_samples(X_ours, lengths)
    theirs_log_prob, theirs_posteriors = theirs.score_samples(X, lengths)
    close(log_prob, theirs_log_prob)
    close(posteriors, theirs_posteriors)
    close(ours.score(X_ours, lengths), theirs.score(X, lengths))
    close(ours.predict_proba(X_ours, lengths), theirs.predict_proba(X, lengths))
    for algorithm in ("viterbi", "map"):
        score, states = ours.decode(X_ours, lengths, algorithm=algorithm)
        theirs_score, theirs_states = theirs.decode(X, lengths, algorithm=algorithm)
        close(score, theirs_score)
        np.testing.assert_array_equal(host(states), theirs_states)
    np.testing.assert_array_equal(host(ours.predict(X_ours, lengths)), theirs.predict(X, lengths))


@pytest.mark.parametrize("lengths", LENGTHS, ids=["one", "ragged"])
@pytest.mark.parametrize("covariance_type", COVARIANCE_TYPES)
def test_gaussian_em_matches_hmmlearn(xp, rng, covariance_type, lengths):
    X, parameters = gaussian_problem(rng, covariance_type)
    priors = dict(means_prior=0.3, means_weight=0.5, covars_prior=0.1, covars_weight=4, transmat_prior=1.5)
    for kwargs in ({}, priors):
        ours = gaussian(hmm, covariance_type, parameters, n_iter=5, **kwargs).fit(xp.asarray(X), lengths)
        theirs = gaussian(H, covariance_type, parameters, n_iter=5, **kwargs).fit(X, lengths)
        close(ours.means_, theirs.means_)
        close(ours._covars_, hmmlearn_covars(theirs))
        close(ours.covars_, theirs.covars_ if covariance_type != "spherical" else
              hmmlearn_covars(theirs)[:, None, None] * np.eye(X.shape[1]))
        assert ours.covars_.shape == (3, 2, 2)
        assert_same_model(ours, theirs, X, lengths, xp)


@pytest.mark.parametrize("lengths", LENGTHS, ids=["one", "ragged"])
def test_categorical_em_matches_hmmlearn(xp, rng, lengths):
    X, parameters = categorical_problem(rng)
    for kwargs in ({}, dict(emissionprob_prior=1.5, transmat_prior=1.2, startprob_prior=2.0)):
        ours = categorical(hmm, parameters, n_iter=6, **kwargs).fit(xp.asarray(X), lengths)
        theirs = categorical(H, parameters, n_iter=6, **kwargs).fit(X, lengths)
        close(ours.emissionprob_, theirs.emissionprob_)
        assert host(ours.transmat_)[0, 2] == 0
        assert_same_model(ours, theirs, X, lengths, xp)


@pytest.mark.parametrize("params", ["", "st", "stm", "mc", "t"])
def test_params_letters_match_hmmlearn(rng, params):
    X, parameters = gaussian_problem(rng, "diag")
    lengths = LENGTHS[1]
    ours = gaussian(hmm, "diag", parameters, n_iter=3, params=params).fit(X, lengths)
    theirs = gaussian(H, "diag", parameters, n_iter=3, params=params).fit(X, lengths)
    for name in ("startprob_", "transmat_", "means_", "_covars_"):
        close(getattr(ours, name), getattr(theirs, name))


def test_convergence_stops_as_hmmlearn(rng):
    X, parameters = categorical_problem(rng, n=200)
    ours = categorical(hmm, parameters, n_iter=100).set_params(tol=0.05).fit(X)
    theirs = categorical(H, parameters, n_iter=100).set_params(tol=0.05)
    theirs.monitor_.tol = 0.05
    theirs.fit(X)
    assert ours.monitor_.converged and 1 < ours.monitor_.iter < 100
    assert ours.monitor_.iter == theirs.monitor_.iter
    close(ours.monitor_.history, theirs.monitor_.history)


def test_fit_leaves_callers_arrays_alone(rng):
    X, parameters = gaussian_problem(rng, "full")
    copies = [p.copy() for p in parameters]
    X_copy = X.copy()
    gaussian(hmm, "full", parameters, n_iter=2).fit(X)
    for p, q in zip(parameters, copies):
        np.testing.assert_array_equal(p, q)
    np.testing.assert_array_equal(X, X_copy)


def left_to_right(rng, c, successors):
    """A (c, c) stochastic CSR matrix: state i moves to i .. i + successors - 1 (mod c)."""
    rows = np.repeat(np.arange(c), successors)
    cols = (rows + np.tile(np.arange(successors), c)) % c
    return scipy.sparse.csr_matrix((rng.dirichlet(np.ones(successors), size=c).ravel(), (rows, cols)),
                                   shape=(c, c))


@pytest.mark.parametrize("lengths", LENGTHS, ids=["one", "ragged"])
def test_sparse_transitions_match_dense(xp, rng, lengths):
    X, (start, _, emit) = categorical_problem(rng, c=6, n=34)
    trans = left_to_right(rng, 6, 3)
    if xp is not np:
        import cupyx.scipy.sparse
        trans = cupyx.scipy.sparse.csr_matrix(trans)
    trans_host = trans.get() if hasattr(trans, "get") else trans
    given = trans_host.data.copy()
    sparse = categorical(hmm, (start, trans, emit), n_iter=4).fit(xp.asarray(X), lengths)
    np.testing.assert_array_equal(host(trans.data), given)  # the caller's matrix is left alone
    dense = categorical(hmm, (start, trans_host.toarray(), emit), n_iter=4).fit(X, lengths)
    fitted = sparse.transmat_.get() if hasattr(sparse.transmat_, "get") else sparse.transmat_
    assert scipy.sparse.issparse(fitted) and fitted.format == "csr"
    np.testing.assert_array_equal(fitted.indices, trans_host.indices)
    np.testing.assert_array_equal(fitted.indptr, trans_host.indptr)
    close(fitted.toarray(), dense.transmat_, rtol=1e-10)
    close(sparse.emissionprob_, dense.emissionprob_, rtol=1e-10)
    close(sparse.monitor_.history, dense.monitor_.history, rtol=1e-10)
    close(sparse.score(xp.asarray(X), lengths), dense.score(X, lengths), rtol=1e-10)
    np.testing.assert_array_equal(host(sparse.predict(xp.asarray(X), lengths)), dense.predict(X, lengths))
    for a, b in zip(sparse.sample(30, random_state=0), dense.sample(30, random_state=0)):
        np.testing.assert_array_equal(host(a), b)  # the same draws, on the stored entries only


def test_sparse_gaussian_matches_hmmlearn_with_zeros(rng):
    X, (start, _, means, covars) = gaussian_problem(rng, "diag", c=5)
    trans = left_to_right(rng, 5, 2)
    ours = gaussian(hmm, "diag", (start, trans, means, covars), n_iter=4).fit(X, LENGTHS[1])
    theirs = gaussian(H, "diag", (start, trans.toarray(), means, covars), n_iter=4).fit(X, LENGTHS[1])
    close(ours.transmat_.toarray(), theirs.transmat_)
    close(ours.means_, theirs.means_)
    close(ours.monitor_.history, theirs.monitor_.history)


def test_sample_matches_hmmlearn(rng):
    _, parameters = categorical_problem(rng)
    X, states = categorical(hmm, parameters).sample(20, random_state=5)
    assert categorical(hmm, parameters).score(X.tolist()) == pytest.approx(categorical(hmm, parameters).score(X))
    X_theirs, states_theirs = categorical(H, parameters).sample(20, random_state=5)
    np.testing.assert_array_equal(X, X_theirs)
    np.testing.assert_array_equal(states, states_theirs)
    for covariance_type in COVARIANCE_TYPES:
        _, parameters = gaussian_problem(rng, covariance_type)
        X, states = gaussian(hmm, covariance_type, parameters).sample(15, random_state=7, currstate=1)
        X_theirs, states_theirs = gaussian(H, covariance_type, parameters).sample(15, random_state=7, currstate=1)
        np.testing.assert_allclose(X, X_theirs, rtol=1e-10)
        np.testing.assert_array_equal(states, states_theirs)


def test_default_initialisation_fits(rng):
    X = np.concatenate([rng.normal(m, 0.2, (40, 2)) for m in (0, 4, 0, 4)])
    first = hmm.GaussianHMM(2, random_state=0, n_iter=20).fit(X, [80, 80])
    again = hmm.GaussianHMM(2, random_state=0, n_iter=20).fit(X, [80, 80])
    np.testing.assert_array_equal(first.means_, again.means_)
    assert np.all(np.diff(first.monitor_.history) > -1e-8)
    np.testing.assert_allclose(np.sort(first.means_[:, 0]), [0, 4], atol=0.2)
    symbols = rng.integers(0, 3, (50, 1))
    ours = hmm.CategoricalHMM(3, random_state=1, n_iter=5).fit(symbols)
    theirs = H.CategoricalHMM(3, random_state=1, n_iter=5).fit(symbols)  # the same random start
    close(ours.emissionprob_, theirs.emissionprob_)
    assert ours.n_features == 3


def test_unreachable_state_stays_finite(rng):
    X, (start, trans, means, covars) = gaussian_problem(rng, "diag")
    start = np.array([0.5, 0.5, 0.0])
    trans = np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.3, 0.3, 0.4]])
    for covariance_type in COVARIANCE_TYPES:
        _, (_, _, _, covars) = gaussian_problem(rng, covariance_type)
        model = gaussian(hmm, covariance_type, (start, trans, means, covars), n_iter=3).fit(X, LENGTHS[1])
        for value in (model.startprob_, model.transmat_, model.means_, model.covars_, model.monitor_.history):
            assert np.all(np.isfinite(value))
        np.testing.assert_allclose(model.means_[2], means[2], rtol=1e-12)  # no data: kept
    model = categorical(hmm, (start, trans, np.full((3, 4), 0.25)), n_iter=3).fit(rng.integers(0, 4, (30, 1)))
    assert np.all(np.isfinite(model.emissionprob_)) and np.all(model.emissionprob_[2] == 0)


def test_impossible_sequence_decodes_to_minus_one():
    """A sequence with a symbol no state emits: score -inf (as hmmlearn), Viterbi states -1 and
    zero posteriors (documented; hmmlearn gives an arbitrary path and NaN), the other sequence
    decoded as hmmlearn decodes it."""
    model = hmm.CategoricalHMM(2, init_params="", n_features=3)
    model.startprob_ = np.array([0.6, 0.4])
    model.transmat_ = np.array([[0.7, 0.3], [0.2, 0.8]])
    model.emissionprob_ = np.array([[0.5, 0.5, 0.0], [0.3, 0.7, 0.0]])  # symbol 2: impossible
    X, lengths = np.array([[0], [1], [2], [1], [0], [1]]), np.array([3, 3])
    ref = H.CategoricalHMM(2, init_params="", n_features=3)
    ref.startprob_, ref.transmat_, ref.emissionprob_ = model.startprob_, model.transmat_, model.emissionprob_
    assert model.score(X, lengths) == -np.inf == ref.score(X, lengths)
    states = model.predict(X, lengths)
    np.testing.assert_array_equal(states[:3], -1)
    np.testing.assert_array_equal(states[3:], ref.predict(X[3:]))
    posteriors = model.predict_proba(X, lengths)
    np.testing.assert_array_equal(posteriors[:3], 0.0)
    close(posteriors[3:], ref.predict_proba(X[3:]), rtol=1e-10)


def test_get_set_params_and_repr():
    model = hmm.GaussianHMM(3, covariance_type="full", tol=5)
    params = model.get_params()
    assert params["n_components"] == 3 and params["covariance_type"] == "full" and params["tol"] == 5
    assert set(params) == set(H.GaussianHMM().get_params())
    assert set(hmm.CategoricalHMM().get_params()) == set(H.CategoricalHMM().get_params())
    assert model.set_params(n_iter=3, covariance_type="tied") is model and model.n_iter == 3
    assert repr(model) == "GaussianHMM(n_components=3, covariance_type='tied', n_iter=3, tol=5)"
    with pytest.raises(ValueError, match="Invalid parameter 'bogus'"):
        model.set_params(bogus=1)
    clone = type(model)(**model.get_params())
    assert clone.get_params() == model.get_params()


def test_errors(rng):
    X, parameters = gaussian_problem(rng, "diag")
    model = gaussian(hmm, "diag", parameters, n_iter=1)
    with pytest.raises(ValueError, match="doesn't sum to 34"):
        model.fit(X, [10, 10])
    with pytest.raises(ValueError, match="positive"):
        model.fit(X, [34, 0])
    with pytest.raises(TypeError, match="integers"):
        model.fit(X, [17.0, 17.0])
    with pytest.raises(ValueError, match="2D"):
        model.fit(X[:, 0])
    with pytest.raises(ValueError, match="NaN or infinity"):
        model.fit(np.where(X > 3, np.nan, X))
    for n_components, error, match in [(0, ValueError, "n_components must be at least 1, got 0"),
                                       (-1, ValueError, "n_components must be non-negative"),
                                       (2.0, TypeError, "n_components must be an int")]:
        for estimator in (hmm.GaussianHMM, hmm.CategoricalHMM):
            with pytest.raises(error, match=match):
                estimator(n_components=n_components).fit(np.ones((6, 1), np.int64))
    model.fit(X)
    with pytest.raises(ValueError, match="Unexpected number of dimensions, got 3 but expected 2"):
        model.score(np.ones((5, 3)))
    with pytest.raises(ValueError, match="Unknown decoder"):
        model.decode(X, algorithm="beam")
    for name, value, match in [("startprob_", np.array([0.5, 0.2, 0.2]), "startprob_ must sum to 1"),
                               ("startprob_", np.array([0.5, 0.5]), "length n_components"),
                               ("transmat_", np.full((3, 3), 0.5), "transmat_ rows must sum to 1"),
                               ("transmat_", scipy.sparse.csr_matrix(np.full((3, 3), 0.5)), "rows must sum to 1"),
                               ("transmat_", np.eye(2), "shape \\(n_components, n_components\\)")]:
        broken = gaussian(hmm, "diag", parameters)
        setattr(broken, name, value)
        with pytest.raises(ValueError, match=match):
            broken.fit(X)
    with pytest.raises(ValueError, match="'diag' covars must be positive"):
        model.covars_ = -np.ones((3, 2))
    with pytest.raises(ValueError, match="symmetric, positive-definite"):
        hmm.GaussianHMM(2, covariance_type="full").covars_ = np.array([-np.eye(2), np.eye(2)])
    with pytest.raises(ValueError, match="not fitted|not set"):
        hmm.GaussianHMM(2).score(X)
    with pytest.raises(ValueError, match="not fitted|not set"):
        hmm.CategoricalHMM(2).sample(3)
    symbols, parameters = categorical_problem(rng)
    model = categorical(hmm, parameters)
    with pytest.raises(ValueError, match="Symbols should be integers"):
        model.fit(symbols + 0.5)
    with pytest.raises(ValueError, match="nonnegative"):
        model.fit(symbols - 1)
    model.n_features = 5
    with pytest.raises(ValueError, match="Largest symbol is 7"):
        model.score(np.array([[0], [7]]))
    with pytest.raises(ValueError, match="emissionprob_ rows must sum to 1"):
        categorical(hmm, (parameters[0], parameters[1], parameters[2] * 2)).fit(symbols)


def test_lazy_submodule_loads_no_numba():
    import subprocess
    import sys

    code = ("import sys, spchain; m = spchain.hmm.GaussianHMM; "
            "print(spchain.hmm.__name__, 'hmm' in dir(spchain), 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.split() == ["spchain.hmm", "True", "False"]
