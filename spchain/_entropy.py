"""The entropy of a chain's posterior over paths and its exact gradient.

With ``θ`` all the log-potentials (``x``, ``log_trans``, ``log_init``) and ``φ(path)`` the
counts of each potential along a path, ``score = <θ, φ>``, ``A(θ) = log Z`` and the posterior
mean ``μ = ∇A`` (marginals, expected transition counts), ``H = A - <θ, μ>`` and

    dH/dθ = μ - μ - ∇²A θ = -Cov(φ, score),

a Hessian-vector product. Per row, one forward and one backward pass in the expectation
semiring give it exactly:

- ``fwd[t, j] = E[score of positions 0..t | s_t = j]`` under the forward (filtering) posterior:
  ``fwd[t+1, j] = sum_i p(i | j) (fwd[t, i] + T[i, j]) + x[t+1, j]`` with
  ``p(i | j) = exp(â_t[i] + T[i, j] - pre[t+1, j])``;
- ``bwd[t, i] = E[score of the steps after t | s_t = i]`` under the posterior:
  ``bwd[t, i] = sum_j q(j | i) (T[i, j] + x[t+1, j] + bwd[t+1, j])`` with
  ``q(j | i) = exp(T[i, j] + x[t+1, j] + beta[t+1, j] - norm[t+1] - beta[t, i])``;
- ``E[score] = sum_j m_{L-1}[j] fwd[L-1, j]``, and
  ``Cov(φ_{t,j}, score) = m_t[j] (fwd[t, j] + bwd[t, j] - E)``,
  ``Cov(φ_{t,i→j}, score) = ξ_t[i, j] (fwd[t, i] + T[i, j] + x[t+1, j] + bwd[t+1, j] - E)``.

Terms of probability 0 (a ``-inf`` potential never taken) count 0, never ``0 · -inf``. The
weights ``p(i | j)`` are renormalised to sum to 1 to the last bit: the expected scores can be
far larger than the entropy (the limit chain of ``+inf`` inputs carries ``2**20`` a term), and
a sum of weights off by ``ε`` would move them by ``ε`` times their size. For the same reason
``fwd`` and ``bwd`` are carried less their mean at each position (:func:`_take_mean`), the
running sums of those means kept in float64: ``fwd + bwd - E`` then adds numbers the size of
one position's spread, not of the whole score. Each step works on
(rows, c, c) arrays, one step at a time: O(batch · v · c) memory kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from . import _logspace
from ._chain_layout import Chain
from ._chain_limits import forward as _forward
from ._logspace import normalised as _normalised
from ._typing import Array


def _grouped(chain: Chain, a: Array) -> Array:
    """(B, ...) → (G, group, ...)."""
    return a.reshape((chain.trans.shape[0], chain.group) + a.shape[1:])


def _weighted(xp: ModuleType, p: Array, value: Array) -> Array:
    """``p * value`` with 0 where ``p`` is 0 (so ``0 · -inf`` is 0)."""
    return xp.where(p > 0, p * value, 0)


class _Dense:
    """The transitions of one step as (G, 1, c, c) matrices against (G, group, c) messages:
    a transition ``i -> j`` is an entry of the last two axes."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain

    def trans(self, t: int) -> Array:
        return self.chain.step_matrices(t)[:, None]

    def src(self, a: Array) -> Array:
        """A state-indexed array at the source ``i`` of each transition."""
        return a[..., :, None]

    def dst(self, a: Array) -> Array:
        """A state-indexed array at the destination ``j`` of each transition."""
        return a[..., None, :]

    def edge(self, a: Array) -> Array:
        """A per-row (G, group, 1) array against the transitions."""
        return a[..., None]

    def to_dst(self, e: Array) -> Array:
        """The sums over the transitions into each state."""
        return e.sum(axis=-2)

    def to_src(self, e: Array) -> Array:
        """The sums over the transitions out of each state."""
        return e.sum(axis=-1)

    def logsumexp_to_src(self, e: Array) -> Array:
        return _logspace.logsumexp(self.chain.xp, e, axis=-1)

    def rows_summed(self, e: Array) -> Array:
        """The sums over the rows of a group, one (G, c, c) matrix per group."""
        return e.sum(axis=1)


class _Sparse(_Dense):
    """The stored transitions of a sparse chain as a last axis of ``nnz`` entries (CSR order)
    against (1, B, c) messages, by gathers and segment reductions: O(B · (c + nnz)) a step,
    never a (c, c) array."""

    def __init__(self, chain: Chain) -> None:
        super().__init__(chain)
        s = chain.sparse
        assert s is not None  # only for sparse chains
        self.indptr, self.dst_index = s.indptr, s.indices
        self.src_index = np.repeat(np.arange(s.shape[0]), np.diff(s.indptr))
        self.t_indptr, self.order = s.t_indptr, s.order

    def trans(self, t: int) -> Array:
        return self.chain.trans  # (1, 1, nnz)

    def src(self, a: Array) -> Array:
        return a[..., self.src_index]

    def dst(self, a: Array) -> Array:
        return a[..., self.dst_index]

    def edge(self, a: Array) -> Array:
        return a

    def to_dst(self, e: Array) -> Array:
        return _segments(np.add, e[..., self.order], self.t_indptr, 0.0)

    def to_src(self, e: Array) -> Array:
        return _segments(np.add, e, self.indptr, 0.0)

    def logsumexp_to_src(self, e: Array) -> Array:
        top = _segments(np.maximum, e, self.indptr, -np.inf)
        shift = _logspace.finite_or_zero(np, top)
        with np.errstate(divide="ignore"):
            return np.log(self.to_src(np.exp(e - self.src(shift)))) + shift


def _segments(ufunc: np.ufunc, e: Array, indptr: Array, empty: float) -> Array:
    """``ufunc`` reduced over the consecutive entries of each segment ``indptr[k]:indptr[k+1]``
    of the last axis of ``e``; ``empty`` for an empty segment."""
    out = np.full(e.shape[:-1] + (indptr.shape[0] - 1,), empty, e.dtype)
    nonempty = indptr[1:] > indptr[:-1]
    if e.shape[-1]:
        out[..., nonempty] = ufunc.reduceat(e, indptr[:-1][nonempty], axis=-1)
    return out


def _steps(chain: Chain) -> _Dense:
    return _Dense(chain) if chain.sparse is None else _Sparse(chain)


def _centred(chain: Chain) -> Chain:
    """``chain`` with each position's ``x`` less its largest finite entry. The entropy and its
    gradient stay the same (a constant at a position adds to every path's score), and the
    expected scores keep the size of their spread instead of ``x``'s, which ``H = log Z -
    E[score]`` would cancel: ``x`` near ``-1e4`` in float32 (or ``-1e300`` in float64) left
    nothing of the entropy, and emissions near ``-50`` over 2000 steps a float32 gradient of
    rounding error."""
    if not chain.x.size:
        return chain
    shift = _logspace.finite_or_zero(chain.xp, chain.x.max(axis=-1, keepdims=True))
    return dataclasses.replace(chain, x=chain.x - shift)


def entropy(chain: Chain) -> tuple[Array, tuple[Array, Array, Array, Array, Array, Array]]:
    """``(H (B,), saved)``: the entropies and what :func:`entropy_grads` needs."""
    chain = _centred(chain)
    xp = chain.xp
    rows, v, c = chain.x.shape
    log_partition, pre, norm = _forward(chain)
    fwd = xp.zeros((rows, v, c), chain.x.dtype)
    shift = xp.zeros((rows, v), np.float64)
    if rows and c:
        on = _steps(chain)
        alpha = _grouped(chain, _normalised(xp, pre, chain.x, norm))
        x, pre4, fwd4, shift3 = (_grouped(chain, a) for a in (chain.x, pre, fwd, shift))
        fwd4[:, :, 0] = _grouped(chain, chain.init) + x[:, :, 0]
        shift3[:, :, 0] = _take_mean(xp, fwd4[:, :, 0], xp.exp(alpha[:, :, 0]))
        for t in range(chain.max_length - 1):
            trans = on.trans(t)
            after = on.dst(pre4[:, :, t + 1])
            p = xp.where(xp.isfinite(after), xp.exp(on.src(alpha[:, :, t]) + trans - after), 0)
            total = on.to_dst(p)
            p = p / on.dst(xp.where(total > 0, total, 1))  # sums to 1 to the last bit
            fwd4[:, :, t + 1] = on.to_dst(_weighted(xp, p, on.src(fwd4[:, :, t]) + trans)) + x[:, :, t + 1]
            shift3[:, :, t + 1] = shift3[:, :, t] + _take_mean(xp, fwd4[:, :, t + 1], xp.exp(alpha[:, :, t + 1]))
    mean = _expected_score(chain, pre, norm, fwd, shift)
    possible = log_partition != -np.inf  # NaN stays in
    value = xp.where(possible, log_partition - xp.where(possible, mean, 0), 0).astype(chain.x.dtype, copy=False)
    return value, (pre, norm, fwd, mean, possible, shift)


def _take_mean(xp: ModuleType, value: Array, weight: Array) -> Array:
    """Subtract from ``value`` (..., c), in place, its ``weight``-ed sum over the last axis
    (finite, else 0) and return that sum (...) in float64. The expected scores carried from
    step to step then stay the size of one step's spread, their running shifts kept in
    float64, instead of growing with the position: ``fwd + bwd - E``, sizes of the whole
    score cancelling to the size of one position's, left a float32 gradient rounding error
    of 0.8 % of its largest entry over 2000 steps."""
    mean = _logspace.finite_or_zero(xp, _weighted(xp, weight, value).sum(axis=-1))
    value -= mean[..., None]
    return mean.astype(np.float64)


def _expected_score(chain: Chain, pre: Array, norm: Array, fwd: Array, shift: Array) -> Array:
    """Each chain's expected score (B,), float64: that of its last position, ``fwd`` there
    weighted by the posterior, plus the shift taken from ``fwd`` up to there."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    if not rows:
        return xp.zeros(0, np.float64)
    last = (chain.lengths - 1)[:, None, None]
    alpha = xp.take_along_axis(_normalised(xp, pre, chain.x, norm), last, axis=1)[:, 0]
    at_end = xp.take_along_axis(fwd, last, axis=1)[:, 0]
    mean = _weighted(xp, _sum_to_one(xp, xp.exp(alpha)), at_end).sum(axis=-1)
    return mean + xp.take_along_axis(shift, last[:, :, 0], axis=1)[:, 0]


def _sum_to_one(xp: ModuleType, p: Array) -> Array:
    """``p`` (..., c) divided by its sums over the last axis where they are positive: weights
    that sum to 1 to the last bit (see the module's docstring)."""
    total = p.sum(axis=-1, keepdims=True)
    return p / xp.where(total > 0, total, 1)


def entropy_grads(chain: Chain, saved: Sequence[Array], weight: Array,
                  trans_grad: bool = True) -> tuple[Array, Array | None]:
    """Gradients of ``sum(weight * H)``: ``(d x (B, v, c), d trans (G, S, c, c) or None)``;
    ``d init`` is ``d x[:, 0]``."""
    chain = _centred(chain)  # as the forward that made ``saved``
    xp = chain.xp
    pre, norm, fwd, mean, possible, shift = saved
    rows, v, c = chain.x.shape
    grad_x = xp.zeros((rows, v, c), chain.x.dtype)
    grad_trans = xp.zeros(chain.trans.shape, chain.x.dtype) if trans_grad else None
    if not rows or not c:
        return grad_x, grad_trans
    shape = (chain.trans.shape[0], chain.group)
    on = _steps(chain)
    w = _grouped(chain, -xp.where(possible, weight, 0))[..., None]
    e = _grouped(chain, mean)  # float64, as the shifts
    x, fwd4, norm3 = _grouped(chain, chain.x), _grouped(chain, fwd), _grouped(chain, norm)
    alpha = _grouped(chain, _normalised(xp, pre, chain.x, norm))
    last = _grouped(chain, chain.lengths - 1)
    shift3 = _grouped(chain, shift)
    gx = _grouped(chain, grad_x)
    beta = xp.zeros(shape + (c,), chain.x.dtype)
    bwd = xp.zeros(shape + (c,), chain.x.dtype)
    bwd_shift = xp.zeros(shape, np.float64)  # taken from bwd, as shift from fwd

    def offset(fwd_at: int) -> Array:  # the shifts of fwd at ``fwd_at`` and of bwd, less E: (G, S, 1)
        return (shift3[:, :, fwd_at] + bwd_shift - e).astype(chain.x.dtype)[..., None]

    for t in range(chain.max_length - 1, -1, -1):
        ends = (last == t)[..., None]
        beta = xp.where(ends, 0, beta)
        bwd = xp.where(ends, 0, bwd)
        bwd_shift = xp.where(last == t, 0, bwd_shift)
        active = (t <= last)[..., None]
        m = _sum_to_one(xp, xp.where(active, xp.exp(alpha[:, :, t] + beta), 0))
        bwd_shift = bwd_shift + _take_mean(xp, bwd, m)
        gx[:, :, t] = w * _weighted(xp, m, fwd4[:, :, t] + bwd + offset(t))
        if t == 0:
            break
        trans = on.trans(t - 1)
        d = norm3[:, :, t, None]
        later = on.dst(x[:, :, t] + beta - _logspace.finite_or_zero(xp, d))
        xi = xp.where(on.edge(active & xp.isfinite(d)), xp.exp(on.src(alpha[:, :, t - 1]) + trans + later), 0)
        gain = trans + on.dst(x[:, :, t] + bwd)
        if grad_trans is not None:
            step = t - 1 if chain.per_step else 0
            counts = _weighted(xp, xi, on.src(fwd4[:, :, t - 1]) + gain + on.edge(offset(t - 1)))
            grad_trans[:, step] += on.rows_summed(on.edge(w) * counts)
        new_beta = on.logsumexp_to_src(trans + later)
        q = xp.where(on.src(xp.isfinite(new_beta)), xp.exp(trans + later - on.src(new_beta)), 0)
        total = on.to_src(q)
        q = q / on.src(xp.where(total > 0, total, 1))  # sums to 1 to the last bit, as p
        bwd = xp.where(active, on.to_src(_weighted(xp, q, gain)), 0)
        beta = xp.where(active & xp.isfinite(d), new_beta, -np.inf)
    return grad_x, grad_trans
