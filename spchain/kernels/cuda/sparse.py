"""``@cuda.jit`` sampled dense-dense product (SDDMM) and its launcher.

The CSR times dense product runs in cuSPARSE (through cupyx); SDDMM has no library routine,
so it is here. Like its CPU twin ``kernels.cpu.sparse.sddmm``, it trusts a validated structure.
"""

from numba import cuda

from . import config


@cuda.jit
def sddmm_kernel(indptr, indices, a, b, out):
    """``out[p] = a[i, :] . b[indices[p], :]`` for entry ``p`` of row ``i``, one thread an entry.

    Grid-stride over entries; each finds its row by binary search in ``indptr`` (empty rows
    included) and accumulates its dot product in the dtype of ``out``. Overwrites ``out`` (nnz).
    """
    n_rows = indptr.shape[0] - 1
    for p in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        lo, hi = 0, n_rows  # invariant: indptr[lo] <= p < indptr[hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if indptr[mid] <= p:
                lo = mid
            else:
                hi = mid
        j = indices[p]
        acc = out.dtype.type(0)
        for c in range(a.shape[1]):
            acc += a[lo, c] * b[j, c]
        out[p] = acc


def launch_sddmm(indptr, indices, a, b, out, stream=0):
    """Launch :func:`sddmm_kernel` on ``stream`` over ``out``'s entries (at least one)."""
    sddmm_kernel[config.blocks_for(out.shape[0]), config.THREADS_PER_BLOCK, stream](indptr, indices, a, b, out)
