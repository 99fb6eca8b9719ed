"""Log-space chain sweeps over a sparse transition matrix shared by all steps, for the CPU.

The sweeps of ``kernels/cpu/chain.py`` (same messages, same normalisers, see its docstring)
with each step's dense log-space product replaced by a log-space SpMV over the stored entries
of a CSR structure: absent entries are ``-inf``. Per step, O(c + nnz) time per row.

- the forward message runs over the transpose (``t_indptr``, ``t_rows``, ``t_values``: the
  entries of column ``j`` in order of their row), an online log-sum-exp per column;
- the backward message runs over the matrix itself (``indptr``, ``indices``, ``values``);
- the gradient of the stored values sums ``exp(â_t[i] + T[i, j] + x[t+1, j] + beta[t+1, j])``
  over rows and steps at the stored entries only.

Every reduction is max-shifted and guards ``-inf``; NaN propagates along stored entries.
"""

import numpy as np
from numba import njit, prange

from .chain import normalise
from .exp import exp_nonpositive
from .logspace import lse_push, lse_value


@njit(cache=True)
def log_spmv(indptr, indices, values, y, out):
    """``out[r] = log sum_q exp(values[q] + y[indices[q]])`` over the entries ``q`` of row ``r``
    (``-inf`` for an empty row): a log-space sparse matrix-vector product, O(rows + nnz)."""
    for r in range(indptr.shape[0] - 1):
        m, s = -np.inf, 0.0
        for q in range(indptr[r], indptr[r + 1]):
            m, s = lse_push(m, s, values[q] + y[indices[q]])
        out[r] = lse_value(m, s)


@njit(parallel=True, cache=True)
def forward(x, t_indptr, t_rows, t_values, init, lengths, pre, norm):
    """Forward sweep: fills ``pre`` (B, v, c) and ``norm`` (B, v) as ``chain.chain_forward``
    does, over the transpose's CSR structure. O(B * v * (c + nnz)) time; rows in parallel."""
    rows, v, c = x.shape
    for b in prange(rows):
        length = lengths[b]
        u = np.empty(c, x.dtype)
        q = np.empty(c, x.dtype)
        pre[b, 0, :] = init[b]
        for j in range(c):
            q[j] = init[b, j] + x[b, 0, j]
        norm[b, 0] = normalise(q, u)
        for t in range(length - 1):
            log_spmv(t_indptr, t_rows, t_values, u, pre[b, t + 1])
            for j in range(c):
                q[j] = pre[b, t + 1, j] + x[b, t + 1, j]
            norm[b, t + 1] = normalise(q, u)
        pre[b, length:, :] = -np.inf
        norm[b, length:] = 0.0


@njit(parallel=True, cache=True)
def backward(x, indptr, indices, values, lengths, norm, beta):
    """Backward sweep: fills ``beta`` (B, v, c) as ``chain.chain_backward`` does.
    O(B * v * (c + nnz)) time; rows in parallel."""
    rows, v, c = x.shape
    for b in prange(rows):
        length = lengths[b]
        y = np.empty(c, x.dtype)
        beta[b, length:, :] = -np.inf
        beta[b, length - 1, :] = 0.0
        for t in range(length - 2, -1, -1):
            for j in range(c):
                y[j] = x[b, t + 1, j] + beta[b, t + 1, j]
            log_spmv(indptr, indices, values, y, beta[b, t])
            d = norm[b, t + 1]
            if d == -np.inf:  # the chain died at t + 1: nothing before it has a posterior
                beta[b, t, :] = -np.inf
            else:
                for i in range(c):
                    beta[b, t, i] -= d


@njit(parallel=True, cache=True)
def values_grad(x, indptr, indices, values, lengths, pre, norm, marg, weight, partial):
    """The expected count of each stored transition: overwrites ``partial`` (K, nnz) with the
    sums over rows ``b`` of chunk ``k`` (rows ``k * B // K`` to ``(k + 1) * B // K - 1``) of

    ``weight[b] * sum_t marg[b, t+1, j] * exp(â_t[i] + values[q] - pre[b, t+1, j])``

    for each entry ``q = (i, j)``; the gradient is ``partial.sum(0)``. Chunks run in parallel
    (no two threads write one entry). O(B * v * (c + nnz)) time.
    """
    rows, v, c = x.shape
    chunks = partial.shape[0]
    for k in prange(chunks):
        out = partial[k]
        out[:] = 0.0
        for b in range(k * rows // chunks, (k + 1) * rows // chunks):
            w = weight[b]
            for t in range(lengths[b] - 1):
                d = norm[b, t]
                for i in range(c):
                    a = pre[b, t, i] + x[b, t, i]
                    if np.isfinite(d):
                        a -= d
                    if a == -np.inf:
                        continue
                    for q in range(indptr[i], indptr[i + 1]):
                        j = indices[q]
                        gm = marg[b, t + 1, j]
                        if gm != 0.0:
                            out[q] += w * gm * exp_nonpositive(a + values[q] - pre[b, t + 1, j])


@njit(parallel=True, cache=True)
def viterbi(x, t_indptr, t_rows, t_values, init, lengths, work, backptr, score, path):
    """Max-product sweep and backtracking as ``chain.viterbi``, over the stored entries (those
    of a column in order of their row, so that ties go to the lowest state index)."""
    rows, v, c = x.shape
    for b in prange(rows):
        length = lengths[b]
        cur = 0
        for j in range(c):
            work[b, 0, j] = init[b, j] + x[b, 0, j]
        for t in range(length - 1):
            u = work[b, cur]
            new = work[b, 1 - cur]
            arg = backptr[b, t + 1]
            for j in range(c):
                best = -np.inf
                arg[j] = 0
                for q in range(t_indptr[j], t_indptr[j + 1]):
                    i = t_rows[q]
                    ui = u[i]
                    val = ui + t_values[q]
                    if val != val and ui == ui and t_values[q] == t_values[q]:  # +inf + -inf
                        val = -np.inf
                    if val > best or (val != val and best == best):
                        best = val
                        arg[j] = i
                new[j] = best + x[b, t + 1, j]
            cur = 1 - cur
        best_j = 0
        last = work[b, cur]
        for j in range(1, c):
            if last[j] > last[best_j] or (last[j] != last[j] and last[best_j] == last[best_j]):
                best_j = j
        score[b] = last[best_j] if c > 0 else -np.inf
        path[b, :] = -1
        if c > 0:
            path[b, length - 1] = best_j
            for t in range(length - 1, 0, -1):
                path[b, t - 1] = backptr[b, t, path[b, t]]


@njit(cache=True)
def first_duplicate(indptr, indices, marks):
    """The position of the first entry of a CSR structure that repeats an earlier one of its
    row, or -1. ``marks`` (columns,) int64 scratch, filled with -1 by the caller."""
    for i in range(indptr.shape[0] - 1):
        for q in range(indptr[i], indptr[i + 1]):
            j = indices[q]
            if marks[j] == i:
                return q
            marks[j] = i
    return -1


@njit(cache=True)
def entry_of(indptr, indices, src, dst, out):
    """``out[k]`` = the stored entry ``(src[k], dst[k])`` of a CSR structure without
    duplicates, or -1 where it is absent (or ``src[k]`` is negative)."""
    for k in range(src.shape[0]):
        out[k] = -1
        i = src[k]
        if i < 0:
            continue
        for q in range(indptr[i], indptr[i + 1]):
            if indices[q] == dst[k]:
                out[k] = q
                break
