"""``@njit`` kernels of the sparse products: raw CSR arrays in, preallocated outputs filled.

Every kernel trusts its caller (``spchain.sparse``) to have validated the structure: ``indptr``
starts at 0, never decreases and ends at ``len(indices)``, and every index is in range. Stored
entries may come in any order within a row, repeat (duplicates add up) or hold zeros.

:func:`sparse_spmm` sums each output row of a tile of columns in vector registers (:func:`_row_tile`, an
LLVM intrinsic); :func:`sparse_sddmm` goes over slabs of columns, eight stored entries a pass over a row's
slab of ``a``, their sums reduced together by a tree of shuffles (:func:`_dot_entries`). Both copy the
tile or slab of ``b`` that a pass reads many times into a buffer that stays in the core's cache, and
both read row-major operands given transposed (a layer's ``x`` and output gradient) through that
buffer, transposing 16 x 16 blocks in registers on the way: no transposed copy of a whole operand.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .team import team_rows

_FAST = {"reassoc", "contract"}  # lets the dot products vectorise; never assumes no inf/NaN


_VECTOR = 64
"""Bytes in one vector register (AVX-512; LLVM splits the vectors on narrower targets)."""
_TILE = 2
"""Registers of accumulators per pass over a row: 32 float32 or 16 float64 columns, so that a
tile of 4096 rows of ``b`` (512 KiB) stays in a core's L2 (1 MiB on the benchmark machine,
where a tile of 4 registers, 1 MiB, ran the sparse-linear product 5 to 40 % slower at 90 %
sparsity and 4 % slower at 99 %: one thread, fastest runs, measured beside other work)."""
_SETS = 4
"""Sets of accumulators of :func:`_row_tile`, each taking every fourth stored entry: eight
independent chains of FMAs for a tile of two vectors, enough to hide the FMA's latency (two
sets ran the sparse-linear product 3 to 12 % slower: 4096², x (256, 4096), same process)."""
_AHEAD = 16
"""Rows ahead whose output lines :func:`_sum_rows` fetches for writing: a tile writes 128 bytes
of each output row, a row apart by the whole product's width, which the hardware prefetcher
does not follow; without the hint each row's store waits for its lines (the 99 % sparse-linear
product's fixed cost, 0.9 ms of 1.8 ms, fell to 0.5 ms)."""
_PANEL = 2**22
"""Bytes at most of a tile of ``b`` copied for :func:`sparse_spmm` (beyond, ``b`` is read in place)."""


@njit(inline="always")
def aligned_empty(shape, like):
    """``np.empty(shape, like.dtype)`` starting on a 64-byte boundary, for the buffers that the
    kernels read by vector loads of 64-byte rows. Numba aligns its arrays to 32 bytes only, and
    half the time each such load then spans two cache lines: the sparse-linear product at 90 %
    sparsity ran 1.25 to 2 times slower so (20.8 against 41.5 ms on one thread)."""
    size = like.itemsize
    count = 1
    for extent in shape:
        count *= extent
    buffer = np.empty(count + _VECTOR // size, like.dtype)
    skip = (-buffer.ctypes.data % _VECTOR) // size
    return buffer[skip:skip + count].reshape(shape)


def packs_transposed(k: int) -> bool:
    """Whether :func:`sparse_spmm` takes a ``b`` of ``k`` rows ``transposed``: its tile buffer
    (``k`` rows of ``_TILE`` vectors) within ``_PANEL`` bytes."""
    return k * _TILE * _VECTOR <= _PANEL


@njit(nogil=True, cache=True)
def sparse_spmm(parallel, team, indptr, indices, data, b, bias, out, threads, transposed, out_transposed):
    """CSR times dense: ``out[i, :] = bias[i] + sum(data[p] * b[indices[p], :])`` over row ``i``.

    Inputs: ``indptr`` (m + 1), ``indices`` and ``data`` (nnz), ``b`` (k, n) C-contiguous, or
    with ``transposed`` its transpose (n, k) C-contiguous (a row-major batch ``x`` for
    ``b = x.T``: no transposed copy), ``bias`` (m), ``threads`` >= 1. Overwrites ``out``
    (m, n), C-contiguous, or with ``out_transposed`` its transpose (n, m) C-contiguous (a
    layer's input gradient in the batch's rows: each 16 rows' sums go through a small buffer,
    written out as 16 x 16 blocks transposed in registers; no transposed copy of the product).
    The work is cut into parts, tiles of ``_TILE`` vectors of columns
    first (each part copies only its own tile of ``b``), then, where the tiles are fewer than
    ``threads``, runs of rows of about equal stored entries (:func:`_parts`); the parts run in
    parallel on a team of ``team`` threads (``team.run``; ``parallel`` 0 or ``team`` 1: on the
    calling thread, the small products' route), each as :func:`_spmm_part`.
    Complexity: O(nnz * n) multiply-adds, O(m * n) writes.
    """
    return team_rows(parallel, team, _spmm_parts, _parts(out, threads, out_transposed)[2],
                     (indptr, indices, data, b, bias, out, threads, transposed, out_transposed))


@njit(inline="always")
def _parts(out, threads, out_transposed):
    """``(tiles, runs, parts)`` of :func:`sparse_spmm`: tiles of ``_TILE`` vectors of the product's
    columns (the last may hold one vector and the columns past the last whole vector; one
    tile where there is no whole vector), each cut into ``runs`` runs of rows so that the
    ``parts`` = tiles x runs are at least ``threads``. A part's tile of ``b`` is read by its
    rows alone: cutting by columns first copies each tile once (with two threads each copying
    every tile, that copy took 1.0 ms of a 1.7 ms product at 99 % sparsity), and every part
    reads the stored entries of its rows whichever way the work is cut."""
    width = _TILE * _VECTOR // out.itemsize
    n = out.shape[0] if out_transposed else out.shape[1]
    whole = n - n % (_VECTOR // out.itemsize)
    tiles = max(1, (whole + width - 1) // width)
    runs = (threads + tiles - 1) // tiles
    return tiles, runs, tiles * runs


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _spmm_parts(lo, hi, indptr, indices, data, b, bias, out, threads, transposed, out_transposed):
    """Parts ``lo:hi`` of :func:`sparse_spmm` (see :func:`_parts`; each row's sums do not depend
    on the parts: the same bits for any ``threads``)."""
    tiles, runs, _ = _parts(out, threads, out_transposed)
    for q in range(lo, hi):
        tile, r = q // runs, q % runs
        start = _run_start(indptr, r, runs, out_transposed)
        end = _run_start(indptr, r + 1, runs, out_transposed)
        _spmm_part(indptr, indices, data, b, bias, out, start, end, tile, tile == tiles - 1, transposed,
                   out_transposed)


@njit(inline="always")
def _run_start(indptr, r, runs, out_transposed):
    """The first row of run ``r`` of ``runs`` of about equal stored entries (``m`` for
    ``r == runs``); with ``out_transposed`` a multiple of 16, so that each part writes whole
    16 x 16 blocks of the transposed ``out`` and no cache line of it is shared by two parts."""
    m = indptr.shape[0] - 1
    if r == runs:
        return m
    start = np.searchsorted(indptr[:m], indptr[m] * r // runs)
    return start - start % _BLOCK if out_transposed else start


@njit(inline="always")
def _spmm_part(indptr, indices, data, b, bias, out, lo, hi, tile, last, transposed, out_transposed):
    """Rows ``lo`` to ``hi`` of tile ``tile`` of :func:`sparse_spmm`, each row summed in registers
    (:func:`_row_tile`); the ``last`` tile also takes the columns past the last whole vector,
    one by one. Where the rows' entries outnumber ``b``'s rows (each row of ``b`` read more
    than once) and the tile takes at most ``_PANEL`` bytes, the tile of ``b`` is first copied
    into a buffer of its own: ``k`` rows of 128 bytes, which stay in the core's cache, where
    ``b``'s power-of-two row strides would map them onto a fraction of the cache's sets. A
    ``transposed`` ``b`` is always copied so, transposed on the way (:func:`_pack_transposed`)."""
    k = b.shape[1] if transposed else b.shape[0]
    n = out.shape[0] if out_transposed else out.shape[1]
    lanes = _VECTOR // out.itemsize
    width = _TILE * lanes
    c0 = tile * width
    vectors = min(_TILE, (n - n % lanes - c0) // lanes)
    if vectors > 0:
        packed = transposed or (indptr[hi] - indptr[lo] >= k and k * width * out.itemsize <= _PANEL)
        panel = aligned_empty((k if packed else 0, width), out)
        if transposed:
            _pack_transposed(b[c0:c0 + vectors * lanes], panel, 0, k)
        elif packed:
            for j in range(k):
                _copy_vectors(b, j, c0, panel, vectors * lanes)
        if packed:
            _tile_rows(indptr, indices, data, panel, 0, bias, out, lo, hi, c0, vectors, out_transposed)
        else:
            _tile_rows(indptr, indices, data, b, c0, bias, out, lo, hi, c0, vectors, out_transposed)
    if last:
        for i in range(lo, hi):
            for c in range(c0 + vectors * lanes, n):
                total = bias[i]
                for p in range(indptr[i], indptr[i + 1]):
                    total += data[p] * (b[c, indices[p]] if transposed else b[indices[p], c])
                if out_transposed:
                    out[c, i] = total
                else:
                    out[i, c] = total


@njit(inline="always")
def _pack_transposed(a, panel, lo, hi):
    """``panel[j, r] = a[r, j]`` for ``lo <= j < hi`` and ``r`` below ``a``'s rows, ``a`` (w, k)
    C-contiguous, ``w`` at most ``panel``'s columns: 16 x 16 blocks in vector registers
    (:func:`_transpose_block`; the first block may start up to 15 rows of ``panel`` before
    ``lo``), the edges element by element."""
    w = a.shape[0]
    start = lo - lo % _BLOCK
    r0 = 0
    while r0 + _BLOCK <= w:
        j0 = start
        while j0 + _BLOCK <= hi:
            _transpose_block(a, r0, j0, panel, j0, r0)
            j0 += _BLOCK
        for r in range(r0, r0 + _BLOCK):
            for j in range(max(j0, lo), hi):
                panel[j, r] = a[r, j]
        r0 += _BLOCK
    for r in range(r0, w):
        for j in range(lo, hi):
            panel[j, r] = a[r, j]


@njit(inline="always")
def _tile_rows(indptr, indices, data, b, b0, bias, out, lo, hi, c0, vectors, out_transposed):
    """``out[i, c0:c0 + w] = bias[i] + sum(data[p] * b[indices[p], b0:b0 + w])`` for rows
    ``lo`` to ``hi``, ``w`` the columns of ``vectors`` (1 or ``_TILE`` = 2) vectors; with
    ``out_transposed`` into ``out[c0:c0 + w, i]``, 16 rows at a time through a buffer."""
    if not out_transposed:
        _sum_rows(indptr, indices, data, b, b0, bias, out, lo, hi, 0, c0, vectors, _AHEAD)
        return
    width = vectors * (_VECTOR // out.itemsize)
    block = aligned_empty((_BLOCK, _TILE * _VECTOR // out.itemsize), out)
    i0 = lo
    while i0 < hi:
        i1 = min(hi, i0 - i0 % _BLOCK + _BLOCK)
        _sum_rows(indptr, indices, data, b, b0, bias, block, i0, i1, i0, 0, vectors, 0)
        j = 0
        if i1 - i0 == _BLOCK:
            while j + _BLOCK <= width:
                _transpose_block(block, 0, j, out, c0 + j, i0)
                j += _BLOCK
        for r in range(i1 - i0):
            for c in range(j, width):
                out[c0 + c, i0 + r] = block[r, c]
        i0 = i1


@njit(inline="always")
def _sum_rows(indptr, indices, data, b, b0, bias, out, lo, hi, first, c0, vectors, ahead):
    """``out[i - first, c0:c0 + w]`` of :func:`_tile_rows` for rows ``lo`` to ``hi``; with
    ``ahead`` rows > 0 each row's output lines that many rows ahead fetched for writing first."""
    lanes = _VECTOR // out.itemsize
    for i in range(lo, hi):
        if ahead:
            for q in range(vectors):
                _prefetch_write(out, i - first + ahead, c0 + q * lanes)
        if vectors == 2:
            _row_tile(indices, data, b, b0, indptr[i], indptr[i + 1], bias[i], out, i - first, c0, 2)
        else:
            _row_tile(indices, data, b, b0, indptr[i], indptr[i + 1], bias[i], out, i - first, c0, 1)


def _vector_types(context, dtype):
    """For an intrinsic's code on ``dtype`` elements: their size in bytes, the lanes of a vector
    register, the LLVM vector type and ``intp``."""
    size = context.get_abi_sizeof(context.get_data_type(dtype))
    lanes = _VECTOR // size
    return size, lanes, ir.VectorType(context.get_data_type(dtype), lanes), context.get_value_type(types.intp)


@intrinsic
def _prefetch_write(typingctx, a, i, j):
    """A hint that ``a[i, j]``'s cache line is about to be written (``llvm.prefetch``): no
    effect on the results, and none past ``a``'s end (a prefetch never faults)."""
    if a.ndim != 2:
        return None

    def codegen(context, builder, signature, args):
        a_type, i_type, j_type = signature.args
        array = context.make_array(a_type)(context, builder, args[0])
        intp = context.get_value_type(types.intp)
        i = context.cast(builder, args[1], i_type, types.intp)
        j = context.cast(builder, args[2], j_type, types.intp)
        row, column = cgutils.unpack_tuple(builder, array.strides)
        offset = builder.add(builder.mul(i, row), builder.mul(j, column))
        address = builder.inttoptr(builder.add(builder.ptrtoint(array.data, intp), offset), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        prototype = ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32])  # address, write, locality, data
        prefetch = cgutils.get_or_insert_function(builder.module, prototype, "llvm.prefetch.p0i8")
        builder.call(prefetch, [address, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(a, i, j), codegen


@intrinsic
def _copy_vectors(typingctx, a, j, c0, out, width):
    """``out[j, :width] = a[j, c0:c0 + width]``, ``width`` a multiple of the vector's lanes up
    to ``_TILE`` vectors, by vector loads and stores; ``a`` and ``out`` C-contiguous."""
    if a.layout != "C" or out.layout != "C" or not isinstance(a.dtype, types.Float):
        return None

    def codegen(context, builder, signature, args):
        a_type, j_type, c0_type, out_type, width_type = signature.args
        a_array = context.make_array(a_type)(context, builder, args[0])
        out_array = context.make_array(out_type)(context, builder, args[3])
        size, lanes, vector, intp = _vector_types(context, a_type.dtype)
        j = context.cast(builder, args[1], j_type, types.intp)
        c0 = context.cast(builder, args[2], c0_type, types.intp)
        width = context.cast(builder, args[4], width_type, types.intp)
        a_row = builder.mul(j, cgutils.unpack_tuple(builder, a_array.strides)[0])
        out_row = builder.mul(j, cgutils.unpack_tuple(builder, out_array.strides)[0])
        for q in range(_TILE):
            column = ir.Constant(intp, q * lanes)
            with builder.if_then(builder.icmp_signed("<", column, width), likely=True):
                source = builder.add(a_row, builder.mul(builder.add(c0, column), ir.Constant(intp, size)))
                target = builder.add(out_row, builder.mul(column, ir.Constant(intp, size)))
                load = builder.load(cgutils.pointer_add(builder, a_array.data, source, return_type=vector.as_pointer()))
                load.align = size
                store = builder.store(load, cgutils.pointer_add(builder, out_array.data, target,
                                                                return_type=vector.as_pointer()))
                store.align = size
        return context.get_dummy_value()

    return types.void(a, j, c0, out, width), codegen


@intrinsic
def _row_tile(typingctx, indices, data, b, b0, p0, p1, start, out, i, c0, vectors):
    """``out[i, c0:c0 + w] = start + sum(data[p] * b[indices[p], b0:b0 + w] for p0 <= p < p1)``
    for ``w`` the columns of ``vectors`` (a literal, 1 to 4) 64-byte vectors: the sums in
    registers, ``_SETS`` sets of them (entries taken ``_SETS`` at a time, added at the end), each
    product fused into its sum (FMA). ``b`` and ``out`` C-contiguous, of one float dtype."""
    if not isinstance(vectors, types.IntegerLiteral) or b.layout != "C" or out.layout != "C":
        return None
    count = vectors.literal_value

    def codegen(context, builder, signature, args):
        (indices_type, data_type, b_type, b0_type, p0_type, p1_type, start_type, out_type, i_type, c0_type,
         _) = signature.args
        index_array = context.make_array(indices_type)(context, builder, args[0])
        data_array = context.make_array(data_type)(context, builder, args[1])
        b_array = context.make_array(b_type)(context, builder, args[2])
        out_array = context.make_array(out_type)(context, builder, args[7])
        size, lanes, vector, intp = _vector_types(context, b_type.dtype)

        def const(v):
            return ir.Constant(intp, v)

        def splat(value):
            one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))

        def address(array, row, stride, column):  # &array[row, column] as a vector pointer
            offset = builder.add(builder.mul(row, stride), builder.mul(column, const(size)))
            return cgutils.pointer_add(builder, array.data, offset, return_type=vector.as_pointer())

        b0 = context.cast(builder, args[3], b0_type, types.intp)
        p0 = context.cast(builder, args[4], p0_type, types.intp)
        p1 = context.cast(builder, args[5], p1_type, types.intp)
        start = context.cast(builder, args[6], start_type, b_type.dtype)
        row = context.cast(builder, args[8], i_type, types.intp)
        c0 = context.cast(builder, args[9], c0_type, types.intp)
        b_stride = cgutils.unpack_tuple(builder, b_array.strides)[0]
        out_stride = cgutils.unpack_tuple(builder, out_array.strides)[0]
        sums = [[cgutils.alloca_once_value(builder, splat(start) if s == 0 else ir.Constant(vector, [0.0] * lanes))
                 for _ in range(count)] for s in range(_SETS)]
        position = cgutils.alloca_once_value(builder, p0)

        def add_entry(p, s):
            j = context.cast(builder, builder.load(cgutils.gep(builder, index_array.data, p)), indices_type.dtype,
                             types.intp)
            value = context.cast(builder, builder.load(cgutils.gep(builder, data_array.data, p)), data_type.dtype,
                                 b_type.dtype)
            weight = splat(value)
            for q in range(count):
                load = builder.load(address(b_array, j, b_stride, builder.add(b0, const(q * lanes))))
                load.align = size
                product = builder.fmul(weight, load, flags=["contract"])
                builder.store(builder.fadd(builder.load(sums[s][q]), product, flags=["contract"]), sums[s][q])

        groups, group, single, one, done = (builder.append_basic_block(name) for name in
                                            ("groups", "group", "single", "one", "done"))
        builder.branch(groups)
        builder.position_at_end(groups)
        p = builder.load(position)
        builder.cbranch(builder.icmp_signed("<=", builder.add(p, const(_SETS)), p1), group, single)
        builder.position_at_end(group)
        for s in range(_SETS):
            add_entry(builder.add(p, const(s)), s)
        builder.store(builder.add(p, const(_SETS)), position)
        builder.branch(groups)
        builder.position_at_end(single)
        p = builder.load(position)
        builder.cbranch(builder.icmp_signed("<", p, p1), one, done)
        builder.position_at_end(one)
        add_entry(p, 0)
        builder.store(builder.add(p, const(1)), position)
        builder.branch(single)
        builder.position_at_end(done)
        for q in range(count):
            total = builder.load(sums[0][q])
            for s in range(1, _SETS):
                total = builder.fadd(total, builder.load(sums[s][q]))
            store = builder.store(total, address(out_array, row, out_stride, builder.add(c0, const(q * lanes))))
            store.align = size
        return context.get_dummy_value()

    return types.void(indices, data, b, b0, p0, p1, start, out, i, c0, vectors), codegen


@njit(nogil=True, cache=True)
def sparse_sddmm(parallel, team, indptr, indices, a, b, out, threads, transposed):
    """Sampled dense-dense product: ``out[p] = a[i, :] . b[indices[p], :]`` for entry ``p`` of row ``i``.

    Inputs: ``indptr`` (m + 1), ``indices`` (nnz), ``a`` (m, k) and ``b`` (n, k), both
    C-contiguous, or with ``transposed`` their transposes (k, m) and (k, n) C-contiguous (the
    row-major batches of a layer's output gradient and input: no transposed copies),
    ``threads`` >= 1. Overwrites ``out`` (nnz). The rows are cut into ``threads`` runs of about
    equal stored entries, which run in parallel on a team of ``team`` threads (``team.run``; ``parallel`` 0
    or ``team`` 1: on the calling thread); each run goes over the columns one slab at a
    time (see :func:`_sddmm_rows`).
    Complexity: O(nnz * k) multiply-adds.
    """
    return team_rows(parallel, team, _sddmm_runs, threads, (indptr, indices, a, b, out, threads, transposed))


@njit(cache=True, fastmath=_FAST, error_model="numpy")  # division by zero gives inf or NaN
def _sddmm_runs(lo, hi, indptr, indices, a, b, out, threads, transposed):
    """Runs ``lo:hi`` of the ``threads`` runs of :func:`sparse_sddmm` (each entry's sum does not
    depend on the runs: the same bits for any ``threads``)."""
    m = a.shape[1] if transposed else a.shape[0]
    nnz = indptr[m]
    for r in range(lo, hi):
        start = np.searchsorted(indptr[:m], nnz * r // threads)
        end = m if r == threads - 1 else np.searchsorted(indptr[:m], nnz * (r + 1) // threads)
        _sddmm_rows(indptr, indices, a, b, out, start, end, transposed)


_SLAB = 2
"""Vector registers of columns per pass of :func:`sparse_sddmm` (32 float32 or 16 float64): a
slab of 4096 rows of ``b`` takes 512 KiB, which stays in a core's cache."""
_GROUP = 8
"""Stored entries per pass over a slab of a row of ``a``: eight dot products at a time."""


@njit(inline="always")
def _sddmm_rows(indptr, indices, a, b, out, lo, hi, transposed):
    """Rows ``lo`` to ``hi`` of :func:`sparse_sddmm`, one slab of ``_SLAB`` vectors of columns at
    a time: each entry's dot product is the sum of its slabs' (:func:`_dot_entries`), the columns
    past the last whole vector one by one. Where the rows' entries outnumber ``b``'s rows, the
    slab of ``b`` is first copied into a buffer of its own (as in :func:`_spmm_part`: ``b``'s
    power-of-two row strides would map its rows onto a fraction of the cache's sets); a
    ``transposed`` ``b`` always is, transposed on the way, and so are the slabs of ``a``'s rows
    ``lo`` to ``hi``."""
    k, n = b.shape if transposed else b.shape[::-1]
    lanes = _VECTOR // out.itemsize
    width = _SLAB * lanes
    p0, p1 = indptr[lo], indptr[hi]
    out[p0:p1] = 0
    packed = transposed or (p1 - p0 >= n and n * width * out.itemsize <= _PANEL)
    panel = aligned_empty((n if packed else 0, width), out)
    rows = aligned_empty((hi if transposed else 0, width), out)
    c0 = 0
    while c0 < k - k % lanes:
        vectors = min(_SLAB, (k - c0) // lanes)
        if transposed:
            _pack_transposed(b[c0:c0 + vectors * lanes], panel, 0, n)
            _pack_transposed(a[c0:c0 + vectors * lanes], rows, lo, hi)
            _slab_rows(indptr, indices, rows, 0, panel, 0, out, lo, hi, vectors)
        elif packed:
            for j in range(n):
                _copy_vectors(b, j, c0, panel, vectors * lanes)
            _slab_rows(indptr, indices, a, c0, panel, 0, out, lo, hi, vectors)
        else:
            _slab_rows(indptr, indices, a, c0, b, c0, out, lo, hi, vectors)
        c0 += vectors * lanes
    if c0 < k:
        for i in range(lo, hi):
            for p in range(indptr[i], indptr[i + 1]):
                j = indices[p]
                total = out[p]
                for c in range(c0, k):
                    total += a[c, i] * b[c, j] if transposed else a[i, c] * b[j, c]
                out[p] = total


@njit(inline="always")
def _slab_rows(indptr, indices, a, a0, b, b0, out, lo, hi, vectors):
    """``out[p] += a[i, a0:a0 + w] . b[indices[p], b0:b0 + w]`` for the entries of rows ``lo`` to
    ``hi``, ``w`` the columns of ``vectors`` (1 or 2) vectors: ``_GROUP`` entries at a time, then
    one by one."""
    for i in range(lo, hi):
        p, end = indptr[i], indptr[i + 1]
        while p + _GROUP <= end:
            if vectors == 2:
                _dot_entries(indices, b, b0, p, a, i, a0, out, 2, _GROUP)
            else:
                _dot_entries(indices, b, b0, p, a, i, a0, out, 1, _GROUP)
            p += _GROUP
        while p < end:
            if vectors == 2:
                _dot_entries(indices, b, b0, p, a, i, a0, out, 2, 1)
            else:
                _dot_entries(indices, b, b0, p, a, i, a0, out, 1, 1)
            p += 1


def _halving(builder, vectors, blocks, size):
    """Pairwise sums that halve each block: ``vectors`` of ``blocks`` blocks of ``size`` lanes
    (one entry's partial sums a block) become half as many vectors (or, for one vector, half
    its lanes) of twice as many blocks of half the size, in the same entry order."""
    lanes = blocks * size
    half = [b * size + t for b in range(blocks) for t in range(size // 2)]
    i32 = ir.IntType(32)
    if len(vectors) == 1:
        x = vectors[0]
        lo = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(i32, lanes // 2), half))
        hi = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(i32, lanes // 2), [h + size // 2 for h in half]))
        return [builder.fadd(lo, hi)]
    low = half + [lanes + h for h in half]
    mask_lo = ir.Constant(ir.VectorType(i32, lanes), low)
    mask_hi = ir.Constant(ir.VectorType(i32, lanes), [h + size // 2 for h in low])
    return [builder.fadd(builder.shuffle_vector(x, y, mask_lo), builder.shuffle_vector(x, y, mask_hi))
            for x, y in zip(vectors[::2], vectors[1::2])]


@intrinsic
def _dot_entries(typingctx, indices, b, b0, p, a, i, a0, out, vectors, entries):
    """``out[p + e] += a[i, a0:a0 + w] . b[indices[p + e], b0:b0 + w]`` for ``e < entries``, ``w``
    the columns of ``vectors`` (a literal, 1 or 2) 64-byte vectors and ``entries`` a literal power
    of two up to the vector's lanes: the products summed lane by lane in registers (FMA), then
    the entries' vectors reduced together by a tree of shuffles into one vector of ``entries``
    sums. ``a``, ``b`` and ``out`` C-contiguous, of one float dtype."""
    if (not isinstance(vectors, types.IntegerLiteral) or not isinstance(entries, types.IntegerLiteral)
            or a.layout != "C" or b.layout != "C" or out.layout != "C"):
        return None
    count, group = vectors.literal_value, entries.literal_value

    def codegen(context, builder, signature, args):
        indices_type, b_type, b0_type, p_type, a_type, i_type, a0_type, out_type, _, _ = signature.args
        index_array = context.make_array(indices_type)(context, builder, args[0])
        b_array = context.make_array(b_type)(context, builder, args[1])
        a_array = context.make_array(a_type)(context, builder, args[4])
        out_array = context.make_array(out_type)(context, builder, args[7])
        size, lanes, vector, intp = _vector_types(context, b_type.dtype)

        def const(v):
            return ir.Constant(intp, v)

        def load(array, row, column):  # array[row, column:column + lanes]
            stride = cgutils.unpack_tuple(builder, array.strides)[0]
            offset = builder.add(builder.mul(row, stride), builder.mul(column, const(size)))
            value = builder.load(cgutils.pointer_add(builder, array.data, offset, return_type=vector.as_pointer()))
            value.align = size
            return value

        b0 = context.cast(builder, args[2], b0_type, types.intp)
        p = context.cast(builder, args[3], p_type, types.intp)
        i = context.cast(builder, args[5], i_type, types.intp)
        a0 = context.cast(builder, args[6], a0_type, types.intp)
        row = [load(a_array, i, builder.add(a0, const(q * lanes))) for q in range(count)]
        sums = []
        for e in range(group):
            j = context.cast(builder, builder.load(cgutils.gep(builder, index_array.data, builder.add(p, const(e)))),
                             indices_type.dtype, types.intp)
            total = None
            for q in range(count):
                product = builder.fmul(row[q], load(b_array, j, builder.add(b0, const(q * lanes))), flags=["contract"])
                total = product if total is None else builder.fadd(total, product, flags=["contract"])
            sums.append(total)
        blocks, size_ = 1, lanes
        while len(sums) > 1 or size_ > 1:
            sums = _halving(builder, sums, blocks, size_)
            blocks, size_ = blocks * 2, size_ // 2
        total = sums[0]
        target = cgutils.pointer_add(builder, out_array.data, builder.mul(p, const(size)),
                                     return_type=ir.VectorType(vector.element, group).as_pointer())
        if group == 1:
            target = cgutils.gep(builder, out_array.data, p)
            total = builder.extract_element(total, ir.Constant(ir.IntType(32), 0))
        old = builder.load(target)
        old.align = size
        store = builder.store(builder.fadd(old, total), target)
        store.align = size
        return context.get_dummy_value()

    return types.void(indices, b, b0, p, a, i, a0, out, vectors, entries), codegen


_RUN = 2**14
"""Entries per chunk of :func:`gather`."""


@njit(nogil=True, cache=True)
def gather(parallel, team, values, order, out):
    """``out[q] = values[order[q]]``: the stored values in the order of a structure's transpose.

    Inputs: ``values`` (nnz), ``order`` (nnz) with every entry in range. Overwrites ``out``
    (nnz). Runs of ``_RUN`` entries in parallel on a team of ``team`` threads (``team.run``;
    ``parallel`` 0 or ``team`` 1: on the calling thread). The reads are scattered over all of
    ``values``: two threads keep more of them in flight than NumPy's ``values[order]`` on one
    (2.6 against 12.3 ms for 1.7 million float32 values). Complexity: O(nnz).
    """
    return team_rows(parallel, team, _gather_runs, (order.shape[0] + _RUN - 1) // _RUN, (values, order, out))


@njit(cache=True)
def _gather_runs(lo, hi, values, order, out):
    """Runs ``lo:hi`` of :func:`gather`."""
    for q in range(lo * _RUN, min(order.shape[0], hi * _RUN)):
        out[q] = values[order[q]]


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
def _transpose_block(typingctx, a, i0, j0, out, k0, l0):
    """``out[k0 + c, l0 + r] = a[i0 + r, j0 + c]`` for ``r, c < 16``: 16 vector loads, 64 lane
    shuffles, 16 vector stores (LLVM emits the target's permutes). Both arrays C-contiguous, of
    one bool, integer or float dtype."""
    plain = isinstance(a.dtype, (types.Boolean, types.Integer, types.Float))
    if a.layout != "C" or out.layout != "C" or not plain or a.dtype != out.dtype:
        return None

    def codegen(context, builder, signature, args):
        a_type, i0_type, j0_type, out_type, k0_type, l0_type = signature.args
        a_array = context.make_array(a_type)(context, builder, args[0])
        out_array = context.make_array(out_type)(context, builder, args[3])
        element = context.get_data_type(a_type.dtype)  # as stored: a bool is a byte
        vector = ir.VectorType(element, _BLOCK)
        size = context.get_abi_sizeof(element)
        intp = lambda v: context.get_constant(types.intp, v)  # noqa: E731
        i0, j0, k0, l0 = (context.cast(builder, args[k], t, types.intp)
                          for k, t in ((1, i0_type), (2, j0_type), (4, k0_type), (5, l0_type)))

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
            store = builder.store(rows[c], row_pointer(out_array, builder.add(k0, intp(c)), l0))
            store.align = size
        return context.get_dummy_value()

    return types.void(a, i0, j0, out, k0, l0), codegen


@njit(nogil=True, cache=True)
def transpose(parallel, threads, a, out):
    """``out[j, i] = a[i, j]``: ``a`` (m, n) C-contiguous into ``out`` (n, m) C-contiguous.

    Strips of 16 columns of ``a`` run in parallel (on a team of threads: ``team.run``);
    each goes down ``a`` one 16 x 16 block at a time, transposed in vector registers (the edges
    element by element). Complexity: O(m * n).
    """
    return team_rows(parallel, threads, _transpose_strips, (a.shape[1] + _BLOCK - 1) // _BLOCK, (a, out))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _transpose_strips(lo, hi, a, out):
    """Strips ``lo:hi`` (of 16 columns of ``a``) of :func:`transpose`."""
    m, n = a.shape
    for strip in range(lo, hi):
        j0 = strip * _BLOCK
        i0 = 0
        if j0 + _BLOCK <= n:
            while i0 + _BLOCK <= m:
                _transpose_block(a, i0, j0, out, j0, i0)
                i0 += _BLOCK
        for i in range(i0, m):
            for j in range(j0, min(j0 + _BLOCK, n)):
                out[j, i] = a[i, j]
