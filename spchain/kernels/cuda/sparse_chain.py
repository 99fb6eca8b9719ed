"""Log-space chain sweeps over a sparse transition matrix, for CUDA: the twins of
``spchain/kernels/cpu/sparse_chain.py`` (same arguments, same outputs).

One block per row of the batch (grid-stride over rows), threads over states: per step, each
thread folds the stored entries of its state's column (forward) or row (backward) into an
online log-sum-exp, reading the previous message from global memory (the block synchronises
between steps); the normalisers are block-wide tree reductions. The gradient of the stored
values runs one thread per (chunk of rows, matrix row) pair, so no two threads write one entry.
"""

import functools
import math

import numba
import numpy as np
from numba import cuda

from . import config
from .chain import _backward_tail, _block_log_sum_exp, _finite, _forward_tail
from .logspace import lse_push, lse_value


@functools.cache
def _forward_kernel(dtype):
    dtype = numba.from_dtype(dtype)

    @cuda.jit
    def sparse_chain_forward_kernel(x, t_indptr, t_rows, t_values, init, lengths, pre, norm):
        """Forward sweep over the stored entries, the twin of ``kernels.cpu.sparse_chain.sparse_chain_forward``.

        Inputs: ``x`` (B, v, c), the transpose's structure ``t_indptr`` (c + 1), ``t_rows`` and ``t_values``
        (nnz), ``init`` (B, c), ``lengths`` (B,). Outputs: ``pre`` (B, v, c) and ``norm`` (B, v), overwritten.
        Launch: grid ``blocks_for(B, 1)`` blocks, one row of the batch each (grid-stride over rows); block
        ``THREADS_PER_BLOCK`` threads over the states; dynamic shared memory ``2 * threads`` values."""
        rows, v, c = x.shape
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        buf = cuda.shared.array(0, dtype)
        red_m = buf[:threads]
        red_s = buf[threads:2 * threads]
        neg_inf, zero = x.dtype.type(-math.inf), x.dtype.type(0)
        for b in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            length = lengths[b]
            d = _first_position(x, init, pre, norm, b, red_m, red_s)
            for t in range(length - 1):
                offset = d if _finite(d) else zero
                m, s = neg_inf, zero
                for j in range(tid, c, threads):
                    mj, sj = neg_inf, zero
                    for q in range(t_indptr[j], t_indptr[j + 1]):
                        i = t_rows[q]
                        mj, sj = lse_push(mj, sj, (pre[b, t, i] + x[b, t, i] - offset) + t_values[q])
                    pre[b, t + 1, j] = lse_value(mj, sj)
                    m, s = lse_push(m, s, pre[b, t + 1, j] + x[b, t + 1, j])
                d = _block_log_sum_exp(m, s, red_m, red_s)  # synchronises: pre[b, t + 1] is complete
                if tid == 0:
                    norm[b, t + 1] = d
            _forward_tail(pre, norm, b, length, tid, threads, neg_inf, zero)
            cuda.syncthreads()

    return sparse_chain_forward_kernel


@functools.cache
def _backward_kernel(dtype):
    @cuda.jit
    def sparse_chain_backward_kernel(x, indptr, indices, values, lengths, norm, beta):
        """Backward sweep over the stored entries, the twin of ``kernels.cpu.sparse_chain.sparse_chain_backward``.

        Inputs: ``x`` (B, v, c), the structure ``indptr`` (c + 1), ``indices`` and ``values`` (nnz), ``lengths``
        (B,), ``norm`` (B, v). Output: ``beta`` (B, v, c), overwritten.
        Launch: grid ``blocks_for(B, 1)`` blocks, one row of the batch each (grid-stride over rows); block
        ``THREADS_PER_BLOCK`` threads over the states."""
        rows, v, c = x.shape
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        neg_inf, zero = x.dtype.type(-math.inf), x.dtype.type(0)
        for b in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            length = lengths[b]
            _backward_tail(beta, b, length, tid, threads, neg_inf, zero)
            cuda.syncthreads()
            for t in range(length - 2, -1, -1):
                d = norm[b, t + 1]
                for i in range(tid, c, threads):
                    m, s = neg_inf, zero
                    for q in range(indptr[i], indptr[i + 1]):
                        j = indices[q]
                        m, s = lse_push(m, s, values[q] + (x[b, t + 1, j] + beta[b, t + 1, j]))
                    beta[b, t, i] = neg_inf if d == neg_inf else lse_value(m, s) - d
                cuda.syncthreads()

    return sparse_chain_backward_kernel


@cuda.jit(device=True)
def _first_position(x, init, pre, norm, b, red_m, red_s):
    """Position 0 of row ``b`` for the block: ``pre[b, 0] = init[b]`` and its normaliser
    ``norm[b, 0] = lse(init[b] + x[b, 0])``, which it returns (the forward kernels' first step)."""
    tid = cuda.threadIdx.x
    m, s = x.dtype.type(-math.inf), x.dtype.type(0)
    for j in range(tid, x.shape[2], cuda.blockDim.x):
        pre[b, 0, j] = init[b, j]
        m, s = lse_push(m, s, init[b, j] + x[b, 0, j])
    d = _block_log_sum_exp(m, s, red_m, red_s)
    if tid == 0:
        norm[b, 0] = d
    return d


@cuda.jit(device=True)
def _values_grad_chunk(x, indptr, indices, values, lengths, pre, norm, marg, weight, partial, k, i):
    """``partial[k, q]`` for the entries ``q`` of matrix row ``i``, over the rows of chunk ``k``."""
    rows = x.shape[0]
    chunks = partial.shape[0]
    zero = partial.dtype.type(0)
    for q in range(indptr[i], indptr[i + 1]):
        partial[k, q] = zero
    for b in range(k * rows // chunks, (k + 1) * rows // chunks):
        w = weight[b]
        for t in range(lengths[b] - 1):
            d = norm[b, t]
            a = pre[b, t, i] + x[b, t, i]
            if _finite(d):
                a -= d
            if a == x.dtype.type(-math.inf):
                continue
            for q in range(indptr[i], indptr[i + 1]):
                j = indices[q]
                gm = marg[b, t + 1, j]
                if gm != zero:
                    partial[k, q] += w * gm * math.exp(a + values[q] - pre[b, t + 1, j])


@cuda.jit
def sparse_chain_values_grad_kernel(x, indptr, indices, values, lengths, pre, norm, marg, weight, partial):
    """Expected counts of the stored entries, the twin of ``kernels.cpu.sparse_chain.sparse_chain_values_grad``.

    Inputs: ``x``, ``pre``, ``marg`` (B, v, c), ``indptr``, ``indices``, ``values``, ``lengths`` (B,), ``norm``
    (B, v), ``weight`` (B,). Output: ``partial`` (K, nnz), overwritten.
    Launch: grid ``blocks_for(K * c)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread a (chunk of rows,
    matrix row) pair (grid-stride)."""
    c = x.shape[2]
    for ki in range(cuda.grid(1), partial.shape[0] * c, cuda.gridsize(1)):
        _values_grad_chunk(x, indptr, indices, values, lengths, pre, norm, marg, weight, partial, ki // c, ki % c)


@cuda.jit
def sparse_chain_values_grad_masked_kernel(x, indptr, indices, values, lengths, pre, norm, marg, weight, ok, partial):
    """:func:`sparse_chain_values_grad_kernel` unless ``ok[0]`` (read on the device: the scaled value
    gradient needs no exact recomputation), which leaves ``partial`` as it is.

    Inputs as :func:`sparse_chain_values_grad_kernel`, and ``ok`` (1,) bool. Output: ``partial`` (K, nnz),
    overwritten unless ``ok[0]``.
    Launch: as :func:`sparse_chain_values_grad_kernel`."""
    if ok[0]:
        return
    c = x.shape[2]
    for ki in range(cuda.grid(1), partial.shape[0] * c, cuda.gridsize(1)):
        _values_grad_chunk(x, indptr, indices, values, lengths, pre, norm, marg, weight, partial, ki // c, ki % c)


@cuda.jit
def sparse_chain_viterbi_kernel(x, t_indptr, t_rows, t_values, init, lengths, work, backptr, score, path):
    """Best paths over the stored entries, the twin of ``kernels.cpu.sparse_chain.sparse_chain_viterbi``.

    Inputs: ``x`` (B, v, c), ``t_indptr``, ``t_rows``, ``t_values``, ``init`` (B, c), ``lengths`` (B,); scratch
    ``work`` (B, 2, c) and ``backptr`` (B, v, c, int32). Outputs: ``score`` (B,) and ``path`` (B, v, int64),
    overwritten.
    Launch: grid ``blocks_for(B, 1)`` blocks, one row of the batch each (grid-stride over rows); block
    ``THREADS_PER_BLOCK`` threads over the states."""
    rows, v, c = x.shape
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    for b in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
        length = lengths[b]
        for j in range(tid, c, threads):
            work[b, 0, j] = init[b, j] + x[b, 0, j]
        cuda.syncthreads()
        cur = 0
        for t in range(length - 1):
            for j in range(tid, c, threads):
                best = -math.inf
                arg = 0
                for q in range(t_indptr[j], t_indptr[j + 1]):
                    i = t_rows[q]
                    ui = work[b, cur, i]
                    val = ui + t_values[q]
                    if val != val and ui == ui and t_values[q] == t_values[q]:  # +inf + -inf
                        val = -math.inf
                    if val > best or (val != val and best == best):
                        best = val
                        arg = i
                backptr[b, t + 1, j] = arg
                work[b, 1 - cur, j] = best + x[b, t + 1, j]
            cuda.syncthreads()
            cur = 1 - cur
        if tid == 0:
            best_j = 0
            for j in range(1, c):
                lj, lb = work[b, cur, j], work[b, cur, best_j]
                if lj > lb or (lj != lj and lb == lb):
                    best_j = j
            score[b] = work[b, cur, best_j] if c > 0 else -math.inf
            for t in range(v):
                path[b, t] = -1
            if c > 0:
                path[b, length - 1] = best_j
                for t in range(length - 1, 0, -1):
                    path[b, t - 1] = backptr[b, t, path[b, t]]
        cuda.syncthreads()


def launch_sparse_chain_forward(x, t_indptr, t_rows, t_values, init, lengths, pre, norm, stream=0):
    """Forward sweep; fills ``pre`` and ``norm`` (see ``kernels.cpu.sparse_chain.sparse_chain_forward``)."""
    if x.shape[0] == 0:
        return
    threads = config.THREADS_PER_BLOCK
    shared = 2 * threads * np.dtype(x.dtype).itemsize
    _forward_kernel(np.dtype(x.dtype))[config.blocks_for(x.shape[0], 1), threads, stream, shared](
        x, t_indptr, t_rows, t_values, init, lengths, pre, norm)


def launch_sparse_chain_backward(x, indptr, indices, values, lengths, norm, beta, stream=0):
    """Backward sweep; fills ``beta`` (see ``kernels.cpu.sparse_chain.sparse_chain_backward``)."""
    if x.shape[0] == 0:
        return
    _backward_kernel(np.dtype(x.dtype))[config.blocks_for(x.shape[0], 1), config.THREADS_PER_BLOCK, stream](
        x, indptr, indices, values, lengths, norm, beta)


def launch_sparse_chain_values_grad(x, indptr, indices, values, lengths, pre, norm, marg, weight, partial, stream=0):
    """Expected counts of the stored entries; overwrites ``partial`` (see
    ``kernels.cpu.sparse_chain.sparse_chain_values_grad``)."""
    work = partial.shape[0] * x.shape[2]
    if work == 0:
        return
    sparse_chain_values_grad_kernel[config.blocks_for(work), config.THREADS_PER_BLOCK, stream](
        x, indptr, indices, values, lengths, pre, norm, marg, weight, partial)


def launch_sparse_chain_values_grad_masked(x, indptr, indices, values, lengths, pre, norm, marg, weight, ok, partial,
                                           stream=0):
    """:func:`launch_sparse_chain_values_grad` where ``ok[0]`` is False (on the device); else nothing."""
    work = partial.shape[0] * x.shape[2]
    if work == 0:
        return
    sparse_chain_values_grad_masked_kernel[config.blocks_for(work), config.THREADS_PER_BLOCK, stream](
        x, indptr, indices, values, lengths, pre, norm, marg, weight, ok, partial)


def launch_sparse_chain_viterbi(x, t_indptr, t_rows, t_values, init, lengths, work, backptr, score, path, stream=0):
    """Best paths; overwrites ``score`` and ``path`` (see ``kernels.cpu.sparse_chain.sparse_chain_viterbi``)."""
    if x.shape[0] == 0:
        return
    sparse_chain_viterbi_kernel[config.blocks_for(x.shape[0], 1), config.THREADS_PER_BLOCK, stream](
        x, t_indptr, t_rows, t_values, init, lengths, work, backptr, score, path)


# --- the forward sweep in scaled space (the twin of kernels/cpu/sparse_chain_scaled.py) -------


@cuda.jit
def sparse_chain_shifted_exp_kernel(indptr, values, top, e):
    """For each segment ``r`` (a column of the transposed structure), one thread: ``top[r]`` =
    the maximum of its values (``-inf`` if empty or all ``-inf``, NaN if one is NaN) and
    ``e[q] = exp(values[q] - top[r])`` in the values' dtype (NaN for a NaN segment).

    Inputs: ``indptr`` (r + 1), ``values`` (nnz). Outputs: ``top`` (r,) and ``e`` (nnz), overwritten.
    Launch: grid ``blocks_for(r)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread a segment (grid-stride)."""
    neg_inf, zero = values.dtype.type(-math.inf), values.dtype.type(0)
    for r in range(cuda.grid(1), indptr.shape[0] - 1, cuda.gridsize(1)):
        best = neg_inf
        for q in range(indptr[r], indptr[r + 1]):
            w = values[q]
            if w != w:
                best = w
                break
            if w > best:
                best = w
        top[r] = best
        shift = best if _finite(best) else zero
        for q in range(indptr[r], indptr[r + 1]):
            e[q] = math.exp(values[q] - shift) if best == best else best


@cuda.jit(device=True)
def _block_max(value, red):
    """The block's maximum of every thread's ``value`` (NaN ignored, ``-inf`` if none)."""
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    red[tid] = value
    cuda.syncthreads()
    stride = 1
    while stride < threads:
        if tid % (2 * stride) == 0 and tid + stride < threads and red[tid + stride] > red[tid]:
            red[tid] = red[tid + stride]
        cuda.syncthreads()
        stride *= 2
    top = red[0]
    cuda.syncthreads()
    return top


@functools.cache
def _forward_scaled_kernel(dtype):
    dtype = numba.from_dtype(dtype)

    @cuda.jit
    def sparse_chain_forward_scaled_kernel(x, t_indptr, t_rows, t_values, t_e, cmax, tiny_over_eps, init, lengths,
                                           work, pre, norm):
        """:func:`sparse_chain_forward_kernel` by scaled SpMVs: per step and row, ``c`` exponentials, ``nnz``
        multiply-adds and ``c`` logarithms instead of an exponential per stored entry:

            pre[t + 1, j] = top + cmax[j] + log sum_q t_e[q] exp(â_t[t_rows[q]] - top)

        (``top`` the maximum of â_t, the row's exponentials in ``work[b]``). A column whose
        scaled sum is below ``count · tiny / eps`` (its ``count`` terms' underflow could matter)
        or not a number is recomputed in log space, exactly as :func:`sparse_chain_forward_kernel` does.

        Inputs: as :func:`sparse_chain_forward_kernel`, and ``t_e`` (nnz), ``cmax`` (c,), ``tiny_over_eps``; scratch
        ``work`` (B, c). Outputs: ``pre`` (B, v, c) and ``norm`` (B, v), overwritten.
        Launch: grid ``blocks_for(B, 1)`` blocks, one row of the batch each (grid-stride over rows); block
        ``THREADS_PER_BLOCK`` threads over the states; dynamic shared memory ``2 * threads`` values."""
        rows, v, c = x.shape
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        buf = cuda.shared.array(0, dtype)
        red_m = buf[:threads]
        red_s = buf[threads:2 * threads]
        neg_inf, zero = x.dtype.type(-math.inf), x.dtype.type(0)
        for b in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            length = lengths[b]
            d = _first_position(x, init, pre, norm, b, red_m, red_s)
            for t in range(length - 1):
                offset = d if _finite(d) else zero
                best = neg_inf
                for i in range(tid, c, threads):
                    a = pre[b, t, i] + x[b, t, i] - offset
                    if a > best:
                        best = a
                top = _block_max(best, red_m)
                shift = top if _finite(top) else zero
                for i in range(tid, c, threads):
                    work[b, i] = math.exp(pre[b, t, i] + x[b, t, i] - offset - shift)
                cuda.syncthreads()
                m, s = neg_inf, zero
                for j in range(tid, c, threads):
                    acc = zero
                    for q in range(t_indptr[j], t_indptr[j + 1]):
                        acc += t_e[q] * work[b, t_rows[q]]
                    count = x.dtype.type(t_indptr[j + 1] - t_indptr[j])
                    if acc > zero and acc >= count * tiny_over_eps:
                        val = shift + cmax[j] + math.log(acc)
                    elif acc == acc and (cmax[j] == neg_inf or top == neg_inf):
                        val = neg_inf  # every term -inf, none NaN
                    else:
                        mj, sj = neg_inf, zero
                        for q in range(t_indptr[j], t_indptr[j + 1]):
                            i = t_rows[q]
                            mj, sj = lse_push(mj, sj, (pre[b, t, i] + x[b, t, i] - offset) + t_values[q])
                        val = lse_value(mj, sj)
                    pre[b, t + 1, j] = val
                    m, s = lse_push(m, s, val + x[b, t + 1, j])
                d = _block_log_sum_exp(m, s, red_m, red_s)  # synchronises: pre[b, t + 1] is complete
                if tid == 0:
                    norm[b, t + 1] = d
            _forward_tail(pre, norm, b, length, tid, threads, neg_inf, zero)
            cuda.syncthreads()

    return sparse_chain_forward_scaled_kernel


def launch_sparse_chain_shifted_exp(indptr, values, top, e, stream=0):
    """Column maxima ``top`` and shifted exponentials ``e`` of the stored values
    (:func:`sparse_chain_shifted_exp_kernel`)."""
    if top.shape[0] == 0:
        return
    sparse_chain_shifted_exp_kernel[config.blocks_for(top.shape[0]), config.THREADS_PER_BLOCK, stream](indptr, values,
                                                                                                       top, e)


def launch_sparse_chain_forward_scaled(x, t_indptr, t_rows, t_values, t_e, cmax, init, lengths, work, pre, norm,
                                       stream=0):
    """Forward sweep by scaled SpMVs; fills ``pre`` and ``norm`` as :func:`launch_sparse_chain_forward` does.
    ``t_e``, ``cmax`` from :func:`launch_sparse_chain_shifted_exp` on the transpose's values; ``work`` (B, c)."""
    if x.shape[0] == 0:
        return
    info = np.finfo(np.dtype(x.dtype))
    tiny_over_eps = np.dtype(x.dtype).type(info.tiny / info.eps)
    threads = config.THREADS_PER_BLOCK
    kernel = _forward_scaled_kernel(np.dtype(x.dtype))
    kernel[config.blocks_for(x.shape[0], 1), threads, stream, 2 * threads * np.dtype(x.dtype).itemsize](
        x, t_indptr, t_rows, t_values, t_e, cmax, tiny_over_eps, init, lengths, work, pre, norm)


@functools.cache
def _backward_scaled_kernel(dtype):
    dtype = numba.from_dtype(dtype)

    @cuda.jit
    def sparse_chain_backward_scaled_kernel(x, indptr, indices, values, row_e, rmax, tiny_over_eps, lengths, norm,
                                            work, beta):
        """:func:`sparse_chain_backward_kernel` by scaled SpMVs over the rows of the matrix (``row_e``,
        ``rmax`` of :func:`sparse_chain_shifted_exp_kernel` on the matrix itself):

            beta[t, i] = top + rmax[i] + log sum_q row_e[q] exp(y[indices[q]] - top) - norm[t + 1]

        with ``y = x[t + 1] + beta[t + 1]`` and ``top`` its maximum; log space where a scaled
        sum is below ``count · tiny / eps`` or not a number, as in :func:`sparse_chain_forward_scaled_kernel`.

        Inputs: as :func:`sparse_chain_backward_kernel`, and ``row_e`` (nnz), ``rmax`` (c,), ``tiny_over_eps``; scratch
        ``work`` (B, c). Output: ``beta`` (B, v, c), overwritten.
        Launch: grid ``blocks_for(B, 1)`` blocks, one row of the batch each (grid-stride over rows); block
        ``THREADS_PER_BLOCK`` threads over the states; dynamic shared memory ``threads`` values."""
        rows, v, c = x.shape
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        red = cuda.shared.array(0, dtype)
        neg_inf, zero = x.dtype.type(-math.inf), x.dtype.type(0)
        for b in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            length = lengths[b]
            _backward_tail(beta, b, length, tid, threads, neg_inf, zero)
            cuda.syncthreads()
            for t in range(length - 2, -1, -1):
                d = norm[b, t + 1]
                best = neg_inf
                for j in range(tid, c, threads):
                    y = x[b, t + 1, j] + beta[b, t + 1, j]
                    if y > best:
                        best = y
                top = _block_max(best, red)
                shift = top if _finite(top) else zero
                for j in range(tid, c, threads):
                    work[b, j] = math.exp(x[b, t + 1, j] + beta[b, t + 1, j] - shift)
                cuda.syncthreads()
                for i in range(tid, c, threads):
                    acc = zero
                    for q in range(indptr[i], indptr[i + 1]):
                        acc += row_e[q] * work[b, indices[q]]
                    count = x.dtype.type(indptr[i + 1] - indptr[i])
                    if acc > zero and acc >= count * tiny_over_eps:
                        val = shift + rmax[i] + math.log(acc)
                    elif acc == acc and (rmax[i] == neg_inf or top == neg_inf):
                        val = neg_inf  # every term -inf, none NaN
                    else:
                        m, s = neg_inf, zero
                        for q in range(indptr[i], indptr[i + 1]):
                            j = indices[q]
                            m, s = lse_push(m, s, values[q] + (x[b, t + 1, j] + beta[b, t + 1, j]))
                        val = lse_value(m, s)
                    beta[b, t, i] = neg_inf if d == neg_inf else val - d
                cuda.syncthreads()

    return sparse_chain_backward_scaled_kernel


def launch_sparse_chain_backward_scaled(x, indptr, indices, values, row_e, rmax, lengths, norm, work, beta, stream=0):
    """Backward sweep by scaled SpMVs; fills ``beta`` as :func:`launch_sparse_chain_backward` does. ``row_e``,
    ``rmax`` from :func:`launch_sparse_chain_shifted_exp` on the matrix's own values; ``work`` (B, c)."""
    if x.shape[0] == 0:
        return
    info = np.finfo(np.dtype(x.dtype))
    tiny_over_eps = np.dtype(x.dtype).type(info.tiny / info.eps)
    threads = config.THREADS_PER_BLOCK
    kernel = _backward_scaled_kernel(np.dtype(x.dtype))
    kernel[config.blocks_for(x.shape[0], 1), threads, stream, threads * np.dtype(x.dtype).itemsize](
        x, indptr, indices, values, row_e, rmax, tiny_over_eps, lengths, norm, work, beta)
