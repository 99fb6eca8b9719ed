"""Hidden Markov models fitted by EM: hmmlearn 0.3's ``CategoricalHMM`` and ``GaussianHMM``.

The estimators take hmmlearn's constructor parameters, fitted attributes and methods, so
that code written for ``hmmlearn.hmm`` changes one import. Underneath, every E-step is one
batched call over all sequences:

- a dense ``transmat_`` on the CPU: one forward and one backward sweep per sequence in
  probability space (Rabiner's scaling; :func:`spchain._chain_scaled.hmm_posteriors`, the
  sequences in parallel), which give the log-likelihoods, the state posteriors and the
  expected transition counts together, and for diagonal covariances compute the emission
  log-likelihoods and gather the M-step's sums as they go. A sequence whose scaled sweep could
  lose precision (probabilities beyond float64's range) is computed in log space instead, so
  the results are the log-space ones;
- otherwise (a sparse ``transmat_``, the GPU) a ragged chain call (the sequences padded to
  ``(n_seq, max_len, c)`` with their lengths): :data:`spchain.chain.LOGSUMEXP`
  and its backward give the log-likelihoods, the state posteriors (the gradient with respect
  to the emission scores) and the expected transition counts (the gradient with respect to
  ``log_trans``), and the emission log-likelihoods and M-step sums are matrix products over
  all samples at once.

NumPy ``X`` computes with NumPy (and SciPy), CuPy ``X`` on its device; the parameters follow
``X``. ``transmat_`` may be a SciPy or cupyx sparse matrix whose stored entries are the
allowed moves: EM keeps that structure and runs the sparse chain, in memory that grows with
the stored entries.

>>> import numpy as np
>>> from spchain.hmm import GaussianHMM
>>> X = np.concatenate([np.random.default_rng(0).normal(m, 0.1, (50, 1)) for m in (0, 5, 0)])
>>> model = GaussianHMM(n_components=2, random_state=0).fit(X)
>>> np.sort(model.means_.ravel()).round(1)
array([0., 5.])
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import _backend, _chain_scaled, _csr, _sparse_chain
from .chain import LOGSUMEXP, prepare_chain, viterbi_forward
from ._typing import Array

__all__ = ["CategoricalHMM", "GaussianHMM", "ConvergenceMonitor"]

_log = logging.getLogger(__name__)
COVARIANCE_TYPES = frozenset(("spherical", "diag", "full", "tied"))
DECODER_ALGORITHMS = frozenset(("viterbi", "map"))


class ConvergenceMonitor:
    """The log-likelihood of each EM iteration, and whether EM converged (hmmlearn's monitor).

    Attributes
    ----------
    history : deque
        The log-likelihood of the data at each iteration's E-step.
    iter : int
        The number of iterations done.
    """

    def __init__(self, tol: float, n_iter: int, verbose: bool) -> None:
        self.tol = tol
        self.n_iter = n_iter
        self.verbose = verbose
        self.history: deque[float] = deque()
        self.iter = 0

    def __repr__(self) -> str:
        return (f"ConvergenceMonitor(history={list(self.history)}, iter={self.iter}, n_iter={self.n_iter}, "
                f"tol={self.tol}, verbose={self.verbose})")

    def _reset(self) -> None:
        self.iter = 0
        self.history.clear()

    def report(self, log_prob: float) -> None:
        """Record an iteration's log-likelihood (printed to stderr where ``verbose``)."""
        if self.verbose:
            delta = log_prob - self.history[-1] if self.history else np.nan
            print(f"{self.iter + 1:>10d} {log_prob:>16.8f} {delta:>+16.8f}", file=sys.stderr)
        if self.history and log_prob - self.history[-1] < -np.finfo(float).eps ** 0.5:
            _log.warning("Model is not converging.  Current: %s is not greater than %s. Delta is %s",
                         log_prob, self.history[-1], log_prob - self.history[-1])
        self.history.append(log_prob)
        self.iter += 1

    @property
    def converged(self) -> bool:
        """Whether EM has done ``n_iter`` iterations or gained less than ``tol`` in the last one."""
        return self.iter == self.n_iter or (len(self.history) >= 2
                                            and self.history[-1] - self.history[-2] < self.tol)


def _random_state(seed: Any) -> np.random.RandomState:
    """scikit-learn's ``check_random_state``: ``None``, an int or a ``RandomState``."""
    if seed is None or seed is np.random:
        return np.random.mtrand._rand
    if isinstance(seed, (int, np.integer)):
        return np.random.RandomState(int(seed))
    if isinstance(seed, np.random.RandomState):
        return seed
    raise ValueError(f"{seed!r} cannot be used to seed a numpy.random.RandomState instance")


def _to(backend: _backend.Backend, a: Any) -> Any:
    """``a`` (an array, a list, a number, or a SciPy / cupyx sparse matrix) as a float64 array
    or CSR matrix of ``backend`` (a copy for sparse matrices)."""
    if _sparse_chain.is_sparse(a):
        if not backend.on_gpu and _backend.backend_of(a) is not _backend.NUMPY:
            a = a.get()
        csr = backend.sparse.csr_matrix(a, dtype=np.float64, copy=True)
        csr.sum_duplicates()
        return csr
    if not backend.on_gpu and hasattr(a, "get"):
        a = a.get()
    return backend.xp.asarray(a, dtype=np.float64)


def _normalize(xp: Any, a: Array, axis: int | None = None) -> Array:
    """``a`` divided by its sum along ``axis`` (hmmlearn's ``normalize``; a zero sum stays 0)."""
    total = a.sum(axis=axis, keepdims=True)
    return a / xp.where(total == 0, 1, total)


@dataclass
class _Sequences:
    """Concatenated sequences (``n`` samples) as a padded batch ``(n_seq, max_len, ...)``."""

    n_seq: int
    max_len: int
    lengths: Array | None  # (n_seq,) on the device; None where all have the same length
    index: Array | None  # the padded row of each sample; None where all have the same length
    starts: NDArray[np.int64]  # (n_seq + 1,) on the host: sequence b is samples starts[b]:starts[b + 1]

    def pad(self, xp: Any, a: Array) -> Array:
        """(n, k) samples → (n_seq, max_len, k), zero past each length."""
        if self.index is None:
            return a.reshape(self.n_seq, self.max_len, a.shape[1])
        out = xp.zeros((self.n_seq * self.max_len, a.shape[1]), a.dtype)
        out[self.index] = a
        return out.reshape(self.n_seq, self.max_len, a.shape[1])

    def unpad(self, a: Array) -> Array:
        """(n_seq, max_len, ...) → (n, ...), the inverse of :meth:`pad`."""
        flat = a.reshape((self.n_seq * self.max_len,) + a.shape[2:])
        return flat if self.index is None else flat[self.index]


def _sequences(xp: Any, n: int, lengths: Any) -> _Sequences:
    """The layout of ``n`` samples cut into sequences of ``lengths`` (hmmlearn's errors)."""
    if lengths is None:
        return _Sequences(1, n, None, None, np.array([0, n]))
    if hasattr(lengths, "get"):
        lengths = lengths.get()
    host = np.asarray(lengths)
    if host.ndim != 1 or not host.size:
        raise ValueError(f"lengths must be a non-empty 1-d array of sequence lengths, got shape {host.shape}")
    if not np.issubdtype(host.dtype, np.integer):
        raise TypeError(f"lengths must hold integers, got dtype {host.dtype}")
    if host.min() < 1:
        raise ValueError(f"lengths must be positive, got {host}")
    ends = np.cumsum(host, dtype=np.int64)
    if ends[-1] != n:
        raise ValueError(f"lengths array {host} doesn't sum to {n} samples")
    n_seq, max_len = len(host), int(host.max())
    starts = np.concatenate([[0], ends])
    if (host == max_len).all():
        return _Sequences(n_seq, max_len, None, None, starts)
    index = np.arange(n) - np.repeat(starts[:-1], host) + np.repeat(np.arange(n_seq) * max_len, host)
    return _Sequences(n_seq, max_len, xp.asarray(host.astype(np.int64)), xp.asarray(index), starts)


class _BaseHMM:
    """What the two estimators share: parameters, validation, the batched E-step, decoding."""

    startprob_: Any
    transmat_: Any

    def __init__(self, n_components: int, startprob_prior: Any, transmat_prior: Any, algorithm: str,
                 random_state: Any, n_iter: int, tol: float, verbose: bool, params: str, init_params: str,
                 implementation: str) -> None:
        self.n_components = n_components
        self.startprob_prior = startprob_prior
        self.transmat_prior = transmat_prior
        self.algorithm = algorithm
        self.random_state = random_state
        self.n_iter = n_iter
        self.tol = tol
        self.verbose = verbose
        self.params = params
        self.init_params = init_params
        self.implementation = implementation
        self.monitor_ = ConvergenceMonitor(tol, n_iter, verbose)

    # scikit-learn's estimator protocol

    @classmethod
    def _param_names(cls) -> list[str]:
        return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor parameters, by name (scikit-learn's ``get_params``)."""
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params: Any) -> _BaseHMM:
        """Set constructor parameters by name (scikit-learn's ``set_params``); returns ``self``."""
        valid = self._param_names()
        for name, value in params.items():
            if name not in valid:
                raise ValueError(f"Invalid parameter {name!r} for estimator {type(self).__name__}. "
                                 f"Valid parameters are: {sorted(valid)}.")
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        defaults = {p.name: p.default for p in inspect.signature(type(self).__init__).parameters.values()}
        changed = [f"{k}={v!r}" for k, v in self.get_params().items()
                   if not (isinstance(v, type(defaults[k])) and np.array_equal(v, defaults[k]))]
        return f"{type(self).__name__}({', '.join(changed)})"

    # Validation

    def _data(self, X: Any) -> tuple[_backend.Backend, Array]:
        """``X`` checked as scikit-learn's ``check_array`` does, and its backend."""
        if not hasattr(X, "dtype"):  # a list, as scikit-learn takes
            X = np.asarray(X)
        backend = _backend.backend_of(X, caller=f"spchain.hmm.{type(self).__name__}")
        X = backend.xp.asarray(X)
        if X.ndim != 2:
            raise ValueError(f"Expected 2D array, got {X.ndim}D array instead: reshape your data with "
                             "X.reshape(-1, 1) if it has a single feature")
        if not X.shape[0]:
            raise ValueError(f"Found array with 0 sample(s) (shape={X.shape}) while a minimum of 1 is required")
        if X.dtype.kind not in "biuf":
            raise TypeError(f"X must hold numbers, got dtype {X.dtype}")
        if X.dtype.kind == "f" and not bool(backend.xp.isfinite(X).all()):
            raise ValueError("Input X contains NaN or infinity")
        return backend, X

    def _check_sum_1(self, backend: _backend.Backend, name: str) -> None:
        """``ValueError`` unless ``name`` holds non-negative entries that sum to 1 along its
        last axis (hmmlearn's ``_check_sum_1``)."""
        a = getattr(self, name)
        sparse = _sparse_chain.is_sparse(a)
        sums = backend.to_host(backend.xp.asarray(a.sum(axis=a.ndim - 1))).ravel()
        if bool(((a.data if sparse else a) < 0).any()) or not np.allclose(sums, 1):
            raise ValueError(f"{name} must sum to 1 (got {float(sums[0]):.4f})" if a.ndim == 1 else
                             f"{name} rows must sum to 1 and be non-negative (got row sums of {sums})")

    def _check(self, backend: _backend.Backend) -> None:
        """hmmlearn's ``_check``: the parameters' shapes and sums (``ValueError``), moved to
        ``backend`` as float64 arrays (``transmat_`` a CSR matrix where it is sparse)."""
        for name in ("startprob_", "transmat_"):
            if not hasattr(self, name):
                raise ValueError(f"This {type(self).__name__} instance is not fitted yet: {name} is not set; "
                                 "call fit first")
        if self.implementation not in ("log", "scaling"):
            raise ValueError(f"implementation must be 'log' or 'scaling', got {self.implementation!r}")
        c = self.n_components
        self.startprob_ = _to(backend, self.startprob_)
        if self.startprob_.shape != (c,):
            raise ValueError("startprob_ must have length n_components")
        self._check_sum_1(backend, "startprob_")
        self.transmat_ = _to(backend, self.transmat_)
        if self.transmat_.shape != (c, c):
            raise ValueError("transmat_ must have shape (n_components, n_components)")
        self._check_sum_1(backend, "transmat_")

    # The chain

    def _log_start_trans(self, backend: _backend.Backend) -> tuple[Array, Any]:
        """``log(startprob_)`` and ``log(transmat_)`` (a CSR matrix of the stored entries' logs
        where ``transmat_`` is sparse)."""
        xp = backend.xp
        with np.errstate(divide="ignore"):
            log_start = xp.log(self.startprob_)
            if _sparse_chain.is_sparse(self.transmat_):
                log_trans = self.transmat_.copy()
                log_trans.data = xp.log(log_trans.data)
            else:
                log_trans = xp.log(self.transmat_)
        return log_start, log_trans

    def _posteriors(self, backend: _backend.Backend, data: Any, seqs: _Sequences, transitions: bool,
                    fitting: bool = False) -> tuple[float, Array | None, Array, Any, Array | None]:
        """The E-step over all sequences at once: ``(log-likelihood, posteriors (n, c),
        first-position posteriors summed (c,), expected transition counts or None, the M-step's
        sums or None)``. Where ``fitting`` and the emissions have the form of
        :meth:`_emission_product`, the sums (``posteriors.T @ features``) come instead of the
        posteriors (None).

        A dense model on the CPU runs the scaled (probability-space) sweeps, and the log-space
        chain for the sequences where those could lose precision; otherwise the log-space chain
        runs (:meth:`_posteriors_log`)."""
        if backend.on_gpu or _sparse_chain.is_sparse(self.transmat_):
            return *self._posteriors_log(backend, self._log_likelihood(backend, data), seqs, transitions), None
        product = self._emission_product(backend, data)
        x, weights = product if product is not None else (self._log_likelihood(backend, data), None)
        sums = fitting and product is not None
        log_prob, posteriors, start, counts, totals = _chain_scaled.hmm_posteriors(
            backend, x, weights, seqs.starts, self.startprob_, self.transmat_, transitions, sums, not sums)
        redo = np.flatnonzero(np.isnan(log_prob))
        total = float(np.delete(log_prob, redo).sum())
        if redo.size:
            starts = seqs.starts
            index = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in redo])
            frame = x[index] if product is None else self._log_likelihood(backend, data)[index]
            part, more, first, more_counts = self._posteriors_log(
                backend, frame, _sequences(np, index.size, starts[redo + 1] - starts[redo]), transitions)
            total += part
            start = start + first
            counts = None if counts is None else counts + more_counts
            if posteriors is not None:
                posteriors[index] = more
            if totals is not None:
                totals = totals + more.T @ x[index]
        return total, posteriors, start, counts, totals

    def _posteriors_log(self, backend: _backend.Backend, frame: Array, seqs: _Sequences,
                        transitions: bool) -> tuple[float, Array, Array, Any]:
        """:meth:`_posteriors` by the log-space chain functions."""
        xp = backend.xp
        log_start, log_trans = self._log_start_trans(backend)
        problem = prepare_chain(seqs.pad(xp, frame), log_trans, log_start, seqs.lengths,
                                caller=f"spchain.hmm.{type(self).__name__}")
        (log_prob,), saved = LOGSUMEXP.forward(problem)  # prepared once for the forward and its gradient
        assert LOGSUMEXP.backward is not None  # differentiable
        grad_x, counts, start = LOGSUMEXP.backward(problem, saved, (xp.ones(seqs.n_seq),),
                                                   (True, transitions, True)).ordered()
        return float(log_prob.sum()), seqs.unpad(grad_x), start, counts

    def _mstep_start_trans(self, backend: _backend.Backend, start: Array, counts: Any) -> None:
        """hmmlearn's M-step of ``startprob_`` and ``transmat_``: the Dirichlet priors' MAP,
        zeros kept (a zero entry is a forbidden start or move)."""
        xp = backend.xp
        if "s" in self.params:
            startprob = xp.maximum(_to(backend, self.startprob_prior) - 1 + start, 0)
            self.startprob_ = _normalize(xp, xp.where(self.startprob_ == 0, 0, startprob))
        if "t" in self.params and _sparse_chain.is_sparse(self.transmat_):
            prior = _to(backend, self.transmat_prior)
            trans = self.transmat_
            rows = _csr.row_of_entries(backend, _csr.Csr(trans.indptr, trans.indices, None, trans.shape))
            if prior.ndim:
                prior = prior[rows, trans.indices]
            data = xp.where(trans.data == 0, 0, xp.maximum(prior - 1 + counts.data, 0))
            totals = xp.zeros(self.n_components)
            _backend.scatter_add(xp, totals, rows, data)
            trans.data = data / xp.where(totals == 0, 1, totals)[rows]  # trans is _check's copy
        elif "t" in self.params:
            transmat = xp.maximum(_to(backend, self.transmat_prior) - 1 + counts, 0)
            self.transmat_ = _normalize(xp, xp.where(self.transmat_ == 0, 0, transmat), axis=1)

    # Emissions (the subclasses')

    def _prepare(self, backend: _backend.Backend, X: Array, fitting: bool) -> Any:
        """What the emission log-likelihoods and statistics of ``X`` need, computed once."""
        raise NotImplementedError

    def _log_likelihood(self, backend: _backend.Backend, data: Any) -> Array:
        """The (n, c) emission log-likelihoods."""
        raise NotImplementedError

    def _emission_product(self, backend: _backend.Backend, data: Any) -> tuple[Array, Array] | None:
        """``(features (n, k), weights (k, c))`` whose product is the emission log-likelihoods
        and whose ``posteriors.T @ features`` are the M-step's sums, where the emissions have
        that form; else None."""
        return None

    def _mstep_emissions(self, backend: _backend.Backend, data: Any, posteriors: Array | None,
                         sums: Array | None = None) -> None:
        """The M-step of the emissions, from the posteriors or, where the E-step made them
        instead, ``sums``: ``posteriors.T @ features`` of :meth:`_emission_product`."""
        raise NotImplementedError

    def _init_emissions(self, backend: _backend.Backend, X: Array) -> None:
        raise NotImplementedError

    def _emission_sampler(self, backend: _backend.Backend) -> Callable[[int, np.random.RandomState], Any]:
        """A function that draws one sample (a host array) from a state's emission."""
        raise NotImplementedError

    def _needs_init(self, code: str, name: str) -> bool:
        return code in self.init_params or not hasattr(self, name)

    # The public methods

    def fit(self, X: Any, lengths: Any = None) -> _BaseHMM:
        """Estimate the parameters by EM (Baum-Welch), all sequences in one batch per iteration.

        Parameters not in ``init_params`` that are already set are the starting point;
        the others are initialised as hmmlearn does (``random_state``).

        Parameters
        ----------
        X : array (n_samples, n_features)
            The sequences, concatenated (NumPy or CuPy).
        lengths : int array (n_sequences,), optional
            The length of each sequence; they sum to ``n_samples``.

        Returns
        -------
        self
        """
        backend, X = self._data(X)
        xp = backend.xp
        seqs = _sequences(xp, X.shape[0], lengths)
        data = self._prepare(backend, X, fitting=True)
        random_state = _random_state(self.random_state)
        if _csr.check_size(f"{type(self).__name__}.fit", "n_components", self.n_components) < 1:
            raise ValueError(f"{type(self).__name__}.fit: n_components must be at least 1, got {self.n_components}")
        uniform = np.full(self.n_components, 1.0 / self.n_components)
        if self._needs_init("s", "startprob_"):
            self.startprob_ = random_state.dirichlet(uniform)
        if self._needs_init("t", "transmat_"):
            self.transmat_ = random_state.dirichlet(uniform, size=self.n_components)
        self._init_emissions(backend, X)
        self._check(backend)
        monitor = self.monitor_
        monitor.tol, monitor.n_iter, monitor.verbose = self.tol, self.n_iter, self.verbose
        monitor._reset()
        for _ in range(self.n_iter):
            monitor.report(self._em_step(backend, data, seqs))
            if monitor.converged:
                break
        return self

    def _em_step(self, backend: _backend.Backend, data: Any, seqs: _Sequences) -> float:
        """One EM iteration; returns the E-step's log-likelihood. Its (n, c) arrays are freed
        on return, so that one iteration's never meet the next one's."""
        log_prob, posteriors, start, counts, sums = self._posteriors(backend, data, seqs, "t" in self.params,
                                                                     fitting=True)
        self._mstep_start_trans(backend, start, counts)
        self._mstep_emissions(backend, data, posteriors, sums)
        return log_prob

    def _score(self, X: Any, lengths: Any) -> tuple[float, Array]:
        backend, X = self._data(X)
        self._check(backend)
        seqs = _sequences(backend.xp, X.shape[0], lengths)
        log_prob, posteriors, _, _, _ = self._posteriors(backend, self._prepare(backend, X, fitting=False), seqs,
                                                         False)
        assert posteriors is not None  # not fitting
        return log_prob, posteriors

    def score_samples(self, X: Any, lengths: Any = None) -> tuple[float, Array]:
        """The log-likelihood of ``X`` and the posterior state probabilities of each sample.

        Returns
        -------
        log_prob : float
        posteriors : array (n_samples, n_components)
        """
        return self._score(X, lengths)

    def score(self, X: Any, lengths: Any = None) -> float:
        """The log-likelihood of ``X`` (summed over its sequences)."""
        return self._score(X, lengths)[0]

    def predict_proba(self, X: Any, lengths: Any = None) -> Array:
        """The posterior state probabilities of each sample, (n_samples, n_components); zeros
        for the samples of a sequence that no state path can produce (hmmlearn gives NaN)."""
        return self._score(X, lengths)[1]

    def decode(self, X: Any, lengths: Any = None, algorithm: str | None = None) -> tuple[float, Array]:
        """The most likely states: ``(log_prob, states (n_samples,))``.

        ``algorithm="viterbi"`` gives the best state sequence and its log-probability;
        ``"map"`` each sample's most probable state and, as hmmlearn does, the sum of those
        posterior probabilities. The default is the ``algorithm`` parameter. With ``"viterbi"``
        a sequence that no state path can produce (log-probability ``-inf``) gets state ``-1``
        at every sample, as :func:`spchain.viterbi` gives (hmmlearn returns an arbitrary path):
        check for it before indexing parameters with the states.
        """
        algorithm = algorithm or self.algorithm
        if algorithm not in DECODER_ALGORITHMS:
            raise ValueError(f"Unknown decoder {algorithm!r}")
        if algorithm == "map":
            _, posteriors = self._score(X, lengths)
            return float(posteriors.max(axis=1).sum()), posteriors.argmax(axis=1)
        backend, X = self._data(X)
        self._check(backend)
        seqs = _sequences(backend.xp, X.shape[0], lengths)
        frame = self._log_likelihood(backend, self._prepare(backend, X, fitting=False))
        log_start, log_trans = self._log_start_trans(backend)
        score, path = viterbi_forward(seqs.pad(backend.xp, frame), log_trans, log_start, seqs.lengths,
                                      caller=f"spchain.hmm.{type(self).__name__}.decode")
        return float(score.sum()), seqs.unpad(path[..., None])[:, 0]

    def predict(self, X: Any, lengths: Any = None) -> Array:
        """The most likely state of each sample (by ``algorithm``), (n_samples,); ``-1`` for
        the samples of an impossible sequence under ``"viterbi"`` (see :meth:`decode`)."""
        return self.decode(X, lengths)[1]

    def sample(self, n_samples: int = 1, random_state: Any = None,
               currstate: int | None = None) -> tuple[Array, Array]:
        """Draw a sequence from the model: ``(X (n_samples, n_features), states (n_samples,))``.

        The same draws as hmmlearn's ``sample`` for the same ``random_state``; the arrays are on
        the parameters' backend.
        """
        arrays = [a for a in (getattr(self, "startprob_", None), getattr(self, "transmat_", None))
                  if hasattr(a, "dtype")]
        backend = _backend.backend_of(*arrays, caller=f"spchain.hmm.{type(self).__name__}.sample")
        self._check(backend)
        rs = _random_state(self.random_state if random_state is None else random_state)
        draw = self._emission_sampler(backend)
        successor = _successor(self.transmat_.get() if backend.on_gpu else self.transmat_)
        if currstate is None:
            currstate = int((np.cumsum(backend.to_host(self.startprob_)) > rs.rand()).argmax())
        states = [currstate]
        X = [draw(currstate, rs)]
        for _ in range(n_samples - 1):
            currstate = successor(currstate, rs.rand())
            states.append(currstate)
            X.append(draw(currstate, rs))
        return backend.xp.asarray(np.atleast_2d(X)), backend.xp.asarray(np.array(states, dtype=int))


def _successor(transmat: Any) -> Callable[[int, float], int]:
    """The next state after ``state`` for a uniform draw ``u``: hmmlearn's inverse-CDF rule, on
    the stored entries of a sparse (canonical CSR) ``transmat`` (host arrays)."""
    if _sparse_chain.is_sparse(transmat):
        indptr, indices, data = transmat.indptr, transmat.indices, transmat.data

        def sparse(state: int, u: float) -> int:
            row = slice(indptr[state], indptr[state + 1])
            return int(indices[row][(np.cumsum(data[row]) > u).argmax()])
        return sparse
    cdf = np.cumsum(transmat, axis=1)
    return lambda state, u: int((cdf[state] > u).argmax())


class CategoricalHMM(_BaseHMM):
    """Hidden Markov model with categorical (discrete) emissions: hmmlearn's ``CategoricalHMM``.

    ``X`` holds one symbol (a non-negative integer) per sample, shape ``(n_samples, 1)``.
    The parameters, attributes and methods are hmmlearn 0.3's; ``implementation`` is
    accepted for compatibility (both of hmmlearn's give the same results as spchain's one).

    Attributes
    ----------
    n_features : int
        The number of symbols.
    startprob_ : array (n_components,)
    transmat_ : array (n_components, n_components), or a sparse matrix
        The transition probabilities; a SciPy / cupyx sparse matrix stores the allowed moves.
    emissionprob_ : array (n_components, n_features)
    monitor_ : ConvergenceMonitor

    Examples
    --------
    >>> import numpy as np
    >>> from spchain.hmm import CategoricalHMM
    >>> X = np.array([[0], [0], [1], [1], [1], [0], [2], [2]])
    >>> model = CategoricalHMM(n_components=2, random_state=0, n_iter=20).fit(X, lengths=[5, 3])
    >>> model.emissionprob_.shape
    (2, 3)
    """

    emissionprob_: Any

    def __init__(self, n_components: int = 1, startprob_prior: Any = 1.0, transmat_prior: Any = 1.0, *,
                 emissionprob_prior: Any = 1.0, n_features: int | None = None, algorithm: str = "viterbi",
                 random_state: Any = None, n_iter: int = 10, tol: float = 1e-2, verbose: bool = False,
                 params: str = "ste", init_params: str = "ste", implementation: str = "log") -> None:
        super().__init__(n_components, startprob_prior, transmat_prior, algorithm, random_state, n_iter, tol,
                         verbose, params, init_params, implementation)
        self.emissionprob_prior = emissionprob_prior
        self.n_features = n_features

    def _prepare(self, backend: _backend.Backend, X: Array, fitting: bool) -> Any:
        if X.dtype.kind not in "iu":
            raise ValueError("Symbols should be integers")
        if X.shape[1] != 1:
            raise ValueError(f"CategoricalHMM takes X of shape (n_samples, 1), got {X.shape}")
        symbols = X[:, 0].astype(np.int64)
        if int(symbols.min()) < 0:
            raise ValueError("Symbols should be nonnegative")
        largest = int(symbols.max())
        if fitting and self.n_features is None:
            self.n_features = largest + 1
        elif self.n_features is not None and self.n_features - 1 < largest:
            raise ValueError(f"Largest symbol is {largest} but the model only emits symbols up to "
                             f"{self.n_features - 1}")
        return symbols

    def _init_emissions(self, backend: _backend.Backend, X: Array) -> None:
        if self._needs_init("e", "emissionprob_"):
            assert self.n_features is not None  # set from X by _prepare
            emissionprob = _random_state(self.random_state).rand(self.n_components, self.n_features)
            self.emissionprob_ = emissionprob / emissionprob.sum(axis=1, keepdims=True)

    def _check(self, backend: _backend.Backend) -> None:
        super()._check(backend)
        if not hasattr(self, "emissionprob_"):
            raise ValueError("emissionprob_ is not set; call fit first")
        self.emissionprob_ = backend.xp.atleast_2d(_to(backend, self.emissionprob_))
        if self.n_features is None:
            self.n_features = int(self.emissionprob_.shape[1])
        if self.emissionprob_.shape != (self.n_components, self.n_features):
            raise ValueError(f"emissionprob_ must have shape ({self.n_components}, {self.n_features})")
        self._check_sum_1(backend, "emissionprob_")

    def _log_likelihood(self, backend: _backend.Backend, data: Any) -> Array:
        with np.errstate(divide="ignore"):
            return backend.xp.log(self.emissionprob_).T[data]

    def _mstep_emissions(self, backend: _backend.Backend, data: Any, posteriors: Array | None,
                         sums: Array | None = None) -> None:
        if "e" not in self.params:
            return
        xp = backend.xp
        assert posteriors is not None  # categorical emissions have no product form: the E-step keeps them
        n = data.shape[0]
        indicator = backend.sparse.coo_matrix((xp.ones(n), (data, xp.arange(n))), shape=(self.n_features, n))
        counts = (indicator @ posteriors).T
        emissionprob = xp.maximum(_to(backend, self.emissionprob_prior) - 1 + counts, 0)
        self.emissionprob_ = _normalize(xp, emissionprob, axis=1)

    def _emission_sampler(self, backend: _backend.Backend) -> Callable[[int, np.random.RandomState], Any]:
        cdf = np.cumsum(backend.to_host(self.emissionprob_), axis=1)

        def draw(state: int, random_state: np.random.RandomState) -> Any:
            return [(cdf[state] > random_state.rand()).argmax()]
        return draw


@dataclass
class _Gaussian:
    """The data of a Gaussian HMM, laid out once: ``X`` shifted by its mean (better conditioned
    sums), and for diagonal covariances ``[X, X**2, 1]``, whose product with the posteriors is
    every M-step sum (one GEMM) and with the parameters every log-likelihood (one GEMM)."""

    shift: Array  # (f,)
    centered: Array  # (n, f)
    features: Array | None  # (n, 2f + 1) [x, x**2, 1] for spherical and diag


class GaussianHMM(_BaseHMM):
    """Hidden Markov model with Gaussian emissions: hmmlearn's ``GaussianHMM``.

    The parameters, attributes and methods are hmmlearn 0.3's, with ``covariance_type`` in
    ``"spherical"``, ``"diag"``, ``"full"``, ``"tied"``; ``implementation`` is accepted for
    compatibility. Two differences, where hmmlearn gives NaN: a state with no posterior
    mass keeps its means (and its covariance where the update would divide by zero), and the
    means' sums are gathered for ``"c"`` alone too (hmmlearn gathers them only for ``"m"``).

    Attributes
    ----------
    n_features : int
    startprob_ : array (n_components,)
    transmat_ : array (n_components, n_components), or a sparse matrix
    means_ : array (n_components, n_features)
    covars_ : array (n_components, n_features, n_features)
        The covariance matrices. Set it in the shape of ``covariance_type``: (n_components,)
        for spherical, (n_components, n_features) for diag, (n_components, n_features,
        n_features) for full, (n_features, n_features) for tied.
    monitor_ : ConvergenceMonitor

    Examples
    --------
    >>> import numpy as np
    >>> from spchain.hmm import GaussianHMM
    >>> model = GaussianHMM(n_components=2, init_params="")
    >>> model.startprob_ = np.array([0.5, 0.5])
    >>> model.transmat_ = np.array([[0.9, 0.1], [0.1, 0.9]])
    >>> model.means_ = np.array([[0.0], [5.0]])
    >>> model.covars_ = np.array([[1.0], [1.0]])
    >>> model.predict(np.array([[0.1], [-0.3], [5.2], [4.9]]))
    array([0, 0, 1, 1])
    """

    means_: Any
    _covars_: Any

    def __init__(self, n_components: int = 1, covariance_type: str = "diag", min_covar: float = 1e-3,
                 startprob_prior: Any = 1.0, transmat_prior: Any = 1.0, means_prior: Any = 0,
                 means_weight: Any = 0, covars_prior: Any = 1e-2, covars_weight: Any = 1,
                 algorithm: str = "viterbi", random_state: Any = None, n_iter: int = 10, tol: float = 1e-2,
                 verbose: bool = False, params: str = "stmc", init_params: str = "stmc",
                 implementation: str = "log") -> None:
        super().__init__(n_components, startprob_prior, transmat_prior, algorithm, random_state, n_iter, tol,
                         verbose, params, init_params, implementation)
        self.covariance_type = covariance_type
        self.min_covar = min_covar
        self.means_prior = means_prior
        self.means_weight = means_weight
        self.covars_prior = covars_prior
        self.covars_weight = covars_weight

    @property
    def covars_(self) -> Array:
        """The covariance matrices, (n_components, n_features, n_features)."""
        xp = _backend.backend_of(self._covars_).xp
        c, cov = self.n_components, self._covars_
        f = self.means_.shape[1]
        if self.covariance_type == "full":
            return cov
        if self.covariance_type == "tied":
            return xp.broadcast_to(cov, (c, f, f)).copy()
        diag = cov[:, None] * xp.ones(f) if self.covariance_type == "spherical" else cov
        return diag[:, :, None] * xp.eye(f)

    @covars_.setter
    def covars_(self, covars: Any) -> None:
        backend = _backend.backend_of(covars) if hasattr(covars, "dtype") else _backend.NUMPY
        covars = _to(backend, covars).copy()
        _validate_covars(backend.to_host(covars), self.covariance_type, self.n_components)
        self._covars_ = covars

    def _prepare(self, backend: _backend.Backend, X: Array, fitting: bool) -> Any:
        xp = backend.xp
        f = X.shape[1]
        expected = getattr(self, "n_features", None) if fitting else self.means_.shape[1]
        if expected is not None and expected != f:
            raise ValueError(f"Unexpected number of dimensions, got {f} but expected {expected}")
        self.n_features = f
        X = X.astype(np.float64, copy=False)
        shift = X.mean(axis=0)
        centered = X - shift
        diagonal = self.covariance_type in ("spherical", "diag")
        features = xp.concatenate([centered, centered**2, xp.ones((X.shape[0], 1))], axis=1) if diagonal else None
        return _Gaussian(shift, centered, features)

    def _init_emissions(self, backend: _backend.Backend, X: Array) -> None:
        xp = backend.xp
        X = X.astype(np.float64, copy=False)
        if self._needs_init("m", "means_"):
            self.means_ = _kmeans(xp, X, self.n_components, _random_state(self.random_state))
        if self._needs_init("c", "covars_"):
            f = X.shape[1]
            cv = xp.cov(X.T).reshape(f, f) + self.min_covar * xp.eye(f)
            c = self.n_components
            self.covars_ = {"spherical": xp.full(c, cv.mean()), "tied": cv,
                            "diag": xp.tile(xp.diag(cv), (c, 1)), "full": xp.tile(cv, (c, 1, 1))
                            }.get(self.covariance_type, cv)

    def _check(self, backend: _backend.Backend) -> None:
        super()._check(backend)
        if self.covariance_type not in COVARIANCE_TYPES:
            raise ValueError(f"covariance_type must be one of {COVARIANCE_TYPES}")
        if not (hasattr(self, "means_") and hasattr(self, "_covars_")):
            raise ValueError("means_ and covars_ are not set; call fit first")
        self.means_ = _to(backend, self.means_)
        if self.means_.ndim != 2 or self.means_.shape[0] != self.n_components:
            raise ValueError(f"means_ must have shape (n_components, n_features), got {self.means_.shape}")
        self.n_features = int(self.means_.shape[1])
        self._covars_ = _to(backend, self._covars_)
        f, c = self.n_features, self.n_components
        shape = {"spherical": (c,), "diag": (c, f), "full": (c, f, f), "tied": (f, f)}[self.covariance_type]
        if self._covars_.shape != shape:
            raise ValueError(f"{self.covariance_type!r} covars must have shape {shape}, got {self._covars_.shape}")

    def _emission_product(self, backend: _backend.Backend, data: Any) -> tuple[Array, Array] | None:
        """For diagonal covariances, ``[x, x**2, 1]`` and the weights whose product with them is
        the log-likelihoods."""
        if data.features is None:
            return None
        xp = backend.xp
        f = self.n_features
        means = self.means_ - data.shift
        cov = self._covars_[:, None] * xp.ones(f) if self.covariance_type == "spherical" else self._covars_
        var = xp.maximum(cov, np.finfo(float).tiny)
        precision = 1 / var
        offset = f * np.log(2 * np.pi) + xp.log(var).sum(axis=1) + (means**2 * precision).sum(axis=1)
        weights = xp.concatenate([means * precision, -0.5 * precision, -0.5 * offset[:, None]], axis=1)
        return data.features, weights.T

    def _log_likelihood(self, backend: _backend.Backend, data: Any) -> Array:
        xp = backend.xp
        product = self._emission_product(backend, data)
        if product is not None:
            return _backend.matmul(xp, *product)
        f = self.n_features
        means = self.means_ - data.shift
        const = f * np.log(2 * np.pi)
        chol = _cholesky(xp, self._covars_)
        log_det = 2 * xp.log(xp.diagonal(chol, axis1=-2, axis2=-1)).sum(axis=-1)
        inverse = xp.linalg.inv(chol)
        X = data.centered
        if self.covariance_type == "tied":
            precision = inverse.T @ inverse
            quadratic = (_backend.matmul(xp, X, precision) * X).sum(axis=1)
            cross = _backend.matmul(xp, X, precision @ means.T)
            return -0.5 * (quadratic[:, None] - 2 * cross + ((means @ precision) * means).sum(axis=1)
                           + const + log_det)
        out = xp.empty((X.shape[0], self.n_components))
        for k in range(self.n_components):
            y = _backend.matmul(xp, X - means[k], inverse[k].T)
            out[:, k] = (y * y).sum(axis=1)
        return -0.5 * (out + const + log_det)

    def _mstep_emissions(self, backend: _backend.Backend, data: Any, posteriors: Array | None,
                         sums: Array | None = None) -> None:
        need_means, need_covars = "m" in self.params, "c" in self.params
        if not (need_means or need_covars):
            return
        xp = backend.xp
        f = self.n_features
        X = data.centered
        if sums is None:
            assert posteriors is not None  # the E-step gives one of them
            sums = _backend.matmul(xp, posteriors.T, X if data.features is None else data.features)
        if data.features is not None:
            totals = sums[:, -1]
        else:
            assert posteriors is not None  # full and tied covariances: the E-step keeps them
            totals = posteriors.sum(axis=0)
        prior = _to(backend, self.means_prior) - data.shift
        weight = _to(backend, self.means_weight)
        means = self.means_ - data.shift
        if need_means:
            denom = weight + totals[:, None]
            fresh = (weight * prior + sums[:, :f]) / xp.where(denom == 0, 1, denom)
            means = xp.where(denom == 0, means, fresh)
            self.means_ = means + data.shift
        if not need_covars:
            return
        covars_prior = _to(backend, self.covars_prior)
        covars_weight = _to(backend, self.covars_weight)
        diff = means - prior
        if data.features is not None:
            c_n = weight * diff**2 + sums[:, f:2 * f] - 2 * means * sums[:, :f] + means**2 * totals[:, None]
            c_d = xp.maximum(covars_weight - 1, 0) + totals[:, None]
            covars = (covars_prior + c_n) / xp.maximum(c_d, 1e-5)
            self._covars_ = covars.mean(axis=1) if self.covariance_type == "spherical" else covars
            return
        assert posteriors is not None  # full and tied covariances: the E-step keeps them
        cvweight = xp.maximum(covars_weight - f, 0)
        if self.covariance_type == "tied":
            second = _backend.matmul(xp, X.T, posteriors.sum(axis=1)[:, None] * X)
            cross = sums.T @ means
            c_n = weight * diff.T @ diff + second - cross - cross.T + (means * totals[:, None]).T @ means
            self._covars_ = (covars_prior + c_n) / (cvweight + totals.sum())
            return
        second = xp.stack([_backend.matmul(xp, X.T, posteriors[:, k, None] * X) for k in range(self.n_components)])
        c_n = (weight * diff[:, :, None] * diff[:, None, :] + second - sums[:, :, None] * means[:, None, :]
               - means[:, :, None] * sums[:, None, :] + means[:, :, None] * means[:, None, :] * totals[:, None, None])
        denom = cvweight + totals[:, None, None]
        fresh = (covars_prior + c_n) / xp.where(denom == 0, 1, denom)
        self._covars_ = xp.where(denom == 0, self._covars_, fresh)

    def _emission_sampler(self, backend: _backend.Backend) -> Callable[[int, np.random.RandomState], Any]:
        means, covars = backend.to_host(self.means_), backend.to_host(self.covars_)

        def draw(state: int, random_state: np.random.RandomState) -> Any:
            return random_state.multivariate_normal(means[state], covars[state])
        return draw


def _cholesky(xp: Any, covars: Array) -> Array:
    """The Cholesky factors of ``covars`` (..., f, f); ``ValueError`` where one is not
    positive-definite."""
    try:
        chol = xp.linalg.cholesky(covars)
    except np.linalg.LinAlgError:
        raise ValueError("'covars' must be symmetric, positive-definite") from None
    return chol


def _kmeans(xp: Any, X: Array, k: int, random_state: np.random.RandomState, n_init: int = 10,
            n_iter: int = 300) -> Array:
    """k-means cluster centres of ``X``: the starting means of a Gaussian HMM, as hmmlearn takes
    scikit-learn's ``KMeans`` (k-means++ seeds, Lloyd's iterations, the best of ``n_init``)."""
    n = X.shape[0]
    if n < k:
        raise ValueError(f"n_samples={n} should be >= n_clusters={k}")
    squares = (X**2).sum(axis=1)
    best, best_inertia = X[:k], np.inf
    for _ in range(n_init):
        centers = _kmeans_seeds(xp, X, squares, k, random_state)
        for _ in range(n_iter):
            distances = squares[:, None] - 2 * _backend.matmul(xp, X, centers.T) + (centers**2).sum(axis=1)
            member = (distances.argmin(axis=1)[:, None] == xp.arange(k)).astype(X.dtype)
            counts = member.sum(axis=0)[:, None]
            fresh = xp.where(counts > 0, _backend.matmul(xp, member.T, X) / xp.maximum(counts, 1), centers)
            if bool((fresh == centers).all()):
                break
            centers = fresh
        inertia = float(distances.min(axis=1).sum())
        if inertia < best_inertia:
            best, best_inertia = centers, inertia
    return best


def _kmeans_seeds(xp: Any, X: Array, squares: Array, k: int, random_state: np.random.RandomState) -> Array:
    """k-means++ seeds: each next one a sample drawn with probability ∝ its squared distance
    to the nearest seed so far."""
    n = X.shape[0]
    chosen = [int(random_state.randint(n))]
    closest = xp.maximum(squares - 2 * (X @ X[chosen[0]]) + squares[chosen[0]], 0)
    for _ in range(1, k):
        weights = np.asarray(closest.get() if hasattr(closest, "get") else closest, dtype=np.float64)
        total = weights.sum()
        chosen.append(int(random_state.choice(n, p=weights / total) if total > 0 else random_state.randint(n)))
        closest = xp.minimum(closest, xp.maximum(squares - 2 * (X @ X[chosen[-1]]) + squares[chosen[-1]], 0))
    return X[xp.asarray(chosen)]


def _validate_covars(covars: Any, covariance_type: str, n_components: int) -> None:
    """hmmlearn's checks of covariances set in the shape of ``covariance_type`` (``ValueError``)."""
    if covariance_type == "spherical":
        if covars.shape != (n_components,):
            raise ValueError("'spherical' covars have length n_components")
        if np.any(covars <= 0):
            raise ValueError("'spherical' covars must be positive")
    elif covariance_type == "diag":
        if covars.ndim != 2 or covars.shape[0] != n_components:
            raise ValueError("'diag' covars must have shape (n_components, n_dim)")
        if np.any(covars <= 0):
            raise ValueError("'diag' covars must be positive")
    elif covariance_type in ("full", "tied"):
        matrices = covars if covariance_type == "full" else covars[None]
        if matrices.ndim != 3 or matrices.shape[1] != matrices.shape[2] or (
                covariance_type == "full" and matrices.shape[0] != n_components):
            shape = "(n_components, n_dim, n_dim)" if covariance_type == "full" else "(n_dim, n_dim)"
            raise ValueError(f"{covariance_type!r} covars must have shape {shape}")
        symmetric = np.allclose(matrices, matrices.transpose(0, 2, 1))
        if not symmetric or np.any(np.linalg.eigvalsh(matrices) <= 0):
            raise ValueError(f"{covariance_type!r} covars must be symmetric, positive-definite")
    else:
        raise ValueError(f"covariance_type must be one of {sorted(COVARIANCE_TYPES)}")
