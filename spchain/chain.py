"""Log-space chain products: the HMM forward algorithm, its marginals and Viterbi decoding.

``chain_logsumexp`` computes ``log(init^T D(e^x0) T_1 D(e^x1) ... T_{v-1} e^x{v-1})`` for
batches of chains, exactly, in O(batch · v · c) memory, by one of two exact sweeps
(``spchain._chain_sweep``: scaled GEMMs or log-space Numba kernels, chosen by a cost model or
forced by :func:`chain_sweep`) over the layout of ``spchain._chain_layout``; ``+inf`` inputs
are handled by ``spchain._chain_limits``.

The gradient is the forward-backward algorithm: the backward sweep reuses the saved forward
messages (O(batch · v · c)), never a (batch, v, c, c) tensor. Each function is an
:class:`~spchain._op.Op` (:data:`LOGSUMEXP`, :data:`MARGINALS`, :data:`VITERBI`) that
``spchain.torch`` runs: :func:`prepare_chain` validates and lays out the inputs once, the
backward reuses that :class:`ChainProblem`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _backend, _chain_limits, _logspace, _sparse_chain
from ._chain_layout import Chain, prepare
from ._chain_sweep import chain_sweep
from ._dask import scales_out
from ._op import Grads, Op, Saved
from ._typing import Array, Shape, Sparse

__all__ = ["chain_logsumexp", "chain_marginals", "viterbi", "chain_sweep"]

def _viterbi_grads(chain: Chain, path: Array, weight: Array, trans_grad: bool = True) -> tuple[Array, Array | None]:
    """Sub-gradients of ``sum(weight * score)``: ``weight`` on every step of the best path.

    Returns ``(d x (B, v, c), d trans (G, S, c, c) or None)``; ``d init`` is ``d x[:, 0]``.
    """
    xp = chain.xp
    rows, v, c = chain.x.shape
    grad_x = xp.zeros((rows, v, c), chain.x.dtype)
    grad_trans = xp.zeros(chain.trans.shape, chain.x.dtype) if trans_grad else None
    if not rows or not c:
        return grad_x, grad_trans
    inside = path >= 0
    state = xp.where(inside, path, 0)
    w = xp.where(inside, weight[:, None], 0).astype(chain.x.dtype)
    grad_x[xp.arange(rows)[:, None], xp.arange(v)[None, :], state] = w  # one state a position: no sums (add.at: 5x)
    if trans_grad and v > 1 and chain.sparse is not None:
        grad_trans = _sparse_chain.path_counts(chain, xp.where(inside, path, -1), w)
    elif trans_grad and v > 1:
        groups = (xp.arange(rows) // chain.group)[:, None]
        steps = xp.arange(v - 1)[None, :] if chain.per_step else xp.zeros((1, v - 1), np.int64)
        _backend.scatter_add(xp, grad_trans, (groups, steps, state[:, :-1], state[:, 1:]), w[:, 1:])
    return grad_x, grad_trans


@scales_out
def chain_logsumexp(x: ArrayLike, log_trans: ArrayLike | Sparse, log_init: ArrayLike | None = None, *,
                    lengths: ArrayLike | None = None) -> Array:
    """Log-partition of batched chains: ``log(init^T D(e^x0) T_1 D(e^x1) ... T_{v-1} e^x{v-1})``.

    The HMM forward algorithm, exact for every ``v >= 1``, in O(batch · v · c) memory.

    Parameters
    ----------
    x : array (..., v, c)
        Log of the diagonals (the emission scores) at each of ``v`` positions over ``c`` states.
    log_trans : array (..., v-1, c, c) or (..., c, c)
        Log transition matrices: with one more axis than ``x``, one matrix per step
        (``log_trans[..., t, i, j]`` scores state i at t → state j at t + 1); with as many
        axes as ``x`` or fewer, one matrix shared by all steps. Leading axes broadcast.
        Or a sparse (c, c) SciPy / cupyx matrix (CSR; CSC and COO are converted once) of
        log-values shared by all steps: absent entries are ``-inf`` (a stored ``-inf`` is
        legal; an entry stored twice is a ``ValueError``). Each step is then a log-space SpMV,
        O(batch · v · (c + nnz)) time, and the gradient of ``log_trans`` (array level and
        ``spchain.torch``) has exactly its stored entries (a CSR matrix in CSR order).
    log_init : array (..., c), optional
        Log initial weights (default: zeros).
    lengths : int array, optional
        The number of positions, in 1..v, of each chain of the (broadcast) batch.

    Returns
    -------
    array
        The log-partition, of the broadcast batch shape. ``-inf`` where no path has weight;
        ``+inf`` where a path with no ``-inf`` term goes through a ``+inf`` one (a ``+inf``
        on impossible paths only changes nothing), never NaN for ``+inf`` inputs; NaN where a
        chain reads a NaN (in ``x`` before its length, in ``log_init`` or in the ``log_trans``
        of a step it takes), also one that lies on no possible path. The gradient of a
        ``+inf`` output goes in equal shares to the ``+inf`` terms of each reduction (the limit
        as they grow together: the posterior of the paths with the most ``+inf`` terms), 0
        elsewhere.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> x = np.log(np.full((2, 3, 4), 0.5))        # 2 chains, 3 positions, 4 states
    >>> trans = np.log(np.full((4, 4), 0.25))      # shared by every step
    >>> np.round(np.exp(sc.chain_logsumexp(x, trans)), 4)   # 4 * 0.5**3
    array([0.5, 0.5])
    """
    return _logsumexp_value(prepare_chain(x, log_trans, log_init, lengths))[0]


@dataclasses.dataclass(frozen=True)
class ChainProblem:
    """Chain inputs validated and laid out (:func:`prepare_chain`): the sweeps' :class:`Chain`,
    and the shapes (and sparse structure) of the inputs that the gradients take."""

    chain: Chain
    x_shape: Shape
    trans_shape: Shape
    init_shape: Shape | None
    structure: _sparse_chain.Structure | None  # of a sparse log_trans (the chain may hold it densified)


@dataclasses.dataclass(frozen=True)
class ChainGrads(Grads):
    """The gradients of a chain function's ``(x, log_trans, log_init)``, ``None`` where not needed;
    ``log_trans`` a CSR matrix of its structure for a sparse ``log_trans``."""

    x: Array | None
    log_trans: Array | Sparse | None
    log_init: Array | None


@dataclasses.dataclass(frozen=True)
class Messages(Saved):
    """What the forward-backward algorithm's backward sweep reads: the forward messages
    ``pre`` (batch shape + (v, c)) before each position's emission and their log normalisers
    ``norm`` (batch shape + (v,))."""

    pre: Array
    norm: Array


def prepare_chain(x: Any, log_trans: Any, log_init: Any = None, lengths: Any = None, *,
                  caller: str = "spchain.chain_logsumexp", check: bool = True) -> ChainProblem:
    """The :class:`ChainProblem` of the arguments of :func:`chain_logsumexp` (checks naming
    ``caller``; ``check=False`` for arguments that a ``prepare`` has validated)."""
    chain = prepare(x, log_trans, log_init, lengths, caller, check)
    trans_shape = chain.sparse.shape if chain.sparse is not None else tuple(np.shape(log_trans))
    return ChainProblem(chain, chain.x_shape, trans_shape, None if log_init is None else tuple(np.shape(log_init)),
                        chain.sparse)


def _logsumexp_forward(problem: ChainProblem) -> tuple[tuple[Array], Messages]:
    chain = problem.chain
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), chain.backend.use():
        log_partition, pre, norm = _chain_limits.forward(chain)
        return (chain.unrows(log_partition),), Messages(chain.unrows(pre), chain.unrows(norm))


def _logsumexp_value(problem: ChainProblem) -> tuple[Array]:
    chain = problem.chain
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), chain.backend.use():
        return (chain.unrows(_chain_limits.log_partition(chain)),)


def _logsumexp_backward(problem: ChainProblem, saved: Messages, grads: Sequence[Array | None],
                        needs: Sequence[bool]) -> ChainGrads:
    """The forward-backward algorithm's backward sweep over the saved messages: ``d x`` is
    ``grad`` times the posterior marginals, ``d log_trans`` the expected transition counts,
    ``d log_init`` the first marginals."""
    chain = problem.chain
    _, v, c = chain.x.shape
    assert grads[0] is not None  # the operator gives zeros for an unused output
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), chain.backend.use():
        weight = chain.rows(grads[0].astype(chain.x.dtype, copy=False))
        grad_x, grad_trans = _chain_limits.backward(chain, chain.rows(saved.pre, (v, c)), chain.rows(saved.norm, (v,)),
                                                    weight, trans_grad=needs[1])
        return _input_grads(problem, needs, grad_x, grad_trans)


LOGSUMEXP: Op[ChainProblem, Messages] = Op(prepare_chain, _logsumexp_forward, Messages, _logsumexp_backward,
                                           value=_logsumexp_value)
""":func:`chain_logsumexp` as an :class:`~spchain._op.Op`: outputs ``(log_partition,)``,
differentiable in ``(x, log_trans, log_init)``."""


def _input_grads(problem: ChainProblem, needs: Sequence[bool], grad_x: Array, grad_trans: Array | None) -> ChainGrads:
    """The gradients of ``(x, log_trans, log_init)`` where ``needs`` says, from the sweeps'
    (B, v, c) and (G, S, c, c) ones (``d log_init`` is ``d x`` at the first position)."""
    chain = problem.chain
    need_x, need_trans, need_init = needs
    trans: Array | Sparse | None = None
    # grad_trans is None unless need_trans (the sweeps computed it where trans_grad = need_trans)
    if grad_trans is not None and problem.structure is not None:
        trans = _sparse_chain.trans_grad(chain.backend, problem.structure, grad_trans)
    elif grad_trans is not None:  # a 0-d log_trans stood for every entry: the sum of theirs
        trans = grad_trans.reshape(problem.trans_shape) if problem.trans_shape else _logspace.reduce_to(grad_trans, ())
    init_shape = problem.init_shape if problem.init_shape is not None else problem.x_shape[-1:]
    return ChainGrads(_logspace.reduce_to(chain.unrows(grad_x), problem.x_shape) if need_x else None,
                      trans if need_trans else None,
                      _logspace.reduce_to(chain.unrows(grad_x[:, 0]), init_shape) if need_init else None)


@scales_out
def chain_marginals(x: ArrayLike, log_trans: ArrayLike | Sparse, log_init: ArrayLike | None = None, *,
                    lengths: ArrayLike | None = None) -> Array:
    """Posterior marginals of each state at each position: the gradient of
    ``chain_logsumexp(...).sum()`` with respect to ``x``.

    Takes the arguments of :func:`chain_logsumexp` and returns an array of ``x``'s shape
    (summed over the batch axes along which ``x`` was broadcast). Each position's marginals
    sum to 1 (0 where the chain has no path of positive weight, and past its length). Where
    ``+inf`` inputs make the log-partition ``+inf``, they are its limit as the ``+inf`` terms
    grow together (see :func:`chain_logsumexp`).

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> x = np.log(np.array([[0.9, 0.1], [0.5, 0.5]]))
    >>> stay = np.array([[0.0, -np.inf], [-np.inf, 0.0]])   # the state never changes
    >>> sc.chain_marginals(x, stay).round(2)
    array([[0.9, 0.1],
           [0.9, 0.1]])
    """
    return chain_marginals_forward(x, log_trans, log_init, lengths)


def _marginals_forward(problem: ChainProblem) -> tuple[tuple[Array], Saved]:
    chain = problem.chain
    xp = chain.xp
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), chain.backend.use():
        _, pre, norm = _chain_limits.forward(chain)
        grad_x, _ = _chain_limits.backward(chain, pre, norm, xp.ones(chain.x.shape[0], chain.x.dtype),
                                           trans_grad=False)
        return (_logspace.reduce_to(chain.unrows(grad_x), chain.x_shape),), Saved()


MARGINALS: Op[ChainProblem, Saved] = Op(prepare_chain, _marginals_forward, Saved)
""":func:`chain_marginals` as an :class:`~spchain._op.Op` (not differentiable: no backward)."""


def chain_marginals_forward(x: ArrayLike, log_trans: ArrayLike | Sparse, log_init: ArrayLike | None = None,
                            lengths: ArrayLike | None = None, caller: str = "spchain.chain_marginals") -> Array:
    """:func:`chain_marginals` with its checks naming ``caller``."""
    (marginals,), _ = MARGINALS.forward(prepare_chain(x, log_trans, log_init, lengths, caller=caller))
    return marginals


@scales_out
def viterbi(x: ArrayLike, log_trans: ArrayLike | Sparse, log_init: ArrayLike | None = None, *,
            lengths: ArrayLike | None = None) -> tuple[Array, Array]:
    """The best state sequence of each chain and its score (the max-product forward algorithm).

    Takes the arguments of :func:`chain_logsumexp`.

    Returns
    -------
    score : array
        ``max over paths of init[s0] + x[0, s0] + sum_t (log_trans[s_{t-1}, s_t] + x[t, s_t])``,
        of the broadcast batch shape (``-inf`` where no path has weight; ``+inf``, with a
        path through ``+inf`` terms, where a path with no ``-inf`` term has one).
    path : int64 array (..., v)
        The best path; -1 past each chain's length, and -1 everywhere for an impossible chain
        (score ``-inf``), whose score then has zero gradients in ``spchain.torch``, and for a
        chain that reads a NaN (score NaN, as for :func:`chain_logsumexp`; NaN ``x`` gradient).
        Ties go to the lowest state index, from the last position backwards: the last state is
        the lowest best one, each earlier state the lowest best predecessor of the next.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> x = np.log(np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]]))
    >>> score, path = sc.viterbi(x, np.log(np.array([[0.7, 0.3], [0.3, 0.7]])))
    >>> path
    array([0, 1, 1])
    """
    return viterbi_forward(x, log_trans, log_init, lengths)


@dataclasses.dataclass(frozen=True)
class BestPath(Saved):
    """What Viterbi's backward reads: the best ``path`` (one of its outputs)."""

    path: Array


@dataclasses.dataclass(frozen=True)
class _FromOutputs(Op[ChainProblem, BestPath]):
    """An :class:`~spchain._op.Op` whose backward reads its second output only: no residuals."""

    def residuals(self, saved: BestPath) -> tuple[Array, ...]:
        return ()

    def restore(self, outputs: Sequence[Array], residuals: Sequence[Array]) -> BestPath:
        return BestPath(outputs[1])


def _viterbi_forward(problem: ChainProblem) -> tuple[tuple[Array, Array], BestPath]:
    chain = problem.chain
    with chain.backend.use():
        score, path = _chain_limits.viterbi(chain)
        path = chain.unrows(path)
        return (chain.unrows(score), path), BestPath(path)


def _viterbi_backward(problem: ChainProblem, saved: BestPath, grads: Sequence[Array | None],
                      needs: Sequence[bool]) -> ChainGrads:
    """Sub-gradients of ``sum(grad * score)``: ``grad`` on every step of the best path (NaN in
    ``x``'s gradient for a chain that reads a NaN, whose score is NaN)."""
    chain = problem.chain
    v = chain.x.shape[1]
    assert grads[0] is not None  # the operator gives zeros for an unused output
    with chain.backend.use():
        weight = chain.rows(grads[0].astype(chain.x.dtype, copy=False))
        grad_x, grad_trans = _viterbi_grads(chain, chain.rows(saved.path, (v,)), weight, needs[1])
        return _input_grads(problem, needs, _chain_limits.nan_gradients(chain, weight, grad_x), grad_trans)


VITERBI: Op[ChainProblem, BestPath] = _FromOutputs(prepare_chain, _viterbi_forward, BestPath, _viterbi_backward)
""":func:`viterbi` as an :class:`~spchain._op.Op`: outputs ``(score, path)``, ``score``
differentiable in ``(x, log_trans, log_init)``."""


def viterbi_forward(x: ArrayLike, log_trans: ArrayLike | Sparse, log_init: ArrayLike | None = None,
                    lengths: ArrayLike | None = None, caller: str = "spchain.viterbi") -> tuple[Array, Array]:
    """:func:`viterbi` with its checks naming ``caller``: ``(score, path)``, which is all that
    its backward (``VITERBI.backward``) needs besides the inputs."""
    (score, path), _ = VITERBI.forward(prepare_chain(x, log_trans, log_init, lengths, caller=caller))
    return score, path
