"""Sparse products for sparse linear layers: ``spmm``, ``sddmm`` and ``prune``.

Public functions take SciPy / cupyx sparse matrices (CSR, CSC or COO, matrix or array
classes) and NumPy / CuPy dense arrays, and return results on the same backend. Beneath them,
every structure goes through one validation and conversion step (:func:`to_csr`) into a
:class:`Csr` of raw arrays in CSR order, which the kernels (``spchain.kernels.cpu.sparse``,
``spchain.kernels.cuda.sparse``) and cuSPARSE (through cupyx) consume. The caller's arrays are
never written to: conversions build new arrays, and nothing here sorts or sums in place.

The functions without a leading underscore that are not in ``__all__`` (:func:`linear`,
:func:`linear_backward`, ...) are the array-level dispatchers of ``spchain.torch.sparse``;
structures and their validation live in ``spchain._csr`` (:func:`to_csr`), entry selection
and drop-and-grow in ``spchain._selection``.

>>> import numpy as np, scipy.sparse, spchain as sc
>>> a = scipy.sparse.csr_array(np.array([[1.0, 0.0], [0.0, 2.0]]))
>>> sc.spmm(a, np.array([3.0, 4.0]))
array([3., 8.])
"""

from __future__ import annotations

import importlib
import weakref
from typing import Any, Literal

import numpy as np
import scipy.sparse

from . import _backend, _checks, blocksparse
from ._backend import Backend
from ._csr import Csr, _operand, check_dense, check_fraction, contiguous, new_csr, sparse_parts, to_csr
from ._dask import scales_out
from ._selection import largest, positions_to_csr, random_positions
from ._typing import Array, Seed, Shape, Sparse

__all__ = ["spmm", "sddmm", "prune"]


def _cupyx_csr(backend: Backend, csr: Csr, data: Array) -> Sparse:
    """A cupyx CSR matrix of ``csr``'s structure and ``data``, safe to hand to cupyx.

    cupyx sorts and sums a non-canonical matrix in place before multiplying; so a
    non-canonical structure is canonicalised on a copy, never on the caller's arrays. Whether
    the structure is canonical is found once per structure (:class:`_GpuStructure`), and a
    canonical one is wrapped around ``data`` with no copy, no validation kernel and no
    synchronisation.
    """
    structure = _GpuStructure.of(backend, csr)
    if structure.canonical:
        return structure.matrix(backend, data)
    matrix = backend.sparse.csr_matrix((data, structure.indices, structure.indptr), shape=csr.shape)
    matrix = matrix.copy()
    matrix.sum_duplicates()
    return matrix


class _GpuStructure:
    """What cuSPARSE needs of a structure, worked out once while the :class:`Csr` lives: its
    index arrays in cupyx's int32 and whether it is canonical (sorted, no duplicates: one
    check, which synchronises once per structure, never per product)."""

    _cache: dict[int, tuple[weakref.ref[Csr], _GpuStructure]] = {}

    def __init__(self, backend: Backend, csr: Csr) -> None:
        self.indptr = csr.indptr.astype(np.int32, copy=False)
        self.indices = csr.indices.astype(np.int32, copy=False)
        self.shape = csr.shape
        probe = backend.sparse.csr_matrix((backend.xp.empty(csr.nnz, np.float32), self.indices, self.indptr),
                                          shape=csr.shape)
        self.canonical = bool(probe.has_canonical_format)

    @classmethod
    def of(cls, backend: Backend, csr: Csr) -> _GpuStructure:
        """The structure of ``csr``, from the cache while ``csr`` lives."""
        key = id(csr)
        entry = cls._cache.get(key)
        if entry is not None and entry[0]() is csr:
            return entry[1]
        structure = cls(backend, csr)
        cls._cache[key] = (weakref.ref(csr, lambda _: cls._cache.pop(key, None)), structure)
        return structure

    def matrix(self, backend: Backend, data: Array) -> Sparse:
        """A canonical cupyx CSR matrix of this structure around ``data`` (no copy)."""
        matrix = backend.sparse.csr_matrix((data, self.indices, self.indptr), shape=self.shape, copy=False)
        matrix.has_canonical_format = True  # known: spares cupyx's check (a kernel and a synchronisation)
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


# --- products ------------------------------------------------------------------------------

def matmul(backend: Backend, csr: Csr, b: Array, dtype: np.dtype[Any], bias: Array | None = None) -> Array:
    """``csr @ b`` (plus ``bias[:, None]``) for a dense (k, n) ``b``: an (m, n) array.

    C-contiguous on the CPU (the parallel Numba kernel); on the GPU, cuSPARSE's layout.
    """
    xp = backend.xp
    m, n = csr.shape[0], b.shape[1]
    assert csr.data is not None, "matmul multiplies by a structure with values"
    data = csr.data.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    if bias is not None:
        bias = bias.astype(dtype, copy=False)
    if backend.on_gpu:
        return _gpu_spmm(backend, csr, data, b, dtype, bias)
    out = np.empty((m, n), dtype)
    if out.size:
        args = (csr.indptr, csr.indices, data, contiguous(backend, b), np.zeros(m, dtype) if bias is None else bias, out)
        threads = _backend.threads(csr.nnz * n)
        if threads > 1:
            backend.kernel("sparse", "spmm")(*args, threads)
        else:
            backend.kernel("sparse", "spmm_serial")(*args)
    return out


def sampled(backend: Backend, csr: Csr, a: Array, b: Array, dtype: np.dtype[Any]) -> Array:
    """``data[p] = a[row_p, :] . b[col_p, :]`` for every stored entry ``p`` of ``csr`` (SDDMM)."""
    xp = backend.xp
    if csr.nnz == 0 or a.shape[1] == 0:
        return xp.zeros(csr.nnz, dtype)
    a = contiguous(backend, a.astype(dtype, copy=False))
    b = contiguous(backend, b.astype(dtype, copy=False))
    out = xp.empty(csr.nnz, dtype)
    with backend.use():
        kernel = "sddmm" if backend.on_gpu or _backend.threads(csr.nnz * a.shape[1]) > 1 else "sddmm_serial"
        backend.kernel("sparse", kernel)(csr.indptr, csr.indices, a, b, out)
    return out


@scales_out
def spmm(a: Sparse, b: Array) -> Array:
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


def spmm_parts(backend: Backend, fmt: str, shape: Shape, data: Array, index: tuple[Array, Array], b: Array,
               caller: str) -> tuple[Csr, Array]:
    """:func:`spmm` on unpacked parts: ``(csr, product)``, ``csr`` the validated structure."""
    b = _operand(backend, b, caller, "b", (1, 2))
    if shape[1] != b.shape[0]:
        raise ValueError(f"{caller}: shapes {tuple(shape)} and {b.shape} do not match ({shape[1]} != {b.shape[0]})")
    dtype = _checks.float_dtype(caller, a=data, b=b)
    csr = to_csr(backend, fmt, shape, data, *index, caller=caller)
    out = matmul(backend, csr, b[:, None] if b.ndim == 1 else b, dtype)
    return csr, out[:, 0] if b.ndim == 1 else out


@scales_out
def sddmm(pattern: Sparse, a: Array, b: Array) -> Sparse:
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
    return new_csr(backend, pattern, data, csr.indices, csr.indptr, shape, copy=True)


def sddmm_parts(backend: Backend, fmt: str, shape: Shape, index: tuple[Array, Array], a: Array, b: Array,
                caller: str) -> tuple[Csr, Array]:
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


def prune(w: Array, sparsity: float | None = None, *, method: Literal["magnitude", "random", "n:m"] = "magnitude",
          seed: Seed = None, block: tuple[int, int] | None = None, n: int | None = None,
          m: int | None = None) -> Sparse:
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
    return new_csr(backend, None, data, indices, indptr, w.shape, copy=False)


def prune_parts(backend: Backend, w: Array, sparsity: float, method: str, seed: Seed,
                caller: str) -> tuple[Array, Array, Array]:
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


def linear(backend: Backend, csr: Csr, values: Array, x: Array, bias: Array | None,
           dtype: np.dtype[Any]) -> tuple[Array, Array]:
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


def linear_backward(backend: Backend, csr: Csr, transpose: tuple[Csr, Array] | None, values: Array, grad_y: Array,
                    x: Array, dtype: np.dtype[Any], need_x: bool,
                    need_values: bool) -> tuple[Array | None, Array | None]:
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
            grad_x = _gpu_spmm(backend, csr, values.astype(dtype, copy=False), grad_yt.astype(dtype, copy=False),
                               dtype, None, transpose=True).T
        else:
            assert transpose is not None, "the CPU path multiplies by the cached transpose"
            t_csr, order = transpose
            grad_x = matmul(backend, Csr(t_csr.indptr, t_csr.indices, values[order], t_csr.shape), grad_yt, dtype).T
    if need_values:
        grad_values = sampled(backend, csr, grad_yt, x.T, dtype)
    return grad_x, grad_values
