"""The hmm-fit workload: fitting HMMs by EM with :mod:`spchain.hmm` beside hmmlearn's ``fit``.

- ``gaussian diag``: ``GaussianHMM(n_components=50, covariance_type="diag")``, 500 sequences of
  200 steps, 10 features, 10 EM iterations, float64, both from the same starting parameters
  (``init_params=""``, ``tol=-inf``: every iteration runs); the result is the fitted parameters.
  At full size hmmlearn's fit (minutes) runs once, and there is no error figure (the tests
  compare the two at the quick size).
- ``sparse categorical``: ``CategoricalHMM`` with 4096 states, left-to-right with 8 successors
  (a SciPy CSR ``transmat_``), 64 symbols, 64 sequences of 500 steps, 2 EM iterations.
  hmmlearn needs the dense (4096, 4096) matrix, c / 8 = 512 times the work per step; at full
  size it runs one sequence of 10 steps (its label gives the factor by which its time scales)
  and gets no error figure.
- ``sparse marginals``: one :func:`spchain.chain_marginals` call on the sparse case's data and
  starting model, the yardstick of its peak memory (the fit should stay within 2x of it); its
  float64 reference is the scaled forward-backward recursion in NumPy and SciPy
  (:mod:`spchain.bench.reference`).

``python -m spchain.bench.hmm`` times the Gaussian case alone, the two fits alternating.
"""

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.sparse

from .. import chain_marginals, hmm
from . import reference
from .core import Case

CASES = ["gaussian diag", "sparse categorical", "sparse marginals"]
SIZES = {
    False: {"states": 50, "sequences": 500, "steps": 200, "features": 10, "iterations": 10,
            "sparse states": 4096, "successors": 8, "symbols": 64, "sparse sequences": 64, "sparse steps": 500,
            "sparse iterations": 2},
    True: {"states": 4, "sequences": 12, "steps": 30, "features": 3, "iterations": 3,
           "sparse states": 32, "successors": 4, "symbols": 8, "sparse sequences": 4, "sparse steps": 20,
           "sparse iterations": 2},
}
HMMLEARN_SPARSE_SIZE = (1, 10)
"""(sequences, steps) of hmmlearn's dense fit in the full-size sparse case."""


def _states(rng: np.random.Generator, start: np.ndarray, trans: np.ndarray, sequences: int,
            steps: int) -> np.ndarray:
    """(sequences, steps) state paths drawn from a dense chain, all sequences at once."""
    cdf = np.cumsum(trans, axis=1)
    states = np.empty((sequences, steps), np.int64)
    states[:, 0] = rng.choice(len(start), size=sequences, p=start)
    for t in range(1, steps):
        u = rng.random(sequences)[:, None]
        states[:, t] = np.minimum((u > cdf[states[:, t - 1]]).sum(axis=1), len(start) - 1)
    return states


def gaussian_problem(quick: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """``(X, lengths, starting parameters)``: data from a random diagonal Gaussian HMM."""
    size = SIZES[quick]
    c, n_seq, steps, f = size["states"], size["sequences"], size["steps"], size["features"]
    rng = np.random.default_rng(seed)
    trans = rng.dirichlet(np.full(c, 0.3), size=c) + 2 * np.eye(c)
    trans /= trans.sum(axis=1, keepdims=True)
    states = _states(rng, np.full(c, 1 / c), trans, n_seq, steps).ravel()
    centres = 3 * rng.normal(size=(c, f))
    X = centres[states] + rng.normal(size=(states.size, f)) * rng.uniform(0.5, 1.5, (c, f))[states]
    start = {"startprob_": rng.dirichlet(np.ones(c)), "transmat_": rng.dirichlet(np.ones(c), size=c),
             "means_": centres + rng.normal(size=(c, f)), "covars_": rng.uniform(0.5, 2.0, (c, f))}
    return X, np.full(n_seq, steps), start


def left_to_right(rng: np.random.Generator, c: int, successors: int) -> scipy.sparse.csr_matrix:
    """A stochastic (c, c) CSR matrix: each state moves to itself and its next successors - 1."""
    rows = np.repeat(np.arange(c), successors)
    cols = rows + np.tile(np.arange(successors), c)
    keep = cols < c
    values = rng.dirichlet(np.ones(successors), size=c).ravel()[keep]
    matrix = scipy.sparse.csr_matrix((values, (rows[keep], cols[keep])), shape=(c, c))
    return scipy.sparse.csr_matrix(matrix.multiply(1 / matrix.sum(axis=1)))


def sparse_problem(quick: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """``(X symbols (n, 1), lengths, starting parameters)`` of the sparse categorical case."""
    size = SIZES[quick]
    c, symbols = size["sparse states"], size["symbols"]
    n_seq, steps = size["sparse sequences"], size["sparse steps"]
    rng = np.random.default_rng(seed)
    X = rng.integers(0, symbols, (n_seq * steps, 1))
    start = {"startprob_": rng.dirichlet(np.ones(c)), "transmat_": left_to_right(rng, c, size["successors"]),
             "emissionprob_": rng.dirichlet(np.ones(symbols), size=c)}
    return X, np.full(n_seq, steps), start


def fit(module: Any, cls: str, parameters: dict[str, Any], X: np.ndarray, lengths: np.ndarray, n_iter: int,
        dense: bool = False, **kwargs: Any) -> tuple[Any, ...]:
    """Fit ``module.cls`` (spchain's or hmmlearn's) from ``parameters``: the fitted parameters."""
    model = getattr(module, cls)(parameters["startprob_"].size, init_params="", n_iter=n_iter, tol=-np.inf,
                                 **kwargs)
    for name, value in parameters.items():
        setattr(model, name, value.toarray() if dense and scipy.sparse.issparse(value) else value.copy())
    log = logging.getLogger("hmmlearn.base")  # warns that the quick sizes' few samples fit many parameters
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        model.fit(X, lengths)
    finally:
        log.setLevel(level)
    return tuple(getattr(model, name) for name in parameters)


def _dense(result: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
    return tuple(a.toarray() if scipy.sparse.issparse(a) else a for a in result)


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    import hmmlearn.hmm

    size = SIZES[quick]
    if device != "cpu":
        raise ValueError("hmm-fit compares with hmmlearn, which runs on the CPU only")
    if name == "gaussian diag":
        X, lengths, initial = gaussian_problem(quick)
        n_iter = size["iterations"]

        def run(module: Any) -> Callable[[], object]:
            return lambda: fit(module, "GaussianHMM", initial, X, lengths, n_iter, covariance_type="diag")

        # at full size hmmlearn's fit takes minutes: one run, no warm-up, no second run as the reference
        return Case("hmm-fit", name, {"spchain": run(hmm), "hmmlearn": run(hmmlearn.hmm)},
                    run(hmmlearn.hmm) if quick else None, device, slow=set() if quick else {"hmmlearn"})
    X, lengths, start = sparse_problem(quick)
    n_iter, symbols = size["sparse iterations"], size["symbols"]
    if name == "sparse marginals":
        log_trans = start["transmat_"].copy()
        log_trans.data = np.log(log_trans.data)
        steps = int(lengths[0])
        x = np.log(start["emissionprob_"]).T[X[:, 0]].reshape(len(lengths), steps, -1)

        probabilities, log_init = start["transmat_"], np.log(start["startprob_"])

        def exact() -> object:
            return reference.chain_marginals(x, lambda a, t: (probabilities.T @ a.T).T,
                                             lambda b, t: (probabilities @ b.T).T, log_init)

        return Case("hmm-fit", name, {"spchain": lambda: chain_marginals(x, log_trans, log_init)}, exact, device)
    small_seq, small_steps = (len(lengths), int(lengths[0])) if quick else HMMLEARN_SPARSE_SIZE
    baseline = "hmmlearn (dense transmat_)"
    if not quick:
        factor = len(lengths) * int(lengths[0]) / (small_seq * small_steps)
        baseline += f" at {small_seq} sequence of {small_steps} steps: x{factor:.0f} less work, scale its time by that"
    X_small = X[:small_seq * small_steps]

    def ours() -> object:
        return _dense(fit(hmm, "CategoricalHMM", start, X, lengths, n_iter, n_features=symbols))

    def theirs() -> object:
        result = fit(hmmlearn.hmm, "CategoricalHMM", start, X_small, np.full(small_seq, small_steps), n_iter,
                     dense=True, n_features=symbols)
        return result if quick else None

    return Case("hmm-fit", name, {"spchain": ours, baseline: theirs}, theirs if quick else None, device)


def main(order: str = "spchain,hmmlearn,spchain,spchain") -> None:
    """``python -m spchain.bench.hmm [ORDER]``: the full-size Gaussian case, spchain's and
    hmmlearn's fits alternating in ``ORDER`` (comma-separated) after a small warm-up; prints
    each time with the machine's load average over the last minute, and the ratio of the medians."""
    import logging
    import os
    import time

    import hmmlearn.hmm

    logging.getLogger("hmmlearn").setLevel(logging.ERROR)
    X, lengths, initial = gaussian_problem(False)
    n_iter = SIZES[False]["iterations"]
    fit(hmm, "GaussianHMM", initial, X[:4000], lengths[:20], 2, covariance_type="diag")  # compiles the kernels
    modules = {"spchain": hmm, "hmmlearn": hmmlearn.hmm}
    times: dict[str, list[float]] = {name: [] for name in modules}
    for name in order.split(","):
        start = time.perf_counter()
        fit(modules[name], "GaussianHMM", initial, X, lengths, n_iter, covariance_type="diag")
        times[name].append(time.perf_counter() - start)
        print(f"{name}: {times[name][-1]:.2f} s (load {os.getloadavg()[0]:.2f})", flush=True)
    ours, theirs = (float(np.median(times[name])) for name in modules)
    print(f"median spchain {ours:.2f} s, hmmlearn {theirs:.2f} s: {theirs / ours:.1f}x")


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:2])
