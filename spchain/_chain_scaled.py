"""Scaled (exp-space) forms of the chain sweeps, exact as the log-space kernels.

- On the CPU, where each transition matrix serves many row-steps: the scaled kernels of
  ``spchain/kernels/cpu/chain_scaled.py`` (``c²`` multiply-adds and ``c`` exponentials a step
  instead of ``c²`` exponentials).
- On the GPU: the expected transition counts as batched GEMMs (:func:`transition_grad_gemm`,
  array-API code that the CPU tests run on NumPy arrays), instead of a serial kernel walking
  the batch rows of each matrix entry.
- An HMM's whole E-step on the CPU (:func:`hmm_posteriors`): forward and backward in
  probability space, the posteriors and transition counts from one backward sweep.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from ._logspace import finite_or_zero
from .kernels import cpu, cuda
from ._typing import Array

if TYPE_CHECKING:
    from ._backend import Backend
    from ._chain_layout import Chain

REUSE = 4
"""Row-steps per transition matrix from which exponentiating the matrices once pays."""

CHUNK = 1 << 20
"""Row-step-states whose float64 scratch the batched counts hold at a time."""

PARTS = 8
"""Row chunks per transition matrix that the transition gradient sums in parallel, at most."""


def applies(chain: Chain) -> bool:
    """Whether the scaled kernels run: on the CPU, where each matrix serves ``REUSE`` row-steps."""
    rows, v, c = chain.x.shape
    groups, steps = chain.trans.shape[:2]
    return not chain.backend.on_gpu and c > 0 and rows * max(v - 1, 1) >= REUSE * groups * steps


def _scaled(chain: Chain) -> tuple[Array, Array]:
    """``(e, cmax)``: the transitions' exponentials shifted by their column maxima (float64)."""
    trans = chain.trans.astype(np.float64)
    cmax = trans.max(axis=-2) if trans.shape[-2] else np.full(trans.shape[:-2] + trans.shape[-1:], -np.inf)
    e = np.exp(trans - np.where(cmax == -np.inf, 0, cmax)[..., None, :])
    from .kernels.rules import FLUSH

    e[e < FLUSH] = 0
    return e, cmax


def forward(chain: Chain, pre: Array, norm: Array) -> None:
    """Fills ``pre`` and ``norm`` as ``chain_forward`` does."""
    e, cmax = _scaled(chain)
    kernels = cpu.chain_scaled
    cpu.team.run(kernels.chain_forward_scaled,
                 chain.x, chain.trans, e, cmax, chain.group, chain.init, chain.lengths, pre, norm)


def log_partition(chain: Chain) -> tuple[Array, Array]:
    """``(log_partition (B,) float64, lost (B,) bool)`` without the messages a gradient reads;
    ``lost`` rows (garbage in ``log_partition``) need :func:`forward`."""
    e, cmax = _scaled(chain)
    out, lost = np.empty(chain.x.shape[0]), np.empty(chain.x.shape[0], bool)
    kernels = cpu.chain_scaled
    cpu.team.run(kernels.chain_logsumexp_scaled,
                 chain.x, e, cmax, chain.group, chain.init, chain.lengths, out, lost)
    return out, lost


def backward(chain: Chain, pre: Array, norm: Array, weight: Array, grad_trans: Array | None) -> Array:
    """The posterior marginals (B, v, c); fills ``grad_trans`` (if not ``None``) with the
    ``weight``-ed expected transition counts."""
    e, cmax = _scaled(chain)
    marg = np.empty_like(chain.x)
    e_t = np.ascontiguousarray(e.swapaxes(-1, -2))
    kernels = cpu.chain_scaled
    cpu.team.run(kernels.chain_marginals_scaled,
                 chain.x, chain.trans, e_t, cmax, chain.group, chain.lengths, pre, norm, marg)
    if grad_trans is not None:
        groups, steps = chain.trans.shape[:2]
        parts = max(1, min(PARTS // max(groups * steps, 1), chain.group))
        chunks = -(-chain.group // parts)
        acc = np.zeros(chain.trans.shape[:2] + (parts,) + chain.trans.shape[2:])
        ok = np.ones((groups, steps, parts), bool)
        cpu.team.run(kernels.chain_transition_grad_scaled,
                     chain.x, cmax, chain.group, chain.lengths, pre, norm, marg, weight, chunks, acc, ok)
        if ok.all():
            grad_trans[...] = e * acc.sum(axis=2)
        else:  # a scale factor out of range: the exact log-space sums
            cpu.team.run(cpu.chain.chain_transition_grad, chain.x, chain.trans,
                         chain.group, chain.lengths, pre, norm, marg, weight, grad_trans)
    return marg


def transition_grad_gemm(chain: Chain, pre: Array, norm: Array, marg: Array, weight: Array,
                         grad_trans: Array) -> None:
    """Overwrite ``grad_trans`` (G, S, c, c) with the ``weight``-ed expected transition counts,
    ``chain_transition_grad``'s result, by one batched GEMM (batch ``G · S``).

    The count of ``i -> j`` at step ``t`` of row ``b`` is ``w_b · marg[b, t+1, j] ·
    exp(â_t[i] + trans[i, j] - pre[b, t+1, j])``; it factors as ``p[i] · e[i, j] · r[j]`` with
    ``p = exp(â_t - max â_t)``, ``e = exp(trans - cmax)`` (column maxima) and
    ``r[j] = w_b · marg[b, t+1, j] · exp(max â_t + cmax[j] - pre[b, t+1, j])``, so a matrix's
    counts are ``e * (Pᵀ R)`` over the row-steps that use it, in float64. Each ``r`` factor's
    exponent is at least ``-log c``; where one exceeds ``LIMIT`` (or a factor is not a number)
    the scaled terms could lose the answer, and that matrix's counts are recomputed exactly in
    log space (``chain_transition_grad``; on the GPU a kernel that skips the other matrices,
    reading the flags on the device: no synchronisation). Dropped terms (a ``p`` below
    float64's range) are below ``1e-300 · exp(LIMIT)`` of ``w_b``. The rows of each group go
    in chunks, so the float64 scratch stays near ``CHUNK`` entries (a GEMM call a chunk).
    """
    xp = chain.xp
    v, c = chain.x.shape[1:]
    groups, steps = chain.trans.shape[:2]
    if v == 1 or c == 0:
        grad_trans[...] = 0
        return
    f64 = np.float64
    trans = chain.trans.astype(f64)
    cmax = trans.max(axis=-2)
    e = xp.exp(trans - finite_or_zero(xp, cmax)[..., None, :])
    col = cmax.reshape(groups, 1, steps, c)  # the column maxima of the matrix of each row-step
    acc = xp.zeros((groups, steps, c, c), f64)
    ok = xp.ones((groups, steps), bool)
    rows4 = (groups, chain.group)
    x4, pre4, marg4 = (a.reshape(rows4 + (v, c)) for a in (chain.x, pre, marg))
    norm3, last, w = norm.reshape(rows4 + (v,)), (chain.lengths - 1).reshape(rows4), weight.reshape(rows4)
    width = max(1, CHUNK // (groups * v * c))
    for k in range(0, chain.group, width):  # bounds the float64 scratch to about CHUNK entries
        part = slice(k, k + width)
        p, r, bad = scaled_factors(xp, x4[:, part], pre4[:, part], norm3[:, part], marg4[:, part], w[:, part],
                                   last[:, part], col)
        if steps == 1:  # one matrix per group: sum over all its rows and steps
            acc[:, 0] += xp.matmul(p.reshape(groups, -1, c).swapaxes(-1, -2), r.reshape(groups, -1, c))
            ok &= ~bad.reshape(groups, -1).any(axis=1, keepdims=True)
        else:  # one matrix per group and step: sum over the group's rows
            acc += xp.matmul(p.transpose(0, 2, 3, 1), r.transpose(0, 2, 1, 3))
            ok &= ~bad.any(axis=(1, 3))
    grad_trans[...] = e * acc
    _exact_where_not(chain, pre, norm, marg, weight, ok, grad_trans)


def scaled_factors(xp: ModuleType, x: Array, pre: Array, norm: Array, marg: Array, weight: Array, last: Array,
                   col: Array) -> tuple[Array, Array, Array]:
    """``(p, r, bad)`` of rows ``(..., v, c)`` for the steps ``t -> t + 1``, each (..., v - 1, c),
    float64: ``p = exp(â_t - max â_t)`` (0 where row ``b`` takes no step ``t``, ``t >= last_b``),
    ``r = weight_b · marg[t + 1] · exp(max â_t + col - pre[t + 1])`` and ``bad`` where that
    exponent passes ``rules.LIMIT`` (or a factor is not a number): the expected count of a transition
    ``i -> j`` is ``Σ p[i] · exp(T[i, j] - col[j]) · r[j]`` where nothing is bad. ``col`` holds
    the column maxima of ``T``, broadcast against (..., v - 1, c)."""
    from .kernels.rules import LIMIT

    f64 = np.float64
    v = x.shape[-2]
    active = xp.arange(v - 1) < last[..., None]  # steps t -> t + 1 taken
    offset = finite_or_zero(xp, norm[..., :-1])[..., None]
    a = xp.where(active[..., None], (pre[..., :-1, :] + x[..., :-1, :] - offset).astype(f64), -np.inf)
    amax = a.max(axis=-1, keepdims=True)
    p = xp.exp(a - finite_or_zero(xp, amax))  # 0 where a step is not taken
    gm = marg[..., 1:, :].astype(f64) * weight[..., None, None].astype(f64)
    with np.errstate(over="ignore", invalid="ignore"):  # -inf - -inf: NaN, flagged where it counts
        scale = amax + col - pre[..., 1:, :].astype(f64)
        r = xp.where(gm == 0, 0, gm * xp.exp(xp.minimum(scale, LIMIT)))
    bad: Array = ((gm != 0) & ~(scale <= LIMIT)) | ~xp.isfinite(r) | xp.isnan(amax)
    return p, r, bad


def _exact_where_not(chain: Chain, pre: Array, norm: Array, marg: Array, weight: Array, ok: Array,
                     grad_trans: Array) -> None:
    """Overwrite the matrices of ``grad_trans`` where ``ok`` (G, S) is False with the exact
    log-space counts: on the GPU one kernel that reads ``ok`` on the device, on the CPU only if
    some matrix needs it."""
    args = (chain.x, chain.trans, chain.group, chain.lengths, pre, norm, marg, weight)
    if chain.backend.on_gpu:
        chain.backend.launcher(cuda.chain.launch_chain_transition_grad_masked)(*args, ok, grad_trans)
    elif not ok.all():
        exact = np.empty_like(grad_trans)
        cpu.team.run(cpu.chain.chain_transition_grad, *args, exact)
        grad_trans[...] = np.where(ok[..., None, None], grad_trans, exact)


def hmm_posteriors(backend: Backend, x: Array, weights: Array | None, starts: Array, startprob: Array,
                   transmat: Array, transitions: bool, sums: bool,
                   posteriors: bool = True) -> tuple[Array, Array | None, Array, Array | None, Array | None]:
    """The E-step of a dense HMM on the CPU, in probability space (Rabiner's scaling).

    Sequence ``b`` is rows ``starts[b]:starts[b + 1]`` of ``x`` (n, k) float64: its emission
    log-likelihoods (``weights`` None), or features whose product with ``weights`` (k, c) they
    are (a Gaussian's with diagonal covariances: no (n, c) array of them is made);
    ``startprob`` (c,) and ``transmat`` (c, c) are probabilities. One forward and one backward
    sweep per sequence, ``c²`` multiply-adds a step for each and for the counts, ``c``
    exponentials a step and no logarithms.

    Returns
    -------
    log_prob : array (B,)
        Each sequence's log-likelihood; NaN where the scaled sweep could lose precision (a
        scale factor below ``1e-130``, a backward message above ``1e130``): the caller computes
        those sequences in log space. They are left out of the sums below.
    posteriors : array (n, c) or None
        The state posteriors (``None`` unless ``posteriors``).
    first : array (c,)
        The posteriors of the sequences' first positions, summed.
    counts : array (c, c) or None
        The expected transition counts (``None`` unless ``transitions``).
    sums : array (c, k) or None
        ``posteriors.T @ x`` (``None`` unless ``sums``).
    """
    rows, c = len(starts) - 1, transmat.shape[0]
    parts = max(1, min(PARTS, rows))
    x = np.ascontiguousarray(x, dtype=np.float64)
    post = np.empty((x.shape[0], c)) if posteriors else None
    log_prob = np.empty(rows)
    first = np.empty((parts, c))
    counts = np.empty((parts, c, c)) if transitions else None
    totals = np.empty((parts, c, x.shape[1])) if sums else None
    kernels = cpu.chain_scaled
    weights = None if weights is None else np.ascontiguousarray(weights, dtype=np.float64)
    cpu.team.run(kernels.hmm_posteriors_scaled, x, weights, starts, np.ascontiguousarray(startprob, dtype=np.float64),
                 np.ascontiguousarray(transmat, dtype=np.float64), parts, post, log_prob, first, counts, totals)
    return (log_prob, post, first.sum(axis=0), None if counts is None else transmat * counts.sum(axis=0),
            None if totals is None else totals.sum(axis=0))
