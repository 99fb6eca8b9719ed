"""Paths of log-space chains for CUDA: the twins of ``spchain/kernels/cpu/paths.py`` (same arguments,
same outputs). One thread per sample (``chain_sample``) or per row (``chain_kbest``),
grid-stride loops; scratch lives in the arrays the launchers are given.
"""

import math

from numba import cuda

from ..rules import WALK_CHUNK, kbest_row, sparse_kbest_row
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


@cuda.jit
def chain_kbest_kernel(x, trans, group, init, lengths, work, counts, backptr, scores, paths):
    """Exact k-best Viterbi, the twin of ``kernels.cpu.paths.chain_kbest`` (same arguments).

    Inputs: ``x`` (B, v, c), ``trans`` (G, S, c, c), ``group``, ``init`` (B, c), ``lengths`` (B,); scratch
    ``work``, ``counts`` and ``backptr``. Outputs: ``scores`` (k, B) and ``paths`` (k, B, v), overwritten.
    Launch: grid ``blocks_for(B)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread a row of the batch
    (grid-stride)."""
    for b in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        kbest_row(b, x, trans, group, init, lengths, work, counts, backptr, scores, paths)


@cuda.jit
def sparse_chain_kbest_kernel(x, t_indptr, t_rows, t_values, init, lengths, work, counts, backptr, scores, paths):
    """Exact k-best Viterbi with one sparse transition matrix, the twin of
    ``kernels.cpu.paths.sparse_chain_kbest`` (same arguments but the CPU's team).

    Inputs: ``x`` (B, v, c), the transpose's CSR ``t_indptr`` (c + 1,), ``t_rows`` and ``t_values``
    (nnz,), ``init`` (B, c), ``lengths`` (B,); scratch ``work``, ``counts`` and ``backptr``. Outputs:
    ``scores`` (k, B) and ``paths`` (k, B, v), overwritten. Launch: grid ``blocks_for(B)`` blocks of
    ``THREADS_PER_BLOCK`` threads, a thread a row of the batch (grid-stride), which visits the
    stored predecessors of each state only: O(v · (c + nnz) · k²) a row."""
    for b in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        sparse_kbest_row(b, x, t_indptr, t_rows, t_values, init, lengths, work, counts, backptr, scores, paths)


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
