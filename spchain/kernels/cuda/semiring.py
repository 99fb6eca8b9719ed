"""The max-plus matrix product for CUDA: the twin of ``spchain/kernels/cpu/semiring.py``."""

import math

from numba import cuda

from . import config


@cuda.jit
def max_matmul_kernel(a, b, a_index, b_index, values, argmax):
    """Max-plus product, the twin of ``kernels.cpu.semiring.max_matmul``: ``values[p, i, j] = max_k a[a_index[p],
    i, k] + b[b_index[p], k, j]`` and its ``argmax`` (NaN wins, ``-inf`` beside anything but NaN is ``-inf``).

    Inputs: ``a`` (Ba, m, k), ``b`` (Bb, k, n), ``a_index``, ``b_index`` (P,). Outputs: ``values`` (P, m, n) and
    ``argmax`` (P, m, n, int64), overwritten.
    Launch: grid ``blocks_for(P * m * n)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread an output entry
    (grid-stride)."""
    batches, m, n = values.shape
    k = a.shape[2]
    start, step = cuda.grid(1), cuda.gridsize(1)
    neg_inf = values.dtype.type(-math.inf)
    for flat in range(start, batches * m * n, step):
        p = flat // (m * n)
        i = (flat // n) % m
        j = flat % n
        best = neg_inf
        arg = 0
        for kk in range(k):
            left, right = a[a_index[p], i, kk], b[b_index[p], kk, j]
            if (left == neg_inf and right == right) or (right == neg_inf and left == left):
                val = neg_inf  # also beside +inf, as on the CPU (never computing inf - inf)
            else:
                val = left + right
            if val > best or (val != val and best == best):
                best = val
                arg = kk
        values[p, i, j] = best
        argmax[p, i, j] = arg


def launch_max_matmul(a, b, a_index, b_index, values, argmax, stream=0):
    """Max-plus product; overwrites ``values`` and ``argmax`` (see ``kernels.cpu.semiring.max_matmul``)."""
    if values.size == 0:
        return
    max_matmul_kernel[config.blocks_for(values.size), config.THREADS_PER_BLOCK, stream](
        a, b, a_index, b_index, values, argmax)
