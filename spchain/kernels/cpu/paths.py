"""Paths of log-space chains, for the CPU: posterior sampling and k-best Viterbi.

Shapes as in ``spchain/kernels/cpu/chain.py``: B rows, v positions, c states, row ``b`` uses
``trans[b // group]`` (G, S, c, c), S = v - 1 per-step matrices or S = 1 shared.
Paths are int64, -1 past each row's length.
"""

import math

import numpy as np
from numba import njit

from ..rules import WALK_CHUNK, kbest_row, sparse_kbest_row
from .exp import exp_nonpositive
from .team import team_rows


@njit(cache=True)
def draw_exact(alpha, b, t, trans_t, g, s, state, u):
    """A state ``i`` drawn with probability ∝ ``exp(alpha[b, t, i] + trans_t[g, s, state, i])``
    (no transition term for ``state < 0``) by the uniform ``u`` in [0, 1), in log space: the
    first ``i`` whose cumulative weight exceeds ``u`` times the total. -1 if no state has
    weight (or a weight is NaN)."""
    c = alpha.shape[2]
    top = -np.inf
    for i in range(c):
        val = alpha[b, t, i] + (trans_t[g, s, state, i] if state >= 0 else 0.0)
        if val > top:
            top = val
    if not math.isfinite(top):
        return -1
    total = 0.0
    for i in range(c):
        total += exp_nonpositive(alpha[b, t, i] + (trans_t[g, s, state, i] if state >= 0 else 0.0) - top)
    if total != total:
        return -1
    threshold = u * total
    last = -1
    cumulative = 0.0
    for i in range(c):
        w = exp_nonpositive(alpha[b, t, i] + (trans_t[g, s, state, i] if state >= 0 else 0.0) - top)
        if w > 0.0:
            last = i
            cumulative += w
            if cumulative > threshold:
                return i
    return last  # rounding: the cumulative sum fell short of the threshold


@njit(cache=True)
def draw(alpha, probs, b, t, trans_t, trans_probs, g, s, state, u, tiny, total):
    """:func:`draw_exact`'s draw from the scaled weights ``probs[b, t, i] * trans_probs[g, s,
    state, i]`` (products, no exponentials) whose sum is ``total``; redone in log space where
    ``total`` is below ``tiny`` (chosen so that weights that underflowed are negligible)."""
    if not total >= tiny or total == np.inf:
        return draw_exact(alpha, b, t, trans_t, g, s, state, u)
    c = probs.shape[2]
    threshold = u * total
    cumulative = 0.0
    for i0 in range(0, c, WALK_CHUNK):  # whole chunks while they stay below the threshold
        i1 = i0 + WALK_CHUNK if i0 + WALK_CHUNK < c else c
        chunk = 0.0
        for i in range(i0, i1):
            chunk += probs[b, t, i] * (trans_probs[g, s, state, i] if state >= 0 else 1.0)
        if cumulative + chunk <= threshold:
            cumulative += chunk
            continue
        for i in range(i0, i1):
            w = probs[b, t, i] * (trans_probs[g, s, state, i] if state >= 0 else 1.0)
            cumulative += w
            if w > 0.0 and cumulative > threshold:
                return i
    for i in range(c - 1, -1, -1):  # rounding: the sums fell short of the threshold
        if probs[b, t, i] * (trans_probs[g, s, state, i] if state >= 0 else 1.0) > 0.0:
            return i
    return -1


@njit(cache=True)
def draw_sparse(alpha, b, t, t_indptr, t_rows, t_values, state, u):
    """:func:`draw_exact` over the stored predecessors ``i`` of ``state`` (the entries of its
    column in the transpose's CSR structure), weights ``exp(alpha[b, t, i] + value)``."""
    top = -np.inf
    for q in range(t_indptr[state], t_indptr[state + 1]):
        val = alpha[b, t, t_rows[q]] + t_values[q]
        if val > top:
            top = val
    if not math.isfinite(top):
        return -1
    total = 0.0
    for q in range(t_indptr[state], t_indptr[state + 1]):
        total += exp_nonpositive(alpha[b, t, t_rows[q]] + t_values[q] - top)
    if total != total:
        return -1
    threshold = u * total
    last = -1
    cumulative = 0.0
    for q in range(t_indptr[state], t_indptr[state + 1]):
        w = exp_nonpositive(alpha[b, t, t_rows[q]] + t_values[q] - top)
        if w > 0.0:
            last = t_rows[q]
            cumulative += w
            if cumulative > threshold:
                return t_rows[q]
    return last  # rounding: the cumulative sum fell short of the threshold


@njit(nogil=True, cache=True)
def sparse_chain_sample(parallel, threads, alpha, t_indptr, t_rows, t_values, lengths, possible, uniforms, paths):
    """:func:`chain_sample` with one sparse transition matrix for all rows and steps (the
    transpose's CSR structure, as in :func:`sparse_chain_kbest`): each draw in log space
    (:func:`draw_sparse`) over the stored predecessors of the state drawn after it.
    O(N * B * v * (c + nnz)) time at worst, no (c, c) matrix; samples run in parallel
    (on a team of threads: ``team.run``)."""
    return team_rows(parallel, threads, _sparse_sample_rows, paths.shape[0] * paths.shape[1],
                     (alpha, t_indptr, t_rows, t_values, lengths, possible, uniforms, paths))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _sparse_sample_rows(lo, hi, alpha, t_indptr, t_rows, t_values, lengths, possible, uniforms, paths):
    """Samples ``lo:hi`` (of the flattened (B, N)) of :func:`sparse_chain_sample`."""
    samples, rows, v = paths.shape
    none = np.empty((1, 1, 1, 1), alpha.dtype)  # draw_exact reads no transition for state -1
    for bn in range(lo, hi):
        b = bn // samples
        n = bn % samples
        length = lengths[b]
        paths[n, b, :] = -1
        if not possible[b]:
            continue
        state = draw_exact(alpha, b, length - 1, none, 0, 0, -1, uniforms[n, b, length - 1])
        paths[n, b, length - 1] = state
        for t in range(length - 2, -1, -1):
            if state < 0:
                break
            state = draw_sparse(alpha, b, t, t_indptr, t_rows, t_values, state, uniforms[n, b, t])
            paths[n, b, t] = state
        if state < 0:
            paths[n, b, :] = -1


@njit(nogil=True, cache=True)
def chain_sample(parallel, threads, alpha, probs, trans_t, trans_probs, totals, tiny, group, lengths, possible,
                 uniforms, paths):
    """Backward sampling from the normalised forward messages: fills ``paths`` (N, B, v).

    ``alpha`` (B, v, c) holds the normalised forward messages â_t (log p(s_t | x_0..t) up to
    a constant) and ``probs`` (float64) their exponentials, shifted by each position's maximum;
    ``trans_t`` (G, S, c, c) the transposed transitions (``trans_t[g, s, j, i]`` scores
    i → j) and ``trans_probs`` (float64) their exponentials, shifted by each row's maximum;
    ``totals[b, t, j] = sum_i probs[b, t, i] * trans_probs[g, s, j, i]`` (B, v - 1, c), the
    sums of the weights of each draw (one GEMM per step, computed by the caller).
    ``possible`` (B,) says whether the row has a path of positive weight, ``uniforms``
    (N, B, v) are in [0, 1), ``tiny`` is :func:`draw`'s. The last state is drawn from
    â_{L-1}, each earlier one from â_t[i] + trans[i, s_{t+1}]. Impossible rows get -1
    everywhere. Parallel over the N * B samples (those of one row in a run, sharing its
    messages in cache; on a team of threads: ``team.run``); O(N * B * v * c) time, about
    c / 2 multiply-adds a draw.
    """
    return team_rows(parallel, threads, _sample_rows, paths.shape[0] * paths.shape[1],
                     (alpha, probs, trans_t, trans_probs, totals, tiny, group, lengths, possible, uniforms, paths))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _sample_rows(lo, hi, alpha, probs, trans_t, trans_probs, totals, tiny, group, lengths, possible, uniforms, paths):
    """Samples ``lo:hi`` (of the flattened (B, N)) of :func:`chain_sample`."""
    samples, rows, v = paths.shape
    per_step = trans_t.shape[1] > 1
    for bn in range(lo, hi):
        b = bn // samples
        n = bn % samples
        g = b // group
        length = lengths[b]
        paths[n, b, :] = -1
        if not possible[b]:
            continue
        total = 0.0
        for i in range(probs.shape[2]):
            total += probs[b, length - 1, i]
        state = draw(alpha, probs, b, length - 1, trans_t, trans_probs, g, 0, -1, uniforms[n, b, length - 1], tiny,
                     total)
        paths[n, b, length - 1] = state
        for t in range(length - 2, -1, -1):
            if state < 0:
                break
            s = t if per_step else 0
            state = draw(alpha, probs, b, t, trans_t, trans_probs, g, s, state, uniforms[n, b, t], tiny,
                         totals[b, t, state])
            paths[n, b, t] = state
        if state < 0:
            paths[n, b, :] = -1


@njit(nogil=True, cache=True)
def chain_kbest(parallel, threads, x, trans, group, init, lengths, work, counts, backptr, scores, paths):
    """Exact k-best Viterbi: the ``k`` best paths of each row, best first.

    Inputs as for ``chain.chain_viterbi``; ``work`` (B, 2, c, k) and ``counts`` (B, 2, c, k, int64)
    are scratch: the kept partial paths' scores as their finite sums and their numbers of
    ``+inf`` terms (``rules.kbest_plus``), ranked by the ``+inf`` terms first (the limit as they grow
    together), then the finite sum. ``backptr`` (B, v, c, k, int64) holds ``i * k + r`` (the
    predecessor state ``i`` and its rank ``r``; ``backptr[b, 0, 0]`` is scratch for the final
    ranking). Paths of score ``-inf`` are dropped, so fewer than ``k`` paths leave ``-inf``
    scores and -1 paths. Ties go to the lower (state, rank), as in ``chain.chain_viterbi``. Overwrites
    ``scores`` (k, B; ``+inf`` for a path through a ``+inf`` term) and ``paths`` (k, B, v).
    O(B * v * c² * k²) time at worst; rows run in parallel (on a team of threads: ``team.run``).
    """
    return team_rows(parallel, threads, _kbest_rows, x.shape[0],
                     (x, trans, group, init, lengths, work, counts, backptr, scores, paths))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _kbest_rows(lo, hi, x, trans, group, init, lengths, work, counts, backptr, scores, paths):
    """Rows ``lo:hi`` of :func:`chain_kbest`."""
    for b in range(lo, hi):
        kbest_row(b, x, trans, group, init, lengths, work, counts, backptr, scores, paths)


@njit(nogil=True, cache=True)
def sparse_chain_kbest(parallel, threads, x, t_indptr, t_rows, t_values, init, lengths, work, counts, backptr, scores,
                       paths):
    """:func:`chain_kbest` with one sparse transition matrix for all rows and steps, given by
    its transpose's CSR structure (``t_indptr``, ``t_rows``, ``t_values``: the stored entries
    of column ``j`` in order of their row; absent entries are ``-inf``). The candidates of a
    state are those of its stored predecessors: O(B * v * (c + nnz) * k²) time at worst
    (on a team of threads: ``team.run``)."""
    return team_rows(parallel, threads, _sparse_kbest_rows, x.shape[0],
                     (x, t_indptr, t_rows, t_values, init, lengths, work, counts, backptr, scores, paths))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _sparse_kbest_rows(lo, hi, x, t_indptr, t_rows, t_values, init, lengths, work, counts, backptr, scores, paths):
    """Rows ``lo:hi`` of :func:`sparse_chain_kbest`."""
    for b in range(lo, hi):
        sparse_kbest_row(b, x, t_indptr, t_rows, t_values, init, lengths, work, counts, backptr, scores, paths)
