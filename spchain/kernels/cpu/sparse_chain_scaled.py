"""Sparse chain sweeps for the CPU by scaled SpMVs: what ``sparse_chain.py`` computes, with
the exponentials of the stored values taken once instead of one per stored entry a step.

Shapes, messages and normalisers as in ``spchain/kernels/cpu/chain.py``. The caller exponentiates
the stored values once, shifted by the maximum of their column (``e``, ``cmax``; for the
forward product and the value gradient) and of their row (``row_e``, ``rmax``; for the
backward product), in float64, 0 below ``FLUSH`` (see :func:`sparse_chain_shifted_exp`). A step of a row
is then ``c`` exponentials, ``nnz`` multiply-adds and ``c`` logarithms:

    log sum_i exp(u[i] + T[i, j]) = umax + cmax[j] + log sum_i exp(u[i] - umax) e[i, j],

with the rows of a chunk of the batch innermost, so that the loops over them vectorise; float32
data use the float32-accurate ``exp_float32`` / ``log_float32`` (float64 range). As in
``chain_scaled.py``, a scaled sum below ``TINY`` (where dropped terms could matter) or not a
number is recomputed in log space, exactly as ``sparse_chain.py`` does; NaN propagates. The
backward sweep also gives the renormalised posterior marginals and, in the same pass, the
gradient of the stored values.
"""

import math

import numpy as np
from numba import njit

from ..rules import FLUSH, LIMIT, TINY
from .exp import exp_like, exp_nonpositive, log_like
from .sparse_chain import chunk_of
from .team import team_rows

BLOCK = 64
"""States per block where a sweep moves data between (B, v, c) arrays and its (c, W) ones."""


@njit(cache=True, error_model="numpy")
def sparse_chain_shifted_exp(indptr, values, top, e):
    """For each segment ``r`` of a CSR structure (a row, or a column of the transpose): ``top[r]``
    = the maximum of its values (``-inf`` if empty or all ``-inf``, NaN if one is NaN) and
    ``e[q] = exp(values[q] - top[r])`` in float64, 0 below ``FLUSH`` (NaN for a NaN segment)."""
    for r in range(indptr.shape[0] - 1):
        best = -np.inf
        for q in range(indptr[r], indptr[r + 1]):
            w = np.float64(values[q])
            if w != w:
                best = np.nan
                break
            best = max(best, w)
        top[r] = best
        shift = best if math.isfinite(best) else 0.0
        for q in range(indptr[r], indptr[r + 1]):
            p = exp_nonpositive(values[q] - shift) if best == best else np.nan
            e[q] = p if not p < FLUSH else 0.0


@njit(cache=True, error_model="numpy")
def _scale_rows(z, p, shift, top, total, like):
    """``top[k]`` = the maximum of column ``k`` of ``z`` (c, W) (NaN ignored, ``-inf`` if none),
    ``shift[k]`` = ``top[k]`` where finite (else 0), ``p = exp(z - shift)``, 0 below ``FLUSH``
    (NaN stays), and ``total[k]`` the sum of column ``k`` of ``p``; ``like`` is a sample of the
    data's dtype."""
    c, width = z.shape
    top[:] = -np.inf
    total[:] = 0.0
    for j in range(c):
        for k in range(width):
            if z[j, k] > top[k]:
                top[k] = z[j, k]
    for k in range(width):
        shift[k] = top[k] if math.isfinite(top[k]) else 0.0
    for j in range(c):
        for k in range(width):
            val = exp_like(like, z[j, k] - shift[k])
            p[j, k] = val if not val < FLUSH else 0.0
            total[k] += p[j, k]


@njit(cache=True, error_model="numpy")
def _lse(indptr, indices, values, z, zoff, k, r):
    """``log sum_q exp(values[q] + z[indices[q], k] - zoff)`` over the entries ``q`` of segment
    ``r``, max-shifted (``-inf`` for an empty or all ``-inf`` sum, NaN if a term is NaN)."""
    top = -np.inf
    for q in range(indptr[r], indptr[r + 1]):
        val = values[q] + (z[indices[q], k] - zoff)
        if val > top:
            top = val
    shift = top if math.isfinite(top) else 0.0
    total = 0.0
    for q in range(indptr[r], indptr[r + 1]):
        total += exp_nonpositive(values[q] + (z[indices[q], k] - zoff) - shift)
    if top == -np.inf:
        return -np.inf if total == 0.0 else total
    return shift + math.log(total)


@njit(cache=True, error_model="numpy")
def _scaled_spmm(indptr, indices, values, e, top_of, z, zoff, p, shift, top, acc, out, active, like):
    """``out[r, k] = log sum_q exp(values[q] + z[indices[q], k] - zoff[k])`` over the entries
    of segment ``r``, for the columns ``k`` where ``active``: from ``p``, ``top`` of
    :func:`_scale_rows` of ``z`` and ``shift`` (its shift less ``zoff``), as ``shift +
    top_of[r] + log sum_q e[q] p[indices[q]]``, recomputed by :func:`_lse` where that sum is
    below ``TINY`` or not a number."""
    segments, width = out.shape
    for r in range(segments):
        row = acc[r]
        row[:] = 0.0
        for q in range(indptr[r], indptr[r + 1]):
            w = e[q]
            pj = p[indices[q]]
            for k in range(width):
                row[k] += w * pj[k]
        base = top_of[r]
        for k in range(width):
            out[r, k] = shift[k] + base + log_like(like, row[k])
    for r in range(segments):
        for k in range(width):
            a = acc[r, k]
            if active[k] and not a >= TINY:
                if a == a and (top_of[r] == -np.inf or top[k] == -np.inf):
                    out[r, k] = -np.inf  # every term -inf, none NaN
                else:
                    out[r, k] = _lse(indptr, indices, values, z, zoff[k], k, r)


@njit(nogil=True, cache=True)
def sparse_chain_forward_scaled(parallel, threads, x, t_indptr, t_rows, t_values, e, cmax, init, lengths, pre, norm,
                                chunks):
    """Forward sweep: fills ``pre`` (B, v, c) and ``norm`` (B, v) as ``chain.chain_forward``
    does, over the transpose (``t_indptr``, ``t_rows``, ``t_values``: the entries of each column)
    with ``e``, ``cmax`` of :func:`sparse_chain_shifted_exp` on it. ``chunks`` of rows (``chunk_of``) run in
    parallel, each one step at a time for all its rows (on a team of threads: ``team.run``).
    O(B * v * (c + nnz)), O(c * B) scratch."""
    return team_rows(parallel, threads, _forward_chunks, chunks,
                     (x, t_indptr, t_rows, t_values, e, cmax, init, lengths, pre, norm, chunks))


@njit(cache=True, error_model="numpy")
def _forward_chunks(lo, hi, x, t_indptr, t_rows, t_values, e, cmax, init, lengths, pre, norm, chunks):
    """Chunks ``lo:hi`` (of ``chunks``) of :func:`sparse_chain_forward_scaled`."""
    rows, v, c = x.shape
    like = np.zeros(1, x.dtype)[0]
    for chunk in range(lo, hi):
        b0, b1 = chunk_of(rows, chunks, chunk)
        width = b1 - b0
        u = np.empty((c, width))  # pre + x, state-major
        p = np.empty((c, width))
        acc = np.empty((c, width))
        out = np.empty((c, width))
        top, shift, total, offset = np.empty(width), np.empty(width), np.empty(width), np.empty(width)
        active = np.empty(width, np.bool_)
        longest = 0
        for k in range(width):
            b = b0 + k
            longest = max(longest, lengths[b])
            for j in range(c):  # (an array assignment compiles Numba's shape-mismatch message: seconds)
                pre[b, 0, j] = init[b, j]
                u[j, k] = init[b, j] + x[b, 0, j]
        for t in range(longest):
            _scale_rows(u, p, shift, top, total, like)  # the flushed terms are below 1e-154 of the sum
            for k in range(width):
                lse = shift[k] + math.log(total[k]) if top[k] != -np.inf else (
                    -np.inf if total[k] == 0.0 else total[k])
                if t < lengths[b0 + k]:
                    norm[b0 + k, t] = lse
                offset[k] = lse if math.isfinite(lse) else 0.0  # â_t = u - offset
                shift[k] -= offset[k]  # p = exp(â_t - shift)
                active[k] = t + 1 < lengths[b0 + k]
            if t + 1 == longest:
                break
            _scaled_spmm(t_indptr, t_rows, t_values, e, cmax, u, offset, p, shift, top, acc, out, active, like)
            for j0 in range(0, c, BLOCK):  # blocks of states, so that ``out`` stays in cache
                j1 = min(j0 + BLOCK, c)
                for k in range(width):
                    b = b0 + k
                    for j in range(j0, j1):
                        if active[k]:
                            pre[b, t + 1, j] = out[j, k]
                            u[j, k] = pre[b, t + 1, j] + x[b, t + 1, j]
                        else:
                            u[j, k] = -np.inf
        for k in range(width):
            b = b0 + k
            pre[b, lengths[b]:, :] = -np.inf
            norm[b, lengths[b]:] = 0.0


@njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _dot(a, b):
    total = 0.0
    for k in range(a.shape[0]):
        total += a[k] * b[k]
    return total


@njit(cache=True, error_model="numpy")
def _values_grad(indptr, indices, t_indptr, t_rows, t_values, order, cmax, a, gm, pre_next, pa, r, shift, top,
                 total, active, like, acc, exact):
    """Adds the expected counts of the step from ``a`` (the normalised messages â_t, (c, W)) to
    ``gm`` (the weighted marginals at t + 1) with ``pre_next`` (``pre`` at t + 1, (c, W)):

    ``sum_k gm[j, k] exp(a[i, k] + T[i, j] - pre_next[j, k])`` for each entry ``(i, j)``,

    as ``e * acc`` (``acc += sum_k exp(a[i, k] - amax[k]) * r[j, k]``, ``r[j, k] = gm[j, k]
    exp(amax[k] + cmax[j] - pre_next[j, k])``), the terms whose factor ``r`` would pass
    ``exp(LIMIT)`` (or is not a number) exactly in log space into ``exact``."""
    c, width = a.shape
    _scale_rows(a, pa, shift, top, total, like)
    for k in range(width):
        if not active[k] or top[k] == -np.inf:  # no step, or no message: no term
            pa[:, k] = 0.0
    for j in range(c):
        cm = cmax[j]
        for k in range(width):
            r[j, k] = gm[j, k] * exp_like(like, min(shift[k] + cm - pre_next[j, k], LIMIT))
    for j in range(c):
        for k in range(width):
            g = gm[j, k]
            scale = shift[k] + cmax[j] - pre_next[j, k]
            if g == 0.0 or not active[k] or top[k] == -np.inf:
                r[j, k] = 0.0
            elif not scale <= LIMIT:
                r[j, k] = 0.0
                for qq in range(t_indptr[j], t_indptr[j + 1]):
                    val = a[t_rows[qq], k] + t_values[qq] - pre_next[j, k]
                    exact[order[qq]] += g * exp_nonpositive(val)
    for i in range(c):
        pi = pa[i]
        for q in range(indptr[i], indptr[i + 1]):
            acc[q] += _dot(pi, r[indices[q]])


@njit(nogil=True, cache=True)
def sparse_chain_backward_scaled(parallel, threads, x, indptr, indices, values, row_e, rmax, t_indptr, t_rows,
                                 t_values, order, e, cmax, lengths, pre, norm, weight, grad_x, partial):
    """Backward sweep: fills ``grad_x`` (B, v, c) with ``weight[b]`` times the posterior
    marginals (each position renormalised to sum 1 where that sum is positive and finite, 0
    past each length), and ``partial`` (K, nnz) float64 with the value gradient of each of K
    chunks of rows (``chunk_of``; the gradient is ``partial.sum(0)``; (K, 0) to skip it).

    The matrix (``indptr``, ``indices``, ``values``, with ``row_e``, ``rmax`` of
    :func:`sparse_chain_shifted_exp` on it) for the backward messages, its transpose (``t_*``; entry ``qq``
    of it is entry ``order[qq]`` of the matrix) with ``e`` (in CSR order) and ``cmax`` for the
    value gradient; ``pre``, ``norm`` from :func:`sparse_chain_forward_scaled`. O(B * v * (c + nnz)) time
    (on a team of threads: ``team.run``).
    """
    return team_rows(parallel, threads, _backward_chunks, partial.shape[0],
                     (x, indptr, indices, values, row_e, rmax, t_indptr, t_rows, t_values, order, e, cmax, lengths,
                      pre, norm, weight, grad_x, partial))


@njit(cache=True, error_model="numpy")
def _backward_chunks(lo, hi, x, indptr, indices, values, row_e, rmax, t_indptr, t_rows, t_values, order, e, cmax,
                     lengths, pre, norm, weight, grad_x, partial):
    """Chunks ``lo:hi`` (of ``partial.shape[0]``) of :func:`sparse_chain_backward_scaled`."""
    rows, v, c = x.shape
    like = np.zeros(1, x.dtype)[0]
    chunks, nnz = partial.shape
    for chunk in range(lo, hi):
        b0, b1 = chunk_of(rows, chunks, chunk)
        width = b1 - b0
        a = np.empty((c, width))  # â_t
        xs, ps = np.empty((c, width)), np.empty((c, width))  # x and pre at t, state-major
        xs_before, ps_before = np.empty((c, width)), np.empty((c, width))  # at t - 1
        beta = np.empty((c, width))  # beta_t
        gm = np.empty((c, width))  # weight * marginals at t
        z = np.empty((c, width))  # x + beta at t
        p = np.empty((c, width))
        acc = np.empty((c, width))
        out = np.empty((c, width))
        top, shift, total, zero = np.empty(width), np.empty(width), np.empty(width), np.zeros(width)
        scale, d = np.empty(width), np.empty(width)
        active = np.empty(width, np.bool_)
        grad_acc = np.zeros(nnz)
        exact = np.zeros(nnz)
        longest = 0
        for k in range(width):
            longest = max(longest, lengths[b0 + k])
            grad_x[b0 + k, lengths[b0 + k]:, :] = 0.0
        t = longest - 1
        _messages(x, pre, norm, b0, t, lengths, a, xs, ps)
        beta[:] = 0.0
        while True:
            total[:] = 0.0
            for i in range(c):
                for k in range(width):
                    gm[i, k] = exp_like(like, a[i, k] + beta[i, k])
                    total[k] += gm[i, k]
            for k in range(width):
                b = b0 + k
                scale[k] = weight[b] / total[k] if total[k] > 0.0 and math.isfinite(total[k]) else weight[b]
                active[k] = 0 < t < lengths[b]  # the step t - 1 -> t is taken
                d[k] = norm[b, t]
            for i in range(c):
                for k in range(width):
                    gm[i, k] *= scale[k]
                    z[i, k] = xs[i, k] + beta[i, k] if active[k] else -np.inf
            for i0 in range(0, c, BLOCK):
                i1 = min(i0 + BLOCK, c)
                for k in range(width):
                    if t < lengths[b0 + k]:
                        for i in range(i0, i1):
                            grad_x[b0 + k, t, i] = gm[i, k]
            if t == 0:
                break
            _messages(x, pre, norm, b0, t - 1, lengths, a, xs_before, ps_before)  # â_{t-1}
            _scale_rows(z, p, shift, top, total, like)
            _scaled_spmm(indptr, indices, values, row_e, rmax, z, zero, p, shift, top, acc, out, active, like)
            for i in range(c):
                for k in range(width):
                    # 0 at the last position of a chain (or past it); -inf where the chain died
                    # at t: nothing before it has a posterior
                    beta[i, k] = (out[i, k] - d[k] if d[k] != -np.inf else -np.inf) if active[k] else 0.0
            if nnz:
                _values_grad(indptr, indices, t_indptr, t_rows, t_values, order, cmax, a, gm, ps, p, acc, shift, top,
                             total, active, like, grad_acc, exact)
            xs, xs_before = xs_before, xs
            ps, ps_before = ps_before, ps
            t -= 1
        for q in range(nnz):
            partial[chunk, q] = e[q] * grad_acc[q] + exact[q]


@njit(cache=True, error_model="numpy")
def _messages(x, pre, norm, b0, t, lengths, a, xs, ps):
    """``a[:, k]`` = the normalised forward message â_t of row ``b0 + k`` (``-inf`` past its
    length), ``xs[:, k]`` and ``ps[:, k]`` its ``x`` and ``pre`` at ``t``."""
    c, width = a.shape
    for i0 in range(0, c, BLOCK):
        i1 = min(i0 + BLOCK, c)
        for k in range(width):
            b = b0 + k
            if t < lengths[b]:
                dt = norm[b, t]
                offset = dt if math.isfinite(dt) else 0.0
                for i in range(i0, i1):
                    xs[i, k] = x[b, t, i]
                    ps[i, k] = pre[b, t, i]
                    a[i, k] = pre[b, t, i] + x[b, t, i] - offset
            else:
                for i in range(i0, i1):
                    a[i, k] = -np.inf
                    xs[i, k] = -np.inf
                    ps[i, k] = -np.inf
