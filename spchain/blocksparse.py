"""Block-sparse (BSR) and N:M sparse products and pruning, for sparse layers at 50-95 % sparsity.

:func:`spchain.spmm`, :func:`spchain.sddmm` and :func:`spchain.prune` hand their BSR inputs and
their ``block=`` and ``method="n:m"`` options to this module. A BSR operand is a SciPy
``bsr_matrix`` / ``bsr_array`` or, on any backend (cupyx has no BSR class), the three BSR arrays
and the shape in SciPy's constructor form, ``((data, indices, indptr), shape)``: ``data``
(nnzb, R, C), ``indices`` (nnzb) the block column of each block, ``indptr`` (M / R + 1).
Every structure goes through one validation step (:func:`to_bsr`) into a :class:`Bsr` of raw
arrays, which the kernels (``spchain.kernels.cpu.blocksparse``, ``spchain.kernels.cuda.blocksparse``)
consume. The caller's arrays are never written to.

>>> import numpy as np, scipy.sparse, spchain as sc
>>> a = scipy.sparse.bsr_array(np.kron(np.eye(2), np.ones((2, 2))), blocksize=(2, 2))
>>> sc.spmm(a, np.arange(4.0))
array([1., 1., 5., 5.])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, Union

import numpy as np
import scipy.sparse

from . import _backend, _checks, _csr, _selection
from ._backend import Backend
from ._typing import Array, Seed, Shape, Sparse
from .kernels import cpu, cuda

BsrOperand: TypeAlias = Union[Sparse, tuple[tuple[Array, Array, Array], Shape]]
"""A BSR operand: a SciPy ``bsr_matrix`` / ``bsr_array`` or ``((data, indices, indptr), shape)``."""


@dataclass(frozen=True)
class Bsr:
    """A validated BSR structure: raw arrays of one backend.

    ``indptr`` (M / R + 1) and ``indices`` (nnzb) share one integer dtype; ``data`` is
    (nnzb, R, C) or ``None`` for a pattern. Blocks may be unsorted within a block row, repeat
    (duplicates add up) or hold zeros. Its products have the method set of
    :class:`spchain._csr.Csr` (``values`` are blocks here).
    """

    indptr: Array
    indices: Array
    data: Array | None
    shape: tuple[int, int]
    blocksize: tuple[int, int]

    @property
    def nnzb(self) -> int:
        return int(self.indices.shape[0])

    @property
    def grid(self) -> tuple[int, int]:
        """The shape of the block grid, (M / R, N / C)."""
        return self.shape[0] // self.blocksize[0], self.shape[1] // self.blocksize[1]

    @property
    def nbytes(self) -> int:
        """The bytes of the index arrays, and of the transpose once :meth:`transposed` built it."""
        return _csr.structure_nbytes(self)

    def transposed(self, backend: Backend) -> tuple[_csr.Csr, Array]:
        """``(grid_t, order)``: the block structure of the transpose (a CSR pattern over the
        transposed grid) and, for each of its blocks, the slot of this structure it transposes.
        Built once and kept with the structure."""
        cached: tuple[_csr.Csr, Array] | None = self.__dict__.get("_transposed")
        if cached is None:
            cached = _csr.Csr(self.indptr, self.indices, None, self.grid).transposed(backend)
            object.__setattr__(self, "_transposed", cached)  # a cache of a frozen value, not a change of it
        return cached

    def prepare(self, backend: Backend) -> None:
        """Build what this structure's products need: its transpose (the input gradient reads it)."""
        self.transposed(backend)

    def matmul(self, backend: Backend, values: Array, b: Array, dtype: np.dtype[Any], bias: Array | None = None, *,
               transpose: bool = False, rows: bool = False) -> Array:
        """``W @ b`` (plus ``bias[:, None]``), ``W`` this structure with blocks ``values``
        (nnzb, R, C), for a dense (N, n) ``b``: a C-contiguous (M, n) array, or with ``rows`` its
        transpose (n, M) (C-contiguous on the CPU, a view on the GPU). With ``transpose`` it is
        ``W.T @ b``, read from the same blocks through :meth:`transposed`."""
        xp = backend.xp
        data = xp.ascontiguousarray(values.astype(dtype, copy=False))
        if transpose:
            grid_t, slots = self.transposed(backend)
            indptr, indices, m = grid_t.indptr, grid_t.indices, self.shape[1]
            if backend.on_gpu:  # the CPU kernel reads the blocks transposed as they are; CUDA takes a copy
                data = xp.ascontiguousarray(data.transpose(0, 2, 1))
        else:
            indptr, indices, slots, m = self.indptr, self.indices, xp.arange(self.nnzb, dtype=self.indices.dtype), \
                self.shape[0]
        out = xp.empty((m, b.shape[1]), dtype)
        if out.size:
            bias = xp.zeros(m, dtype) if bias is None else bias.astype(dtype, copy=False)
            b = _csr.contiguous(backend, b.astype(dtype, copy=False))
            if backend.on_gpu:
                with backend.use():
                    backend.launcher(cuda.blocksparse.launch_blocksparse_spmm)(indptr, indices, slots, data, b, bias,
                                                                               out)
            else:
                _csr.on_threads(cpu.blocksparse.blocksparse_spmm, _backend.threads(data.size * b.shape[1]), indptr,
                                indices, slots, data, transpose, b, bias, out)
        if rows:
            return out.T if backend.on_gpu else _csr.contiguous(backend, out.T)
        return out

    def sampled(self, backend: Backend, a: Array, b: Array, dtype: np.dtype[Any]) -> Array:
        """``out[p] = a[rows of block p] @ b[cols of block p].T`` for every stored block: (nnzb, R, C)."""
        xp = backend.xp
        out = xp.zeros((self.nnzb, *self.blocksize), dtype)
        if out.size and a.shape[1]:
            a = _csr.contiguous(backend, a.astype(dtype, copy=False))
            b = _csr.contiguous(backend, b.astype(dtype, copy=False))
            if backend.on_gpu:
                with backend.use():
                    backend.launcher(cuda.blocksparse.launch_blocksparse_sddmm)(self.indptr, self.indices, a, b, out)
            else:
                _csr.on_threads(cpu.blocksparse.blocksparse_sddmm, _backend.threads(out.size * a.shape[1]), self.indptr,
                                self.indices, a, b, out)
        return out


# --- validation ----------------------------------------------------------------------------


def is_bsr(a: object) -> bool:
    """Whether ``a`` is a BSR operand: a SciPy BSR object or a ``((data, indices, indptr), shape)`` tuple."""
    return getattr(a, "format", None) == "bsr" or (isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], tuple))


def bsr_parts(a: BsrOperand, caller: str) -> tuple[Array, Array, Array, Shape]:
    """``(data, indices, indptr, shape)`` of a BSR operand (see :func:`is_bsr`)."""
    if isinstance(a, tuple):
        if len(a[0]) != 3:
            raise ValueError(f"{caller}: a BSR tuple is ((data, indices, indptr), shape), got {len(a[0])} arrays")
        return (*a[0], _csr.check_shape(caller, a[1]))
    return a.data, a.indices, a.indptr, a.shape


def to_bsr(backend: Backend, shape: Shape, data: Array | None, indptr: Array, indices: Array, caller: str, *,
           blocksize: Shape | None = None) -> Bsr:
    """Validate a BSR structure and return it as a :class:`Bsr`.

    The block size is ``data.shape[1:]`` (or ``blocksize`` for a pattern without data). The
    shape must be a whole number of blocks; ``indptr`` and ``indices`` are checked on the
    block grid by the CSR checks of :func:`spchain._csr.to_csr` (``ValueError`` for a bad
    structure, ``TypeError`` for non-integer indices), before any kernel runs.
    """
    m, n = _csr.check_shape(caller, shape)
    if data is not None:
        if data.ndim != 3:
            raise ValueError(f"{caller}: BSR data must be 3-D (nnzb, R, C), got shape {data.shape}")
        blocksize = data.shape[1:]
    if blocksize is None:
        raise TypeError(f"{caller}: a BSR structure without data needs a blocksize")
    r, c = (int(s) for s in blocksize)
    if r < 1 or c < 1 or m % r or n % c:
        raise ValueError(f"{caller}: shape {(m, n)} is not a whole number of {(r, c)} blocks")
    grid = _csr.to_csr(backend, "csr", (m // r, n // c), None, indptr, indices, caller)
    if data is not None and data.shape[0] != grid.nnz:
        raise ValueError(f"{caller}: data has {data.shape[0]} blocks but the indices have {grid.nnz}")
    return Bsr(grid.indptr, grid.indices, data, (m, n), (r, c))


def _like(a: object, backend: Backend, data: Array, indices: Array, indptr: Array, shape: Shape) -> BsrOperand:
    """A BSR result of ``a``'s kind: a SciPy object of its class, else a tuple."""
    if isinstance(a, tuple) or backend.on_gpu:
        return (data, indices, indptr), tuple(shape)
    cls = scipy.sparse.bsr_matrix if isinstance(a, scipy.sparse.spmatrix) else scipy.sparse.bsr_array
    return cls((data, indices, indptr), shape=shape, copy=False)


# --- products ------------------------------------------------------------------------------


def spmm(a: BsrOperand, b: Array) -> Array:
    """``a @ b`` for a BSR ``a``: the BSR case of :func:`spchain.spmm`.

    ``a`` is a SciPy ``bsr_matrix`` / ``bsr_array`` or ``((data, indices, indptr), shape)``
    (NumPy or CuPy arrays; ``data`` (nnzb, R, C)); ``b`` is dense (N,) or (N, n), any layout.
    Returns a dense (M,) or (M, n) array on ``b``'s backend: float32 if both are float32,
    else float64. Duplicate blocks add up; NaN and inf propagate through stored blocks.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> data = np.ones((1, 2, 2))
    >>> sc.spmm(((data, np.array([1]), np.array([0, 1, 1])), (4, 4)), np.arange(4.0))
    array([5., 5., 0., 0.])
    """
    caller = "spchain.spmm"
    _csr.check_dense(caller, b=b)
    data, indices, indptr, shape = bsr_parts(a, caller)
    backend = _backend.backend_of(data, indices, indptr, b, caller=caller)
    b = _csr._operand(backend, b, caller, "b", (1, 2))
    if shape[1] != b.shape[0]:
        raise ValueError(f"{caller}: shapes {tuple(shape)} and {b.shape} do not match ({shape[1]} != {b.shape[0]})")
    dtype = _checks.float_dtype(caller, a=data, b=b)
    bsr = to_bsr(backend, shape, data, indptr, indices, caller)
    assert bsr.data is not None, "spmm multiplies by a structure with values"
    out = bsr.matmul(backend, bsr.data, b[:, None] if b.ndim == 1 else b, dtype)
    return out[:, 0] if b.ndim == 1 else out


def sddmm(pattern: BsrOperand, a: Array, b: Array) -> BsrOperand:
    """Block-sampled dense-dense product: the BSR case of :func:`spchain.sddmm`.

    Returns a BSR of ``pattern``'s kind with exactly its blocks (in its order, duplicates kept),
    block ``p`` holding ``a[rows of p] @ b[cols of p].T``; ``a`` is (M, k), ``b`` is (N, k).

    Examples
    --------
    >>> import numpy as np, scipy.sparse, spchain as sc
    >>> pattern = scipy.sparse.bsr_array(np.eye(4), blocksize=(2, 2))
    >>> sc.sddmm(pattern, np.ones((4, 3)), np.ones((4, 3))).toarray()[:, 0]
    array([3., 3., 0., 0.])
    """
    caller = "spchain.sddmm"
    _csr.check_dense(caller, a=a, b=b)
    data, indices, indptr, shape = bsr_parts(pattern, caller)
    backend = _backend.backend_of(data, indices, indptr, a, b, caller=caller)
    a = _csr._operand(backend, a, caller, "a", (2,))
    b = _csr._operand(backend, b, caller, "b", (2,))
    if a.shape[0] != shape[0] or b.shape[0] != shape[1] or a.shape[1] != b.shape[1]:
        raise ValueError(f"{caller}: pattern {tuple(shape)}, a {a.shape} and b {b.shape} do not match "
                         "(an (m, n) pattern needs a of shape (m, k) and b of shape (n, k))")
    dtype = _checks.float_dtype(caller, a=a, b=b)
    bsr = to_bsr(backend, shape, data, indptr, indices, caller)
    out = bsr.sampled(backend, a, b, dtype)
    return _like(pattern, backend, out, bsr.indices.copy(), bsr.indptr.copy(), shape)


# --- pruning -------------------------------------------------------------------------------


def prune(w: Array, sparsity: float | None = None, *, method: Literal["magnitude", "random", "n:m"] = "magnitude",
          seed: Seed = None, block: tuple[int, int] | None = None, n: int | None = None,
          m: int | None = None) -> BsrOperand:
    """Block and N:M pruning: the ``block=`` and ``method="n:m"`` cases of :func:`spchain.prune`.

    With ``block=(R, C)`` (``method`` "magnitude" or "random"), keeps
    ``nblocks - round(sparsity * nblocks)`` of the (M / R) x (N / C) blocks: those of largest
    Frobenius norm (NaN counts as the largest, ties go to the earlier block in row-major order),
    or uniformly chosen ones (``seed``); returns a SciPy ``bsr_array`` (a BSR tuple on the GPU),
    sorted, with ``w``'s dtype. ``w``'s shape must be a whole number of blocks.

    With ``method="n:m"``, keeps in every group of ``m`` consecutive entries along each row the
    ``n`` of largest ``|w|`` (NaN the largest, ties to the earlier entry); returns CSR (as
    :func:`spchain.prune`) with exactly ``n`` entries per group. The row length must be a
    multiple of ``m``. ``sparsity`` is implied, ``1 - n / m``: pass ``None`` or that value.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> sc.prune(np.array([[1.0, -4.0, 3.0, 2.0]]), method="n:m", n=2, m=4).toarray()
    array([[ 0., -4.,  3.,  0.]])
    >>> w = np.array([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 5.0]])
    >>> sc.prune(w, 0.5, block=(2, 2)).toarray()
    array([[0., 0., 0., 0.],
           [0., 0., 0., 5.]])
    """
    caller = "spchain.prune"
    backend = _backend.backend_of(w, caller=caller)
    w = _csr._operand(backend, w, caller, "w", (2,))
    _checks.float_dtype(caller, w=w)
    if method == "n:m":
        if block is not None:
            raise ValueError(f"{caller}: method='n:m' takes no block")
        indptr, indices, data = n_m_parts(backend, w, sparsity, n, m, caller)
        return _csr.new_csr(backend, None, data, indices, indptr, w.shape, copy=False)
    data, indices, indptr = block_parts(backend, w, sparsity, method, seed, block, caller)
    return _like(None, backend, data, indices, indptr, w.shape)


def n_m_parts(backend: Backend, w: Array, sparsity: float | None, n: int | None, m: int | None,
              caller: str) -> tuple[Array, Array, Array]:
    """:func:`prune` with ``method="n:m"`` as raw CSR arrays ``(indptr, indices, data)``."""
    xp = backend.xp
    n, m = _csr.check_size(caller, "n", n), _csr.check_size(caller, "m", m)
    if m < 1 or not 0 <= n <= m:
        raise ValueError(f"{caller}: n:m needs 0 <= n <= m and m >= 1, got {n}:{m}")
    if sparsity is not None and abs(_csr.check_fraction(caller, "sparsity", sparsity) - (1 - n / m)) > 1e-12:
        raise ValueError(f"{caller}: {n}:{m} pruning has sparsity {1 - n / m}, not {sparsity}; pass sparsity=None")
    rows, cols = w.shape
    if cols % m:
        raise ValueError(f"{caller}: rows of length {cols} do not split into groups of m = {m}")
    groups = xp.abs(w).reshape(rows, cols // m, m)
    key = xp.where(xp.isnan(groups), xp.inf, groups)
    kept = xp.sort(xp.argsort(-key, axis=2, kind="stable")[:, :, :n], axis=2)
    per_row = cols // m * n
    dtype = np.int32 if _csr.fits_int32(rows, cols, rows * per_row) else np.int64
    indices = (kept + (xp.arange(cols // m) * m)[None, :, None]).reshape(rows, per_row).astype(dtype)
    indptr = (xp.arange(rows + 1) * per_row).astype(dtype)
    return indptr, indices.ravel(), xp.take_along_axis(w, indices, axis=1).ravel()


def block_parts(backend: Backend, w: Array, sparsity: float | None, method: str, seed: Seed,
                block: Any, caller: str) -> tuple[Array, Array, Array]:
    """:func:`prune` with ``block=(R, C)`` as raw BSR arrays ``(data, indices, indptr)``; ``block``
    is the caller's, checked here (hence ``Any``)."""
    xp = backend.xp
    r, c = _csr.check_block(caller, block)
    (mw, nw), shape = w.shape, (w.shape[0] // max(r, 1), w.shape[1] // max(c, 1))
    if r < 1 or c < 1 or mw % r or nw % c:
        raise ValueError(f"{caller}: shape {w.shape} is not a whole number of {(r, c)} blocks")
    if sparsity is None:
        raise ValueError(f"{caller}: method={method!r} needs a sparsity")
    total = shape[0] * shape[1]
    keep = total - round(_csr.check_fraction(caller, "sparsity", sparsity) * total)
    tiles = w.reshape(shape[0], r, shape[1], c).transpose(0, 2, 1, 3)
    if method == "magnitude":
        norms = xp.square(tiles, dtype=np.float64).sum(axis=(2, 3))
        positions = _selection.largest(backend, norms.ravel(), keep)
    elif method == "random":
        positions = _selection.random_positions(backend, total, keep, seed=seed)
    else:
        raise ValueError(f"{caller}: method must be 'magnitude', 'random' or 'n:m', not {method!r}")
    indptr, indices = _selection.positions_to_csr(backend, positions, shape)
    return tiles.reshape(total, r, c)[positions], indices, indptr
