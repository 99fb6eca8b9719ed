"""Chain sweeps for the CPU where many rows share each transition matrix: scaled products.

Shapes and messages as in ``spchain/kernels/cpu/chain.py``. Each transition matrix is exponentiated
once by the caller, shifted by its column maxima: ``e[g, s, i, j] = exp(trans[g, s, i, j] -
cmax[g, s, j])`` in float64, 0 below ``FLUSH`` (and where the column is all ``-inf``). A step
is then ``c`` exponentials and ``c²`` multiply-adds instead of ``c²`` exponentials:

    log sum_i exp(u[i] + trans[i, j]) = umax + cmax[j] + log sum_i exp(u[i] - umax) e[i, j].

Every dropped term (a factor below ``FLUSH``, the other at most 1) is below 1e-154; where a
scaled sum is below ``TINY`` (so dropped terms could matter) or not a number, that entry is
recomputed in log space, exactly as ``chain.py`` does (``spchain/kernels/rules.py``). NaN propagates.
"""

import math

import numpy as np
from numba import njit

from ..rules import FLUSH, LIMIT, TINY
from .chain import normalise
from .exp import exp_like, exp_nonpositive, log_like
from .team import team_rows


@njit(cache=True, fastmath={"contract"})  # FMAs: the exponentials' polynomials vectorise 2x faster
def _scaled_exp(u, out):
    """``out = exp(u - max(u))`` in float64 (to the accuracy of ``u``'s type), 0 below
    ``FLUSH``; returns ``max(u)`` (-inf if every entry is ``-inf``, NaN if the others are; a NaN
    entry gives NaN in ``out``)."""
    top = _max_of_numbers(u)  # over the numbers: a NaN entry is never greater
    if top == -np.inf:
        for i in range(u.shape[0]):
            if u[i] != u[i]:
                return u[i]
        return top
    like = u[0]
    for i in range(u.shape[0]):
        p = exp_like(like, u[i] - top)
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


@njit(cache=True, fastmath={"reassoc"})
def _sum(a):
    """``sum(a)`` in float64, in any order (so that it vectorises)."""
    total = 0.0
    for j in range(a.shape[0]):
        total += a[j]
    return total


@njit(cache=True, fastmath={"contract"})  # FMAs: the exponentials' polynomials vectorise 2x faster
def _message(q, u, p, flush):
    """From ``q = pre + x`` of one position: ``u = q - lse(q)`` (``u = q`` where that is not
    finite, as ``chain.normalise``) and ``p = exp(u - max u)`` in ``p``'s dtype, 0 below
    ``flush`` (``FLUSH`` for the scaled kernels; a GEMM operand's dtype's smallest normal number,
    so that every term a GEMM drops is below it, as ``_logspace.underflow_threshold`` assumes).
    Returns ``(lse(q), max u)``. The exponentials of ``q`` serve both (one vectorised pass, to
    the accuracy of ``q``'s type); no path (all ``-inf``) or NaN takes ``chain.normalise``."""
    top = _nan_max(q)
    if math.isfinite(top):
        _shifted_exp(q, top, flush, p)
        lse = top + log_like(q[0], _sum(p))
        for j in range(q.shape[0]):
            u[j] = q[j] - lse
        return lse, top - lse
    lse = normalise(q, u)
    p[:] = 0.0 if lse == -np.inf else np.nan
    return lse, lse


@njit(cache=True)
def _scaled_log(top, shift, acc, out):
    """``out[j] = top + shift[j] + log(acc[j])`` where ``acc[j] >= TINY`` (one vectorised
    pass, to the accuracy of ``out``'s type); returns whether some ``acc[j]`` is not (those
    entries of ``out`` then hold garbage, for the caller's exact fallback)."""
    like = out[0]
    for j in range(acc.shape[0]):
        out[j] = top + shift[j] + log_like(like, acc[j])
    lost = 0
    for j in range(acc.shape[0]):
        lost += 0 if acc[j] >= TINY else 1
    return lost > 0


@njit(nogil=True, cache=True)
def chain_forward_scaled(parallel, threads, x, trans, e, cmax, group, init, lengths, pre, norm):
    """``chain.chain_forward`` by scaled products: fills ``pre`` (B, v, c) and ``norm`` (B, v).

    ``e`` (G, S, c, c) and ``cmax`` (G, S, c) float64 as in the module docstring, the other
    inputs as for ``chain.chain_forward``. A step is ``p @ e`` (BLAS, for a block of rows at
    once: :func:`_product`) on the scaled messages ``p = exp(â_t - max â_t)`` and ``c``
    logarithms a row; the normaliser's exponentials give the next ``p``. O(B * v * c²)
    multiply-adds, O(B * v * c) exponentials and logarithms; blocks of rows run in parallel
    (on a team of threads: ``team.run``).
    """
    return team_rows(parallel, threads, _forward_blocks, -(-x.shape[0] // BLOCK),
                     (x, trans, e, cmax, group, init, lengths, pre, norm))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _forward_blocks(lo, hi, x, trans, e, cmax, group, init, lengths, pre, norm):
    """Blocks ``lo:hi`` (of :data:`BLOCK` rows) of :func:`chain_forward_scaled`."""
    c = x.shape[2]
    per_step = trans.shape[1] > 1
    most = _block_rows(c)
    u = np.empty((most, c), x.dtype)
    q = np.empty(c, x.dtype)
    p = np.zeros((most, c))
    acc = np.empty((most, c))
    top = np.empty(most)
    for b0, b1 in _blocks(lo, hi, x.shape[0], group, most):
        g = b0 // group
        steps = 0
        for r in range(b1 - b0):
            b = b0 + r
            for j in range(c):  # (an array assignment compiles Numba's shape-mismatch message: seconds)
                pre[b, 0, j] = init[b, j]
                q[j] = init[b, j] + x[b, 0, j]
            norm[b, 0], top[r] = _message(q, u[r], p[r], FLUSH)
            steps = max(steps, lengths[b] - 1)
        for t in range(steps):
            s = t if per_step else 0
            _product(p[:b1 - b0], e[g, s], acc[:b1 - b0])
            for r in range(b1 - b0):
                b = b0 + r
                if t >= lengths[b] - 1:
                    continue
                out = pre[b, t + 1]
                if not math.isfinite(top[r]):  # no path (-inf), or NaN on one
                    out[:] = top[r]
                elif _scaled_log(top[r], cmax[g, s], acc[r], out):
                    for j in range(c):
                        if not acc[r, j] >= TINY:
                            out[j] = -np.inf if cmax[g, s, j] == -np.inf else _log_column(u[r], trans[g, s], j)
                for j in range(c):
                    q[j] = out[j] + x[b, t + 1, j]
                norm[b, t + 1], top[r] = _message(q, u[r], p[r], FLUSH)
        for b in range(b0, b1):
            pre[b, lengths[b]:, :] = -np.inf
            norm[b, lengths[b]:] = 0.0


@njit(nogil=True, cache=True)
def chain_logsumexp_scaled(parallel, threads, x, e, cmax, group, init, lengths, out, lost):
    """The log-partition alone, without the messages a gradient reads: fills ``out`` (B,)
    float64, and ``lost`` (B,) True where a row needs :func:`chain_forward_scaled` (then its
    ``out`` is garbage).

    Inputs as for :func:`chain_forward_scaled`. The message stays in probability space,
    float64, scaled to a maximum of 1: a step is ``acc = p @ e`` (BLAS, a block of rows at
    once) and ``p' = acc * exp(cmax + x[t + 1] - w)`` (``w`` their largest exponent), ``c``
    exponentials and one logarithm a row.
    A row is lost where some ``acc[j]`` with a possible ``cmax[j] + x[t + 1, j]`` is below
    ``TINY`` (dropped terms could matter, as in the module docstring), or where a message is
    not finite (``-inf``, NaN, no path): the exact sweep decides those. O(B * v * c²)
    multiply-adds; blocks of rows run in parallel (on a team of threads: ``team.run``).
    """
    return team_rows(parallel, threads, _logsumexp_blocks, -(-x.shape[0] // BLOCK),
                     (x, e, cmax, group, init, lengths, out, lost))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _logsumexp_blocks(lo, hi, x, e, cmax, group, init, lengths, out, lost):
    """Blocks ``lo:hi`` (of :data:`BLOCK` rows) of :func:`chain_logsumexp_scaled`."""
    c = x.shape[2]
    per_step = e.shape[1] > 1
    most = _block_rows(c)
    p = np.zeros((most, c))
    acc = np.empty((most, c))
    w = np.empty(c)
    total = np.empty(most)
    for b0, b1 in _blocks(lo, hi, x.shape[0], group, most):
        g = b0 // group
        like = x[b0, 0, 0]  # exponentials to the accuracy of x's type, as the forward sweep's
        steps = 0
        for r in range(b1 - b0):
            b = b0 + r
            for j in range(c):
                w[j] = np.float64(init[b, j]) + x[b, 0, j]
            total[r] = _scaled_exp(w, p[r])
            lost[b] = not math.isfinite(total[r])
            steps = max(steps, lengths[b] - 1)
        for t in range(steps):
            s = t if per_step else 0
            _product(p[:b1 - b0], e[g, s], acc[:b1 - b0])
            for r in range(b1 - b0):
                b = b0 + r
                if lost[b] or t >= lengths[b] - 1:
                    continue
                for j in range(c):
                    w[j] = cmax[g, s, j] + x[b, t + 1, j]
                short = 0
                for j in range(c):  # a scaled sum that could have lost terms, or NaN
                    short += 0 if (acc[r, j] >= TINY or (w[j] == -np.inf and acc[r, j] == acc[r, j])) \
                        and w[j] == w[j] else 1
                top = _max_of_numbers(w) if short == 0 else np.nan
                if not math.isfinite(top):
                    lost[b] = True
                    continue
                pr = p[r]
                for j in range(c):
                    pr[j] = acc[r, j] * exp_like(like, w[j] - top)
                biggest = _max_of_numbers(pr)  # positive: some acc[j] >= TINY has the largest w[j]
                scale = 1.0 / biggest
                for j in range(c):
                    f = pr[j] * scale
                    pr[j] = f if f >= FLUSH else 0.0
                total[r] += top + math.log(biggest)
        for r in range(b1 - b0):
            b = b0 + r
            out[b] = total[r] + math.log(_sum(p[r]))
            lost[b] = lost[b] or not math.isfinite(out[b])


@njit(cache=True)
def _marginals(pre, x, d, beta, out):
    """``out = exp(pre + x - d + beta)`` renormalised to sum 1 (left as is where the sum is 0
    or not finite)."""
    offset = d if math.isfinite(d) else 0.0
    like = out[0]
    for i in range(out.shape[0]):
        out[i] = exp_like(like, pre[i] + x[i] - offset + beta[i])
    total = _sum(out)
    if total > 0.0 and math.isfinite(total):
        for i in range(out.shape[0]):
            out[i] /= total


@njit(nogil=True, cache=True)
def chain_marginals_scaled(parallel, threads, x, trans, e_t, cmax, group, lengths, pre, norm, marg):
    """The backward sweep by scaled products, straight to the posterior marginals: fills
    ``marg`` (B, v, c), each position renormalised to sum 1 (0 past each length and where a
    chain has no path). ``e_t`` holds the matrices of ``e`` transposed (G, S, c, c), the other
    inputs as for :func:`chain_forward_scaled`, plus its outputs. A step is ``q @ e_t`` (BLAS,
    a block of rows at once) on ``q = exp(z - max z)``, ``z = x[t + 1] + beta[t + 1] + cmax``.
    O(B * v * c²) multiply-adds; blocks of rows run in parallel
    (on a team of threads: ``team.run``).
    """
    return team_rows(parallel, threads, _marginals_blocks, -(-x.shape[0] // BLOCK),
                     (x, trans, e_t, cmax, group, lengths, pre, norm, marg))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _marginals_blocks(lo, hi, x, trans, e_t, cmax, group, lengths, pre, norm, marg):
    """Blocks ``lo:hi`` (of :data:`BLOCK` rows) of :func:`chain_marginals_scaled`; the rows of a
    block take each step together, each from its own last one."""
    c = x.shape[2]
    per_step = trans.shape[1] > 1
    most = _block_rows(c)
    beta = np.empty((most, c), x.dtype)
    y = np.empty((most, c), x.dtype)
    z = np.empty(c, x.dtype)
    q = np.zeros((most, c))
    acc = np.empty((most, c))
    top = np.empty(most)
    zero = np.zeros(c)
    for b0, b1 in _blocks(lo, hi, x.shape[0], group, most):
        g = b0 // group
        steps = 0
        for r in range(b1 - b0):
            b = b0 + r
            length = lengths[b]
            beta[r] = 0.0
            marg[b, length:, :] = 0.0
            _marginals(pre[b, length - 1], x[b, length - 1], norm[b, length - 1], beta[r], marg[b, length - 1])
            steps = max(steps, length - 1)
        for t in range(steps - 1, -1, -1):
            s = t if per_step else 0
            for r in range(b1 - b0):
                b = b0 + r
                if t < lengths[b] - 1:
                    for j in range(c):
                        y[r, j] = x[b, t + 1, j] + beta[r, j]
                        z[j] = y[r, j] + cmax[g, s, j]
                    top[r] = _scaled_exp(z, q[r])
            _product(q[:b1 - b0], e_t[g, s], acc[:b1 - b0])
            for r in range(b1 - b0):
                b = b0 + r
                if t >= lengths[b] - 1:
                    continue
                d = norm[b, t + 1]
                if d == -np.inf:  # the chain died at t + 1: nothing before it has a posterior
                    beta[r] = -np.inf
                elif not math.isfinite(top[r]):  # no path (-inf), or NaN on one
                    beta[r] = top[r]
                elif _scaled_log(top[r] - d, zero, acc[r], beta[r]):
                    for i in range(c):
                        if not acc[r, i] >= TINY:
                            beta[r, i] = _log_column(y[r], trans[g, s].T, i) - d
                _marginals(pre[b, t], x[b, t], norm[b, t], beta[r], marg[b, t])


BUFFER = 64
"""Row-steps whose scaled factors the transition gradient gathers before adding their outer products."""


@njit(cache=True)
def _count_weights(top, cmax, pre_next, marg_next, w, r):
    """``r = w * marg_next * exp(top + cmax - pre_next)`` (0 where ``marg_next`` is), float64
    to the accuracy of ``pre_next``'s type; returns whether a factor exceeds ``exp(LIMIT)`` or
    is not a number."""
    like = pre_next[0]
    bad = 0
    for j in range(r.shape[0]):
        gm = marg_next[j]
        scale = top + cmax[j] - pre_next[j]
        bad += 1 if gm != 0.0 and not scale <= LIMIT else 0
        f = exp_like(like, min(scale, LIMIT))
        r[j] = w * gm * f if gm != 0.0 else 0.0
    return bad > 0


@njit(cache=True)
def _count_factors(a, cmax, pre_next, marg_next, w, p, r):
    """The scaled factors of one row-step's expected transition counts, from ``a = â_t``:
    ``p = exp(a - amax)`` (0 below ``FLUSH``) and ``r`` of :func:`_count_weights`, float64, to
    the accuracy of ``a``'s type. Returns ``(use, bad)``: whether the step has weight
    (``amax > -inf``), and whether a scale factor exceeds ``exp(LIMIT)`` or is not a number, or
    ``a`` holds NaN (the exact kernel's cases)."""
    top = _scaled_exp(a, p)
    if top == -np.inf:
        return False, False
    if top != top:
        return False, True
    return True, _count_weights(top, cmax, pre_next, marg_next, w, r)


@njit(cache=True)
def _add_outer(out, p, r, product):
    """``out += p.T @ r`` for ``p`` (n, c) and ``r`` (n, k), by BLAS (:func:`_product`) a few
    rows at a time (``product`` (c, k) is scratch)."""
    most = max(1, SMALL_GEMM // max(p.shape[1] * r.shape[1], 1))
    for i in range(0, p.shape[0], most):
        _product(p[i:i + most].T, r[i:i + most], product)
        out += product


@njit(nogil=True, cache=True)
def chain_transition_grad_scaled(parallel, threads, x, cmax, group, lengths, pre, norm, marg, weight, chunks, acc, ok):
    """Scaled sums of the expected transition counts: adds to ``acc`` (G, S, K, c, c) float64

    ``acc[g, s, k, i, j] += sum_{b, t} exp(â_t[i] - amax) * weight[b] * marg[b, t+1, j] * exp(amax + cmax[j] - pre[b, t+1, j])``

    over the rows ``b`` of chunk ``k`` of group ``g`` (``chunks`` rows each) and the steps that use
    matrix ``s``, so that ``e * acc.sum(2)`` is ``chain.chain_transition_grad``'s result.
    Sets ``ok[g, s, k]`` False where a scale factor exceeds ``exp(LIMIT)`` or is not a number (the
    caller then uses the exact kernel). Parallel over the (g, s, k) blocks of ``acc``; the
    factors of ``BUFFER`` row-steps are added at once (BLAS products).
    O(B * v * c²) multiply-adds (on a team of threads: ``team.run``).
    """
    return team_rows(parallel, threads, _transition_grad_blocks, acc.shape[0] * acc.shape[1] * acc.shape[2],
                     (x, cmax, group, lengths, pre, norm, marg, weight, chunks, acc, ok))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _transition_grad_blocks(lo, hi, x, cmax, group, lengths, pre, norm, marg, weight, chunks, acc, ok):
    """Blocks ``lo:hi`` (of the flattened (G, S, K)) of :func:`chain_transition_grad_scaled`."""
    groups, steps, parts, c, _ = acc.shape
    per_step = steps > 1
    for gsk in range(lo, hi):
        g = gsk // (steps * parts)
        s = (gsk // parts) % steps
        k = gsk % parts
        a = np.empty(c, x.dtype)
        p = np.empty((BUFFER, c), np.float64)
        r = np.empty((BUFFER, c), np.float64)
        product = np.empty((c, c))
        n = 0
        start = g * group + k * chunks
        for b in range(start, min(start + chunks, (g + 1) * group)):
            first = s if per_step else 0
            last = min(s + 1, lengths[b] - 1) if per_step else lengths[b] - 1
            for t in range(first, last):
                d = norm[b, t]
                offset = d if math.isfinite(d) else 0.0
                for i in range(c):
                    a[i] = pre[b, t, i] + x[b, t, i] - offset
                use, bad = _count_factors(a, cmax[g, s], pre[b, t + 1], marg[b, t + 1], weight[b], p[n], r[n])
                if bad:
                    ok[g, s, k] = False
                if use:
                    n += 1
                if n == BUFFER:
                    _add_outer(acc[g, s, k], p, r, product)
                    n = 0
        _add_outer(acc[g, s, k], p[:n], r[:n], product)


@njit(cache=True, fastmath={"contract"})  # FMAs: the exponentials' polynomials vectorise 2x faster
def _marginal_row(forward, beta, weight, m):
    """``m = weight * exp(forward + beta)`` renormalised (as ``_logspace.renormalise``);
    subtracts the log normaliser from ``beta``."""
    c = m.shape[0]
    like = m[0]
    for j in range(c):
        m[j] = exp_like(like, forward[j] + beta[j])
    total = _sum(m)
    usable = total > 0.0 and math.isfinite(total)
    scale = weight / total if usable else weight
    for j in range(c):
        m[j] *= scale
    if usable:
        log_total = math.log(total)
        for j in range(c):
            beta[j] -= log_total


@njit(nogil=True, cache=True)
def gemm_forward_step(parallel, threads, t, x, trans, cmax, group, init, lengths, log_threshold, tiny, log_product,
                      top, u, pre, norm):
    """The elementwise part of position ``t`` of the GEMM sweep's forward (``_chain_sweep``):
    one pass over each row (rows in parallel) around the step's GEMM ``u @ e``, where ``e``
    (G, S, c, c) is ``exp(trans - cmax)`` (column maxima ``cmax`` (G, S, c) made finite).

    For ``t > 0``, ``log_product`` (B, c) holds the log of the GEMM of the scaled messages
    ``u`` of ``t - 1`` and ``top`` (B,) float64 their maxima: writes ``pre[:, t] = top + cmax +
    log_product``, recomputing exactly in log space each entry whose product fell below
    ``exp(log_threshold)`` (``_logspace.underflow_threshold``); ``pre[:, 0] = init``. Then
    ``norm[:, t]`` and the next operand: ``u = exp(â_t - max â_t)`` (0 below ``tiny``, the
    smallest normal number of ``x``'s dtype) and ``top = max â_t``. Rows with ``t >=
    lengths[b]`` get ``pre = -inf``, ``norm = 0`` and ``u = 0``. O(B * c) operations
    (on a team of threads: ``team.run``).
    """
    return team_rows(parallel, threads, _gemm_forward_rows, x.shape[0],
                     (t, x, trans, cmax, group, init, lengths, log_threshold, tiny, log_product, top, u, pre, norm))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _gemm_forward_rows(lo, hi, t, x, trans, cmax, group, init, lengths, log_threshold, tiny, log_product, top, u,
                       pre, norm):
    """Rows ``lo:hi`` of :func:`gemm_forward_step`."""
    c = x.shape[2]
    per_step = trans.shape[1] > 1
    q = np.empty(c, x.dtype)
    a = np.empty(c, x.dtype)
    for b in range(lo, hi):
        out = pre[b, t]
        if t >= lengths[b]:
            out[:] = -np.inf
            norm[b, t] = 0.0
            u[b, :] = 0.0
            top[b] = -np.inf
            continue
        if t == 0:
            for j in range(c):  # (an array assignment compiles Numba's shape-mismatch message: seconds)
                out[j] = init[b, j]
        else:
            g, s = b // group, (t - 1 if per_step else 0)
            m = top[b]
            if not math.isfinite(m):  # no path (-inf), or NaN on one
                out[:] = m
            elif _log_scaled(m, cmax[g, s], log_product[b], log_threshold, out):
                _previous_message(pre[b, t - 1], x[b, t - 1], norm[b, t - 1], a)
                for j in range(c):
                    if log_product[b, j] < log_threshold and cmax[g, s, j] != -np.inf:
                        out[j] = _log_column(a, trans[g, s], j)
        for j in range(c):
            q[j] = out[j] + x[b, t, j]
        norm[b, t], top[b] = _message(q, a, u[b], tiny)


@njit(cache=True)
def _log_scaled(top, shift, log_product, log_threshold, out):
    """``out = top + shift + log_product`` (``shift`` made finite); returns whether an entry
    of ``log_product`` is below ``log_threshold`` where ``shift`` is not ``-inf`` (its sum may
    have lost its answer: the caller recomputes it exactly)."""
    lost = 0
    for j in range(out.shape[0]):
        sj = shift[j]
        out[j] = top + (sj if math.isfinite(sj) else 0.0) + log_product[j]
        lost += 1 if (log_product[j] < log_threshold) & (sj != -np.inf) else 0
    return lost > 0


@njit(cache=True)
def _previous_message(pre, x, d, out):
    """``out = â``, the normalised message of one position from the forward's ``pre``, ``x``
    and normaliser ``d`` (``_logspace.normalised``)."""
    offset = d if math.isfinite(d) else 0.0
    for j in range(out.shape[0]):
        out[j] = (pre[j] + x[j]) - offset


@njit(cache=True)
def _nan_max(a):
    """``max(a)``: NaN if ``a`` holds NaN, ``-inf`` if it is empty."""
    nan = 0
    for j in range(a.shape[0]):
        nan += 0 if a[j] == a[j] else 1
    return _max_of_numbers(a) if nan == 0 else np.nan


@njit(cache=True)
def _max_of_numbers(a):
    """``max(a)`` of an array without NaN (``-inf`` if it is empty; a NaN entry is never greater,
    so with NaN it is the largest number), in eight running maxima: eight independent chains of
    comparisons (2.5x faster than one, which LLVM does not vectorise)."""
    n = a.shape[0]
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = -np.inf
    j = 0
    while j + 8 <= n:
        v0, v1, v2, v3, v4, v5, v6, v7 = a[j], a[j + 1], a[j + 2], a[j + 3], a[j + 4], a[j + 5], a[j + 6], a[j + 7]
        m0 = v0 if v0 > m0 else m0
        m1 = v1 if v1 > m1 else m1
        m2 = v2 if v2 > m2 else m2
        m3 = v3 if v3 > m3 else m3
        m4 = v4 if v4 > m4 else m4
        m5 = v5 if v5 > m5 else m5
        m6 = v6 if v6 > m6 else m6
        m7 = v7 if v7 > m7 else m7
        j += 8
    for k in range(j, n):
        m0 = a[k] if a[k] > m0 else m0
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


@njit(cache=True, fastmath={"contract"})  # FMAs: the exponentials' polynomials vectorise 2x faster
def _shifted_exp(a, top, tiny, out):
    """``out = exp(a - top)`` in ``out``'s dtype (to the accuracy of ``a``'s), 0 below ``tiny``."""
    like = a[0]
    for j in range(a.shape[0]):
        v = exp_like(like, a[j] - top)
        out[j] = v if v >= tiny else 0.0


@njit(nogil=True, cache=True)
def gemm_backward_step(parallel, threads, t, last, weight, inv_scale, x, trans, cmax, group, pre, norm, log_threshold,
                       tiny, counts, forward, beta, y, top, z, log_product, grad_x, p, w, ok, reached):
    """The elementwise part of position ``t`` of the GEMM sweep's backward (``_chain_sweep``):
    one pass over each row (rows in parallel) around the step's two GEMMs, ``z @ e.T`` (the
    backward messages) and ``p.T @ w`` (the transition counts).

    ``cmax``, ``log_threshold`` and ``tiny`` as for :func:`gemm_forward_step`. Row
    ``b`` takes position ``t`` where ``t <= last[b]``. On entry ``forward`` (B, c) holds
    ``â_t``, and for ``t < last[b]`` ``log_product``, ``top`` and ``y`` the log of step ``t +
    1``'s backward GEMM, its shift and its log operand ``y = x[t + 1] + beta[t + 1]``. Writes
    ``beta`` (B, c) at ``t`` (0 at ``t == last[b]``; entries whose product fell below
    ``exp(log_threshold)`` exactly in log space), ``grad_x[:, t]`` with the marginals
    renormalised times ``weight`` (0 where the row takes no position ``t``), and subtracts
    their log normaliser from ``beta``. For ``t > 0``: ``forward = â_{t-1}``; the next GEMM's
    operand ``z = exp(y + cmax - top)`` with ``y = x[t] + beta``, and ``top``; and where
    ``counts``, the factors of the expected counts of step ``t - 1 -> t``: ``p = exp(â_{t-1}
    - max)`` and ``w = inv_scale[g] * grad_x[:, t] * exp(max + cmax - pre[:, t])`` (the
    forward's scaled product, read from ``pre`` to its rounding; ``inv_scale`` (G,) keeps each
    group's factors in range), so that group ``g``'s counts are ``e * (p.T @ w) /
    inv_scale[g]``. Rows that take no step have zero factors;
    ``reached[g, s]`` marks a matrix some row uses, and ``ok[g, s]`` goes False where a
    factor's scaled product fell below the threshold or is not a number (the caller then takes
    the exact kernel). O(B * c) operations (on a team of threads: ``team.run``).
    """
    return team_rows(parallel, threads, _gemm_backward_rows, x.shape[0],
                     (t, last, weight, inv_scale, x, trans, cmax, group, pre, norm, log_threshold, tiny,
                      counts, forward, beta, y, top, z, log_product, grad_x, p, w, ok, reached))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _gemm_backward_rows(lo, hi, t, last, weight, inv_scale, x, trans, cmax, group, pre, norm, log_threshold, tiny,
                        counts, forward, beta, y, top, z, log_product, grad_x, p, w, ok, reached):
    """Rows ``lo:hi`` of :func:`gemm_backward_step`."""
    c = x.shape[2]
    per_step = trans.shape[1] > 1
    r = np.empty(c, np.float64)
    zero = np.zeros(c)
    for b in range(lo, hi):
        g = b // group
        here = beta[b]
        if t == last[b]:
            here[:] = 0.0
        elif t < last[b]:
            s = t if per_step else 0
            d = norm[b, t + 1]
            if d == -np.inf:  # the chain died at t + 1: nothing before it has a posterior
                here[:] = -np.inf
            elif not math.isfinite(top[b]):  # no path (-inf), or NaN on one
                here[:] = top[b] - d
            elif _log_scaled(top[b] - d, zero, log_product[b], log_threshold, here):
                for i in range(c):
                    if log_product[b, i] < log_threshold:
                        here[i] = _log_column(y[b], trans[g, s].T, i) - d
        if t <= last[b]:
            _marginal_row(forward[b], here, weight[b], grad_x[b, t])
        else:
            grad_x[b, t, :] = 0.0
        if t == 0:
            continue
        _previous_message(pre[b, t - 1], x[b, t - 1], norm[b, t - 1], forward[b])
        s = t - 1 if per_step else 0
        if t > last[b]:  # no step t - 1 -> t: nothing to add
            z[b, :] = 0.0
            top[b] = -np.inf
            if counts:
                p[b, :] = 0.0
                w[b, :] = 0.0
            continue
        if counts:
            if not reached[g, s]:  # read first: no cache line bounces between the threads
                reached[g, s] = True
            if not _count_row(forward[b], cmax[g, s], pre[b, t], grad_x[b, t], inv_scale[g], log_threshold, tiny, p[b],
                              w[b], r):
                ok[g, s] = False
        for j in range(c):
            y[b, j] = x[b, t, j] + here[j]
            r[j] = y[b, j] + cmax[g, s, j]
        top[b] = _nan_max(r)
        if math.isfinite(top[b]):
            _shifted_exp(r, top[b], tiny, z[b])
        else:  # no path (-inf), or NaN on one: the next beta is top[b] - d
            z[b, :] = 0.0


@njit(cache=True, fastmath={"contract"})  # FMAs: the exponentials' polynomials vectorise 2x faster
def _count_row(a, cmax, pre_next, grad_next, inv_scale, log_threshold, tiny, p, w, r):
    """The count factors of one row-step of :func:`gemm_backward_step` from ``a = â_t``:
    ``p`` and ``w`` (0 where ``a`` has no finite entry); ``r`` is float64 scratch. Returns
    False where a weighted factor's scaled product is below ``exp(log_threshold)`` or not a
    number, or ``a`` holds NaN (the exact kernel's cases; those factors are 0)."""
    c = a.shape[0]
    top = _nan_max(a)
    if top == -np.inf or top != top:
        p[:] = 0.0
        w[:] = 0.0
        return top == -np.inf
    _shifted_exp(a, top, tiny, p)
    like = a[0]
    for j in range(c):  # the log of the inverse of the forward's scaled product, from pre
        cj = cmax[j]
        r[j] = top + (cj if math.isfinite(cj) else 0.0) - pre_next[j]
    limit = -log_threshold
    bad = 0
    for j in range(c):  # w = gm * exp(r), 0 where gm is; r above limit: lost
        gm = grad_next[j] * inv_scale
        f = exp_like(like, min(r[j], limit))  # NaN stays
        fine = r[j] <= limit
        w[j] = gm * f if (gm != 0.0) & fine else 0.0
        bad += 0 if fine | (gm == 0.0) else 1
    return bad == 0


BLOCK = 8
"""Rows of one transition matrix that the scaled sweeps step at once: their products are one
BLAS product a step (:func:`_product`; 4-6x the multiply-adds a second of a row at a time)."""

SMALL_GEMM = 2**18
"""Multiply-adds up to which :func:`_product` calls BLAS: OpenBLAS runs such a product on the
calling thread (``m·n·k <= 4 · 65536``), and its own threads stay asleep beside torch's."""


@njit(cache=True)
def _blocks(lo, hi, rows, group, most):
    """The row ranges ``(b0, b1)`` that a sweep steps together in blocks ``lo:hi`` of
    :data:`BLOCK` rows: at most ``most`` rows, of one transition matrix (``group`` rows each).
    They depend on the blocks alone, so that every route and thread count groups a row with
    the same others, and gets the same bits from BLAS."""
    out = []
    for k in range(lo, hi):
        b0, end = k * BLOCK, min(rows, (k + 1) * BLOCK)
        while b0 < end:
            b1 = min(end, b0 + most, (b0 // group + 1) * group)
            out.append((b0, b1))
            b0 = b1
    return out


@njit(cache=True)
def _block_rows(c):
    """The rows a block of the scaled sweeps takes for ``c`` states: :data:`BLOCK`, fewer where
    their product would exceed :data:`SMALL_GEMM`."""
    return max(1, min(BLOCK, SMALL_GEMM // max(c * c, 1)))


@njit(cache=True)
def _product(p, m, out):
    """``out = p @ m`` for ``p`` (n, k), ``m`` (k, c), float64: BLAS's ``dgemm`` up to
    :data:`SMALL_GEMM` multiply-adds, else a row at a time (:func:`_add_vecmat`)."""
    n, k = p.shape
    if n * k * m.shape[1] <= SMALL_GEMM:
        np.dot(p, m, out)
        return
    for r in range(n):
        out[r] = 0.0
        _add_vecmat(out[r], p[r], m)


@njit(cache=True)
def _product_rows(p, m, out):
    """``out = p @ m`` as :func:`_product`, a chunk of rows of ``p`` at a time."""
    most = max(1, SMALL_GEMM // max(m.shape[0] * m.shape[1], 1))
    for r in range(0, p.shape[0], most):
        _product(p[r:r + most], m, out[r:r + most])


@njit(cache=True, fastmath={"contract"})
def _add_vecmat(acc, w, m):
    """``acc += w @ m``: ``acc`` (c,), ``w`` (k,), ``m`` (k, c); eight rows of ``m`` a pass over ``acc``."""
    k, c = m.shape
    i = 0
    while i + 8 <= k:
        w0, w1, w2, w3, w4, w5, w6, w7 = w[i], w[i + 1], w[i + 2], w[i + 3], w[i + 4], w[i + 5], w[i + 6], w[i + 7]
        m0, m1, m2, m3, m4, m5, m6, m7 = m[i], m[i + 1], m[i + 2], m[i + 3], m[i + 4], m[i + 5], m[i + 6], m[i + 7]
        for j in range(c):
            low = w0 * m0[j] + w1 * m1[j] + w2 * m2[j] + w3 * m3[j]
            acc[j] += low + (w4 * m4[j] + w5 * m5[j] + w6 * m6[j] + w7 * m7[j])
        i += 8
    while i + 4 <= k:
        w0, w1, w2, w3 = w[i], w[i + 1], w[i + 2], w[i + 3]
        m0, m1, m2, m3 = m[i], m[i + 1], m[i + 2], m[i + 3]
        for j in range(c):
            acc[j] += w0 * m0[j] + w1 * m1[j] + w2 * m2[j] + w3 * m3[j]
        i += 4
    for r in range(i, k):
        wr, mr = w[r], m[r]
        for j in range(c):
            acc[j] += wr * mr[j]


@njit(cache=True)
def _hmm_forward(x, weights, start, trans, first, length, alpha, e, s):
    """The scaled forward sweep of one sequence in probability space: ``alpha[t] = P(state |
    samples first..first + t)``, ``e[t] = exp(l[t] - max l[t])`` of its emission
    log-likelihoods ``l[t] = x[first + t]`` (``weights`` None) or ``x[first + t] @ weights``,
    and ``s[t]`` the ``t``-th scale factor. Returns its log-likelihood, or NaN where a scale
    factor is below ``TINY`` or not a number (then the outputs are incomplete)."""
    c = alpha.shape[1]
    log_prob = 0.0
    if weights is not None:
        _product_rows(x[first:first + length], weights, e[:length])
    for t in range(length):
        et, a = e[t], alpha[t]
        if weights is None:
            for j in range(c):  # (an array assignment compiles Numba's shape-mismatch message: seconds)
                et[j] = x[first + t, j]
        top = _max_of_numbers(et)
        if not math.isfinite(top):
            return np.nan
        for j in range(c):
            et[j] = exp_nonpositive(et[j] - top)
        if t == 0:
            for j in range(c):
                a[j] = start[j] * et[j]
        else:
            a[:] = 0.0
            _add_vecmat(a, alpha[t - 1], trans)
            for j in range(c):
                a[j] *= et[j]
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
def _hmm_backward(trans_t, length, alpha, e, s, post):
    """The scaled backward sweep of one sequence after :func:`_hmm_forward`: fills ``post``
    (length, c) with the posteriors, each position renormalised to sum 1, and overwrites
    ``e[t]`` (t >= 1) with ``r[t] = e[t] * beta[t] / s[t]``, so that ``sum_t alpha[t, i] *
    r[t + 1, j] * trans[i, j]`` are the expected transition counts. Returns False where a
    backward message exceeds ``1 / TINY`` or is not a number: a forward probability lost below
    float64's range might then matter."""
    c = alpha.shape[1]
    beta = np.ones(c)
    for t in range(length - 1, -1, -1):
        g = post[t]
        total = 0.0
        for i in range(c):
            g[i] = alpha[t, i] * beta[i]
            total += g[i]
        if total > 0.0:
            for i in range(c):
                g[i] /= total
        if t == 0:
            break
        r = e[t]
        for j in range(c):
            r[j] *= beta[j] / s[t]
        beta[:] = 0.0
        _add_vecmat(beta, r, trans_t)
        for i in range(c):
            if not beta[i] <= 1.0 / TINY:
                return False
    return True


@njit(nogil=True, cache=True)
def hmm_posteriors_scaled(parallel, threads, x, weights, starts, start, trans, parts, post, log_prob, first, counts,
                          sums):
    """The E-step of an HMM in probability space (Rabiner's scaling), the sequences in parallel.

    Sequence ``b`` is rows ``starts[b]:starts[b + 1]`` of ``x`` (n, k) float64, its emission
    log-likelihoods (``weights`` None) or the features whose product with ``weights`` (k, c) they
    are; ``start`` (c,) and ``trans`` (c, c) hold the start and transition probabilities. Fills
    ``post`` (n, c) with the state posteriors (None: not kept) and ``log_prob`` (B,) with each
    sequence's log-likelihood, NaN where the scaled sweep is not exact (a scale factor below
    ``TINY``, a backward message above ``1 / TINY``: the caller recomputes that sequence in log
    space). Over the other sequences, by part of them: sets ``first`` (parts, c) to the sums of
    their first positions' posteriors, ``counts`` (parts, c, c) to sums whose total times
    ``trans`` is the expected transition counts, and ``sums`` (parts, c, k) to sums whose total is
    ``posteriors.T @ x`` (either None: not computed). Every probability lost below float64's
    range weighs below 1e-170 of its sequence's likelihood. O(n * c * (c + k)) operations,
    scratch memory at most 3n * c plus the sums (on a team of threads: ``team.run``).
    """
    trans_t = np.ascontiguousarray(trans.T)
    return team_rows(parallel, threads, _posteriors_parts, parts,
                     (x, weights, starts, start, trans, trans_t, post, log_prob, first, counts, sums))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _posteriors_parts(lo, hi, x, weights, starts, start, trans, trans_t, post, log_prob, first, counts, sums):
    """Parts ``lo:hi`` (of ``first.shape[0]``) of :func:`hmm_posteriors_scaled`."""
    c = trans.shape[0]
    rows = starts.shape[0] - 1
    chunk = -(-rows // first.shape[0])
    for part in range(lo, hi):
        longest = 0
        for b in range(part * chunk, min(rows, (part + 1) * chunk)):
            longest = max(longest, starts[b + 1] - starts[b])
        alpha = np.empty((longest, c))
        e = np.empty((longest, c))
        s = np.empty(longest)
        g = np.empty((longest if post is None else 0, c))
        square, wide = np.empty((c, c)), np.empty((c, x.shape[1]))
        first[part] = 0.0
        if counts is not None:
            counts[part] = 0.0
        if sums is not None:
            sums[part] = 0.0
        for b in range(part * chunk, min(rows, (part + 1) * chunk)):
            begin, length = starts[b], starts[b + 1] - starts[b]
            if post is None:
                gamma = g[:length]
            else:
                gamma = post[begin:begin + length]
            log_prob[b] = _hmm_forward(x, weights, start, trans, begin, length, alpha, e, s)
            if log_prob[b] != log_prob[b]:
                continue
            if not _hmm_backward(trans_t, length, alpha, e, s, gamma):
                log_prob[b] = np.nan
                continue
            for i in range(c):  # (an array assignment compiles Numba's shape-mismatch message: seconds)
                first[part, i] += gamma[0, i]
            if counts is not None:
                _add_outer(counts[part], alpha[:length - 1], e[1:length], square)
            if sums is not None:
                _add_outer(sums[part], gamma, x[begin:begin + length], wide)
