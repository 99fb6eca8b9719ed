"""``@njit`` kernels of the sparse products: raw CSR arrays in, preallocated outputs filled.

Every kernel trusts its caller (``spchain.sparse``) to have validated the structure: ``indptr``
starts at 0, never decreases and ends at ``len(indices)``, and every index is in range. Stored
entries may come in any order within a row, repeat (duplicates add up) or hold zeros.

The products loop over a row's stored entries several at a time, so that each pass over a dense
row loads and stores the accumulator once for several entries (an unroll-and-jam of the entry loop).
"""

from numba import njit, prange

_FAST = {"reassoc", "contract"}  # lets the dot products vectorise; never assumes no inf/NaN


@njit(parallel=True, cache=True, fastmath=_FAST)
def spmm(indptr, indices, data, b, bias, out):
    """CSR times dense: ``out[i, :] = bias[i] + sum(data[p] * b[indices[p], :])`` over row ``i``.

    Inputs: ``indptr`` (m + 1), ``indices`` and ``data`` (nnz), ``b`` (k, n) C-contiguous,
    ``bias`` (m). Overwrites ``out`` (m, n), C-contiguous. Rows run in parallel; a row's
    entries are taken eight at a time, then four, then one.
    Complexity: O(nnz * n) multiply-adds, O(m * n) writes.
    """
    n = b.shape[1]
    for i in prange(out.shape[0]):
        o = out[i]
        o[:] = bias[i]
        p = indptr[i]
        end = indptr[i + 1]
        while p + 8 <= end:
            v0, v1, v2, v3 = data[p], data[p + 1], data[p + 2], data[p + 3]
            v4, v5, v6, v7 = data[p + 4], data[p + 5], data[p + 6], data[p + 7]
            b0, b1, b2, b3 = b[indices[p]], b[indices[p + 1]], b[indices[p + 2]], b[indices[p + 3]]
            b4, b5, b6, b7 = b[indices[p + 4]], b[indices[p + 5]], b[indices[p + 6]], b[indices[p + 7]]
            for c in range(n):
                o[c] += (v0 * b0[c] + v1 * b1[c] + v2 * b2[c] + v3 * b3[c]) + (
                    v4 * b4[c] + v5 * b5[c] + v6 * b6[c] + v7 * b7[c])
            p += 8
        if p + 4 <= end:
            v0, v1, v2, v3 = data[p], data[p + 1], data[p + 2], data[p + 3]
            b0, b1, b2, b3 = b[indices[p]], b[indices[p + 1]], b[indices[p + 2]], b[indices[p + 3]]
            for c in range(n):
                o[c] += v0 * b0[c] + v1 * b1[c] + v2 * b2[c] + v3 * b3[c]
            p += 4
        while p < end:
            v0 = data[p]
            b0 = b[indices[p]]
            for c in range(n):
                o[c] += v0 * b0[c]
            p += 1


@njit(parallel=True, cache=True, fastmath=_FAST)
def sddmm(indptr, indices, a, b, out):
    """Sampled dense-dense product: ``out[p] = a[i, :] . b[indices[p], :]`` for entry ``p`` of row ``i``.

    Inputs: ``indptr`` (m + 1), ``indices`` (nnz), ``a`` (m, k) and ``b`` (n, k), both
    C-contiguous. Overwrites ``out`` (nnz). Rows run in parallel.
    Complexity: O(nnz * k) multiply-adds.
    """
    k = a.shape[1]
    zero = out.dtype.type(0)
    for i in prange(a.shape[0]):
        ai = a[i]
        p = indptr[i]
        end = indptr[i + 1]
        while p + 4 <= end:
            b0, b1, b2, b3 = b[indices[p]], b[indices[p + 1]], b[indices[p + 2]], b[indices[p + 3]]
            s0 = s1 = s2 = s3 = zero
            for c in range(k):
                x = ai[c]
                s0 += x * b0[c]
                s1 += x * b1[c]
                s2 += x * b2[c]
                s3 += x * b3[c]
            out[p], out[p + 1], out[p + 2], out[p + 3] = s0, s1, s2, s3
            p += 4
        while p < end:
            b0 = b[indices[p]]
            s0 = zero
            for c in range(k):
                s0 += ai[c] * b0[c]
            out[p] = s0
            p += 1


@njit(cache=True)
def group_by(keys, indptr, order):
    """Stable counting sort of entry positions by key.

    Inputs: ``keys`` (nnz), each in ``0 .. len(indptr) - 2``. Overwrites ``indptr``
    (n_groups + 1) with the group boundaries and ``order`` (nnz) with the positions of the
    entries of group 0, then group 1, ..., each group in its original order.
    Complexity: O(nnz + n_groups), serial.
    """
    indptr[:] = 0
    for p in range(keys.shape[0]):
        indptr[keys[p] + 1] += 1
    for g in range(1, indptr.shape[0]):
        indptr[g] += indptr[g - 1]
    fill = indptr[:-1].copy()
    for p in range(keys.shape[0]):
        g = keys[p]
        order[fill[g]] = p
        fill[g] += 1


_TILE = 16


@njit(parallel=True, cache=True)
def transpose(a, out):
    """``out[j, i] = a[i, j]``: ``a`` (m, n) C-contiguous into ``out`` (n, m) C-contiguous.

    Column strips of ``a`` run in parallel; within a strip each row of ``a`` is read once,
    contiguously. Complexity: O(m * n).
    """
    m, n = a.shape
    for strip in prange((n + _TILE - 1) // _TILE):
        j0 = strip * _TILE
        width = min(_TILE, n - j0)
        for i in range(m):
            row = a[i, j0:j0 + width]
            for j in range(width):
                out[j0 + j, i] = row[j]
