"""``@njit`` kernels of the block-sparse (BSR) products: raw arrays in, preallocated outputs filled.

A BSR matrix of shape (M, N) with (R, C) blocks is ``indptr`` (M / R + 1), ``indices`` (nnzb,
the block column of each stored block) and ``data`` (nnzb, R, C). Every kernel trusts its caller
(``spchain.blocksparse``) to have validated the structure on the block grid: ``indptr`` starts
at 0, never decreases and ends at nnzb, and every block index is in range. Blocks may come in
any order within a block row, repeat (duplicates add up) or hold zeros.

The dense tiles are multiplied as register-blocked micro-GEMMs vectorised along a contiguous
axis: both products keep a 4 x 64-byte panel of the output in vector registers over a whole
block (:func:`_panel`, LLVM vectors: Numba would keep the output in memory, as it may alias
the operands). The edges go by loops that Numba vectorises: four output rows by four block
columns per pass (``blocksparse_spmm``) or dot products (``blocksparse_sddmm``).
"""

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .sparse import aligned_empty
from .team import team_rows

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


_PANEL_ROWS, _PANEL_BYTES = 4, 64  # a 4 x 64-byte output panel: eight AVX2 registers


@intrinsic
def _panel(typingctx, a, b, o, r, t):
    """``o[r + q, t:t + L] += a[r + q, :] @ b[:, t:t + L]`` for ``q < 4``, ``L = 64 / itemsize``.

    ``a`` (R, C) any strides, ``b`` (C, n) and ``o`` (R, n) C-contiguous, one float dtype. The
    panel of ``o`` is loaded into four vector accumulators, each step over ``c`` loads one
    vector of ``b``, broadcasts four values of ``a`` and does four vector fused multiply-adds;
    the panel is stored once at the end.
    """
    arrays = (a, b, o)
    if (not all(isinstance(x, types.Array) and x.ndim == 2 for x in arrays) or b.layout != "C"
            or o.layout != "C" or not isinstance(a.dtype, types.Float) or not a.dtype == b.dtype == o.dtype):
        return None

    def codegen(context, builder, signature, args):
        a_arr, b_arr, o_arr = (context.make_array(ty)(context, builder, v)
                               for ty, v in zip(signature.args[:3], args[:3]))
        element = context.get_data_type(signature.args[0].dtype)
        size = context.get_abi_sizeof(element)
        lanes = _PANEL_BYTES // size
        vector = ir.VectorType(element, lanes)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                             f"llvm.fma.v{lanes}f{size * 8}")
        undef, zero = ir.Constant(vector, ir.Undefined), ir.Constant(ir.IntType(32), 0)
        splat_mask = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
        intp = lambda v: context.get_constant(types.intp, v)  # noqa: E731
        r0, t0 = (context.cast(builder, v, ty, types.intp) for v, ty in zip(args[3:], signature.args[3:]))
        a_rows, a_cols = cgutils.unpack_tuple(builder, a_arr.strides)
        b_rows, o_rows = (cgutils.unpack_tuple(builder, x.strides)[0] for x in (b_arr, o_arr))
        column = builder.mul(t0, intp(size))

        def pointer(array, offset, kind):
            return cgutils.pointer_add(builder, array.data, offset, return_type=kind.as_pointer())

        o_ptrs = [pointer(o_arr, builder.add(builder.mul(builder.add(r0, intp(q)), o_rows), column), vector)
                  for q in range(_PANEL_ROWS)]
        accumulators = []
        for ptr in o_ptrs:
            slot = cgutils.alloca_once(builder, vector)  # promoted to a register by LLVM
            load = builder.load(ptr)
            load.align = size
            builder.store(load, slot)
            accumulators.append(slot)
        a_starts = [builder.mul(builder.add(r0, intp(q)), a_rows) for q in range(_PANEL_ROWS)]
        with cgutils.for_range(builder, cgutils.unpack_tuple(builder, a_arr.shape)[1]) as loop:
            x = builder.load(pointer(b_arr, builder.add(builder.mul(loop.index, b_rows), column), vector))
            x.align = size
            a_column = builder.mul(loop.index, a_cols)
            for start, slot in zip(a_starts, accumulators):
                value = builder.load(pointer(a_arr, builder.add(start, a_column), element))
                splat = builder.shuffle_vector(builder.insert_element(undef, value, zero), undef, splat_mask)
                builder.store(builder.call(fma, [splat, x, builder.load(slot)]), slot)
        for ptr, slot in zip(o_ptrs, accumulators):
            store = builder.store(builder.load(slot), ptr)
            store.align = size
        return context.get_dummy_value()

    return types.void(a, b, o, r, t), codegen


@njit(nogil=True, cache=True)
def blocksparse_spmm(parallel, threads, indptr, indices, slots, data, transpose, b, bias, out):
    """BSR times dense: ``out[rows of block row i] = bias + sum(data[slots[p]] @ b[cols of block p])``.

    Inputs: ``indptr`` (M / R + 1), ``indices`` and ``slots`` (nnzb; block ``p`` of the structure
    holds ``data[slots[p]]``, so a transposed structure reads the original blocks), ``data``
    (any, R, C) C-contiguous, with ``transpose`` read as ``data.transpose(0, 2, 1)`` (multiplies
    by the transposed blocks; one compiled kernel for both), ``b`` (N, n) C-contiguous, ``bias``
    (M). Overwrites ``out`` (M, n), C-contiguous. Block rows run in parallel
    (on a team of threads: ``team.run``); each block goes by :func:`_panel` (its
    edges by :func:`_tile`).
    Complexity: O(nnzb * R * C * n) multiply-adds, O(M * n) writes.
    """
    return team_rows(parallel, threads, _spmm_block_rows, indptr.shape[0] - 1,
                     (indptr, indices, slots, data, transpose, b, bias, out))


@njit(cache=True, fastmath=_FAST, error_model="numpy")  # division by zero gives inf or NaN
def _spmm_block_rows(lo, hi, indptr, indices, slots, data, transpose, b, bias, out):
    """Block rows ``lo:hi`` of :func:`blocksparse_spmm`."""
    rows, cols = (data.shape[2], data.shape[1]) if transpose else (data.shape[1], data.shape[2])
    lanes = _PANEL_BYTES // out.itemsize
    full_rows, full_n = rows - rows % _PANEL_ROWS, b.shape[1] - b.shape[1] % lanes
    for i in range(lo, hi):
        o = out[i * rows:(i + 1) * rows]
        for r in range(rows):
            o[r, :] = bias[i * rows + r]
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            a = data[slots[p]].T if transpose else data[slots[p]]  # one type, any strides
            panel = b[j * cols:(j + 1) * cols]
            for t in range(0, full_n, lanes):  # one lane panel of b stays in L1 over the rows
                for r in range(0, full_rows, _PANEL_ROWS):
                    _panel(a, panel, o, r, t)
            if full_n < o.shape[1]:
                _tile(a[:full_rows], panel[:, full_n:], o[:full_rows, full_n:])
            if full_rows < rows:
                _tile(a[full_rows:], panel, o[full_rows:])


@njit(nogil=True, cache=True)
def blocksparse_sddmm(parallel, threads, indptr, indices, a, b, out):
    """Block-sampled dense-dense product: ``out[p] = a[rows of block row i] @ b[cols of block p].T``.

    Inputs: ``indptr`` (M / R + 1), ``indices`` (nnzb), ``a`` (M, k) and ``b`` (N, k), both
    C-contiguous. Overwrites ``out`` (nnzb, R, C). First ``b`` is copied, in parallel, into
    one contiguous (k, C) panel per block column (``b[cols of j].T``); then block rows run
    in parallel, each block as :func:`_panel` products of ``a``'s rows with its panel. The
    edges (R % 4 rows, C % L columns) are dot products over ``k``, two rows by four columns
    at a time (:func:`_dots`). Both run on a team of threads (``team.run``).
    Complexity: O(nnzb * R * C * k) multiply-adds, O(N * k) extra memory.
    """
    panels = _sddmm_panels(b, out)
    failed = team_rows(parallel, threads, _copy_panels, panels.shape[0], (b, panels))
    if failed:
        return failed
    return team_rows(parallel, threads, _sddmm_block_rows, indptr.shape[0] - 1, (indptr, indices, a, b, panels, out))


@njit(cache=True)
def _sddmm_panels(b, out):
    """The (uninitialised) panels of :func:`blocksparse_sddmm`: (N / C, k, C), none where the
    blocks have no whole 4-row by 64-byte panel."""
    rows, cols, k = out.shape[1], out.shape[2], b.shape[1]
    lanes = _PANEL_BYTES // out.itemsize
    whole = rows >= _PANEL_ROWS and cols >= lanes
    return aligned_empty((b.shape[0] // cols if whole else 0, k, cols), out)


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _copy_panels(lo, hi, b, panels):
    """Panels ``lo:hi`` of :func:`blocksparse_sddmm`: ``panels[j] = b[cols of j].T``."""
    cols, k = panels.shape[2], panels.shape[1]
    for j in range(lo, hi):
        panel = panels[j]
        for c in range(cols):
            row = b[j * cols + c]
            for t in range(k):
                panel[t, c] = row[t]


@njit(cache=True, fastmath=_FAST, error_model="numpy")  # division by zero gives inf or NaN
def _sddmm_block_rows(lo, hi, indptr, indices, a, b, panels, out):
    """Block rows ``lo:hi`` of :func:`blocksparse_sddmm`."""
    rows, cols = out.shape[1], out.shape[2]
    lanes = _PANEL_BYTES // out.itemsize
    full_rows, full_cols = rows - rows % _PANEL_ROWS, cols - cols % lanes
    for i in range(lo, hi):
        a_rows = a[i * rows:(i + 1) * rows]
        for p in range(indptr[i], indptr[i + 1]):
            j, o = indices[p] * cols, out[p]
            if panels.shape[0]:
                o[:full_rows, :full_cols] = 0
                for c in range(0, full_cols, lanes):
                    for r in range(0, full_rows, _PANEL_ROWS):
                        _panel(a_rows, panels[indices[p]], o, r, c)
                if full_cols < cols:
                    for r in range(0, full_rows, 2):
                        _dots(a_rows[r], a_rows[r + 1], b, j + full_cols, o[r, full_cols:], o[r + 1, full_cols:])
                r = full_rows
            else:
                r = 0
            while r + 2 <= rows:
                _dots(a_rows[r], a_rows[r + 1], b, j, o[r], o[r + 1])
                r += 2
            if r < rows:
                _dots(a_rows[r], a_rows[r], b, j, o[r], o[r])


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
