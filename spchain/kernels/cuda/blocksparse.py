"""``@cuda.jit`` block-sparse (BSR) products and their launchers.

cupyx has no BSR class and no block SDDMM, so both products are here. Like their CPU twins in
``kernels.cpu.blocksparse`` (same arguments), they trust a structure validated on the block grid.
One thread computes one output value; consecutive threads take consecutive columns of the
output (``spmm``) or of a block (``sddmm``), so a warp reads the dense operand coalesced and
shares each block value it reads.
"""

from numba import cuda

from . import config
from .sparse import row_of


@cuda.jit
def blocksparse_spmm_kernel(indptr, indices, slots, data, b, bias, out):
    """``out[row, col] = bias[row] + sum(data[slots[p]][r, c] * b[indices[p] * C + c, col])`` over
    the blocks ``p`` of ``row``'s block row (``r = row % R``).

    Accumulated in the dtype of ``out``.

    Inputs: ``indptr``, ``indices``, ``slots`` of the block grid, ``data`` (nnzb, R, C), ``b`` (N, n), ``bias``
    (M,). Output: ``out`` (M, n), overwritten.
    Launch: grid ``blocks_for(M * n)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread an output entry
    (grid-stride).
    """
    rows, cols = data.shape[1], data.shape[2]
    n = out.shape[1]
    for q in range(cuda.grid(1), out.shape[0] * n, cuda.gridsize(1)):
        row, col = q // n, q % n
        i, r = row // rows, row % rows
        acc = out.dtype.type(0)
        for p in range(indptr[i], indptr[i + 1]):
            s, j = slots[p], indices[p] * cols
            for c in range(cols):
                acc += data[s, r, c] * b[j + c, col]
        out[row, col] = bias[row] + acc


def launch_blocksparse_spmm(indptr, indices, slots, data, b, bias, out, stream=0):
    """Launch :func:`blocksparse_spmm_kernel` on ``stream`` over ``out``'s values (at least one)."""
    blocksparse_spmm_kernel[config.blocks_for(out.size), config.THREADS_PER_BLOCK, stream](
        indptr, indices, slots, data, b, bias, out)


@cuda.jit
def blocksparse_sddmm_kernel(indptr, indices, a, b, out):
    """``out[p, r, c] = a[i * R + r, :] . b[indices[p] * C + c, :]`` for block ``p`` of block row ``i``.

    Grid-stride over the nnzb * R * C outputs; each finds its block row by binary search in
    ``indptr`` (empty block rows included) and accumulates in the dtype of ``out``. Overwrites ``out``.

    Inputs: ``indptr``, ``indices`` of the block grid, ``a`` (M, k), ``b`` (N, k). Output: ``out`` (nnzb, R, C).
    Launch: grid ``blocks_for(nnzb * R * C)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread an output entry
    (grid-stride).
    """
    rows, cols = out.shape[1], out.shape[2]
    for q in range(cuda.grid(1), out.shape[0] * rows * cols, cuda.gridsize(1)):
        p, rest = q // (rows * cols), q % (rows * cols)
        r, c = rest // cols, rest % cols
        lo = row_of(indptr, p)
        row, col = lo * rows + r, indices[p] * cols + c
        acc = out.dtype.type(0)
        for t in range(a.shape[1]):
            acc += a[row, t] * b[col, t]
        out[p, r, c] = acc


def launch_blocksparse_sddmm(indptr, indices, a, b, out, stream=0):
    """Launch :func:`blocksparse_sddmm_kernel` on ``stream`` over ``out``'s values (at least one)."""
    blocksparse_sddmm_kernel[config.blocks_for(out.size), config.THREADS_PER_BLOCK, stream](indptr, indices, a, b, out)
