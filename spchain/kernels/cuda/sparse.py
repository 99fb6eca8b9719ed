"""``@cuda.jit`` sampled dense-dense product (SDDMM) and its launcher.

The CSR times dense product runs in cuSPARSE (through cupyx); SDDMM has no library routine,
so it is here. Like its CPU twin ``kernels.cpu.sparse.sparse_sddmm``, it trusts a validated structure.
"""

import functools

import numba
import numpy as np
from numba import cuda

from . import config


@cuda.jit(device=True)
def row_of(indptr, p):
    """The row ``i`` of stored entry ``p``: ``indptr[i] <= p < indptr[i + 1]``, by binary search
    (empty rows skipped)."""
    lo, hi = 0, indptr.shape[0] - 1  # invariant: indptr[lo] <= p < indptr[hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if indptr[mid] <= p:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit
def sparse_sddmm_kernel(indptr, indices, a, b, out):
    """``out[p] = a[i, :] . b[indices[p], :]`` for entry ``p`` of row ``i``, one thread an entry.

    Grid-stride over entries; each finds its row by binary search in ``indptr`` (empty rows
    included) and accumulates its dot product in the dtype of ``out``. Overwrites ``out`` (nnz).

    Inputs: ``indptr`` (m + 1), ``indices`` (nnz), ``a`` (m, k), ``b`` (n, k). Output: ``out`` (nnz).
    Launch: grid ``blocks_for(nnz)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread an entry (grid-stride).
    For fewer than ``WARP_FROM`` columns.
    """
    for p in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        lo = row_of(indptr, p)
        j = indices[p]
        acc = out.dtype.type(0)
        for c in range(a.shape[1]):
            acc += a[lo, c] * b[j, c]
        out[p] = acc


WARP = 32

WARP_FROM = 16
"""Columns from which an entry gets a warp of its own (:func:`sparse_sddmm_warp_kernel`)."""


@functools.cache
def _sddmm_warp_kernel(dtype):
    dtype = numba.from_dtype(dtype)

    @cuda.jit
    def sparse_sddmm_warp_kernel(indptr, indices, a, b, out):
        """:func:`sparse_sddmm_kernel` with a warp an entry: its 32 lanes read consecutive columns of
        ``a[i, :]`` and ``b[j, :]`` (coalesced loads, where a thread an entry reads rows far
        apart), and sum their partial dot products in shared memory. Blocks are whole warps
        and take their entries in rounds, so every thread reaches every barrier.

        Inputs and Output as :func:`sparse_sddmm_kernel`.
        Launch: grid ``blocks_for(nnz, threads // WARP)`` blocks of ``threads`` (``THREADS_PER_BLOCK`` rounded
        down to whole warps, at least one) threads, a warp an entry (grid-stride); dynamic shared memory
        ``threads`` values. From ``WARP_FROM`` columns on."""
        tid = cuda.threadIdx.x
        lane, w = tid % WARP, tid // WARP
        per_block = cuda.blockDim.x // WARP
        red = cuda.shared.array(0, dtype)
        n = out.shape[0]
        for base in range(cuda.blockIdx.x * per_block, n, cuda.gridDim.x * per_block):
            p = base + w
            acc = out.dtype.type(0)
            if p < n:
                lo = row_of(indptr, p)
                j = indices[p]
                for c in range(lane, a.shape[1], WARP):
                    acc += a[lo, c] * b[j, c]
            red[tid] = acc
            cuda.syncthreads()
            offset = WARP // 2
            while offset > 0:
                if lane < offset:
                    red[tid] += red[tid + offset]
                cuda.syncthreads()
                offset //= 2
            if lane == 0 and p < n:
                out[p] = red[tid]
            cuda.syncthreads()

    return sparse_sddmm_warp_kernel


def launch_sparse_sddmm(indptr, indices, a, b, out, stream=0):
    """Launch the SDDMM on ``stream`` over ``out``'s entries (at least one): a warp an entry
    from ``WARP_FROM`` columns on, else a thread an entry."""
    if a.shape[1] >= WARP_FROM:
        threads = WARP * max(1, config.THREADS_PER_BLOCK // WARP)
        blocks = config.blocks_for(out.shape[0], threads // WARP)
        kernel = _sddmm_warp_kernel(np.dtype(out.dtype))
        kernel[blocks, threads, stream, threads * np.dtype(out.dtype).itemsize](indptr, indices, a, b, out)
        return
    sparse_sddmm_kernel[config.blocks_for(out.shape[0]), config.THREADS_PER_BLOCK, stream](indptr, indices, a, b, out)
