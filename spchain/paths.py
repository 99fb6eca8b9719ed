"""Paths of log-space chains: posterior samples, entropy, the k best paths and path scores.

All take the chain arguments of :func:`spchain.chain_logsumexp` (``x`` (..., v, c),
``log_trans``, ``log_init``, ``lengths``; leading axes broadcast) and return paths as int64
arrays with -1 past each chain's length. A path's score is
``init[s0] + x[0, s0] + sum_{t < length - 1} (log_trans[t][s_t, s_{t+1}] + x[t+1, s_{t+1}])``.

- :func:`chain_sample`: forward filtering (the saved, normalised forward messages of
  :func:`spchain.chain_logsumexp`), then backward sampling, one O(c) draw per position.
- :func:`chain_entropy`: ``H = log Z - E[score]``, the expected score carried forward in the
  expectation semiring (``_entropy.py`` also holds its gradient, an exact Hessian-vector product).
- :func:`chain_kbest`: k-best Viterbi, every state keeping its k best partial paths.
- :func:`chain_path_score`: gathers the scores along given paths.

A sparse ``log_trans`` (SciPy CSR, CSC or COO) runs on its stored entries on the CPU:
O(batch · v · (c + nnz)) time and O(batch · v · c + nnz) memory, never a (c, c) matrix (the
path scores look each step up in the CSR structure). ``+inf`` inputs follow the limit rule of
the chain functions: the limit as the ``+inf`` terms grow together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _chain_limits, _checks, _entropy, _sparse_chain
from ._op import Op, Saved
from .chain import ChainGrads, ChainProblem, _input_grads, _viterbi_grads, prepare_chain
from ._chain_layout import Chain
from ._chain_limits import forward as _forward
from ._dask import scales_out
from ._logspace import normalised as _normalised
from ._typing import Array, Shape, Sparse
from .kernels import cpu, cuda



def _prepare(x: Any, log_trans: Any, log_init: Any, lengths: Any, caller: str, check: bool = True) -> ChainProblem:
    """:func:`spchain.chain.prepare_chain`; sparse transitions stay sparse on the CPU (the path
    functions run on their stored entries) and become a dense matrix on the GPU (O(c²) memory;
    :func:`chain_kbest` keeps them sparse there too)."""
    problem = prepare_chain(x, log_trans, log_init, lengths, caller=caller, check=check)
    if not problem.chain.backend.on_gpu:
        return problem
    return dataclasses.replace(problem, chain=_sparse_chain.densified(problem.chain))


def _limit(chain: Chain) -> Chain:
    """``chain`` itself where no input holds ``+inf``; else the chain in float64 with ``+inf``
    as ``_chain_limits.LIMIT``, whose posterior is the limit one as the ``+inf`` terms grow
    together (the paths through the most ``+inf`` terms, weighed by their finite terms), as
    for the gradients of the chain functions."""
    return _chain_limits.limited(chain) if chain.has_plus_inf else chain


def _count(caller: str, name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{caller}: {name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{caller}: {name} must be >= {low}, got {value}")
    return int(value)


def _leading(chain: Chain, a: Array) -> Array:
    """(B, N, *tail) in row order → (N, *batch, *tail)."""
    xp = chain.xp
    out = chain.unrows(a)
    return xp.ascontiguousarray(xp.moveaxis(out, len(chain.batch_shape), 0))


def _scaled_exp(xp: ModuleType, a: Array) -> Array:
    """``exp(a - max(a))`` over the last axis in float64, 0 below ``rules.FLUSH`` and where the
    maximum is not finite (the scaled weights of the sampling kernels, ``spchain/kernels/rules.py``)."""
    from .kernels.rules import FLUSH

    a = a.astype(np.float64)
    if not a.shape[-1]:  # no states (c = 0): no weights
        return a
    top = a.max(axis=-1, keepdims=True)
    e = xp.exp(a - xp.where(xp.isfinite(top), top, 0))
    return xp.where(xp.isfinite(top) & (e >= FLUSH), e, 0)


def _draw_totals(chain: Chain, probs: Array, trans_probs: Array) -> Array:
    """``totals[b, t, j] = sum_i probs[b, t, i] * trans_probs[g, s, j, i]`` (B, v - 1, c):
    one batched GEMM per step (BLAS / cuBLAS)."""
    xp = chain.xp
    rows, v, c = probs.shape
    groups = chain.trans.shape[0]
    by_step = probs.reshape(groups, chain.group, v, c)[:, :, :v - 1].transpose(0, 2, 1, 3)  # (G, v-1, group, c)
    by_column = xp.ascontiguousarray(trans_probs.swapaxes(-1, -2))
    totals = xp.matmul(xp.ascontiguousarray(by_step), by_column)  # (G, v-1, group, c)
    return xp.ascontiguousarray(totals.transpose(0, 2, 1, 3)).reshape(rows, v - 1, c)


def _sample(chain: Chain, num_samples: int, seed: int | None) -> Array:
    """``(num_samples, B, v)`` paths drawn from each row's posterior."""
    from .kernels.rules import TINY

    xp = chain.xp
    rows, v, c = chain.x.shape
    log_partition, pre, norm = _forward(chain)
    alpha = xp.ascontiguousarray(_normalised(xp, pre, chain.x, norm))
    uniforms = xp.random.default_rng(seed).random((num_samples, rows, v))
    paths = xp.empty((num_samples, rows, v), np.int64)
    possible = xp.isfinite(log_partition) & (c > 0)  # NaN where a chain reads a NaN, off every path too
    if num_samples and rows and chain.sparse is not None:
        s = chain.sparse
        t_values = _sparse_chain.transposed_values(chain)
        cpu.team.run(cpu.paths.sparse_chain_sample,
                     alpha, s.t_indptr, s.t_rows, t_values, chain.lengths, possible, uniforms, paths)
    elif num_samples and rows:
        trans_t = xp.ascontiguousarray(chain.trans.swapaxes(-1, -2))
        probs, trans_probs = _scaled_exp(xp, alpha), _scaled_exp(xp, trans_t)
        args = (alpha, probs, trans_t, trans_probs, _draw_totals(chain, probs, trans_probs), TINY,
                chain.group, chain.lengths, possible, uniforms, paths)
        if chain.backend.on_gpu:
            chain.backend.launcher(cuda.paths.launch_chain_sample)(*args)
        else:
            cpu.team.run(cpu.paths.chain_sample, *args)
    return paths


@scales_out
def chain_sample(x: ArrayLike, log_trans: ArrayLike | Sparse, log_init: ArrayLike | None = None, *,
                 lengths: ArrayLike | None = None, num_samples: int = 1, seed: int | None = None) -> Array:
    """Paths drawn exactly from each chain's posterior ``p(path) = exp(score(path) - log Z)``.

    Forward filtering, backward sampling: the forward messages of :func:`chain_logsumexp`,
    then from the last position backwards one draw over ``c`` states per position.
    O(batch · v · c²) for the messages plus O(num_samples · batch · v · c).

    Parameters
    ----------
    x, log_trans, log_init, lengths
        As for :func:`spchain.chain_logsumexp`.
    num_samples : int
        Paths to draw per chain.
    seed : int or None
        Seeds the generator of the uniforms (NumPy's or CuPy's ``default_rng``).

    Returns
    -------
    int64 array (num_samples, *batch, v)
        The states; -1 past each chain's length, and -1 everywhere on a chain with no path
        of positive weight or a NaN input. Where ``+inf`` inputs make the log-partition
        ``+inf``, the paths are drawn from the limit of the posterior as the ``+inf`` terms
        grow together: among the paths through the most ``+inf`` terms, by their finite terms.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> stay = np.array([[0.0, -np.inf], [-np.inf, 0.0]])   # the state never changes
    >>> sc.chain_sample(np.zeros((3, 2)), stay, num_samples=4, seed=0)[:, 1:] == \\
    ...     sc.chain_sample(np.zeros((3, 2)), stay, num_samples=4, seed=0)[:, :-1]
    array([[ True,  True],
           [ True,  True],
           [ True,  True],
           [ True,  True]])
    """
    (paths,), _ = SAMPLE.forward(prepare_sample(x, log_trans, log_init, lengths, num_samples, seed))
    return paths


@dataclasses.dataclass(frozen=True)
class SampleProblem:
    """:func:`chain_sample`'s arguments validated and laid out."""

    chain: Chain
    num_samples: int
    seed: int | None


def prepare_sample(x: Any, log_trans: Any, log_init: Any = None, lengths: Any = None, num_samples: Any = 1,
                   seed: int | None = None, *, caller: str = "spchain.chain_sample",
                   check: bool = True) -> SampleProblem:
    """The :class:`SampleProblem` of :func:`chain_sample`'s arguments."""
    num_samples = _count(caller, "num_samples", num_samples, 0)
    return SampleProblem(_prepare(x, log_trans, log_init, lengths, caller, check).chain, num_samples, seed)


def _sample_forward(p: SampleProblem) -> tuple[tuple[Array], Saved]:
    chain = p.chain
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), chain.backend.use():
        return (_leading(chain, _sample(_limit(chain), p.num_samples, p.seed).transpose(1, 0, 2)),), Saved()


SAMPLE: Op[SampleProblem, Saved] = Op(prepare_sample, _sample_forward, Saved)
""":func:`chain_sample` as an :class:`~spchain._op.Op`: outputs ``(paths,)``, not differentiable."""


@scales_out
def chain_entropy(x: ArrayLike, log_trans: ArrayLike | Sparse, log_init: ArrayLike | None = None, *,
                  lengths: ArrayLike | None = None) -> Array:
    """The entropy of each chain's posterior over paths, ``log Z - E[score]`` (in nats).

    The expected score is carried forward beside the forward messages (the expectation
    semiring): O(batch · v · c²) time, O(batch · v · c) memory. Terms ``0 · -inf`` (a
    transition or state of weight zero, never taken) count 0.

    Takes the arguments of :func:`spchain.chain_logsumexp`; returns an array of the broadcast
    batch shape, 0 where a chain has no path of positive weight. Where ``+inf`` inputs make
    the log-partition ``+inf``, the entropy (and its gradient) is its limit as the ``+inf``
    terms grow together: that of the posterior over the paths through the most ``+inf`` terms.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> round(float(sc.chain_entropy(np.zeros((3, 2)), np.zeros((2, 2))) / np.log(2)), 6)   # 8 equal paths
    3.0
    """
    (entropy,), _ = ENTROPY.forward(prepare_entropy(x, log_trans, log_init, lengths))
    return entropy


@dataclasses.dataclass(frozen=True)
class Expectations(Saved):
    """What the entropy's backward reads (the entropy's batch shape leading): the forward
    messages before each emission ``pre`` (v, c), their log normalisers ``norm`` (v,), the
    expected scores carried forward ``fwd`` (v, c), each chain's expected score ``mean`` and
    whether it has a path ``possible``, and the running sums ``shift`` (v,) taken out of ``fwd``
    at each position (``mean`` and ``shift`` in float64)."""

    pre: Array
    norm: Array
    fwd: Array
    mean: Array
    possible: Array
    shift: Array


def prepare_entropy(x: Any, log_trans: Any, log_init: Any = None, lengths: Any = None, *,
                    caller: str = "spchain.chain_entropy", check: bool = True) -> ChainProblem:
    """The :class:`~spchain.chain.ChainProblem` of :func:`chain_entropy`'s arguments."""
    return _prepare(x, log_trans, log_init, lengths, caller, check)


def _entropy_forward(problem: ChainProblem) -> tuple[tuple[Array], Expectations]:
    chain = problem.chain
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), chain.backend.use():
        entropy, (pre, norm, fwd, mean, possible, shift) = _entropy.entropy(_limit(chain))
        dtype = chain.x.dtype  # the float64 limit chain's messages rounded (its backward runs it again)
        entropy, pre, norm, fwd = (chain.unrows(a.astype(dtype, copy=False)) for a in (entropy, pre, norm, fwd))
        return (entropy,), Expectations(pre, norm, fwd, *(chain.unrows(a) for a in (mean, possible, shift)))


def _entropy_backward(problem: ChainProblem, saved: Expectations, grads: Sequence[Array | None],
                      needs: Sequence[bool]) -> ChainGrads:
    """The exact Hessian-vector product ``-∇²A θ`` by the expectation-semiring backward pass.
    With ``+inf`` inputs the forward of the float64 limit chain is run again (``saved`` holds it
    rounded)."""
    chain = problem.chain
    _, v, c = chain.x.shape
    assert grads[0] is not None  # the operator gives zeros for an unused output
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), chain.backend.use():
        limit = _limit(chain)
        if limit is chain:
            rows = [chain.rows(saved.pre, (v, c)), chain.rows(saved.norm, (v,)), chain.rows(saved.fwd, (v, c)),
                    chain.rows(saved.mean), chain.rows(saved.possible), chain.rows(saved.shift, (v,))]
        else:
            rows = list(_entropy.entropy(limit)[1])
        weight = chain.rows(grads[0].astype(limit.x.dtype, copy=False))
        grad_x, grad_trans = _entropy.entropy_grads(limit, rows, weight, trans_grad=needs[1])
        grad_trans = None if grad_trans is None else grad_trans.astype(chain.x.dtype, copy=False)
        return _input_grads(problem, needs, grad_x.astype(chain.x.dtype, copy=False), grad_trans)


ENTROPY: Op[ChainProblem, Expectations] = Op(prepare_entropy, _entropy_forward, Expectations, _entropy_backward)
""":func:`chain_entropy` as an :class:`~spchain._op.Op`: outputs ``(entropy,)``, differentiable
in ``(x, log_trans, log_init)``."""


def _kbest(chain: Chain, k: int) -> tuple[Array, Array]:
    """``(scores (k, B), paths (k, B, v))``, best first."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    scores = xp.full((k, rows), -np.inf, chain.x.dtype)
    paths = xp.full((k, rows, v), -1, np.int64)
    if rows and c:
        work = xp.empty((rows, 2, c, k), chain.x.dtype)
        counts = xp.empty((rows, 2, c, k), np.int64)
        backptr = xp.empty((rows, v, c, k), np.int64)
        scratch = (work, counts, backptr, scores, paths)
        if chain.sparse is not None:
            s = chain.sparse
            args = (chain.x, s.t_indptr, s.t_rows, _sparse_chain.transposed_values(chain), chain.init, chain.lengths,
                    *scratch)
            if chain.backend.on_gpu:
                chain.backend.launcher(cuda.paths.launch_sparse_chain_kbest)(*args)
            else:
                cpu.team.run(cpu.paths.sparse_chain_kbest, *args)
        elif chain.backend.on_gpu:
            chain.backend.launcher(cuda.paths.launch_chain_kbest)(chain.x, chain.trans, chain.group, chain.init,
                                                                   chain.lengths, *scratch)
        else:
            cpu.team.run(cpu.paths.chain_kbest, chain.x, chain.trans, chain.group,
                         chain.init, chain.lengths, *scratch)
    return scores, paths


@scales_out
def chain_kbest(x: ArrayLike, log_trans: ArrayLike | Sparse, log_init: ArrayLike | None = None, *, k: int,
                lengths: ArrayLike | None = None) -> tuple[Array, Array]:
    """The ``k`` best paths of each chain and their scores, best first (exact k-best Viterbi).

    Every state keeps its ``k`` best partial paths, with back-pointers to a predecessor state
    and rank: O(batch · v · c² · k²) time at worst, O(batch · v · c · k) memory.

    Parameters
    ----------
    x, log_trans, log_init, lengths
        As for :func:`spchain.chain_logsumexp`.
    k : int
        How many paths (>= 1).

    Returns
    -------
    scores : array (k, *batch)
        The scores, non-increasing; ``-inf`` where a chain has fewer than ``k`` paths of
        positive weight (paths of score ``-inf`` are never listed). A path through a ``+inf``
        term scores ``+inf`` (through a ``-inf`` one too, ``-inf``); such paths rank as in the
        limit where the ``+inf`` terms grow together: by their number of ``+inf`` terms, then
        by the sum of their finite terms.
    paths : int64 array (k, *batch, v)
        The paths (-1 past each length, and -1 everywhere for an unlisted path and for a chain
        that reads a NaN, whose scores are NaN, as for :func:`spchain.viterbi`). Ties go to
        the lower state, from the last position backwards, so ``k = 1`` gives
        :func:`spchain.viterbi`'s path wherever its score is finite.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> x = np.log(np.array([[0.9, 0.1], [0.2, 0.8]]))
    >>> scores, paths = sc.chain_kbest(x, np.zeros((2, 2)), k=2)
    >>> paths, np.exp(scores).round(2)
    (array([[0, 1],
           [0, 0]]), array([0.72, 0.18]))
    """
    (scores, paths), _ = KBEST.forward(prepare_kbest(x, log_trans, log_init, lengths, k))
    return scores, paths


@dataclasses.dataclass(frozen=True)
class KBestProblem:
    """:func:`chain_kbest`'s arguments validated and laid out."""

    chain: Chain
    k: int


def prepare_kbest(x: Any, log_trans: Any, log_init: Any = None, lengths: Any = None, k: Any = 1, *,
                  caller: str = "spchain.chain_kbest", check: bool = True) -> KBestProblem:
    """The :class:`KBestProblem` of :func:`chain_kbest`'s arguments."""
    k = _count(caller, "k", k, 1)
    return KBestProblem(prepare_chain(x, log_trans, log_init, lengths, caller=caller, check=check).chain, k)


def _kbest_forward(p: KBestProblem) -> tuple[tuple[Array, Array], Saved]:
    chain = p.chain
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), chain.backend.use():
        scores, paths = _chain_limits.nan_paths(chain, *_kbest(chain, p.k))
        return (_leading(chain, scores.T[..., None])[..., 0], _leading(chain, paths.transpose(1, 0, 2))), Saved()


KBEST: Op[KBestProblem, Saved] = Op(prepare_kbest, _kbest_forward, Saved)
""":func:`chain_kbest` as an :class:`~spchain._op.Op`: outputs ``(scores, paths)``, not differentiable
(:func:`chain_path_score` of a path gives a differentiable score)."""


def _path_rows(chain: Chain, path: Array, caller: str, check: bool = True) -> Array:
    """``path`` in row order (B, v) of int64 (an unsigned path would wrap the -1), checked (unless
    ``check`` is false), -1 past each length."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    path = chain.rows(path, (v,)).astype(np.int64, copy=False)
    inside = xp.arange(v)[None, :] < chain.lengths[:, None]
    if check and rows and bool(((path < 0) | (path >= c))[inside].any()):
        raise ValueError(f"{caller}: path states must lie in 0..c-1 = 0..{c - 1} within each chain's length")
    return xp.where(inside, path, -1)


def _path_score(chain: Chain, path: Array) -> Array:
    """The scores (B,) of row-ordered paths (B, v) (-1 past each length)."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    inside = path >= 0
    state = xp.where(inside, path, 0)
    r = xp.arange(rows)[:, None]
    terms = [xp.where(inside, chain.x[r, xp.arange(v)[None, :], state], 0),
             chain.init[xp.arange(rows), state[:, 0], None]]
    if v > 1 and chain.sparse is not None:  # a look-up of each step in the CSR structure; -1: absent, -inf
        stored = xp.concatenate([chain.trans.reshape(-1), xp.full(1, -np.inf, chain.trans.dtype)])
        moves = stored[_sparse_chain.entries_of(chain, state[:, :-1], state[:, 1:])]
        terms.append(xp.where(inside[:, 1:], moves, 0))
    elif v > 1:
        steps = xp.arange(v - 1)[None, :] if chain.per_step else xp.zeros((1, v - 1), np.int64)
        moves = chain.trans[r // chain.group, steps, state[:, :-1], state[:, 1:]]
        terms.append(xp.where(inside[:, 1:], moves, 0))
    every = xp.concatenate(terms, axis=1).astype(np.float64)
    score = every.sum(axis=1)  # +inf + -inf is NaN here, and -inf in the limit rule: a structural zero wins
    zero = (every == -np.inf).any(axis=1) & ~xp.isnan(every).any(axis=1)
    return xp.where(zero, -np.inf, score).astype(chain.x.dtype)


def path_layout(caller: str, x_shape: Shape, batch_shape: Shape, path_shape: Shape) -> Shape:
    """The batch shape of :func:`chain_path_score`'s results: the chains' ``batch_shape``
    broadcast with the leading axes of ``path``; ``ValueError`` where they do not fit."""
    if len(x_shape) < 2 or len(path_shape) < 1 or path_shape[-1] != x_shape[-2]:
        raise ValueError(f"{caller}: path must have shape (..., v) with v = x.shape[-2], got path {path_shape} "
                         f"and x {x_shape}")
    try:
        return _checks.broadcast_shapes(batch_shape, path_shape[:-1])
    except ValueError:
        raise ValueError(f"{caller}: the batch shape of path {path_shape[:-1]} does not broadcast with the "
                         f"chains' {batch_shape}") from None


@dataclasses.dataclass(frozen=True)
class PathProblem:
    """Path-score inputs validated and laid out: the chains of ``x`` broadcast against the
    paths' batch axes (``problem.x_shape`` that of ``x`` itself), and the rows of the paths."""

    problem: ChainProblem
    rows: Array


def prepare_paths(x: Any, log_trans: Any, log_init: Any, path: Any, lengths: Any = None, *,
                  caller: str = "spchain.chain_path_score", check: bool = True) -> PathProblem:
    """The :class:`PathProblem` of the arguments of :func:`chain_path_score` (``check=False``:
    inputs that a ``prepare`` has validated)."""
    if check and (not hasattr(path, "dtype") or not np.issubdtype(np.dtype(path.dtype), np.integer)):
        raise TypeError(f"{caller}: path must be an integer array, got {getattr(path, 'dtype', type(path).__name__)}")
    if check:
        path_layout(caller, tuple(np.shape(x)), (), tuple(path.shape))  # before the chain's checks, as always
    problem = _prepare(x, log_trans, log_init, lengths, caller, check)
    chain = problem.chain
    full = path_layout(caller, chain.x_shape, chain.batch_shape, tuple(path.shape))
    if chain.batch_shape != full:  # x takes the paths' extra axes (per-step transitions keep theirs)
        x = chain.xp.asarray(x)
        added = len(full) + 2 - x.ndim
        if not _sparse_chain.is_sparse(log_trans) and np.ndim(log_trans) == x.ndim + 1:
            log_trans = chain.xp.asarray(log_trans).reshape((1,) * added + np.shape(log_trans))
        broadcast = _prepare(chain.xp.broadcast_to(x, full + x.shape[-2:]), log_trans, log_init, lengths, caller,
                             check)
        problem = dataclasses.replace(broadcast, x_shape=problem.x_shape, trans_shape=problem.trans_shape)
    return PathProblem(problem, _path_rows(problem.chain, path, caller, check))


@scales_out
def chain_path_score(x: ArrayLike, log_trans: ArrayLike | Sparse, log_init: ArrayLike | None, path: Array, *,
                     lengths: ArrayLike | None = None) -> Array:
    """The log-score of given paths: ``init[s0] + x[0, s0] + sum_t (log_trans[t][s_{t-1}, s_t] + x[t, s_t])``
    over each chain's length.

    A CRF's negative log-likelihood is ``chain_logsumexp(...) - chain_path_score(...)``.

    Parameters
    ----------
    x, log_trans, log_init, lengths
        As for :func:`spchain.chain_logsumexp` (``log_init`` may be ``None``: zeros).
    path : int array (..., v)
        States in 0..c-1 at the positions within each chain's length (any value past it).
        Its leading axes broadcast with the chains' batch.

    Returns
    -------
    array
        The scores, of the broadcast batch shape: ``-inf`` for a path through a ``-inf`` term,
        else ``+inf`` for one through a ``+inf`` term.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> x = np.log(np.array([[0.9, 0.1], [0.2, 0.8]]))
    >>> np.exp(sc.chain_path_score(x, np.zeros((2, 2)), None, np.array([0, 1]))).round(2)
    np.float64(0.72)
    """
    (score,), _ = PATH_SCORE.forward(prepare_paths(x, log_trans, log_init, path, lengths))
    return score


def _path_score_forward(paths: PathProblem) -> tuple[tuple[Array], Saved]:
    chain = paths.problem.chain
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), chain.backend.use():
        return (chain.unrows(_path_score(chain, paths.rows)),), Saved()


def _path_score_backward(paths: PathProblem, saved: Saved, grads: Sequence[Array | None],
                         needs: Sequence[bool]) -> ChainGrads:
    """``grad`` on every potential the path uses."""
    chain = paths.problem.chain
    assert grads[0] is not None  # the operator gives zeros for an unused output
    with chain.backend.use():
        weight = chain.rows(grads[0].astype(chain.x.dtype, copy=False))
        grad_x, grad_trans = _viterbi_grads(chain, paths.rows, weight, needs[1])
        return _input_grads(paths.problem, needs, grad_x, grad_trans)


PATH_SCORE: Op[PathProblem, Saved] = Op(prepare_paths, _path_score_forward, Saved, _path_score_backward,
                                        reads_outputs=False)
""":func:`chain_path_score` as an :class:`~spchain._op.Op`: outputs ``(score,)``, differentiable
in ``(x, log_trans, log_init)``."""
