"""Sparse products for sparse linear layers: ``spmm``, ``sddmm`` and ``prune``.

Public functions take SciPy / cupyx sparse matrices (CSR, CSC or COO, matrix or array
classes) and NumPy / CuPy dense arrays, and return results on the same backend. Beneath them,
every structure goes through one validation and conversion step (:func:`to_csr`) into a
:class:`Csr` of raw arrays in CSR order, which the kernels (``spchain.kernels.cpu.sparse``,
``spchain.kernels.cuda.sparse``) and cuSPARSE (through cupyx) consume. The caller's arrays are
never written to: conversions build new arrays, and nothing here sorts or sums in place.

The functions without a leading underscore that are not in ``__all__`` are the array
level of ``spchain.torch.sparse`` (``spmm_parts``, ...) and of ``spchain.torch.linear``:
:func:`linear` and :func:`linear_backward`, one body for CSR and BSR weights, on the method
set the two structure types share (:class:`Structure`), and their :class:`~spchain._op.Op`,
:data:`LINEAR`. The structures, their validation and
their products live in ``spchain._csr`` (:class:`Csr`, :func:`to_csr`) and
``spchain.blocksparse`` (``Bsr``), their cache in ``spchain._structures``, entry selection and
drop-and-grow in ``spchain._selection``.

>>> import numpy as np, scipy.sparse, spchain as sc
>>> a = scipy.sparse.csr_array(np.array([[1.0, 0.0], [0.0, 2.0]]))
>>> sc.spmm(a, np.array([3.0, 4.0]))
array([3., 8.])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

from . import _backend, _checks, _structures, blocksparse
from ._backend import Backend
from ._csr import Csr, _operand, check_dense, check_fraction, contiguous, new_csr, sparse_parts, to_csr
from ._dask import scales_out
from ._op import Op, Positional, Saved
from ._selection import largest, positions_to_csr, random_positions
from ._typing import Array, Seed, Shape, Sparse

__all__ = ["spmm", "sddmm", "prune"]


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
    assert csr.data is not None, "spmm multiplies by a structure with values"
    out = csr.matmul(backend, csr.data, b[:, None] if b.ndim == 1 else b, dtype)
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
    return csr, csr.sampled(backend, a, b, dtype)


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



class Structure(Protocol):
    """What :func:`linear` needs of a sparse weight's structure: the method set that
    :class:`~spchain._csr.Csr` and :class:`~spchain.blocksparse.Bsr` share."""

    def matmul(self, backend: Backend, values: Array, b: Array, dtype: np.dtype[Any], bias: Array | None = None, *,
               transpose: bool = False) -> Array: ...

    def sampled(self, backend: Backend, a: Array, b: Array, dtype: np.dtype[Any]) -> Array: ...


def linear(backend: Backend, structure: Structure, values: Array, x: Array, bias: Array | None,
           dtype: np.dtype[Any]) -> Array:
    """``y.T`` for ``y = x @ W.T + bias``, ``W`` the sparse weight of ``structure`` (CSR or BSR)
    and ``values`` ((nnz,) or (nnzb, R, C)).

    ``x`` is (batch, in) in any layout (the CSR kernel reads a row-major ``x`` as it is, ``x.T``
    transposed tile by tile into its buffer). Returns ``yt`` (out, batch), the layout the
    products write (so ``y`` is its transposed view, free to feed into the next sparse layer).
    """
    return structure.matmul(backend, values, x.T.astype(dtype, copy=False), dtype, bias)


def linear_backward(backend: Backend, structure: Structure, values: Array, grad_yt: Array, x: Array,
                    dtype: np.dtype[Any], need_x: bool, need_values: bool) -> tuple[Array | None, Array | None]:
    """Gradients of :func:`linear` for ``x`` (batch, in) and for ``values``, when needed, from
    the gradient ``grad_yt`` (out, batch) of its output, both in any layout (on the CPU the
    kernels read the usual column-major ``grad_yt`` and row-major ``x`` as they are): the input
    gradient by the transposed product (on the CPU turned into rows by the parallel transpose
    kernel), the value gradient by the SDDMM of ``grad_yt`` and ``x.T`` at the stored entries."""
    grad_x = grad_values = None
    if need_x:
        grad_x = structure.matmul(backend, values, grad_yt, dtype, transpose=True).T
        if not backend.on_gpu:
            grad_x = contiguous(backend, grad_x)
    if need_values:
        grad_values = structure.sampled(backend, grad_yt, x.T, dtype)
    return grad_x, grad_values


def block_size(values: Any) -> Shape | None:
    """The block size of a BSR weight's ``values`` (nnzb, R, C), an array or a tensor; ``None``
    for CSR values (nnz,)."""
    return None if values.ndim == 1 else tuple(int(s) for s in values.shape[1:])


class LinearProblem(NamedTuple):
    """A prepared ``sparse_linear`` call: the arguments, the computation's dtype and the
    validated structure (``None`` where prepared without checks: the backward looks it up
    under the structure its forward ran on). A named tuple, frozen too, built in 0.6 us
    against a frozen dataclass's 2.3 us: a layer prepares one a call."""

    backend: Backend
    dtype: np.dtype[Any]
    x: Array | None
    values: Array
    indptr: Array
    indices: Array
    shape: Shape
    bias: Array | None
    structure: Csr | blocksparse.Bsr | None
    same: Array | None
    caller: str


@dataclasses.dataclass(frozen=True)
class LinearSaved(Saved):
    """The structure the product ran on (the backward reads ``x`` from its problem)."""

    indptr: Array
    indices: Array


def prepare_linear(x: Array | None, values: Array, indptr: Array, indices: Array, shape: Sequence[int],
                   bias: Array | None, caller: str = "spchain.torch.sparse_linear",
                   check: bool = True) -> LinearProblem:
    """The problem of :data:`LINEAR`: the checks of the arrays and the structure from the cache,
    validated and prepared once (``check=False``: the arrays only, for a backward that looks
    up the structure its forward ran on)."""
    backend = _backend.backend_of(x, values, bias, indptr, indices, caller=caller)
    if not check:  # the backward operator: bias does not reach it, the structure is the forward's
        return LinearProblem(backend, values.dtype, x, values, indptr, indices, tuple(shape), bias, None, None,
                             caller)
    dtype = _checks.float_dtype(caller, x=x, values=values, bias=bias)
    structure, same = _structures.STRUCTURES.lookup(backend, (indptr, indices), tuple(shape), caller,
                                                    blocksize=block_size(values))
    return LinearProblem(backend, dtype, x, values, indptr, indices, tuple(shape), bias, structure, same, caller)


def _linear_forward(p: LinearProblem) -> tuple[tuple[Array], LinearSaved]:
    """``y.T``, and the validated structure the product ran on for the backward."""
    assert p.structure is not None and p.x is not None  # prepared with checks
    yt = linear(p.backend, p.structure, p.values, p.x, p.bias, p.dtype)
    if p.same is not None:  # a structure changed since it was cached (GPU): NaN, never the old structure's product
        yt = p.backend.xp.where(p.same, yt, np.nan).astype(yt.dtype, copy=False)
    return (yt,), LinearSaved(p.structure.indptr, p.structure.indices)


def _linear_backward(p: LinearProblem, saved: LinearSaved, grads: Sequence[Array | None],
                     needs: Sequence[bool]) -> Positional:
    structure = p.structure
    if structure is None:  # the structure the forward prepared, under the caller's arrays
        structure, _ = _structures.STRUCTURES.lookup(p.backend, (saved.indptr, saved.indices), p.shape, p.caller,
                                                     blocksize=block_size(p.values), key_arrays=(p.indptr, p.indices))
    grad_yt = grads[0]  # in the computation's dtype, that of y.T
    assert grad_yt is not None and p.x is not None  # the operator fills unused gradients with zeros; reads x
    need_x, need_values, need_bias = needs
    grad_x, grad_values = linear_backward(p.backend, structure, p.values, grad_yt, p.x, grad_yt.dtype,
                                          need_x, need_values)
    return Positional((grad_x, grad_values, grad_yt.sum(axis=1) if need_bias else None))


@dataclasses.dataclass(frozen=True)
class _LinearOp(Op[LinearProblem, LinearSaved]):
    """:data:`LINEAR`'s class: its residuals copy the cached structure on the CPU."""

    def residuals(self, saved: LinearSaved) -> tuple[Array, ...]:
        """On the CPU copies of the cached structure (a registered operator's results are the
        caller's tensors); on the GPU the cache's own arrays, never written."""
        if isinstance(saved.indptr, np.ndarray):
            return saved.indptr.copy(), saved.indices.copy()
        return saved.arrays()


LINEAR: Op[LinearProblem, LinearSaved] = _LinearOp(prepare_linear, _linear_forward, LinearSaved, _linear_backward)
"""``y.T`` for ``y = x @ W.T + bias`` as an :class:`~spchain._op.Op` (:func:`linear` and
:func:`linear_backward`), the array half of ``spchain::sparse_linear``: its problem holds the
structure from the cache, so an eager backward reuses its forward's."""
