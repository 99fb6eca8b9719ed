"""Sparse products for sparse linear layers: ``spmm``, ``sddmm`` and ``prune``.

Public functions take SciPy / cupyx sparse matrices (CSR, CSC or COO, matrix or array
classes) and NumPy / CuPy dense arrays, and return results on the same backend. Beneath them,
every structure goes through one validation and conversion step (:func:`to_csr`) into a
:class:`Csr` of raw arrays in CSR order, which the kernels (``spchain.kernels.cpu.sparse``,
``spchain.kernels.cuda.sparse``) and cuSPARSE (through cupyx) consume. The caller's arrays are
never written to: conversions build new arrays, and nothing here sorts or sums in place.

The functions without a leading underscore that are not in ``__all__`` (:func:`to_csr`,
:func:`linear`, :func:`drop_and_grow`, ...) are the array-level dispatchers of
``spchain.torch.sparse``.

>>> import numpy as np, scipy.sparse, spchain as sc
>>> a = scipy.sparse.csr_array(np.array([[1.0, 0.0], [0.0, 2.0]]))
>>> sc.spmm(a, np.array([3.0, 4.0]))
array([3., 8.])
"""

import operator
from dataclasses import dataclass

import numpy as np
import scipy.sparse

from . import _backend, _checks, blocksparse
from ._dask import scales_out

__all__ = ["spmm", "sddmm", "prune"]

FORMATS = ("csr", "csc", "coo")
_INT32_MAX = np.iinfo(np.int32).max
_SCORE_BLOCK = 1 << 20
"""Dense gradient entries scored at a time when regrowing by gradient (bounds its memory)."""


@dataclass(frozen=True)
class Csr:
    """A validated sparse structure in CSR order: raw arrays of one backend.

    ``indptr`` (m + 1) and ``indices`` (nnz) share one integer dtype (int32, or int64 when
    mixed or large); ``data`` (nnz) is ``None`` for a pattern. Entries may be unsorted within a
    row, repeat, or hold zeros.
    """

    indptr: object
    indices: object
    data: object
    shape: tuple[int, int]

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])


# --- validation and conversion -------------------------------------------------------------


def sparse_parts(backend, a, caller: str):
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


def check_size(caller: str, name: str, value) -> int:
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


def check_shape(caller: str, shape) -> tuple[int, int]:
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


def _index_arrays(caller: str, shape, **arrays):
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


def _check_indptr(caller: str, indptr, n_major: int, axis: str, nnz: int) -> None:
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


def _check_bounds(caller: str, name: str, index, size: int) -> None:
    if index.shape[0] == 0:
        return
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= size:
        bad = low if low < 0 else high
        raise ValueError(f"{caller}: {name} holds {bad}, out of range for a dimension of size {size}")


def to_csr(backend, fmt: str, shape, data, first, second, caller: str) -> Csr:
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


def _group(backend, keys, n_groups: int):
    """``(indptr, order)``: a stable sort of entry positions by ``keys`` (each in 0..n_groups-1)."""
    xp = backend.xp
    if backend.on_gpu:
        counts = xp.bincount(keys, minlength=n_groups)
        indptr = xp.concatenate([xp.zeros(1, keys.dtype), xp.cumsum(counts).astype(keys.dtype)])
        return indptr, xp.argsort(keys, kind="stable").astype(keys.dtype)
    indptr = np.empty(n_groups + 1, keys.dtype)
    order = np.empty(keys.shape[0], keys.dtype)
    backend.kernel("sparse", "group_by")(keys, indptr, order)
    return indptr, order


def row_of_entries(backend, csr: Csr):
    """The row of every stored entry of ``csr`` (nnz)."""
    xp = backend.xp
    return xp.repeat(xp.arange(csr.shape[0], dtype=csr.indices.dtype), xp.diff(csr.indptr))


def transposed(backend, csr: Csr):
    """``(csr_t, order)``: the CSR structure of the transpose, and ``order`` (nnz) such that
    entry ``q`` of ``csr_t`` is entry ``order[q]`` of ``csr`` (its data, if any, is gathered)."""
    indptr, order = _group(backend, csr.indices, csr.shape[1])
    rows = row_of_entries(backend, csr)[order]
    data = None if csr.data is None else csr.data[order]
    return Csr(indptr, rows, data, csr.shape[::-1]), order


def check_fraction(caller: str, name: str, value) -> float:
    """``value`` as a float in [0, 1]: ``TypeError`` if it is not a real number, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{caller}: {name} must be a number in [0, 1], not {type(value).__name__}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{caller}: {name} must be in [0, 1], got {value}")
    return float(value)


# --- dense operands ------------------------------------------------------------------------


def check_dense(caller: str, **operands) -> None:
    """``TypeError`` naming the first of ``operands`` that is not an array at all (``None``, a
    Python scalar or sequence): each must be a NumPy or CuPy array (torch tensors and sparse
    matrices get their own messages further on)."""
    for name, a in operands.items():
        if a is None or isinstance(a, (bool, int, float, complex, str, list, tuple, np.generic)):
            raise TypeError(f"{caller}: {name} must be a NumPy or CuPy array, not {type(a).__name__}; "
                            "convert with numpy.asarray")


def _operand(backend, a, caller: str, name: str, ndims: tuple[int, ...]):
    if isinstance(a, np.matrix):  # a 2-D ndarray whose indexing and reductions keep 2 axes
        a = np.asarray(a)
    if backend.sparse.issparse(a):
        raise TypeError(f"{caller}: {name} must be a dense array, not a sparse matrix; convert with .toarray()")
    if a.ndim not in ndims:
        want = " or ".join(f"{d}-D" for d in ndims)
        raise ValueError(f"{caller}: {name} must be {want}, got shape {a.shape}")
    return a


def contiguous(backend, a):
    """``a`` as a C-contiguous array (itself if it already is).

    On the CPU a Fortran-ordered matrix (a transposed view, say) is copied by the parallel
    transpose kernel, several times faster than NumPy's copy.
    """
    if a.flags.c_contiguous:
        return a
    if not backend.on_gpu and a.ndim == 2 and a.flags.f_contiguous:
        out = np.empty(a.shape, a.dtype)
        backend.kernel("sparse", "transpose")(a.T, out)
        return out
    return backend.xp.ascontiguousarray(a)


def _cupyx_csr(backend, csr: Csr, data):
    """A cupyx CSR matrix of ``csr``'s structure and ``data``, safe to hand to cupyx.

    cupyx sorts and sums a non-canonical matrix in place before multiplying; so a
    non-canonical structure is canonicalised on a copy, never on the caller's arrays.
    """
    matrix = backend.sparse.csr_matrix((data, csr.indices, csr.indptr), shape=csr.shape)
    if not matrix.has_canonical_format:
        matrix = matrix.copy()
        matrix.sum_duplicates()
    return matrix


# --- products ------------------------------------------------------------------------------


def matmul(backend, csr: Csr, b, dtype, bias=None):
    """``csr @ b`` (plus ``bias[:, None]``) for a dense (k, n) ``b``: an (m, n) array.

    C-contiguous on the CPU (the parallel Numba kernel); on the GPU, cuSPARSE's layout.
    """
    xp = backend.xp
    m, n = csr.shape[0], b.shape[1]
    data = csr.data.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    if bias is not None:
        bias = bias.astype(dtype, copy=False)
    if backend.on_gpu:
        if csr.nnz == 0 or m == 0 or n == 0:
            out = xp.zeros((m, n), dtype)
        else:
            with backend.use():
                out = _cupyx_csr(backend, csr, data) @ b
        return out if bias is None else out + bias[:, None]
    out = np.empty((m, n), dtype)
    if out.size:
        backend.kernel("sparse", "spmm")(csr.indptr, csr.indices, data, contiguous(backend, b),
                                         np.zeros(m, dtype) if bias is None else bias, out)
    return out


def sampled(backend, csr: Csr, a, b, dtype):
    """``data[p] = a[row_p, :] . b[col_p, :]`` for every stored entry ``p`` of ``csr`` (SDDMM)."""
    xp = backend.xp
    if csr.nnz == 0 or a.shape[1] == 0:
        return xp.zeros(csr.nnz, dtype)
    a = contiguous(backend, a.astype(dtype, copy=False))
    b = contiguous(backend, b.astype(dtype, copy=False))
    out = xp.empty(csr.nnz, dtype)
    with backend.use():
        backend.kernel("sparse", "sddmm")(csr.indptr, csr.indices, a, b, out)
    return out


def _new_csr(backend, like, data, indices, indptr, shape, copy: bool):
    """A CSR object of ``backend``: a ``csr_matrix`` if ``like`` is a (SciPy) matrix or on the
    GPU (cupyx has no array classes), else a ``csr_array``."""
    if backend.on_gpu or isinstance(like, scipy.sparse.spmatrix):
        cls = backend.sparse.csr_matrix
    else:
        cls = scipy.sparse.csr_array
    return cls((data, indices, indptr), shape=shape, copy=copy)


@scales_out
def spmm(a, b):
    """Sparse times dense: ``a @ b``.

    Parameters
    ----------
    a : SciPy or cupyx sparse matrix or array, CSR, CSC or COO, shape (m, k)
        Duplicate entries add up, indices may be unsorted within a row, explicit zeros are
        kept; int32 and int64 indices (a mix is promoted to int64). Or BSR: a SciPy BSR
        object or ``((data, indices, indptr), shape)``, see :func:`spchain.blocksparse.spmm`.
    b : NumPy or CuPy array, shape (k,) or (k, n)
        Any layout: transposed, Fortran-ordered, sliced or broadcast views are fine.

    Returns
    -------
    ndarray, shape (m,) or (m, n)
        On the backend of the inputs: float32 if ``a`` and ``b`` are both float32, else
        float64 (a mix is computed in float64, never downcast).

    Raises
    ------
    TypeError
        A dense or unsupported sparse format ``a``, a sparse ``b``, a non-integer index
        dtype, values other than float32/float64, torch tensors (use ``spchain.torch.spmm``).
    ValueError
        A malformed structure (``indptr`` length, start, order or end; an index out of range;
        index arrays not 1-D; ``data`` of the wrong length), or shapes that do not match.

    Notes
    -----
    On the CPU a parallel Numba kernel runs over the rows of ``a`` (CSC and COO structures are
    first reordered into CSR order, O(nnz)); on the GPU cuSPARSE runs through cupyx. As in
    SciPy, NaN and inf propagate through stored entries; unstored entries contribute nothing.

    Examples
    --------
    >>> import numpy as np, scipy.sparse, spchain as sc
    >>> a = scipy.sparse.coo_array(([1.0, 2.0, 5.0], ([0, 1, 1], [1, 0, 0])), shape=(2, 2))
    >>> sc.spmm(a, np.array([[1.0, 0.0], [0.0, 1.0]]))  # the two (1, 0) entries add up
    array([[0., 1.],
           [7., 0.]])
    """
    if blocksparse.is_bsr(a):
        return blocksparse.spmm(a, b)
    caller = "spchain.spmm"
    check_dense(caller, b=b)
    backend = _backend.backend_of(a, b, caller=caller)
    return spmm_parts(backend, *sparse_parts(backend, a, caller), b, caller)[1]


def spmm_parts(backend, fmt: str, shape, data, index, b, caller: str):
    """:func:`spmm` on unpacked parts: ``(csr, product)``, ``csr`` the validated structure."""
    b = _operand(backend, b, caller, "b", (1, 2))
    if shape[1] != b.shape[0]:
        raise ValueError(f"{caller}: shapes {tuple(shape)} and {b.shape} do not match ({shape[1]} != {b.shape[0]})")
    dtype = _checks.float_dtype(caller, a=data, b=b)
    csr = to_csr(backend, fmt, shape, data, *index, caller=caller)
    out = matmul(backend, csr, b[:, None] if b.ndim == 1 else b, dtype)
    return csr, out[:, 0] if b.ndim == 1 else out


@scales_out
def sddmm(pattern, a, b):
    """Sampled dense-dense product: ``a @ b.T`` at the stored entries of ``pattern`` only.

    Parameters
    ----------
    pattern : SciPy or cupyx sparse matrix or array, CSR, CSC or COO, shape (m, n)
        Only its structure is used (its values are ignored). A BSR pattern gives a BSR
        result, see :func:`spchain.blocksparse.sddmm`.
    a : NumPy or CuPy array, shape (m, k)
    b : NumPy or CuPy array, shape (n, k)

    Returns
    -------
    CSR matrix (cupyx, or SciPy ``csr_matrix``) or SciPy ``csr_array`` (for an array pattern)
        Exactly ``pattern``'s stored entries in CSR order, each holding
        ``a[row, :] . b[col, :]``. Duplicate entries stay separate, each with the product
        (the gradient of each duplicate in a sparse layer), so ``toarray()`` adds them up;
        explicit zeros stay stored. float32 if ``a`` and ``b`` are both float32, else float64.

    Raises
    ------
    TypeError, ValueError
        As for :func:`spmm`; ``ValueError`` names the three shapes if they do not match.

    Notes
    -----
    Neither SciPy nor cupyx has this product: it is a parallel Numba kernel on the CPU and a
    Numba CUDA kernel on the GPU, O(nnz * k) work and no (m, n) intermediate.

    Examples
    --------
    >>> import numpy as np, scipy.sparse, spchain as sc
    >>> pattern = scipy.sparse.csr_array(np.array([[1, 0], [0, 1]]))
    >>> sc.sddmm(pattern, np.array([[1.0, 2.0], [3.0, 4.0]]), np.ones((2, 2))).toarray()
    array([[3., 0.],
           [0., 7.]])
    """
    if blocksparse.is_bsr(pattern):
        return blocksparse.sddmm(pattern, a, b)
    caller = "spchain.sddmm"
    check_dense(caller, a=a, b=b)
    backend = _backend.backend_of(pattern, a, b, caller=caller)
    fmt, shape, _, index = sparse_parts(backend, pattern, caller)
    csr, data = sddmm_parts(backend, fmt, shape, index, a, b, caller)
    return _new_csr(backend, pattern, data, csr.indices, csr.indptr, shape, copy=True)


def sddmm_parts(backend, fmt: str, shape, index, a, b, caller: str):
    """:func:`sddmm` on an unpacked pattern: ``(csr, data)``; ``csr`` may share the caller's arrays."""
    a = _operand(backend, a, caller, "a", (2,))
    b = _operand(backend, b, caller, "b", (2,))
    if a.shape[0] != shape[0] or b.shape[0] != shape[1] or a.shape[1] != b.shape[1]:
        raise ValueError(f"{caller}: pattern {tuple(shape)}, a {a.shape} and b {b.shape} do not match "
                         "(an (m, n) pattern needs a of shape (m, k) and b of shape (n, k))")
    dtype = _checks.float_dtype(caller, a=a, b=b)
    csr = to_csr(backend, fmt, shape, None, *index, caller=caller)
    return csr, sampled(backend, csr, a, b, dtype)


# --- selecting entries ---------------------------------------------------------------------


def largest(backend, scores, count: int):
    """Sorted positions of the ``count`` largest ``scores`` (1-D); NaN counts as the largest
    value, and ties go to the lower position. O(len(scores)) (a partition, not a sort)."""
    xp = backend.xp
    size = scores.shape[0]
    if count >= size:
        return xp.arange(size, dtype=np.int64)
    if count == 0:
        return xp.empty(0, np.int64)
    key = xp.where(xp.isnan(scores), xp.inf, scores)
    threshold = xp.partition(key, size - count)[size - count]
    above = xp.flatnonzero(key > threshold)
    tied = xp.flatnonzero(key == threshold)[: count - above.shape[0]]
    return xp.sort(xp.concatenate([above, tied]))


def random_positions(backend, total: int, count: int, taken=None, seed=None):
    """``count`` sorted flat positions in ``0 .. total - 1`` drawn uniformly without replacement,
    avoiding the sorted positions ``taken``.

    Memory is O(count + len(taken)) when the free positions are plentiful (rejection sampling),
    else O(total), which is then O(count + len(taken)) as well.
    """
    rng = np.random.default_rng(seed)
    taken = np.empty(0, np.int64) if taken is None else backend.to_host(taken)
    free = total - taken.shape[0]
    if taken.shape[0] == 0:
        chosen = rng.choice(total, count, replace=False)
    elif 2 * count <= free and 2 * free >= total:
        chosen = np.empty(0, np.int64)
        while chosen.shape[0] < count:
            draws = np.concatenate([chosen, rng.integers(0, total, 2 * (count - chosen.shape[0]) + 16)])
            first = np.sort(np.unique(draws, return_index=True)[1])  # first draws of each value, in order
            fresh = draws[first]
            chosen = fresh[~np.isin(fresh, taken, assume_unique=True)][:count]
    else:
        chosen = rng.choice(np.setdiff1d(np.arange(total), taken, assume_unique=True), count, replace=False)
    return backend.xp.asarray(np.sort(chosen).astype(np.int64))


def positions_to_csr(backend, positions, shape):
    """``(indptr, indices)`` of the sorted flat (row-major) ``positions`` in an ``shape`` matrix."""
    xp = backend.xp
    m, n = shape
    dtype = np.int32 if max(m, n, positions.shape[0]) <= _INT32_MAX else np.int64
    if positions.shape[0] == 0:
        return xp.zeros(m + 1, dtype), xp.empty(0, dtype)
    rows, cols = xp.divmod(positions, n)
    indptr = xp.searchsorted(rows, xp.arange(m + 1), side="left")
    return indptr.astype(dtype), cols.astype(dtype)


def prune(w, sparsity=None, *, method="magnitude", seed=None, block=None, n=None, m=None):
    """Keep ``w.size - round(sparsity * w.size)`` entries of a dense matrix, as CSR.

    Parameters
    ----------
    w : NumPy or CuPy array, shape (m, n), float32 or float64
    sparsity : float in [0, 1]
        The fraction of entries to drop (the fraction of blocks with ``block``; implied by
        ``n`` and ``m`` for ``"n:m"``, where it must be ``None`` or ``1 - n / m``).
    method : {"magnitude", "random", "n:m"}
        ``"magnitude"`` keeps the largest ``|w|`` (NaN counts as the largest; ties go to the
        earlier position in row-major order); ``"random"`` keeps positions chosen uniformly;
        ``"n:m"`` keeps the ``n`` largest ``|w|`` of every ``m`` consecutive entries of a row.
    seed : int or numpy.random.Generator, optional
        For ``"random"``; the same seed keeps the same positions on the CPU and the GPU.
    block : (R, C), optional
        Prune whole blocks (largest Frobenius norm kept) and return BSR; see
        :func:`spchain.blocksparse.prune`.
    n, m : int, optional
        For ``"n:m"``.

    Returns
    -------
    SciPy ``csr_array`` (cupyx ``csr_matrix`` on the GPU)
        Exactly that many stored entries (zeros of ``w`` that are kept stay stored), sorted
        indices, no duplicates, ``w``'s dtype.

    Raises
    ------
    TypeError
        ``w`` sparse, or not float32/float64; ``sparsity`` not a number.
    ValueError
        ``w`` not 2-D, ``sparsity`` outside [0, 1], an unknown ``method``.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> sc.prune(np.array([[0.5, -3.0], [2.0, 0.1]]), 0.5).toarray()
    array([[ 0., -3.],
           [ 2.,  0.]])
    """
    if block is not None or method == "n:m":
        return blocksparse.prune(w, sparsity, method=method, seed=seed, block=block, n=n, m=m)
    caller = "spchain.prune"
    check_dense(caller, w=w)
    backend = _backend.backend_of(w, caller=caller)
    if sparsity is None:
        raise ValueError(f"{caller}: method={method!r} needs a sparsity")
    indptr, indices, data = prune_parts(backend, w, sparsity, method, seed, caller)
    return _new_csr(backend, None, data, indices, indptr, w.shape, copy=False)


def prune_parts(backend, w, sparsity, method, seed, caller: str):
    """:func:`prune` as raw CSR arrays ``(indptr, indices, data)``."""
    w = _operand(backend, w, caller, "w", (2,))
    _checks.float_dtype(caller, w=w)
    keep = w.size - round(check_fraction(caller, "sparsity", sparsity) * w.size)
    if method == "magnitude":
        positions = largest(backend, backend.xp.abs(w).ravel(), keep)
    elif method == "random":
        positions = random_positions(backend, w.size, keep, seed=seed)
    elif not isinstance(method, str):
        raise TypeError(f"{caller}: method must be a str ('magnitude' or 'random'), not {type(method).__name__}")
    else:
        raise ValueError(f"{caller}: method must be 'magnitude' or 'random', not {method!r}")
    indptr, indices = positions_to_csr(backend, positions, w.shape)
    return indptr, indices, w.ravel()[positions]


# --- sparse linear layers (the array level of spchain.torch.sparse_linear) -----------------


def linear(backend, csr: Csr, values, x, bias, dtype):
    """``y = x @ W.T + bias`` for the CSR weight ``W`` (``csr``'s structure, ``values``).

    ``x`` is (batch, in) in any layout. Returns ``(y, x_saved)``: ``y`` (batch, out) and ``x``
    in the layout :func:`linear_backward` reads without a copy. On the CPU the kernel needs
    x feature-major: ``x_saved`` is that transposed copy, and ``y`` is the transpose of the
    kernel's feature-major output (no copy; free to feed into the next sparse layer). On the
    GPU cuSPARSE reads ``x`` as it is.
    """
    weight = Csr(csr.indptr, csr.indices, values, csr.shape)
    xt = x.T if backend.on_gpu else contiguous(backend, x.T.astype(dtype, copy=False))
    return matmul(backend, weight, xt, dtype, bias).T, xt.T


def linear_backward(backend, csr: Csr, transpose, values, grad_y, x, dtype, need_x: bool, need_values: bool):
    """Gradients of :func:`linear` for ``x`` (batch, in) and for ``values`` (nnz), when needed.

    ``transpose`` is ``transposed(backend, csr)`` on the CPU (cached by the caller: the input
    gradient runs the transposed product on it, gathering ``values`` through its order) and
    ``None`` on the GPU (cuSPARSE multiplies by the transpose itself). The value gradient is
    the SDDMM of ``grad_y.T`` and ``x.T`` at the stored entries.
    """
    grad_yt = grad_y.T if backend.on_gpu else contiguous(backend, grad_y.T.astype(dtype, copy=False))
    grad_x = grad_values = None
    if need_x:
        if backend.on_gpu:
            if csr.nnz == 0 or grad_y.shape[0] == 0:
                grad_x = backend.xp.zeros((grad_y.shape[0], csr.shape[1]), dtype)
            else:
                with backend.use():
                    weight = _cupyx_csr(backend, csr, values.astype(dtype, copy=False))
                    grad_x = (weight.T @ grad_yt.astype(dtype, copy=False)).T
        else:
            t_csr, order = transpose
            grad_x = matmul(backend, Csr(t_csr.indptr, t_csr.indices, values[order], t_csr.shape), grad_yt, dtype).T
    if need_values:
        grad_values = sampled(backend, csr, grad_yt, x.T, dtype)
    return grad_x, grad_values


def drop_and_grow(backend, csr: Csr, values, n_move: int, *, grad_y=None, x=None, seed=None, caller: str):
    """A new structure of the same size with ``n_move`` entries moved.

    Drops the ``n_move`` stored entries of smallest ``|values|`` (among equal magnitudes the
    later ones) and grows as many at positions not stored after the drop: where
    ``|grad_y.T @ x|``, the dense weight gradient of one batch, is largest (RigL; ``grad_y``
    (batch, out), ``x`` (batch, in); scored in row blocks, so it never holds the dense
    gradient), or uniformly at random (``seed``) if ``grad_y`` is None. A just-dropped position
    may be grown again.

    Returns ``(indptr, indices, old_slots, new_slots)``: the surviving entry in slot
    ``old_slots[t]`` sits in slot ``new_slots[t]`` of the new structure; the other new slots
    are the grown connections. ``csr`` must be canonical (sorted, no duplicates).
    """
    xp = backend.xp
    m, n = csr.shape
    positions = row_of_entries(backend, csr).astype(np.int64) * n + csr.indices
    if positions.shape[0] > 1 and bool((positions[1:] <= positions[:-1]).any()):
        raise ValueError(f"{caller} needs a canonical structure: indices sorted within rows, no duplicates")
    old_slots = largest(backend, xp.abs(values), csr.nnz - n_move)
    kept = positions[old_slots]
    if grad_y is None:
        grown = random_positions(backend, m * n, n_move, taken=kept, seed=seed)
    else:
        grown = _largest_gradients(backend, grad_y, x, n_move, kept)
    new_positions = xp.sort(xp.concatenate([kept, grown]))
    indptr, indices = positions_to_csr(backend, new_positions, (m, n))
    return indptr, indices, old_slots, xp.searchsorted(new_positions, kept)


def _largest_gradients(backend, grad_y, x, count: int, taken):
    """Sorted positions of the ``count`` largest ``|grad_y.T @ x|`` outside ``taken`` (sorted)."""
    xp = backend.xp
    m, n = grad_y.shape[1], x.shape[1]
    best_scores, best_positions = xp.empty(0, grad_y.dtype), xp.empty(0, np.int64)
    rows = max(1, _SCORE_BLOCK // max(n, 1))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        scores = xp.abs(_backend.matmul(xp, grad_y[:, r0:r1].T, x)).ravel()
        free = xp.ones(scores.shape[0], bool)
        lo, hi = (int(i) for i in xp.searchsorted(taken, xp.asarray([r0 * n, r1 * n])))
        free[taken[lo:hi] - r0 * n] = False
        candidates = xp.flatnonzero(free)
        pick = largest(backend, scores[candidates], count)
        best_scores = xp.concatenate([best_scores, scores[candidates[pick]]])
        best_positions = xp.concatenate([best_positions, candidates[pick] + r0 * n])
        keep = largest(backend, best_scores, count)
        best_scores, best_positions = best_scores[keep], best_positions[keep]
    return best_positions
