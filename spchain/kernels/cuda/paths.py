"""Paths of log-space chains for CUDA: the twins of ``spchain/kernels/cpu/paths.py`` (same arguments,
same outputs). One thread per sample (``chain_sample``) or per row (``chain_kbest``),
grid-stride loops; scratch lives in the arrays the launchers are given.
"""

import math

from numba import cuda

from ..rules import WALK_CHUNK, kbest_backtrack, kbest_insert, kbest_plus
from . import config


@cuda.jit(device=True)
def _draw_exact(alpha, b, t, trans_t, g, s, state, u):
    """The CPU twin's ``draw_exact``, with ``math.exp``."""
    c = alpha.shape[2]
    top = -math.inf
    for i in range(c):
        val = alpha[b, t, i] + (trans_t[g, s, state, i] if state >= 0 else 0.0)
        if val > top:
            top = val
    if not (top > -math.inf and top < math.inf):
        return -1
    total = 0.0
    for i in range(c):
        total += math.exp(alpha[b, t, i] + (trans_t[g, s, state, i] if state >= 0 else 0.0) - top)
    if total != total:
        return -1
    threshold = u * total
    last = -1
    cumulative = 0.0
    for i in range(c):
        w = math.exp(alpha[b, t, i] + (trans_t[g, s, state, i] if state >= 0 else 0.0) - top)
        if w > 0.0:
            last = i
            cumulative += w
            if cumulative > threshold:
                return i
    return last


@cuda.jit(device=True)
def _draw(alpha, probs, b, t, trans_t, trans_probs, g, s, state, u, tiny, total):
    """The CPU twin's ``draw``."""
    if not total >= tiny or total == math.inf:
        return _draw_exact(alpha, b, t, trans_t, g, s, state, u)
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


@cuda.jit
def chain_sample_kernel(alpha, probs, trans_t, trans_probs, totals, tiny, group, lengths, possible, uniforms, paths):
    """Backward sampling, the twin of ``kernels.cpu.paths.chain_sample`` (same arguments, same draws).

    Inputs: ``alpha``, ``probs`` (B, v, c), ``trans_t``, ``trans_probs`` (G, S, c, c), ``totals`` (B, v - 1, c),
    ``tiny``, ``group``, ``lengths`` (B,), ``possible`` (B,), ``uniforms`` (N, B, v). Output: ``paths`` (N, B,
    v, int64), overwritten.
    Launch: grid ``blocks_for(N * B)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread a path (grid-stride)."""
    samples, rows, v = paths.shape
    per_step = trans_t.shape[1] > 1
    for bn in range(cuda.grid(1), samples * rows, cuda.gridsize(1)):
        b = bn // samples
        n = bn % samples
        g = b // group
        length = lengths[b]
        for t in range(v):
            paths[n, b, t] = -1
        if not possible[b]:
            continue
        total = 0.0
        for i in range(probs.shape[2]):
            total += probs[b, length - 1, i]
        state = _draw(alpha, probs, b, length - 1, trans_t, trans_probs, g, 0, -1, uniforms[n, b, length - 1], tiny,
                     total)
        paths[n, b, length - 1] = state
        for t in range(length - 2, -1, -1):
            if state < 0:
                break
            s = t if per_step else 0
            state = _draw(alpha, probs, b, t, trans_t, trans_probs, g, s, state, uniforms[n, b, t], tiny,
                         totals[b, t, state])
            paths[n, b, t] = state
        if state < 0:
            for t in range(v):
                paths[n, b, t] = -1


def launch_chain_sample(alpha, probs, trans_t, trans_probs, totals, tiny, group, lengths, possible, uniforms, paths,
                        stream=0):
    """Backward sampling; overwrites ``paths`` (see ``kernels.cpu.paths.chain_sample``)."""
    items = paths.shape[0] * paths.shape[1]
    if items == 0:
        return
    chain_sample_kernel[config.blocks_for(items), config.THREADS_PER_BLOCK, stream](
        alpha, probs, trans_t, trans_probs, totals, tiny, group, lengths, possible, uniforms, paths)


@cuda.jit(device=True)
def _kbest_first(b, x, init, work, counts):
    """Position 0 of row ``b``: one partial path per state, in ``work[b, 0]`` / ``counts[b, 0]``."""
    zero = x.dtype.type(0)  # not 0.0: a float64 sum would make float32 kernels compute in float64
    for j in range(x.shape[2]):
        for r in range(work.shape[3]):
            work[b, 0, j, r] = -math.inf
            counts[b, 0, j, r] = 0
        f, n = kbest_plus(zero, 0, init[b, j])
        f, n = kbest_plus(f, n, x[b, 0, j])
        work[b, 0, j, 0] = f
        counts[b, 0, j, 0] = n


@cuda.jit(device=True)
def _kbest_clear(new, index, k):
    """Empty the ``k`` slots of a state's next partial paths."""
    for r in range(k):
        new[r] = -math.inf
        index[r] = -1


@cuda.jit(device=True)
def _kbest_candidate(work, counts, b, cur, i, k, value, new, new_counts, index):
    """Offer the ``k`` partial paths of state ``i`` times the log term ``value`` to ``new``."""
    for r in range(k):
        if work[b, cur, i, r] != -math.inf:  # an empty slot, or a path of weight 0
            f, n = kbest_plus(work[b, cur, i, r], counts[b, cur, i, r], value)
            kbest_insert(new, new_counts, index, k, f, n, i * k + r)


@cuda.jit(device=True)
def _kbest_emit(new, new_counts, index, k, value):
    """The emission ``value`` times the kept partial paths of a state (not the empty slots)."""
    for r in range(k):
        if index[r] >= 0:
            f, n = kbest_plus(new[r], new_counts[r], value)
            new[r] = f
            new_counts[r] = n


@cuda.jit(device=True)
def _kbest_last(b, length, cur, work, counts, backptr, scores, paths):
    """Rank the partial paths of the last position of row ``b`` and follow their back-pointers."""
    c, k = work.shape[2], work.shape[3]
    best = work[b, 1 - cur, 0]  # free scratch now, as is backptr[b, 0]
    best_counts = counts[b, 1 - cur, 0]
    index = backptr[b, 0, 0]
    _kbest_clear(best, index, k)
    for j in range(c):
        for r in range(k):
            kbest_insert(best, best_counts, index, k, work[b, cur, j, r], counts[b, cur, j, r], j * k + r)
    for r in range(k):
        if index[r] >= 0 and best_counts[r] > 0 and best[r] == best[r]:
            scores[r, b] = math.inf
        else:
            scores[r, b] = best[r]
        kbest_backtrack(paths, backptr, r, b, index[r], length, k)


@cuda.jit
def chain_kbest_kernel(x, trans, group, init, lengths, work, counts, backptr, scores, paths):
    """Exact k-best Viterbi, the twin of ``kernels.cpu.paths.chain_kbest`` (same arguments).

    Inputs: ``x`` (B, v, c), ``trans`` (G, S, c, c), ``group``, ``init`` (B, c), ``lengths`` (B,); scratch
    ``work``, ``counts`` and ``backptr``. Outputs: ``scores`` (k, B) and ``paths`` (k, B, v), overwritten.
    Launch: grid ``blocks_for(B)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread a row of the batch
    (grid-stride)."""
    rows, v, c = x.shape
    k = scores.shape[0]
    per_step = trans.shape[1] > 1
    for b in range(cuda.grid(1), rows, cuda.gridsize(1)):
        g = b // group
        _kbest_first(b, x, init, work, counts)
        cur = 0
        for t in range(lengths[b] - 1):
            s = t if per_step else 0
            for j in range(c):
                new, new_counts, index = work[b, 1 - cur, j], counts[b, 1 - cur, j], backptr[b, t + 1, j]
                _kbest_clear(new, index, k)
                for i in range(c):
                    _kbest_candidate(work, counts, b, cur, i, k, trans[g, s, i, j], new, new_counts, index)
                _kbest_emit(new, new_counts, index, k, x[b, t + 1, j])
            cur = 1 - cur
        _kbest_last(b, lengths[b], cur, work, counts, backptr, scores, paths)


@cuda.jit
def sparse_chain_kbest_kernel(x, t_indptr, t_rows, t_values, init, lengths, work, counts, backptr, scores, paths):
    """Exact k-best Viterbi with one sparse transition matrix, the twin of
    ``kernels.cpu.paths.sparse_chain_kbest`` (same arguments but the CPU's team).

    Inputs: ``x`` (B, v, c), the transpose's CSR ``t_indptr`` (c + 1,), ``t_rows`` and ``t_values``
    (nnz,), ``init`` (B, c), ``lengths`` (B,); scratch ``work``, ``counts`` and ``backptr``. Outputs:
    ``scores`` (k, B) and ``paths`` (k, B, v), overwritten. Launch: grid ``blocks_for(B)`` blocks of
    ``THREADS_PER_BLOCK`` threads, a thread a row of the batch (grid-stride), which visits the
    stored predecessors of each state only: O(v · (c + nnz) · k²) a row."""
    rows, v, c = x.shape
    k = scores.shape[0]
    for b in range(cuda.grid(1), rows, cuda.gridsize(1)):
        _kbest_first(b, x, init, work, counts)
        cur = 0
        for t in range(lengths[b] - 1):
            for j in range(c):
                new, new_counts, index = work[b, 1 - cur, j], counts[b, 1 - cur, j], backptr[b, t + 1, j]
                _kbest_clear(new, index, k)
                for q in range(t_indptr[j], t_indptr[j + 1]):
                    _kbest_candidate(work, counts, b, cur, t_rows[q], k, t_values[q], new, new_counts, index)
                _kbest_emit(new, new_counts, index, k, x[b, t + 1, j])
            cur = 1 - cur
        _kbest_last(b, lengths[b], cur, work, counts, backptr, scores, paths)


def launch_chain_kbest(x, trans, group, init, lengths, work, counts, backptr, scores, paths, stream=0):
    """k-best Viterbi; overwrites ``scores`` and ``paths`` (see ``kernels.cpu.paths.chain_kbest``)."""
    if x.shape[0] == 0:
        return
    chain_kbest_kernel[config.blocks_for(x.shape[0]), config.THREADS_PER_BLOCK, stream](
        x, trans, group, init, lengths, work, counts, backptr, scores, paths)


def launch_sparse_chain_kbest(x, t_indptr, t_rows, t_values, init, lengths, work, counts, backptr, scores, paths,
                              stream=0):
    """Sparse k-best Viterbi; overwrites ``scores`` and ``paths`` (see
    ``kernels.cpu.paths.sparse_chain_kbest``)."""
    if x.shape[0] == 0:
        return
    sparse_chain_kbest_kernel[config.blocks_for(x.shape[0]), config.THREADS_PER_BLOCK, stream](
        x, t_indptr, t_rows, t_values, init, lengths, work, counts, backptr, scores, paths)
