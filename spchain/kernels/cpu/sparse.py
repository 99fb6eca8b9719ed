"""``@njit`` kernels of the sparse products: raw CSR arrays in, preallocated outputs filled.

Every kernel trusts its caller (``spchain.sparse``) to have validated the structure: ``indptr``
starts at 0, never decreases and ends at ``len(indices)``, and every index is in range. Stored
entries may come in any order within a row, repeat (duplicates add up) or hold zeros.

The products loop over a row's stored entries several at a time, so that each pass over a dense
row loads and stores the accumulator once for several entries (an unroll-and-jam of the entry loop).
"""

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

_FAST = {"reassoc", "contract"}  # lets the dot products vectorise; never assumes no inf/NaN


@njit(parallel=True, cache=True, fastmath=_FAST)
def sparse_spmm(indptr, indices, data, b, bias, out):
    """CSR times dense: ``out[i, :] = bias[i] + sum(data[p] * b[indices[p], :])`` over row ``i``.

    Inputs: ``indptr`` (m + 1), ``indices`` and ``data`` (nnz), ``b`` (k, n) C-contiguous,
    ``bias`` (m). Overwrites ``out`` (m, n), C-contiguous. Rows run in parallel; a row's
    entries are taken eight at a time, then four, then one.
    Complexity: O(nnz * n) multiply-adds, O(m * n) writes.
    """
    for i in prange(out.shape[0]):
        _spmm_row(indptr, indices, data, b, bias, out, i)


@njit(cache=True, fastmath=_FAST)
def sparse_spmm_serial(indptr, indices, data, b, bias, out):
    """:func:`sparse_spmm` on one thread, row after row (the same arithmetic): for small products,
    where starting the threads would cost more than the product."""
    for i in range(out.shape[0]):
        _spmm_row(indptr, indices, data, b, bias, out, i)


@njit(inline="always")
def _spmm_row(indptr, indices, data, b, bias, out, i):
    n = b.shape[1]
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
def sparse_sddmm(indptr, indices, a, b, out):
    """Sampled dense-dense product: ``out[p] = a[i, :] . b[indices[p], :]`` for entry ``p`` of row ``i``.

    Inputs: ``indptr`` (m + 1), ``indices`` (nnz), ``a`` (m, k) and ``b`` (n, k), both
    C-contiguous. Overwrites ``out`` (nnz). Rows run in parallel.
    Complexity: O(nnz * k) multiply-adds.
    """
    for i in prange(a.shape[0]):
        _sddmm_row(indptr, indices, a, b, out, i)


@njit(cache=True, fastmath=_FAST)
def sparse_sddmm_serial(indptr, indices, a, b, out):
    """:func:`sparse_sddmm` on one thread, row after row (the same arithmetic), for small products."""
    for i in range(a.shape[0]):
        _sddmm_row(indptr, indices, a, b, out, i)


@njit(inline="always")
def _sddmm_row(indptr, indices, a, b, out, i):
    k = a.shape[1]
    zero = out.dtype.type(0)
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


_BLOCK = 16


def _shuffle_masks():
    """Lane masks of a 16 x 16 transpose in four stages: stage ``b`` swaps bit ``b`` of the row
    with bit ``b`` of the lane, pairing rows ``r`` and ``r | 1 << b`` (lanes 16-31 pick from the
    second row of a pair)."""
    stages = []
    for b in range(4):
        bit = 1 << b
        low = [(_BLOCK if c & bit else 0) + (c & ~bit) for c in range(_BLOCK)]
        high = [(_BLOCK if c & bit else 0) + (c | bit) for c in range(_BLOCK)]
        stages.append((bit, low, high))
    return stages


_STAGES = _shuffle_masks()


@intrinsic
def _transpose_block(typingctx, a, out, i0, j0):
    """``out[j0 + c, i0 + r] = a[i0 + r, j0 + c]`` for ``r, c < 16``: 16 vector loads, 64 lane
    shuffles, 16 vector stores (LLVM emits the target's permutes). Both arrays C-contiguous, of
    bool, integer or float elements."""
    plain = isinstance(a.dtype, (types.Boolean, types.Integer, types.Float))
    if a.layout != "C" or out.layout != "C" or not plain:
        return None

    def codegen(context, builder, signature, args):
        a_type, out_type, i0_type, j0_type = signature.args
        a_array = context.make_array(a_type)(context, builder, args[0])
        out_array = context.make_array(out_type)(context, builder, args[1])
        element = context.get_data_type(a_type.dtype)  # as stored: a bool is a byte
        vector = ir.VectorType(element, _BLOCK)
        size = context.get_abi_sizeof(element)
        intp = lambda v: context.get_constant(types.intp, v)  # noqa: E731
        i0 = context.cast(builder, args[2], i0_type, types.intp)
        j0 = context.cast(builder, args[3], j0_type, types.intp)

        def row_pointer(array, row, column):  # &array[row, column]
            stride = cgutils.unpack_tuple(builder, array.strides)[0]
            offset = builder.add(builder.mul(row, stride), builder.mul(column, intp(size)))
            return cgutils.pointer_add(builder, array.data, offset, return_type=vector.as_pointer())

        rows = []
        for r in range(_BLOCK):
            load = builder.load(row_pointer(a_array, builder.add(i0, intp(r)), j0))
            load.align = size
            rows.append(load)
        lanes = ir.VectorType(ir.IntType(32), _BLOCK)
        for bit, low, high in _STAGES:
            pairs = [(r, r | bit) for r in range(_BLOCK) if not r & bit]
            new = list(rows)
            for r, r1 in pairs:
                new[r] = builder.shuffle_vector(rows[r], rows[r1], ir.Constant(lanes, low))
                new[r1] = builder.shuffle_vector(rows[r], rows[r1], ir.Constant(lanes, high))
            rows = new
        for c in range(_BLOCK):
            store = builder.store(rows[c], row_pointer(out_array, builder.add(j0, intp(c)), i0))
            store.align = size
        return context.get_dummy_value()

    return types.void(a, out, i0, j0), codegen


@njit(parallel=True, cache=True)
def transpose(a, out):
    """``out[j, i] = a[i, j]``: ``a`` (m, n) C-contiguous into ``out`` (n, m) C-contiguous.

    Strips of 16 columns of ``a`` run in parallel; each goes down ``a`` one 16 x 16 block at a
    time, transposed in vector registers (the edges element by element). Complexity: O(m * n).
    """
    m, n = a.shape
    for strip in prange((n + _BLOCK - 1) // _BLOCK):
        j0 = strip * _BLOCK
        i0 = 0
        if j0 + _BLOCK <= n:
            while i0 + _BLOCK <= m:
                _transpose_block(a, out, i0, j0)
                i0 += _BLOCK
        for i in range(i0, m):
            for j in range(j0, min(j0 + _BLOCK, n)):
                out[j, i] = a[i, j]
