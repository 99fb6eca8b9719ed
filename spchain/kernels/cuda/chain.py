"""Log-space chain sweeps for CUDA: the twins of ``spchain/kernels/cpu/chain.py`` (same arguments,
same outputs; see that module for the normalised messages they compute).

One block per row of the batch (grid-stride over rows), threads over states. The message of
the step in flight is staged in shared memory, ``STATE_CHUNK`` states at a time, and every
state keeps an online (running-max) log-sum-exp over the chunks, so any number of states
fits. Block-wide log-sum-exps (the normalisers) are tree reductions of ``(max, sum)`` pairs.
Shared memory is dynamic, sized by the launcher, so launch sizes never need a recompile.
"""

import functools
import math

import numba
import numpy as np
from numba import cuda

from . import config
from ..rules import like
from .logspace import lse_merge, lse_push, lse_value


@cuda.jit(device=True)
def _block_log_sum_exp(m, s, red_m, red_s):
    """Every thread passes its partial ``(m, s)``; every thread gets the block's log-sum-exp."""
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    red_m[tid] = m
    red_s[tid] = s
    cuda.syncthreads()
    stride = 1
    while stride < threads:
        if tid % (2 * stride) == 0 and tid + stride < threads:
            red_m[tid], red_s[tid] = lse_merge(red_m[tid], red_s[tid], red_m[tid + stride], red_s[tid + stride])
        cuda.syncthreads()
        stride *= 2
    total = lse_value(red_m[0], red_s[0])
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def _finite(v):
    return v == v and v != like(v, math.inf) and v != like(v, -math.inf)


@cuda.jit(device=True)
def _forward_tail(pre, norm, b, length, tid, threads, neg_inf, zero):
    """The forward messages of row ``b`` past its length: ``pre`` ``neg_inf``, ``norm`` ``zero``
    (a block's threads ``tid`` of ``threads`` share the states)."""
    for t in range(length, pre.shape[1]):
        for j in range(tid, pre.shape[2], threads):
            pre[b, t, j] = neg_inf
        if tid == 0:
            norm[b, t] = zero


@cuda.jit(device=True)
def _backward_tail(beta, b, length, tid, threads, neg_inf, zero):
    """The backward messages of row ``b`` from its last position on: ``zero`` there, ``neg_inf``
    past it (a block's threads ``tid`` of ``threads`` share the states)."""
    for t in range(length - 1, beta.shape[1]):
        for i in range(tid, beta.shape[2], threads):
            beta[b, t, i] = zero if t == length - 1 else neg_inf


@functools.cache
def _forward_kernel(dtype):
    dtype = numba.from_dtype(dtype)

    @cuda.jit
    def chain_forward_kernel(x, trans, group, chunk, init, lengths, pre, norm):
        """Forward sweep, the twin of ``kernels.cpu.chain.chain_forward``.

        Inputs: ``x`` (B, v, c), ``trans`` (G, S, c, c), ``group``, ``chunk`` (states staged in shared memory at
        a time), ``init`` (B, c), ``lengths`` (B,). Outputs: ``pre`` (B, v, c) and ``norm`` (B, v), overwritten.
        Launch: grid ``blocks_for(B, 1)`` blocks, one row of the batch each (grid-stride over rows); block
        ``THREADS_PER_BLOCK`` threads over the states; dynamic shared memory ``chunk + 2 * threads`` values."""
        rows, v, c = x.shape
        per_step = trans.shape[1] > 1
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        buf = cuda.shared.array(0, dtype)
        msg = buf[:chunk]
        red_m = buf[chunk:chunk + threads]
        red_s = buf[chunk + threads:chunk + 2 * threads]
        neg_inf, zero = x.dtype.type(-math.inf), x.dtype.type(0)
        for b in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            g = b // group
            length = lengths[b]
            m, s = neg_inf, zero
            for j in range(tid, c, threads):
                pre[b, 0, j] = init[b, j]
                m, s = lse_push(m, s, init[b, j] + x[b, 0, j])
            d = _block_log_sum_exp(m, s, red_m, red_s)
            if tid == 0:
                norm[b, 0] = d
            for t in range(length - 1):
                step = t if per_step else 0
                offset = d if _finite(d) else zero
                for j0 in range(0, c, threads):
                    j = j0 + tid
                    m, s = neg_inf, zero
                    for i0 in range(0, c, chunk):
                        width = chunk if chunk < c - i0 else c - i0
                        cuda.syncthreads()
                        for k in range(tid, width, threads):
                            msg[k] = pre[b, t, i0 + k] + x[b, t, i0 + k] - offset
                        cuda.syncthreads()
                        if j < c:
                            for k in range(width):
                                m, s = lse_push(m, s, msg[k] + trans[g, step, i0 + k, j])
                    if j < c:
                        pre[b, t + 1, j] = lse_value(m, s)
                cuda.syncthreads()
                m, s = neg_inf, zero
                for j in range(tid, c, threads):
                    m, s = lse_push(m, s, pre[b, t + 1, j] + x[b, t + 1, j])
                d = _block_log_sum_exp(m, s, red_m, red_s)
                if tid == 0:
                    norm[b, t + 1] = d
            _forward_tail(pre, norm, b, length, tid, threads, neg_inf, zero)
            cuda.syncthreads()

    return chain_forward_kernel


@functools.cache
def _backward_kernel(dtype):
    dtype = numba.from_dtype(dtype)

    @cuda.jit
    def chain_backward_kernel(x, trans, group, chunk, lengths, norm, beta):
        """Backward sweep, the twin of ``kernels.cpu.chain.chain_backward``.

        Inputs: ``x`` (B, v, c), ``trans`` (G, S, c, c), ``group``, ``chunk``, ``lengths`` (B,), ``norm`` (B, v)
        of the forward sweep. Output: ``beta`` (B, v, c), overwritten.
        Launch: grid ``blocks_for(B, 1)`` blocks, one row of the batch each (grid-stride over rows); block
        ``THREADS_PER_BLOCK`` threads over the states; dynamic shared memory ``chunk`` values."""
        rows, v, c = x.shape
        per_step = trans.shape[1] > 1
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        msg = cuda.shared.array(0, dtype)[:chunk]
        neg_inf, zero = x.dtype.type(-math.inf), x.dtype.type(0)
        for b in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            g = b // group
            length = lengths[b]
            _backward_tail(beta, b, length, tid, threads, neg_inf, zero)
            for t in range(length - 2, -1, -1):
                step = t if per_step else 0
                d = norm[b, t + 1]
                for i0 in range(0, c, threads):
                    i = i0 + tid
                    m, s = neg_inf, zero
                    for j0 in range(0, c, chunk):
                        width = chunk if chunk < c - j0 else c - j0
                        cuda.syncthreads()
                        for k in range(tid, width, threads):
                            msg[k] = x[b, t + 1, j0 + k] + beta[b, t + 1, j0 + k]
                        cuda.syncthreads()
                        if i < c:
                            for k in range(width):
                                m, s = lse_push(m, s, trans[g, step, i, j0 + k] + msg[k])
                    if i < c:
                        beta[b, t, i] = neg_inf if d == neg_inf else lse_value(m, s) - d
                cuda.syncthreads()

    return chain_backward_kernel


@cuda.jit(device=True)
def _transition_count(x, trans, group, lengths, pre, norm, marg, weight, g, s, i, j):
    """The expected count of ``i -> j`` under matrix ``(g, s)``, summed over its rows and steps."""
    per_step = trans.shape[1] > 1
    neg_inf, zero = x.dtype.type(-math.inf), x.dtype.type(0)
    acc = zero
    tr = trans[g, s, i, j]
    for b in range(g * group, (g + 1) * group):
        w = weight[b]
        first = s if per_step else 0
        last = lengths[b] - 1
        if per_step and s + 1 < last:
            last = s + 1
        for t in range(first, last):
            d = norm[b, t]
            a = pre[b, t, i] + x[b, t, i]
            if _finite(d):
                a -= d
            gm = marg[b, t + 1, j]
            if a != neg_inf and gm != zero:
                acc += w * gm * math.exp(a + tr - pre[b, t + 1, j])
    return acc


@cuda.jit
def chain_transition_grad_kernel(x, trans, group, lengths, pre, norm, marg, weight, grad):
    """Expected transition counts, the twin of ``kernels.cpu.chain.chain_transition_grad``.

    Inputs: ``x``, ``pre``, ``marg`` (B, v, c), ``trans`` (G, S, c, c), ``group``, ``lengths`` (B,), ``norm``
    (B, v), ``weight`` (B,). Output: ``grad`` (G, S, c, c), overwritten.
    Launch: grid ``blocks_for(G * S * c, 1)`` blocks, one row ``(g, s, i)`` of ``grad`` each (grid-stride);
    block ``THREADS_PER_BLOCK`` threads over its columns ``j``."""
    groups, steps, c, _ = trans.shape
    for gsi in range(cuda.blockIdx.x, groups * steps * c, cuda.gridDim.x):
        g = gsi // (steps * c)
        s = (gsi // c) % steps
        i = gsi % c
        for j in range(cuda.threadIdx.x, c, cuda.blockDim.x):
            grad[g, s, i, j] = _transition_count(x, trans, group, lengths, pre, norm, marg, weight, g, s, i, j)


@cuda.jit
def chain_transition_grad_masked_kernel(x, trans, group, lengths, pre, norm, marg, weight, ok, grad):
    """:func:`chain_transition_grad_kernel` for the matrices ``(g, s)`` where ``ok[g, s]`` is
    False only; the others keep their ``grad`` (the batched-GEMM counts). Reading ``ok`` here,
    on the device, spares the host a synchronisation: where every matrix is ok, each block
    only reads its flags.

    Inputs as :func:`chain_transition_grad_kernel`, and ``ok`` (G, S) bool. Output: ``grad`` (G, S, c, c), its
    matrices with ``ok`` False overwritten.
    Launch: as :func:`chain_transition_grad_kernel`."""
    groups, steps, c, _ = trans.shape
    for gsi in range(cuda.blockIdx.x, groups * steps * c, cuda.gridDim.x):
        g = gsi // (steps * c)
        s = (gsi // c) % steps
        if ok[g, s]:
            continue
        i = gsi % c
        for j in range(cuda.threadIdx.x, c, cuda.blockDim.x):
            grad[g, s, i, j] = _transition_count(x, trans, group, lengths, pre, norm, marg, weight, g, s, i, j)


@functools.cache
def _viterbi_kernel(dtype):
    dtype = numba.from_dtype(dtype)

    @cuda.jit
    def chain_viterbi_kernel(x, trans, group, chunk, init, lengths, work, backptr, score, path):
        """Best paths, the twin of ``kernels.cpu.chain.chain_viterbi``.

        Inputs: ``x`` (B, v, c), ``trans`` (G, S, c, c), ``group``, ``chunk``, ``init`` (B, c), ``lengths``
        (B,); scratch ``work`` (B, 2, c) and ``backptr`` (B, v, c, int32). Outputs: ``score`` (B,) and ``path``
        (B, v, int64), overwritten.
        Launch: grid ``blocks_for(B, 1)`` blocks, one row of the batch each (grid-stride over rows); block
        ``THREADS_PER_BLOCK`` threads over the states; dynamic shared memory ``chunk`` values."""
        rows, v, c = x.shape
        per_step = trans.shape[1] > 1
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        msg = cuda.shared.array(0, dtype)[:chunk]
        neg_inf = x.dtype.type(-math.inf)
        for b in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            g = b // group
            length = lengths[b]
            cur = 0
            for j in range(tid, c, threads):
                work[b, 0, j] = init[b, j] + x[b, 0, j]
            for t in range(length - 1):
                step = t if per_step else 0
                for j0 in range(0, c, threads):
                    j = j0 + tid
                    best = neg_inf
                    arg = 0
                    for i0 in range(0, c, chunk):
                        width = chunk if chunk < c - i0 else c - i0
                        cuda.syncthreads()
                        for k in range(tid, width, threads):
                            msg[k] = work[b, cur, i0 + k]
                        cuda.syncthreads()
                        if j < c:
                            for k in range(width):
                                val = msg[k] + trans[g, step, i0 + k, j]
                                if val > best or (val != val and best == best):
                                    best = val
                                    arg = i0 + k
                    if j < c:
                        work[b, 1 - cur, j] = best + x[b, t + 1, j]
                        backptr[b, t + 1, j] = arg
                cur = 1 - cur
                cuda.syncthreads()
            if tid == 0:
                best = 0
                for j in range(1, c):
                    if work[b, cur, j] > work[b, cur, best] or (
                            work[b, cur, j] != work[b, cur, j] and work[b, cur, best] == work[b, cur, best]):
                        best = j
                score[b] = work[b, cur, best] if c > 0 else neg_inf
                for t in range(v):
                    path[b, t] = -1
                if c > 0:
                    path[b, length - 1] = best
                    for t in range(length - 1, 0, -1):
                        path[b, t - 1] = backptr[b, t, path[b, t]]
            cuda.syncthreads()

    return chain_viterbi_kernel


def _shared_bytes(dtype, chunk: int, threads: int) -> int:
    return (chunk + 2 * threads) * np.dtype(dtype).itemsize


def launch_chain_forward(x, trans, group, init, lengths, pre, norm, stream=0):
    """Forward sweep; fills ``pre`` and ``norm`` (see ``kernels.cpu.chain.chain_forward``)."""
    if x.shape[0] == 0:
        return
    threads, chunk = config.THREADS_PER_BLOCK, config.STATE_CHUNK
    kernel = _forward_kernel(np.dtype(x.dtype))
    shared = _shared_bytes(x.dtype, chunk, threads)
    kernel[config.blocks_for(x.shape[0], 1), threads, stream, shared](x, trans, group, chunk, init, lengths, pre, norm)


def launch_chain_backward(x, trans, group, lengths, norm, beta, stream=0):
    """Backward sweep; fills ``beta`` (see ``kernels.cpu.chain.chain_backward``)."""
    if x.shape[0] == 0:
        return
    threads, chunk = config.THREADS_PER_BLOCK, config.STATE_CHUNK
    kernel = _backward_kernel(np.dtype(x.dtype))
    shared = _shared_bytes(x.dtype, chunk, 0)
    kernel[config.blocks_for(x.shape[0], 1), threads, stream, shared](x, trans, group, chunk, lengths, norm, beta)


def launch_chain_transition_grad(x, trans, group, lengths, pre, norm, marg, weight, grad, stream=0):
    """Expected transition counts; overwrites ``grad`` (see ``kernels.cpu.chain.chain_transition_grad``)."""
    rows_of_grad = grad.shape[0] * grad.shape[1] * grad.shape[2]
    if rows_of_grad == 0:
        return
    kernel = chain_transition_grad_kernel
    kernel[config.blocks_for(rows_of_grad, 1), config.THREADS_PER_BLOCK, stream](
        x, trans, group, lengths, pre, norm, marg, weight, grad)


def launch_chain_transition_grad_masked(x, trans, group, lengths, pre, norm, marg, weight, ok, grad, stream=0):
    """Exact expected transition counts of the matrices where ``ok`` (G, S) is False; the rest
    of ``grad`` is left as it is (:func:`chain_transition_grad_masked_kernel`)."""
    rows_of_grad = grad.shape[0] * grad.shape[1] * grad.shape[2]
    if rows_of_grad == 0:
        return
    chain_transition_grad_masked_kernel[config.blocks_for(rows_of_grad, 1), config.THREADS_PER_BLOCK, stream](
        x, trans, group, lengths, pre, norm, marg, weight, ok, grad)


def launch_chain_viterbi(x, trans, group, init, lengths, work, backptr, score, path, stream=0):
    """Best paths; overwrites ``score`` and ``path`` (see ``kernels.cpu.chain.chain_viterbi``)."""
    if x.shape[0] == 0:
        return
    threads, chunk = config.THREADS_PER_BLOCK, config.STATE_CHUNK
    kernel = _viterbi_kernel(np.dtype(x.dtype))
    shared = _shared_bytes(x.dtype, chunk, 0)
    kernel[config.blocks_for(x.shape[0], 1), threads, stream, shared](
        x, trans, group, chunk, init, lengths, work, backptr, score, path)
