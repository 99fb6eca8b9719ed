"""The guarded log-space helpers of ``kernels.logspace`` as CUDA device functions, and the
device-side fix-up of a scaled log-space product."""

import math

from numba import cuda

from .. import logspace
from . import config

log_add_exp = cuda.jit(device=True)(logspace.log_add_exp)
lse_push = cuda.jit(device=True)(logspace.lse_push)
lse_merge = cuda.jit(device=True)(logspace.lse_merge)
lse_value = cuda.jit(device=True)(logspace.lse_value)


@cuda.jit
def log_product_fixup_kernel(a, b, a_index, b_index, lost, out):
    """``out[p, i, j] = log sum_k exp(a[a_index[p], i, k] + b[b_index[p], k, j])`` where
    ``lost[p, i, j]`` is set (one thread an entry, grid-stride); elsewhere ``out`` is left as
    it is. ``a`` (Ba, m, k), ``b`` (Bb, k, n), ``lost`` (P, m, n) uint8, ``out`` (P, m, n).

    The twin of ``spchain._logspace._recompute_lost`` (its NumPy form), without a
    synchronisation: the flags are read on the device, so a product that lost nothing costs
    one pass over them.
    """
    batch, m, n = out.shape
    k = a.shape[2]
    for e in range(cuda.grid(1), batch * m * n, cuda.gridsize(1)):
        p = e // (m * n)
        i = (e // n) % m
        j = e % n
        if lost[p, i, j]:
            ap, bp = a_index[p], b_index[p]
            hi, total = out.dtype.type(-math.inf), out.dtype.type(0)
            for q in range(k):
                hi, total = lse_push(hi, total, a[ap, i, q] + b[bp, q, j])
            out[p, i, j] = lse_value(hi, total)


def launch_log_product_fixup(a, b, a_index, b_index, lost, out, stream=0):
    """Launch :func:`log_product_fixup_kernel` on ``stream`` (nothing for an empty ``out``)."""
    if out.size == 0:
        return
    log_product_fixup_kernel[config.blocks_for(out.size), config.THREADS_PER_BLOCK, stream](
        a, b, a_index, b_index, lost, out)
