"""CSR structures of the sparse layer: validation and conversion of every sparse operand
into one :class:`Csr` of raw arrays (:func:`to_csr`), and the checks of sizes, shapes,
fractions and dense operands that ``spchain.sparse`` and ``spchain.blocksparse`` share.
The caller's arrays are never written to: conversions build new arrays."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse

from ._backend import Backend
from ._typing import Array, Shape, Sparse
from .kernels import cpu

FORMATS = ("csr", "csc", "coo")
_INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class Csr:
    """A validated sparse structure in CSR order: raw arrays of one backend.

    ``indptr`` (m + 1) and ``indices`` (nnz) share one integer dtype (int32, or int64 when
    mixed or large); ``data`` (nnz) is ``None`` for a pattern. Entries may be unsorted within a
    row, repeat, or hold zeros.
    """

    indptr: Array
    indices: Array
    data: Array | None
    shape: tuple[int, int]

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])


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
    small = max((*shape, nnz), default=0) <= _INT32_MAX
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
    return csr if fmt == "csr" else transposed(backend, csr)[0]


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


def transposed(backend: Backend, csr: Csr) -> tuple[Csr, Array]:
    """``(csr_t, order)``: the CSR structure of the transpose, and ``order`` (nnz) such that
    entry ``q`` of ``csr_t`` is entry ``order[q]`` of ``csr`` (its data, if any, is gathered)."""
    indptr, order = _group(backend, csr.indices, csr.shape[1])
    rows = row_of_entries(backend, csr)[order]
    data = None if csr.data is None else csr.data[order]
    return Csr(indptr, rows, data, csr.shape[::-1]), order


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
        cpu.sparse.transpose(a.T, out)
        return out
    return backend.xp.ascontiguousarray(a)
