"""Chain sweeps for the CPU where many rows share each transition matrix: scaled products.

Shapes and messages as in ``spchain/kernels/cpu/chain.py``. Each transition matrix is exponentiated
once by the caller, shifted by its column maxima: ``e[g, s, i, j] = exp(trans[g, s, i, j] -
cmax[g, s, j])`` in float64, 0 below ``FLUSH`` (and where the column is all ``-inf``). A step
is then ``c`` exponentials and ``c²`` multiply-adds instead of ``c²`` exponentials:

    log sum_i exp(u[i] + trans[i, j]) = umax + cmax[j] + log sum_i exp(u[i] - umax) e[i, j].

Every dropped term (a factor below ``FLUSH``, the other at most 1) is below 1e-154; where a
scaled sum is below ``TINY`` = 1e-130 (so dropped terms could matter) or not a number, that
entry is recomputed in log space, exactly as ``chain.py`` does. NaN propagates.
"""

import math

import numpy as np
from numba import njit, prange

from .chain import normalise
from .exp import exp_nonpositive

FLUSH = 1e-154
TINY = 1e-130
LIMIT = 299.0
"""``-log(TINY)``: the transition gradient's scale factors stay below ``exp(LIMIT)``."""


@njit(cache=True)
def _scaled_exp(u, out):
    """``out = exp(u - max(u))`` in float64, 0 below ``FLUSH``; returns ``max(u)`` (-inf if
    every entry is ``-inf``, NaN if the others are; a NaN entry gives NaN in ``out``)."""
    top = -np.inf
    for i in range(u.shape[0]):
        if u[i] > top:
            top = u[i]
    if top == -np.inf:
        for i in range(u.shape[0]):
            if u[i] != u[i]:
                return u[i]
        return top
    for i in range(u.shape[0]):
        p = exp_nonpositive(u[i] - top)
        out[i] = p if not p < FLUSH else 0.0
    return top


@njit(cache=True)
def _log_column(u, m, j):
    """``log sum_i exp(u[i] + m[i, j])``, max-shifted, NaN propagating."""
    top = -np.inf
    for i in range(u.shape[0]):
        val = u[i] + m[i, j]
        if val > top:
            top = val
    if top == -np.inf:
        total = 0.0
        for i in range(u.shape[0]):
            total += u[i] + m[i, j]  # NaN stays NaN, -inf sums give -inf
        return total if total != total else -np.inf
    total = 0.0
    for i in range(u.shape[0]):
        total += exp_nonpositive(u[i] + m[i, j] - top)
    return top + math.log(total)


@njit(cache=True)
def scaled_vecmat(u, m, e, cmax, out, p, acc):
    """``out[j] = log sum_i exp(u[i] + m[i, j])`` by the scaled product (see the module
    docstring). Overwrites ``out``, ``p`` and ``acc`` (float64 scratch, length c)."""
    c = u.shape[0]
    top = _scaled_exp(u, p)
    if top == -np.inf:
        out[:] = -np.inf
        return
    acc[:] = 0.0
    for i in range(c):
        pi = p[i]
        if pi != 0.0:
            for j in range(c):
                acc[j] += pi * e[i, j]
    for j in range(c):
        if acc[j] >= TINY:
            out[j] = top + cmax[j] + math.log(acc[j])
        elif cmax[j] == -np.inf:
            out[j] = -np.inf
        else:
            out[j] = _log_column(u, m, j)


@njit(cache=True, fastmath={"reassoc", "contract"})
def _dot(row, q):
    total = 0.0
    for j in range(row.shape[0]):
        total += row[j] * q[j]
    return total


@njit(cache=True)
def scaled_matvec(m, e, cmax, y, out, z, q):
    """``out[i] = log sum_j exp(m[i, j] + y[j])`` by the scaled product. Overwrites ``out``,
    ``z`` and ``q`` (float64 scratch, length c)."""
    c = y.shape[0]
    for j in range(c):
        z[j] = y[j] + cmax[j]
    top = _scaled_exp(z, q)
    if top == -np.inf:
        out[:] = -np.inf
        return
    for i in range(c):
        total = _dot(e[i], q)
        if total >= TINY:
            out[i] = top + math.log(total)
        else:
            out[i] = _log_column(y, m.T, i)


@njit(parallel=True, cache=True)
def chain_forward_scaled(x, trans, e, cmax, group, init, lengths, pre, norm):
    """``chain.chain_forward`` by scaled products: fills ``pre`` (B, v, c) and ``norm`` (B, v).

    ``e`` (G, S, c, c) and ``cmax`` (G, S, c) float64 as in the module docstring, the other
    inputs as for ``chain.chain_forward``. O(B * v * c²) multiply-adds, O(B * v * c)
    exponentials; rows run in parallel.
    """
    rows, v, c = x.shape
    per_step = trans.shape[1] > 1
    for b in prange(rows):
        g = b // group
        length = lengths[b]
        u = np.empty(c, x.dtype)
        q = np.empty(c, x.dtype)
        p = np.empty(c, np.float64)
        acc = np.empty(c, np.float64)
        pre[b, 0, :] = init[b]
        for j in range(c):
            q[j] = init[b, j] + x[b, 0, j]
        norm[b, 0] = normalise(q, u)
        for t in range(length - 1):
            s = t if per_step else 0
            scaled_vecmat(u, trans[g, s], e[g, s], cmax[g, s], pre[b, t + 1], p, acc)
            for j in range(c):
                q[j] = pre[b, t + 1, j] + x[b, t + 1, j]
            norm[b, t + 1] = normalise(q, u)
        pre[b, length:, :] = -np.inf
        norm[b, length:] = 0.0


@njit(cache=True)
def _marginals(pre, x, d, beta, out):
    """``out = exp(pre + x - d + beta)`` renormalised to sum 1 (left as is where the sum is 0
    or not finite)."""
    offset = d if math.isfinite(d) else 0.0
    total = 0.0
    for i in range(out.shape[0]):
        out[i] = math.exp(pre[i] + x[i] - offset + beta[i])
        total += out[i]
    if total > 0.0 and math.isfinite(total):
        for i in range(out.shape[0]):
            out[i] /= total


@njit(parallel=True, cache=True)
def chain_marginals_scaled(x, trans, e, cmax, group, lengths, pre, norm, marg):
    """The backward sweep by scaled products, straight to the posterior marginals: fills
    ``marg`` (B, v, c), each position renormalised to sum 1 (0 past each length and where a
    chain has no path). Inputs as for :func:`chain_forward_scaled`, plus its outputs.
    O(B * v * c²) multiply-adds; rows run in parallel.
    """
    rows, v, c = x.shape
    per_step = trans.shape[1] > 1
    for b in prange(rows):
        g = b // group
        length = lengths[b]
        beta = np.zeros(c, x.dtype)
        before = np.empty(c, x.dtype)
        y = np.empty(c, x.dtype)
        z = np.empty(c, np.float64)
        q = np.empty(c, np.float64)
        marg[b, length:, :] = 0.0
        _marginals(pre[b, length - 1], x[b, length - 1], norm[b, length - 1], beta, marg[b, length - 1])
        for t in range(length - 2, -1, -1):
            for j in range(c):
                y[j] = x[b, t + 1, j] + beta[j]
            s = t if per_step else 0
            d = norm[b, t + 1]
            if d == -np.inf:  # the chain died at t + 1: nothing before it has a posterior
                before[:] = -np.inf
            else:
                scaled_matvec(trans[g, s], e[g, s], cmax[g, s], y, before, z, q)
                for i in range(c):
                    before[i] -= d
            beta[:] = before
            _marginals(pre[b, t], x[b, t], norm[b, t], beta, marg[b, t])


@njit(parallel=True, cache=True)
def chain_transition_grad_scaled(x, cmax, group, lengths, pre, norm, marg, weight, chunks, acc, ok):
    """Scaled sums of the expected transition counts: adds to ``acc`` (G, S, K, c, c) float64

    ``acc[g, s, k, i, j] += sum_{b, t} exp(â_t[i] - amax) * weight[b] * marg[b, t+1, j] * exp(amax + cmax[j] - pre[b, t+1, j])``

    over the rows ``b`` of chunk ``k`` of group ``g`` (``chunks`` rows each) and the steps that use
    matrix ``s``, so that ``e * acc.sum(2)`` is ``chain.chain_transition_grad``'s result.
    Sets ``ok[g, s, k]`` False where a scale factor exceeds ``exp(LIMIT)`` or is not a number (the
    caller then uses the exact kernel). Parallel over the (g, s, k) blocks of ``acc``.
    O(B * v * c²) multiply-adds.
    """
    groups, steps, parts, c, _ = acc.shape
    per_step = steps > 1
    for gsk in prange(groups * steps * parts):
        g = gsk // (steps * parts)
        s = (gsk // parts) % steps
        k = gsk % parts
        out = acc[g, s, k]
        a = np.empty(c, x.dtype)
        p = np.empty(c, np.float64)
        r = np.empty(c, np.float64)
        start = g * group + k * chunks
        for b in range(start, min(start + chunks, (g + 1) * group)):
            first = s if per_step else 0
            last = min(s + 1, lengths[b] - 1) if per_step else lengths[b] - 1
            for t in range(first, last):
                d = norm[b, t]
                offset = d if math.isfinite(d) else 0.0
                for i in range(c):
                    a[i] = pre[b, t, i] + x[b, t, i] - offset
                top = _scaled_exp(a, p)
                if top == -np.inf:
                    continue
                any_j = False
                for j in range(c):
                    gm = marg[b, t + 1, j]
                    r[j] = 0.0
                    if gm != 0.0:
                        scale = top + cmax[g, s, j] - pre[b, t + 1, j]
                        if not scale <= LIMIT:
                            ok[g, s, k] = False
                        else:
                            r[j] = weight[b] * gm * math.exp(scale)
                            any_j = True
                if not any_j:
                    continue
                for i in range(c):
                    pi = p[i]
                    if pi != 0.0:
                        for j in range(c):
                            out[i, j] += pi * r[j]


@njit(cache=True)
def _hmm_forward(x, start, trans, first, length, alpha, e, s):
    """The scaled forward sweep of one sequence ``x[first:first + length]`` in probability
    space: ``alpha[first + t] = P(state | x[:t + 1])``, ``e[t] = exp(x[t] - max x[t])`` and ``s[t]``
    the ``t``-th scale factor. Returns its log-likelihood, or NaN where a scale factor is below
    ``TINY`` or not a number (then the outputs are incomplete)."""
    c = x.shape[1]
    log_prob = 0.0
    for t in range(length):
        row = first + t
        top = -np.inf
        for j in range(c):
            if x[row, j] > top:
                top = x[row, j]
        if not math.isfinite(top):
            return np.nan
        for j in range(c):
            e[t, j] = exp_nonpositive(x[row, j] - top)
        a = alpha[row]
        if t == 0:
            for j in range(c):
                a[j] = start[j] * e[0, j]
        else:
            a[:] = 0.0
            before = alpha[row - 1]
            for i in range(c):
                bi = before[i]
                if bi != 0.0:
                    for j in range(c):
                        a[j] += bi * trans[i, j]
            for j in range(c):
                a[j] *= e[t, j]
        total = 0.0
        for j in range(c):
            total += a[j]
        if not total >= TINY:
            return np.nan
        s[t] = total
        for j in range(c):
            a[j] /= total
        log_prob += math.log(total) + top
    return log_prob


@njit(cache=True)
def _hmm_backward(trans_t, first, length, post, e, s, counts, with_counts):
    """The scaled backward sweep of one sequence after :func:`_hmm_forward`: turns ``alpha`` (in
    ``post``) into the posteriors, each position renormalised to sum 1, and sets ``counts`` to
    ``sum_t alpha_t[i] * r_t+1[j]`` with ``r_t = e[t] * beta_t / s[t]`` (the expected transition
    counts are ``trans * counts``). Returns False where a backward message exceeds ``1 / TINY``
    or is not a number: a forward probability lost below float64's range might then matter."""
    c = post.shape[1]
    beta = np.ones(c)
    r = np.empty(c)
    if with_counts:
        counts[:] = 0.0
    for t in range(length - 1, -1, -1):
        a = post[first + t]
        total = 0.0
        for i in range(c):
            a[i] *= beta[i]
            total += a[i]
        if total > 0.0:
            for i in range(c):
                a[i] /= total
        if t == 0:
            break
        before = post[first + t - 1]
        for j in range(c):
            r[j] = e[t, j] * beta[j] / s[t]
        beta[:] = 0.0
        for j in range(c):
            rj = r[j]
            if rj != 0.0:
                for i in range(c):
                    beta[i] += rj * trans_t[j, i]
        for i in range(c):
            if not beta[i] <= 1.0 / TINY:
                return False
            bi = before[i]
            if with_counts and bi != 0.0:
                for j in range(c):
                    counts[i, j] += bi * r[j]
    return True


@njit(parallel=True, cache=True)
def hmm_posteriors_scaled(x, starts, start, trans, parts, post, log_prob, counts):
    """The E-step of an HMM in probability space (Rabiner's scaling), the sequences in parallel.

    ``x`` (n, c) float64 holds the emission log-likelihoods of sequences ``b`` at rows
    ``starts[b]:starts[b + 1]``; ``start`` (c,) and ``trans`` (c, c) the start and transition
    probabilities. Fills ``post`` (n, c) with the state posteriors, ``log_prob`` (B,) with each
    sequence's log-likelihood, NaN where the scaled sweep is not exact (a scale factor below
    ``TINY``, a backward message above ``1 / TINY``: the caller recomputes that sequence in log
    space), and ``counts`` (parts, c, c) with sums whose total times ``trans`` is the expected
    transition counts of the other sequences (``counts`` is None: no counts). Every probability
    lost below float64's range weighs below 1e-170 of its sequence's likelihood. O(n * c²).
    """
    n, c = x.shape
    rows = starts.shape[0] - 1
    trans_t = np.ascontiguousarray(trans.T)
    longest = 0
    for b in range(rows):
        longest = max(longest, starts[b + 1] - starts[b])
    chunk = -(-rows // parts)
    for k in prange(parts):
        e = np.empty((longest, c))
        s = np.empty(longest)
        mine = np.empty((c, c))
        if counts is not None:
            counts[k] = 0.0
        for b in range(k * chunk, min(rows, (k + 1) * chunk)):
            first, length = starts[b], starts[b + 1] - starts[b]
            log_prob[b] = _hmm_forward(x, start, trans, first, length, post, e, s)
            if log_prob[b] != log_prob[b]:
                continue
            if not _hmm_backward(trans_t, first, length, post, e, s, mine, counts is not None):
                log_prob[b] = np.nan
            elif counts is not None:
                counts[k] += mine
