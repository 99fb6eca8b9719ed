"""CSR structures of the sparse layer: validation and conversion of every sparse operand
into one :class:`Csr` of raw arrays (:func:`to_csr`), and the checks of sizes, shapes,
fractions and dense operands that ``spchain.sparse`` and ``spchain.blocksparse`` share.
The caller's arrays are never written to: conversions build new arrays."""

from __future__ import annotations

import copy
import importlib
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse

from . import _backend
from ._backend import Backend
from ._typing import Array, Shape, Sparse
from .kernels import cpu, cuda

FORMATS = ("csr", "csc", "coo")
_INT32_MAX = np.iinfo(np.int32).max


def fits_int32(*sizes: int) -> bool:
    """Whether int32 indices can hold every size (dimensions, entry counts, offsets), e.g.
    ``fits_int32(rows, cols, nnz)``; else a structure takes int64. (No ``max``: on symbolic
    sizes under ``torch.compile`` it would guard on which size is largest.)"""
    return all(size <= _INT32_MAX for size in sizes)


def stores_every_entry(indptr: Array, indices: Array, grid: tuple[int, int]) -> bool:
    """Whether a CSR pattern over ``grid`` (rows, cols) stores each of its entries once, in
    row-major order, as a dense matrix does (the values of a CSR weight are then that
    matrix's rows, flattened). NumPy arrays; O(nnz).

    >>> import numpy as np
    >>> stores_every_entry(np.array([0, 2, 4]), np.array([0, 1, 0, 1]), (2, 2))
    True
    >>> stores_every_entry(np.array([0, 2, 4]), np.array([1, 0, 0, 1]), (2, 2))
    False
    """
    m, n = grid
    if indices.shape[0] != m * n:
        return False
    return bool(np.array_equal(indptr, np.arange(m + 1) * n)
                and np.array_equal(indices.reshape(m, n), np.broadcast_to(np.arange(n), (m, n))))


@dataclass(frozen=True)
class Csr:
    """A validated sparse structure in CSR order: raw arrays of one backend.

    ``indptr`` (m + 1) and ``indices`` (nnz) share one integer dtype (int32, or int64 when
    mixed or large); ``data`` (nnz) is ``None`` for a pattern. Entries may be unsorted within a
    row, repeat, or hold zeros.

    It shares its products with :class:`spchain.blocksparse.Bsr` (:meth:`matmul`,
    :meth:`sampled`, :meth:`transposed`), so that one body
    (:func:`spchain.sparse.linear`) runs on either format.
    """

    indptr: Array
    indices: Array
    data: Array | None
    shape: tuple[int, int]

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    @property
    def nbytes(self) -> int:
        """The bytes of the index arrays, and of the transpose once :meth:`transposed` built it."""
        return structure_nbytes(self)

    def transposed(self, backend: Backend) -> tuple[Csr, Array]:
        """``(csr_t, order)``: the CSR structure of the transpose, and ``order`` (nnz) such that
        entry ``q`` of ``csr_t`` is entry ``order[q]`` of this one (its data, if any, is
        gathered). Built once and kept with the structure."""
        cached: tuple[Csr, Array] | None = self.__dict__.get("_transposed")
        if cached is None:
            indptr, order = _group(backend, self.indices, self.shape[1])
            rows = row_of_entries(backend, self)[order]
            data = None if self.data is None else self.data[order]
            cached = Csr(indptr, rows, data, (self.shape[1], self.shape[0])), order
            object.__setattr__(self, "_transposed", cached)  # a cache of a frozen value, not a change of it
        return cached

    def prepare(self, backend: Backend) -> None:
        """Build what this structure's products need: its transpose on the CPU; on the GPU its
        cuSPARSE form (:class:`_GpuStructure`; cuSPARSE multiplies by the transpose itself)."""
        if backend.on_gpu:
            object.__setattr__(self, "_gpu", _GpuStructure(backend, self))  # a cache of a frozen value
        else:
            self.transposed(backend)

    def matmul(self, backend: Backend, values: Array, b: Array, dtype: np.dtype[Any], bias: Array | None = None, *,
               transpose: bool = False, rows: bool = False) -> Array:
        """``W @ b`` (plus ``bias[:, None]``), ``W`` this structure with ``values`` (nnz), for a
        dense (k, n) ``b``; ``W.T @ b`` with ``transpose``. C-contiguous on the CPU (the
        parallel Numba kernel), column-major on the GPU (cuSPARSE); with ``rows`` the product's
        transpose (n, m), C-contiguous (a layer's input gradient: batch rows), written so by
        the kernel on the CPU and a view of cuSPARSE's result on the GPU.
        """
        values = values.astype(dtype, copy=False)
        b = b.astype(dtype, copy=False)
        if bias is not None:
            bias = bias.astype(dtype, copy=False)
        if backend.on_gpu:
            out = _gpu_spmm(backend, self, values, b, dtype, bias, transpose)
            return out.T if rows else out
        csr = self
        if transpose:
            csr, order = self.transposed(backend)
            values = _gathered(values, order)
        m, n = csr.shape[0], b.shape[1]
        out = np.empty((n, m) if rows else (m, n), dtype)
        if out.size:
            # a column-major b (x.T for a row-major x) is read as its transpose, each tile of it
            # transposed into the kernel's buffer: no transposed copy of b
            transposed = not b.flags.c_contiguous and b.flags.f_contiguous and cpu.sparse.packs_transposed(b.shape[0])
            args = (csr.indptr, csr.indices, values, b.T if transposed else contiguous(backend, b),
                    np.zeros(m, dtype) if bias is None else bias, out)
            threads = _backend.threads(csr.nnz * n)
            on_threads(cpu.sparse.sparse_spmm, threads, *args, threads, transposed, rows)
        return out

    def sampled(self, backend: Backend, a: Array, b: Array, dtype: np.dtype[Any]) -> Array:
        """``out[p] = a[row_p, :] . b[col_p, :]`` for every stored entry ``p`` (SDDMM): (nnz,)."""
        xp = backend.xp
        if self.nnz == 0 or a.shape[1] == 0:
            return xp.zeros(self.nnz, dtype)
        a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
        out = xp.empty(self.nnz, dtype)
        if backend.on_gpu:
            with backend.use():
                backend.launcher(cuda.sparse.launch_sparse_sddmm)(self.indptr, self.indices, contiguous(backend, a),
                                                                  contiguous(backend, b), out)
            return out
        # column-major a and b (a layer's gradient and input, transposed) are read as their
        # transposes, each slab transposed into the kernel's buffers: no transposed copies
        threads = _backend.threads(self.nnz * a.shape[1])
        transposed = all(not t.flags.c_contiguous and t.flags.f_contiguous and cpu.sparse.packs_transposed(t.shape[0])
                         for t in (a, b))
        a, b = (a.T, b.T) if transposed else (contiguous(backend, a), contiguous(backend, b))
        on_threads(cpu.sparse.sparse_sddmm, threads, self.indptr, self.indices, a, b, out, threads, transposed)
        return out


def _gathered(values: Array, order: Array) -> Array:
    """``values[order]`` (the values in a transpose's order): by the parallel gather kernel,
    or on one thread by NumPy's ``take``, which is faster there than a kernel's dispatch
    (1.9 against 3.5 us for a 64 x 64 layer's 410 values, 71 against 82 us for 40 000)."""
    threads = _backend.threads(order.shape[0])
    if threads == 1:
        return values.take(order)
    out = np.empty(order.shape[0], values.dtype)
    on_threads(cpu.sparse.gather, threads, values, order, out)
    return out


def on_threads(kernel: Any, threads: int, *args: Any) -> None:
    """``kernel(parallel, team, *args)`` in parallel on torch's threads or Numba's
    (``team.run``), or, for ``threads`` 1 (:func:`spchain._backend.threads` of a work below
    :data:`~spchain._backend.SERIAL_WORK`), on the calling thread."""
    if threads > 1:
        cpu.team.run(kernel, *args)
    else:  # small: on the calling thread
        cpu.team.serial(kernel, *args)


def structure_nbytes(structure: Any) -> int:
    """The bytes of a :class:`Csr`'s or :class:`~spchain.blocksparse.Bsr`'s index arrays, and of
    its transpose once its ``transposed`` built it (values are not counted)."""
    t = structure.__dict__.get("_transposed")
    arrays = (structure.indptr, structure.indices, *(() if t is None else (t[0].indptr, t[0].indices, t[1])))
    return sum(int(a.nbytes) for a in arrays)


# --- validation and conversion -------------------------------------------------------------


def sparse_parts(backend: Backend, a: Sparse, caller: str) -> tuple[str, Shape, Array, tuple[Array, Array]]:
    """``(format, shape, data, (index arrays))`` of a SciPy or cupyx CSR, CSC or COO object.

    The index arrays are ``(indptr, indices)`` for CSR and CSC, ``(row, col)`` for COO.
    """
    if not backend.sparse.issparse(a):
        raise TypeError(f"{caller} takes a sparse matrix (CSR, CSC or COO) first, not {type(a).__name__}")
    if a.format not in FORMATS:
        raise TypeError(f"{caller} takes CSR, CSC or COO matrices, not {a.format.upper()}; convert with .tocsr()")
    if len(a.shape) != 2:
        raise ValueError(f"{caller} takes 2-D sparse matrices, got shape {a.shape}")
    index = (a.row, a.col) if a.format == "coo" else (a.indptr, a.indices)
    return a.format, tuple(int(s) for s in a.shape), a.data, index


def check_size(caller: str, name: str, value: Any) -> int:
    """``value`` as a non-negative int: ``TypeError`` for a non-integer (a float such as 2.5 or
    2.0, a bool), ``ValueError`` for a negative one; never a silent truncation."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{caller}: {name} must be an int, not a bool ({value!r})")
    try:
        size = operator.index(value)
    except TypeError:
        raise TypeError(f"{caller}: {name} must be an int, not {type(value).__name__} ({value!r})") from None
    if size < 0:
        raise ValueError(f"{caller}: {name} must be non-negative, got {size}")
    return size


def check_block(caller: str, block: Any) -> tuple[int, int]:
    """``block`` as a pair of ints ``(R, C)``: ``TypeError`` for anything else (a single int,
    floats, bools); whether a shape is a whole number of such blocks is the caller's check."""
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or any(isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) for s in block)):
        raise TypeError(f"{caller}: block must be a pair of ints (R, C), got {block!r}")
    return int(block[0]), int(block[1])


def check_shape(caller: str, shape: Any) -> tuple[int, int]:
    """``shape`` as a pair of non-negative ints: ``ValueError`` for anything but a pair or for a
    negative size, ``TypeError`` for a size that is not an int (2.5, True)."""
    try:
        m, n = shape
    except (TypeError, ValueError):
        raise ValueError(f"{caller}: shape must be a pair of ints, got {shape!r}") from None
    try:
        return check_size(caller, "shape[0]", m), check_size(caller, "shape[1]", n)
    except ValueError:
        raise ValueError(f"{caller}: shape must be non-negative, got {shape!r}") from None


def _index_arrays(caller: str, shape: tuple[int, int], **arrays: Array) -> list[Array]:
    """The index ``arrays`` checked (1-D integers) and converted to one dtype: int32 when all fit."""
    nnz = 0
    for name, a in arrays.items():
        if np.dtype(a.dtype).kind not in "iu":
            raise TypeError(f"{caller}: {name} has dtype {a.dtype}; index arrays must be integers (int32 or int64)")
        if a.ndim != 1:
            raise ValueError(f"{caller}: {name} must be 1-D, got shape {a.shape}")
        nnz = max(nnz, a.shape[0])
    small = fits_int32(*shape, nnz)
    dtype = np.int32 if small and all(np.can_cast(a.dtype, np.int32) for a in arrays.values()) else np.int64
    return [a.astype(dtype, copy=False) for a in arrays.values()]


def _check_indptr(caller: str, indptr: Array, n_major: int, axis: str, nnz: int) -> None:
    if indptr.shape[0] != n_major + 1:
        raise ValueError(f"{caller}: indptr has length {indptr.shape[0]}; expected {n_major + 1} (the {axis} + 1)")
    first, last = int(indptr[0]), int(indptr[-1])
    if first != 0:
        raise ValueError(f"{caller}: indptr starts at {first}, not 0")
    if n_major and bool((indptr[1:] < indptr[:-1]).any()):
        p = int((indptr[1:] < indptr[:-1]).argmax())
        raise ValueError(f"{caller}: indptr decreases at position {p + 1}: {int(indptr[p])} -> {int(indptr[p + 1])}")
    if last != nnz:
        raise ValueError(f"{caller}: indptr ends at {last} but there are {nnz} stored entries")


def _check_bounds(caller: str, name: str, index: Array, size: int) -> None:
    if index.shape[0] == 0:
        return
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= size:
        bad = low if low < 0 else high
        raise ValueError(f"{caller}: {name} holds {bad}, out of range for a dimension of size {size}")


def to_csr(backend: Backend, fmt: str, shape: Shape, data: Array | None, first: Array, second: Array,
           caller: str) -> Csr:
    """Validate a CSR, CSC or COO structure and return it as a :class:`Csr`.

    ``first, second`` are ``indptr, indices`` (CSR, CSC) or ``row, col`` (COO); ``data`` may be
    ``None`` (a pattern). Raises ``ValueError`` for a bad structure and ``TypeError`` for a
    non-integer index dtype, before any kernel runs. CSC and COO entries are reordered into CSR
    order, stably (duplicates are kept, in their order); CSR arrays are used as they are.
    """
    m, n = check_shape(caller, shape)
    if fmt == "coo":
        row, col = _index_arrays(caller, (m, n), row=first, col=second)
        if row.shape[0] != col.shape[0]:
            raise ValueError(f"{caller}: row has {row.shape[0]} entries but col has {col.shape[0]}")
        nnz = col.shape[0]
    else:
        indptr, indices = _index_arrays(caller, (m, n), indptr=first, indices=second)
        nnz = indices.shape[0]
    if data is not None:
        if data.ndim != 1:
            raise ValueError(f"{caller}: data must be 1-D, got shape {data.shape}")
        if data.shape[0] != nnz:
            raise ValueError(f"{caller}: data has {data.shape[0]} entries but the indices have {nnz}")
    if fmt == "coo":
        _check_bounds(caller, "row", row, m)
        _check_bounds(caller, "col", col, n)
        indptr, order = _group(backend, row, m)
        return Csr(indptr, col[order], None if data is None else data[order], (m, n))
    major, minor = (m, n) if fmt == "csr" else (n, m)
    _check_indptr(caller, indptr, major, "rows" if fmt == "csr" else "columns", nnz)
    _check_bounds(caller, "indices", indices, minor)
    csr = Csr(indptr, indices, data, (major, minor))
    return csr if fmt == "csr" else csr.transposed(backend)[0]


def _group(backend: Backend, keys: Array, n_groups: int) -> tuple[Array, Array]:
    """``(indptr, order)``: a stable sort of entry positions by ``keys`` (each in 0..n_groups-1)."""
    xp = backend.xp
    if backend.on_gpu:
        counts = xp.bincount(keys, minlength=n_groups)
        indptr = xp.concatenate([xp.zeros(1, keys.dtype), xp.cumsum(counts).astype(keys.dtype)])
        return indptr, xp.argsort(keys, kind="stable").astype(keys.dtype)
    indptr = np.empty(n_groups + 1, keys.dtype)
    order = np.empty(keys.shape[0], keys.dtype)
    cpu.sparse.group_by(keys, indptr, order)
    return indptr, order


def new_csr(backend: Backend, like: object, data: Array, indices: Array, indptr: Array, shape: Shape,
            copy: bool) -> Sparse:
    """A CSR object of ``backend``: a ``csr_matrix`` if ``like`` is a (SciPy) matrix or on the
    GPU (cupyx has no array classes), else a ``csr_array``."""
    if backend.on_gpu or isinstance(like, scipy.sparse.spmatrix):
        cls = backend.sparse.csr_matrix
    else:
        cls = scipy.sparse.csr_array
    return cls((data, indices, indptr), shape=shape, copy=copy)


def row_of_entries(backend: Backend, csr: Csr) -> Array:
    """The row of every stored entry of ``csr`` (nnz)."""
    xp = backend.xp
    return xp.repeat(xp.arange(csr.shape[0], dtype=csr.indices.dtype), xp.diff(csr.indptr))


def check_fraction(caller: str, name: str, value: object) -> float:
    """``value`` as a float in [0, 1]: ``TypeError`` if it is not a real number, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{caller}: {name} must be a number in [0, 1], not {type(value).__name__}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{caller}: {name} must be in [0, 1], got {value}")
    return float(value)


# --- dense operands ------------------------------------------------------------------------


def check_dense(caller: str, **operands: object) -> None:
    """``TypeError`` naming the first of ``operands`` that is not an array at all (``None``, a
    Python scalar or sequence): each must be a NumPy or CuPy array (torch tensors and sparse
    matrices get their own messages further on)."""
    for name, a in operands.items():
        if a is None or isinstance(a, (bool, int, float, complex, str, list, tuple, np.generic)):
            raise TypeError(f"{caller}: {name} must be a NumPy or CuPy array, not {type(a).__name__}; "
                            "convert with numpy.asarray")


def _operand(backend: Backend, a: Array, caller: str, name: str, ndims: tuple[int, ...]) -> Array:
    if isinstance(a, np.matrix):  # a 2-D ndarray whose indexing and reductions keep 2 axes
        a = np.asarray(a)
    if backend.sparse.issparse(a):
        raise TypeError(f"{caller}: {name} must be a dense array, not a sparse matrix; convert with .toarray()")
    if isinstance(a, tuple):  # a BSR operand ((data, indices, indptr), shape) where a dense one belongs
        raise TypeError(f"{caller}: {name} must be a dense array, not a tuple")
    if a.ndim not in ndims:
        want = " or ".join(f"{d}-D" for d in ndims)
        raise ValueError(f"{caller}: {name} must be {want}, got shape {a.shape}")
    return a


def contiguous(backend: Backend, a: Array) -> Array:
    """``a`` as a C-contiguous array (itself if it already is).

    On the CPU a Fortran-ordered matrix (a transposed view, say) is copied by the parallel
    transpose kernel, several times faster than NumPy's copy.
    """
    if a.flags.c_contiguous:
        return a
    if not backend.on_gpu and a.ndim == 2 and a.flags.f_contiguous:
        out = np.empty(a.shape, a.dtype)
        on_threads(cpu.sparse.transpose, _backend.threads(a.size), a.T, out)
        return out
    return backend.xp.ascontiguousarray(a)


# --- products: the kernels and cuSPARSE behind Csr.matmul and Csr.sampled ------------------


def _cupyx_csr(backend: Backend, csr: Csr, data: Array) -> Sparse:
    """A cupyx CSR matrix of ``csr``'s structure and ``data``, safe to hand to cupyx.

    cupyx sorts and sums a non-canonical matrix in place before multiplying; so a
    non-canonical structure is canonicalised on a copy, never on the caller's arrays. Whether
    the structure is canonical is found once per prepared structure (:meth:`Csr.prepare` keeps
    its :class:`_GpuStructure`; the structure cache prepares), and a canonical one is wrapped
    around ``data`` with no copy, no validation kernel and no synchronisation.
    """
    structure: _GpuStructure = csr.__dict__.get("_gpu") or _GpuStructure(backend, csr)
    if structure.canonical:
        return structure.matrix(backend, data)
    matrix = backend.sparse.csr_matrix((data, structure.indices, structure.indptr), shape=csr.shape)
    matrix = matrix.copy()
    matrix.sum_duplicates()
    return matrix


class _GpuStructure:
    """What cuSPARSE needs of a structure, worked out once per prepared :class:`Csr`: its
    index arrays in cupyx's int32, whether it is canonical (sorted, no duplicates) and a cupyx
    matrix of it. cupyx's constructor reads ``indptr``'s ends on the host (a synchronisation)
    and its canonical check runs a kernel and synchronises: both happen here, once per
    structure, never per product."""

    def __init__(self, backend: Backend, csr: Csr) -> None:
        self.indptr = csr.indptr.astype(np.int32, copy=False)
        self.indices = csr.indices.astype(np.int32, copy=False)
        self.shape = csr.shape
        self._shell = backend.sparse.csr_matrix((backend.xp.empty(csr.nnz, np.float32), self.indices, self.indptr),
                                                shape=csr.shape)
        self.canonical = bool(self._shell.has_canonical_format)

    def matrix(self, backend: Backend, data: Array) -> Sparse:
        """A canonical cupyx CSR matrix of this structure around ``data`` (no copy): a shallow
        copy of the matrix built once, its values replaced (cupyx's constructor is not run)."""
        matrix = copy.copy(self._shell)
        matrix.data = data
        return matrix


def _cusparse() -> Any:
    """``cupyx.cusparse``: the cuSPARSE products with an output and a transpose flag."""
    return importlib.import_module("cupyx.cusparse")


def _gpu_spmm(backend: Backend, csr: Csr, data: Array, b: Array, dtype: np.dtype[Any], bias: Array | None,
              transpose: bool = False) -> Array:
    """``op(csr) @ b (+ bias[:, None])`` by one cuSPARSE SpMM into a new column-major array:
    the bias is written first and folded in (``beta = 1``), ``b`` read in column-major order
    (a copy only if it is not), the transpose taken by cuSPARSE (no transposed matrix built)."""
    xp = backend.xp
    m = csr.shape[1] if transpose else csr.shape[0]
    n = b.shape[1]
    out = xp.empty((n, m), dtype).T
    if csr.nnz == 0 or m == 0 or n == 0 or b.shape[0] == 0:
        out[...] = 0 if bias is None else bias[:, None]
        return out
    with backend.use():
        matrix = _cupyx_csr(backend, csr, data)
        if bias is not None:
            out[...] = bias[:, None]
        _cusparse().spmm(matrix, xp.asfortranarray(b), c=out, alpha=1.0, beta=0.0 if bias is None else 1.0,
                         transa=transpose)
    return out


