"""Log-space chain sweeps (the HMM forward-backward algorithm), exact, for the CPU.

Shapes: B rows, v positions, c states. Row ``b`` uses the transitions ``trans[b // group]``;
``trans`` is (G, S, c, c): S = v - 1 (one matrix per step, step t → t+1 uses index t) or
S = 1 (one matrix for every step). Positions at and past ``lengths[b]`` are not computed:
their outputs are filled with ``-inf`` (messages) or 0 (normalisers).

The messages are kept normalised, so that they stay O(1) on chains of any length:

- ``pre[b, 0] = init[b]`` and ``pre[b, t+1, j] = log sum_i exp(â_t[i] + trans[i, j])``;
- ``q_t = pre[b, t] + x[b, t]``, ``norm[b, t] = log sum_j exp(q_t[j])`` and
  ``â_t = q_t - norm[b, t]`` (``â_t = q_t`` where the normaliser is not finite);
- the log-partition is ``sum_{t < length} norm[b, t]``;
- backward: ``beta[b, length-1] = 0`` and
  ``beta[b, t, i] = log sum_j exp(trans[i, j] + x[b, t+1, j] + beta[b, t+1, j]) - norm[b, t+1]``,
  so that the posterior marginals are ``exp(â_t + beta[b, t])``.

Every reduction is max-shifted and guards ``-inf``; NaN propagates; no fastmath.
"""

import math

import numpy as np
from numba import njit

from .exp import exp_nonpositive
from .semiring import has_nan, max_vecmat
from .team import team_rows

CHUNK = 16
"""Rows of a transition matrix folded into the running log-sum-exp at a time (kept in L1)."""


@njit(cache=True)
def log_vecmat(u, m, out, run_max, run_sum):
    """``out[j] = log sum_i exp(u[i] + m[i, j])``: a log-space vector-matrix product.

    An online (running-max) log-sum-exp over chunks of ``CHUNK`` rows of ``m``: per chunk one
    pass for the maxima, one rescale where a maximum grew, one pass of exponentials.
    Overwrites ``out``, ``run_max`` and ``run_sum`` (scratch, length ``m.shape[1]``).
    O(c_in * c_out) time.
    """
    c_in, c_out = m.shape
    run_max[:] = -np.inf
    run_sum[:] = 0.0
    for i0 in range(0, c_in, CHUNK):
        i1 = min(i0 + CHUNK, c_in)
        out[:] = -np.inf  # the chunk's maxima; NaN never wins here, the sums below carry it
        for i in range(i0, i1):
            ui = u[i]
            if ui != -np.inf:
                for j in range(c_out):
                    val = ui + m[i, j]
                    if val > out[j]:
                        out[j] = val
        for j in range(c_out):
            if out[j] > run_max[j]:
                run_sum[j] *= exp_nonpositive(run_max[j] - out[j])
                run_max[j] = out[j]
        for i in range(i0, i1):
            ui = u[i]
            if ui != -np.inf:
                for j in range(c_out):
                    val = ui + m[i, j]
                    if val != -np.inf:
                        run_sum[j] += exp_nonpositive(val - run_max[j])
    for j in range(c_out):
        out[j] = run_max[j] + math.log(run_sum[j])  # -inf + log(0) is -inf; NaN stays NaN


@njit(cache=True)
def log_matvec(m, y, out, scratch):
    """``out[i] = log sum_j exp(m[i, j] + y[j])``: a log-space matrix-vector product.

    Two passes over each (contiguous) row of ``m``: its maximum, then its exponentials into
    ``scratch`` (a vectorised loop) and their sum. Overwrites ``out`` and ``scratch``
    (length ``m.shape[1]``). O(c_out * c_in) time.
    """
    rows, cols = m.shape
    for i in range(rows):
        top = -np.inf
        for j in range(cols):
            val = m[i, j] + y[j]
            if val > top:
                top = val
        shift = top if math.isfinite(top) else 0.0
        for j in range(cols):
            scratch[j] = exp_nonpositive(m[i, j] + y[j] - shift)
        out[i] = _log_of_sum(scratch, shift, top)


@njit(cache=True)
def _log_of_sum(terms, shift, top):
    """``shift + log(sum(terms))`` for exponentials shifted by ``shift`` from a maximum ``top``:
    ``-inf`` for an empty or all-zero sum (``top`` is ``-inf``), NaN if a term is NaN."""
    total = 0.0
    for j in range(terms.shape[0]):
        total += terms[j]
    if top == -np.inf:
        return -np.inf if total == 0.0 else total
    return shift + math.log(total)


@njit(cache=True)
def normalise(q, out):
    """``out = q - log sum exp(q)`` (``out = q`` where that is not finite); returns the log-sum-exp."""
    top = -np.inf
    for j in range(q.shape[0]):
        if q[j] > top:
            top = q[j]
    shift = top if math.isfinite(top) else 0.0
    for j in range(q.shape[0]):
        out[j] = exp_nonpositive(q[j] - shift)
    lse = _log_of_sum(out, shift, top)
    offset = lse if math.isfinite(lse) else 0.0
    for j in range(q.shape[0]):
        out[j] = q[j] - offset
    return lse


@njit(nogil=True, cache=True)
def chain_forward(parallel, threads, x, trans, group, init, lengths, pre, norm):
    """Forward sweep: fills ``pre`` (B, v, c) and ``norm`` (B, v), as in the module docstring.

    ``x`` (B, v, c), ``trans`` (G, S, c, c), ``init`` (B, c), ``lengths`` (B,) in 1..v.
    O(B * v * c²) time, O(c) scratch per row; rows run in parallel (on a team of threads: ``team.run``).
    """
    return team_rows(parallel, threads, _forward_rows, x.shape[0], (x, trans, group, init, lengths, pre, norm))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _forward_rows(lo, hi, x, trans, group, init, lengths, pre, norm):
    """Rows ``lo:hi`` of :func:`chain_forward`."""
    rows, v, c = x.shape
    per_step = trans.shape[1] > 1
    for b in range(lo, hi):
        g = b // group
        length = lengths[b]
        u = np.empty(c, x.dtype)
        q = np.empty(c, x.dtype)
        run_max = np.empty(c, x.dtype)
        run_sum = np.empty(c, x.dtype)
        for j in range(c):  # (an array assignment compiles Numba's shape-mismatch message: seconds)
            pre[b, 0, j] = init[b, j]
            q[j] = init[b, j] + x[b, 0, j]
        norm[b, 0] = normalise(q, u)
        for t in range(length - 1):
            log_vecmat(u, trans[g, t if per_step else 0], pre[b, t + 1], run_max, run_sum)
            for j in range(c):
                q[j] = pre[b, t + 1, j] + x[b, t + 1, j]
            norm[b, t + 1] = normalise(q, u)
        pre[b, length:, :] = -np.inf
        norm[b, length:] = 0.0


@njit(nogil=True, cache=True)
def chain_backward(parallel, threads, x, trans, group, lengths, norm, beta):
    """Backward sweep: fills ``beta`` (B, v, c) with the normalised backward messages.

    Inputs as for :func:`chain_forward`, plus its ``norm``. O(B * v * c²) time; rows run in
    parallel (on a team of threads: ``team.run``).
    """
    return team_rows(parallel, threads, _backward_rows, x.shape[0], (x, trans, group, lengths, norm, beta))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _backward_rows(lo, hi, x, trans, group, lengths, norm, beta):
    """Rows ``lo:hi`` of :func:`chain_backward`."""
    rows, v, c = x.shape
    per_step = trans.shape[1] > 1
    for b in range(lo, hi):
        g = b // group
        length = lengths[b]
        y = np.empty(c, x.dtype)
        scratch = np.empty(c, x.dtype)
        beta[b, length:, :] = -np.inf
        beta[b, length - 1, :] = 0.0
        for t in range(length - 2, -1, -1):
            for j in range(c):
                y[j] = x[b, t + 1, j] + beta[b, t + 1, j]
            log_matvec(trans[g, t if per_step else 0], y, beta[b, t], scratch)
            d = norm[b, t + 1]
            if d == -np.inf:  # the chain died at t + 1: nothing before it has a posterior
                beta[b, t, :] = -np.inf
            else:
                for i in range(c):
                    beta[b, t, i] -= d


@njit(nogil=True, cache=True)
def chain_transition_grad(parallel, threads, x, trans, group, lengths, pre, norm, marg, weight, grad):
    """The expected transition counts: overwrites ``grad`` (G, S, c, c) with

    ``sum_{b, t} weight[b] * marg[b, t+1, j] * exp(â_t[i] + trans[g, s, i, j] - pre[b, t+1, j])``

    over the rows ``b`` of group ``g`` and the steps ``t → t+1`` (``t + 1 < lengths[b]``) that
    use matrix ``s``. ``marg`` (B, v, c) holds the posterior marginals. Parallel over the
    (g, s, i) rows of ``grad``, so no two threads write one entry (on a team of threads:
    ``team.run``). O(B * v * c²) time.
    """
    groups, steps, c, _ = trans.shape
    return team_rows(parallel, threads, _transition_grad_rows, groups * steps * c,
                     (x, trans, group, lengths, pre, norm, marg, weight, grad))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _transition_grad_rows(lo, hi, x, trans, group, lengths, pre, norm, marg, weight, grad):
    """The (g, s, i) rows ``lo:hi`` of ``grad`` (flattened) of :func:`chain_transition_grad`."""
    groups, steps, c, _ = trans.shape
    per_step = steps > 1
    for gsi in range(lo, hi):
        g = gsi // (steps * c)
        s = (gsi // c) % steps
        i = gsi % c
        out = grad[g, s, i]
        out[:] = 0.0
        for b in range(g * group, (g + 1) * group):
            w = weight[b]
            first = s if per_step else 0
            last = min(s + 1, lengths[b] - 1) if per_step else lengths[b] - 1
            for t in range(first, last):
                d = norm[b, t]
                a = pre[b, t, i] + x[b, t, i]
                if math.isfinite(d):
                    a -= d
                if a == -np.inf:
                    continue
                for j in range(c):
                    gm = marg[b, t + 1, j]
                    if gm != 0.0:
                        out[j] += w * gm * exp_nonpositive(a + trans[g, s, i, j] - pre[b, t + 1, j])


@njit(nogil=True, cache=True)
def chain_viterbi(parallel, threads, x, trans, group, init, lengths, work, backptr, score, path):
    """Max-product sweep with backpointers, then backtracking: the best path of each row.

    Inputs as for :func:`chain_forward`. ``work`` (B, 2, c) and ``backptr`` (B, v, c, int32)
    are scratch; overwrites ``score`` (B,) and ``path`` (B, v, int64; -1 past the length).
    Ties go to the lowest state index, from the last position backwards (the last state is the
    lowest best one, each earlier state the lowest best predecessor); NaN wins over numbers.
    Each step is one (SIMD) ``semiring.max_vecmat``; the matrices holding NaN are found first,
    so that steps with no NaN skip the NaN tests. O(B * v * c²) time; rows run in parallel
    (on a team of threads: ``team.run``).
    """
    groups, steps = trans.shape[:2]
    nan_in = np.empty(groups * steps, np.bool_)
    failed = team_rows(parallel, threads, _nan_matrices, groups * steps, (trans, nan_in))
    if failed:
        return failed
    return team_rows(parallel, threads, _viterbi_rows, x.shape[0],
                     (x, trans, group, init, lengths, nan_in, work, backptr, score, path))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _viterbi_rows(lo, hi, x, trans, group, init, lengths, nan_in, work, backptr, score, path):
    """Rows ``lo:hi`` of :func:`chain_viterbi`; ``nan_in`` (G * S) from :func:`_nan_matrices`."""
    rows, v, c = x.shape
    steps = trans.shape[1]
    per_step = steps > 1
    for b in range(lo, hi):
        g = b // group
        length = lengths[b]
        scratch_best = np.empty(c, work.dtype)
        scratch_arg = np.empty(c, backptr.dtype)
        cur = 0
        for j in range(c):
            work[b, 0, j] = init[b, j] + x[b, 0, j]
        for t in range(length - 1):
            new = work[b, 1 - cur]
            s = t if per_step else 0
            max_vecmat(work[b, cur], trans[g, s], nan_in[g * steps + s], new, backptr[b, t + 1], scratch_best,
                       scratch_arg)
            for j in range(c):
                new[j] += x[b, t + 1, j]
            cur = 1 - cur
        best = 0
        last = work[b, cur]
        for j in range(1, c):
            if last[j] > last[best] or (last[j] != last[j] and last[best] == last[best]):
                best = j
        score[b] = last[best] if c > 0 else -np.inf
        path[b, :] = -1
        if c > 0:
            path[b, length - 1] = best
            for t in range(length - 1, 0, -1):
                path[b, t - 1] = backptr[b, t, path[b, t]]


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _nan_matrices(lo, hi, trans, nan_in):
    """``nan_in[gs]``: whether the matrix ``gs`` (of the flattened (G, S)) of ``trans`` holds a NaN,
    for ``gs`` in ``lo:hi``."""
    steps = trans.shape[1]
    for gs in range(lo, hi):
        nan_in[gs] = has_nan(trans[gs // steps, gs % steps])
