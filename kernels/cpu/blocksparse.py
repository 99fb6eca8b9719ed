"""``@njit`` kernels of the block-sparse (BSR) products: raw arrays in, preallocated outputs filled.

A BSR matrix of shape (M, N) with (R, C) blocks is ``indptr`` (M / R + 1), ``indices`` (nnzb,
the block column of each stored block) and ``data`` (nnzb, R, C). Every kernel trusts its caller
(``spchain.blocksparse``) to have validated the structure on the block grid: ``indptr`` starts
at 0, never decreases and ends at nnzb, and every block index is in range. Blocks may come in
any order within a block row, repeat (duplicates add up) or hold zeros.

The dense tiles are multiplied as register-blocked micro-GEMMs vectorised along the dense
operand's contiguous axis: four output rows by four block columns per pass, so that each
loaded vector feeds four fused multiply-adds.
"""

from numba import njit, prange

_FAST = {"reassoc", "contract"}  # lets the loops vectorise; never assumes no inf/NaN

@njit(cache=True, fastmath=_FAST, inline="always")
def _tile(a, b, o):
    """``o += a @ b`` for one (R, C) block ``a`` (any strides), ``b`` (C, n) and ``o`` (R, n).

    A register-blocked micro-GEMM: four output rows by four block columns at a time (sixteen
    block values held in registers, each loaded vector of ``b`` used four times, each output
    vector loaded and stored once for four fused multiply-adds), vectorised along ``n``; then
    the leftover columns, then the leftover rows one at a time.
    """
    rows, cols = a.shape
    n = b.shape[1]
    r = 0
    while r + 4 <= rows:
        o0, o1, o2, o3 = o[r], o[r + 1], o[r + 2], o[r + 3]
        c = 0
        while c + 4 <= cols:
            b0, b1, b2, b3 = b[c], b[c + 1], b[c + 2], b[c + 3]
            a00, a01, a02, a03 = a[r, c], a[r, c + 1], a[r, c + 2], a[r, c + 3]
            a10, a11, a12, a13 = a[r + 1, c], a[r + 1, c + 1], a[r + 1, c + 2], a[r + 1, c + 3]
            a20, a21, a22, a23 = a[r + 2, c], a[r + 2, c + 1], a[r + 2, c + 2], a[r + 2, c + 3]
            a30, a31, a32, a33 = a[r + 3, c], a[r + 3, c + 1], a[r + 3, c + 2], a[r + 3, c + 3]
            for t in range(n):
                x0, x1, x2, x3 = b0[t], b1[t], b2[t], b3[t]
                o0[t] += a00 * x0 + a01 * x1 + a02 * x2 + a03 * x3
                o1[t] += a10 * x0 + a11 * x1 + a12 * x2 + a13 * x3
                o2[t] += a20 * x0 + a21 * x1 + a22 * x2 + a23 * x3
                o3[t] += a30 * x0 + a31 * x1 + a32 * x2 + a33 * x3
            c += 4
        while c < cols:
            a00, a10, a20, a30, b0 = a[r, c], a[r + 1, c], a[r + 2, c], a[r + 3, c], b[c]
            for t in range(n):
                x0 = b0[t]
                o0[t] += a00 * x0
                o1[t] += a10 * x0
                o2[t] += a20 * x0
                o3[t] += a30 * x0
            c += 1
        r += 4
    while r < rows:
        o0 = o[r]
        for c in range(cols):
            v, b0 = a[r, c], b[c]
            for t in range(n):
                o0[t] += v * b0[t]
        r += 1


@njit(parallel=True, cache=True, fastmath=_FAST)
def spmm(indptr, indices, slots, data, b, bias, out):
    """BSR times dense: ``out[rows of block row i] = bias + sum(data[slots[p]] @ b[cols of block p])``.

    Inputs: ``indptr`` (M / R + 1), ``indices`` and ``slots`` (nnzb; block ``p`` of the structure
    holds ``data[slots[p]]``, so a transposed structure reads the original blocks), ``data``
    (any, R, C) with any strides (a transposed view multiplies by the transposed blocks),
    ``b`` (N, n) C-contiguous, ``bias`` (M). Overwrites ``out`` (M, n), C-contiguous.
    Block rows run in parallel.
    Complexity: O(nnzb * R * C * n) multiply-adds, O(M * n) writes.
    """
    rows, cols = data.shape[1], data.shape[2]
    for i in prange(indptr.shape[0] - 1):
        o = out[i * rows:(i + 1) * rows]
        for r in range(rows):
            o[r, :] = bias[i * rows + r]
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            _tile(data[slots[p]], b[j * cols:(j + 1) * cols], o)


@njit(parallel=True, cache=True, fastmath=_FAST)
def sddmm(indptr, indices, a, b, out):
    """Block-sampled dense-dense product: ``out[p] = a[rows of block row i] @ b[cols of block p].T``.

    Inputs: ``indptr`` (M / R + 1), ``indices`` (nnzb), ``a`` (M, k) and ``b`` (N, k), both
    C-contiguous. Overwrites ``out`` (nnzb, R, C). Block rows run in parallel; each output
    value is a dot product over ``k``, two block rows by four block columns at a time (eight
    running sums that share each loaded vector, nothing stored inside the loop).
    Complexity: O(nnzb * R * C * k) multiply-adds.
    """
    rows, cols = out.shape[1], out.shape[2]
    for i in prange(indptr.shape[0] - 1):
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p] * cols
            r = 0
            while r + 2 <= rows:
                _dots(a[i * rows + r], a[i * rows + r + 1], b, j, out[p, r], out[p, r + 1])
                r += 2
            if r < rows:
                _dots(a[i * rows + r], a[i * rows + r], b, j, out[p, r], out[p, r])


@njit(cache=True, fastmath=_FAST, inline="always")
def _dots(a0, a1, b, j, out0, out1):
    """``out0[c] = a0 . b[j + c]`` and ``out1[c] = a1 . b[j + c]`` for every ``c`` of ``out0``."""
    zero = out0.dtype.type(0)
    k, cols = a0.shape[0], out0.shape[0]
    c = 0
    while c + 4 <= cols:
        b0, b1, b2, b3 = b[j + c], b[j + c + 1], b[j + c + 2], b[j + c + 3]
        s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = zero
        for t in range(k):
            x0, x1 = a0[t], a1[t]
            y0, y1, y2, y3 = b0[t], b1[t], b2[t], b3[t]
            s00 += x0 * y0
            s01 += x0 * y1
            s02 += x0 * y2
            s03 += x0 * y3
            s10 += x1 * y0
            s11 += x1 * y1
            s12 += x1 * y2
            s13 += x1 * y3
        out0[c], out0[c + 1], out0[c + 2], out0[c + 3] = s00, s01, s02, s03
        out1[c], out1[c + 1], out1[c + 2], out1[c + 3] = s10, s11, s12, s13
        c += 4
    while c < cols:
        b0 = b[j + c]
        s00 = s10 = zero
        for t in range(k):
            s00 += a0[t] * b0[t]
            s10 += a1[t] * b0[t]
        out0[c], out1[c] = s00, s10
        c += 1
