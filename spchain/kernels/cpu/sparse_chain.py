"""Log-space chain sweeps over a sparse transition matrix shared by all steps, for the CPU.

The sweeps of ``spchain/kernels/cpu/chain.py`` (same messages, same normalisers, see its docstring)
with each step's dense log-space product replaced by a log-space SpMV over the stored entries
of a CSR structure: absent entries are ``-inf``. Per step, O(c + nnz) time per row.

- the forward message runs over the transpose (``t_indptr``, ``t_rows``, ``t_values``: the
  entries of column ``j`` in order of their row), an online log-sum-exp per column;
- the backward message runs over the matrix itself (``indptr``, ``indices``, ``values``);
- the gradient of the stored values sums ``exp(â_t[i] + T[i, j] + x[t+1, j] + beta[t+1, j])``
  over rows and steps at the stored entries only.

Every reduction is max-shifted and guards ``-inf``; NaN propagates along stored entries.
Viterbi runs here on the CPU; the CPU forward and backward sweeps run the scaled kernels of
``sparse_chain_scaled.py``, and the log-space ones here are the exact twins of
``spchain/kernels/cuda/sparse_chain.py`` (tested against each other and against the dense chain).

Each parallel kernel here and in ``sparse_chain_scaled.py`` is a serial body over a range of
chunks of rows (:func:`chunks`, a function of the batch alone) or of rows, run on a team of
threads (``team.py``); any team gives the same bits.
"""

import math

import numpy as np
from numba import njit

from . import team
from .chain import normalise
from .exp import exp_nonpositive
from .team import team_rows


@njit(cache=True)
def log_spmm(indptr, indices, values, y, out, top, shift, total):
    """``out[r, k] = log sum_q exp(values[q] + y[indices[q], k])`` over the entries ``q`` of
    row ``r`` (``-inf`` for an empty row): a log-space sparse matrix times the columns of ``y``
    (the rows of a chunk of the batch, innermost, so that the loops over them vectorise).

    Two passes over each row's entries: the maxima, then the sums of shifted exponentials
    (``-inf`` for an all ``-inf`` sum, NaN if a term is NaN). ``top``, ``shift``, ``total``
    are scratch of length ``y.shape[1]``. O((rows + nnz) * y.shape[1]) time.
    """
    width = y.shape[1]
    for r in range(indptr.shape[0] - 1):
        start, stop = indptr[r], indptr[r + 1]
        top[:] = -np.inf
        for q in range(start, stop):
            w = values[q]
            row = y[indices[q]]
            for k in range(width):
                top[k] = max(top[k], w + row[k])
        for k in range(width):
            shift[k] = top[k] if math.isfinite(top[k]) else 0.0
            total[k] = 0.0
        for q in range(start, stop):
            w = values[q]
            row = y[indices[q]]
            for k in range(width):
                total[k] += exp_nonpositive(w + row[k] - shift[k])
        for k in range(width):
            if top[k] == -np.inf:
                out[r, k] = -np.inf if total[k] == 0.0 else total[k]  # NaN stays NaN
            else:
                out[r, k] = shift[k] + math.log(total[k])


@njit(cache=True)
def chunk_of(rows, chunks, k):
    """The rows ``start, stop`` of chunk ``k`` of ``chunks`` (even splits of the batch)."""
    return k * rows // chunks, (k + 1) * rows // chunks


WIDTH = 32
"""Rows a chunk of the sweeps holds where the batch has more than ``2 * WIDTH`` (see :func:`chunks`)."""

CHUNKS = 64
"""Chunks of a batch at most (wider ones beyond ``CHUNKS * WIDTH`` rows): the value gradient's
sums per chunk take ``CHUNKS * nnz`` float64 at most."""


def chunks(rows: int) -> int:
    """The chunks (``chunk_of``) into which the sweeps split a batch of ``rows`` rows: two, or as
    many as make them ``WIDTH`` rows wide, ``CHUNKS`` at most (the loops over a chunk's rows
    vectorise: on 2 threads, batch 64, c 4096, chunks of 32 rows ran a step 1.3 times as fast as
    4 of 16 and 6 times as fast as 64 of one row). A function of ``rows`` alone, not of the
    threads that run them, so that the sums over chunks (the value gradient) are the same bits
    on every route and number of threads; a batch of at most ``2 * WIDTH`` rows keeps at most
    two threads busy."""
    return min(rows, max(2, min(CHUNKS, -(-rows // WIDTH))))


def sparse_chain_forward(x, t_indptr, t_rows, t_values, init, lengths, pre, norm):
    """Forward sweep: fills ``pre`` (B, v, c) and ``norm`` (B, v) as ``chain.chain_forward``
    does, over the transpose's CSR structure. Chunks of rows (:func:`chunks`) run in parallel
    (on torch's threads where torch runs, ``team.run``), each one step at a time for all its
    rows. O(B * v * (c + nnz)) time, O(c * B) scratch."""
    team.run(sparse_chain_forward_chunks, x, t_indptr, t_rows, t_values, init, lengths, pre, norm, chunks(x.shape[0]))


@njit(nogil=True, cache=True)
def sparse_chain_forward_chunks(parallel, threads, x, t_indptr, t_rows, t_values, init, lengths, pre, norm, chunks):
    """:func:`sparse_chain_forward` in ``chunks`` chunks of rows."""
    return team_rows(parallel, threads, _forward_chunks, chunks,
                     (x, t_indptr, t_rows, t_values, init, lengths, pre, norm, chunks))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _forward_chunks(lo, hi, x, t_indptr, t_rows, t_values, init, lengths, pre, norm, chunks):
    """Chunks ``lo:hi`` (of ``chunks``) of :func:`sparse_chain_forward_chunks`."""
    rows, v, c = x.shape
    for chunk in range(lo, hi):
        b0, b1 = chunk_of(rows, chunks, chunk)
        width = b1 - b0
        u = np.empty((c, width), x.dtype)  # the normalised messages of the chunk, state-major
        out = np.empty((c, width), x.dtype)
        top, shift, total = np.empty(width), np.empty(width), np.empty(width)
        q = np.empty(c, x.dtype)
        un = np.empty(c, x.dtype)
        longest = 0
        for k in range(width):
            b = b0 + k
            longest = max(longest, lengths[b])
            for j in range(c):  # (an array assignment compiles Numba's shape-mismatch message: seconds)
                pre[b, 0, j] = init[b, j]
                q[j] = init[b, j] + x[b, 0, j]
            norm[b, 0] = normalise(q, un)
            u[:, k] = un
        for t in range(longest - 1):
            log_spmm(t_indptr, t_rows, t_values, u, out, top, shift, total)
            for k in range(width):
                b = b0 + k
                if t + 1 < lengths[b]:
                    for j in range(c):
                        pre[b, t + 1, j] = out[j, k]
                        q[j] = out[j, k] + x[b, t + 1, j]
                    norm[b, t + 1] = normalise(q, un)
                    u[:, k] = un
                else:
                    u[:, k] = -np.inf
        for k in range(width):
            b = b0 + k
            pre[b, lengths[b]:, :] = -np.inf
            norm[b, lengths[b]:] = 0.0


def sparse_chain_backward(x, indptr, indices, values, lengths, norm, beta):
    """Backward sweep: fills ``beta`` (B, v, c) as ``chain.chain_backward`` does; chunks of
    rows in parallel as in :func:`sparse_chain_forward`. O(B * v * (c + nnz)) time."""
    team.run(sparse_chain_backward_chunks, x, indptr, indices, values, lengths, norm, beta, chunks(x.shape[0]))


@njit(nogil=True, cache=True)
def sparse_chain_backward_chunks(parallel, threads, x, indptr, indices, values, lengths, norm, beta, chunks):
    """:func:`sparse_chain_backward` in ``chunks`` chunks of rows."""
    return team_rows(parallel, threads, _backward_chunks, chunks,
                     (x, indptr, indices, values, lengths, norm, beta, chunks))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _backward_chunks(lo, hi, x, indptr, indices, values, lengths, norm, beta, chunks):
    """Chunks ``lo:hi`` (of ``chunks``) of :func:`sparse_chain_backward_chunks`."""
    rows, v, c = x.shape
    for chunk in range(lo, hi):
        b0, b1 = chunk_of(rows, chunks, chunk)
        width = b1 - b0
        y = np.empty((c, width), x.dtype)
        out = np.empty((c, width), x.dtype)
        top, shift, total = np.empty(width), np.empty(width), np.empty(width)
        longest = 0
        for k in range(width):
            b = b0 + k
            longest = max(longest, lengths[b])
            beta[b, lengths[b]:, :] = -np.inf
            beta[b, lengths[b] - 1, :] = 0.0
        for t in range(longest - 2, -1, -1):
            for k in range(width):
                b = b0 + k
                for j in range(c):
                    y[j, k] = x[b, t + 1, j] + beta[b, t + 1, j] if t + 1 < lengths[b] else -np.inf
            log_spmm(indptr, indices, values, y, out, top, shift, total)
            for k in range(width):
                b = b0 + k
                if t + 1 < lengths[b]:
                    d = norm[b, t + 1]
                    for i in range(c):
                        # the chain died at t + 1: nothing before it has a posterior
                        beta[b, t, i] = -np.inf if d == -np.inf else out[i, k] - d


@njit(nogil=True, cache=True)
def sparse_chain_values_grad(parallel, threads, x, indptr, indices, values, lengths, pre, norm, marg, weight, partial):
    """The expected count of each stored transition: overwrites ``partial`` (K, nnz) with the
    sums over rows ``b`` of chunk ``k`` (rows ``k * B // K`` to ``(k + 1) * B // K - 1``) of

    ``weight[b] * sum_t marg[b, t+1, j] * exp(â_t[i] + values[q] - pre[b, t+1, j])``

    for each entry ``q = (i, j)``; the gradient is ``partial.sum(0)``. Chunks run in parallel
    (no two threads write one entry), each one step at a time for all its rows (innermost).
    O(B * v * (c + nnz)) time (on a team of threads: ``team.run``).
    """
    return team_rows(parallel, threads, _values_grad_chunks, partial.shape[0],
                     (x, indptr, indices, values, lengths, pre, norm, marg, weight, partial))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _values_grad_chunks(lo, hi, x, indptr, indices, values, lengths, pre, norm, marg, weight, partial):
    """Chunks ``lo:hi`` (of ``partial.shape[0]``) of :func:`sparse_chain_values_grad`."""
    rows, v, c = x.shape
    chunks = partial.shape[0]
    for chunk in range(lo, hi):
        out = partial[chunk]
        out[:] = 0.0
        b0, b1 = chunk_of(rows, chunks, chunk)
        width = b1 - b0
        a = np.empty((c, width), x.dtype)  # â_t, -inf where the step is not taken
        m = np.empty((c, width), x.dtype)  # weight * marg[t + 1]
        p = np.empty((c, width), x.dtype)  # pre[t + 1], +inf where m is 0 (its term is 0)
        longest = 0
        for k in range(width):
            longest = max(longest, lengths[b0 + k])
        for t in range(longest - 1):
            for k in range(width):
                b = b0 + k
                taken = t + 1 < lengths[b]
                d = norm[b, t]
                offset = d if math.isfinite(d) else 0.0
                for i in range(c):
                    a[i, k] = pre[b, t, i] + x[b, t, i] - offset if taken else -np.inf
                    gm = marg[b, t + 1, i]
                    m[i, k] = weight[b] * gm if taken else 0.0
                    p[i, k] = pre[b, t + 1, i] if taken and gm != 0.0 else np.inf
            for i in range(c):
                ai = a[i]
                for q in range(indptr[i], indptr[i + 1]):
                    j = indices[q]
                    w = values[q]
                    mj = m[j]
                    pj = p[j]
                    acc = 0.0
                    for k in range(width):
                        acc += mj[k] * exp_nonpositive(ai[k] + w - pj[k])
                    out[q] += acc


@njit(nogil=True, cache=True)
def sparse_chain_viterbi(parallel, threads, x, t_indptr, t_rows, t_values, init, lengths, work, backptr, score, path):
    """Max-product sweep and backtracking as ``chain.chain_viterbi``, over the stored entries (those
    of a column in order of their row, so that ties go to the lowest state index); rows run in
    parallel (on a team of threads: ``team.run``)."""
    return team_rows(parallel, threads, _viterbi_rows, x.shape[0],
                     (x, t_indptr, t_rows, t_values, init, lengths, work, backptr, score, path))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _viterbi_rows(lo, hi, x, t_indptr, t_rows, t_values, init, lengths, work, backptr, score, path):
    """Rows ``lo:hi`` of :func:`sparse_chain_viterbi`."""
    c = x.shape[2]
    for b in range(lo, hi):
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
