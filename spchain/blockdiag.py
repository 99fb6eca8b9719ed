"""Block-diagonal and grouped matrix products (NumPy or CuPy in, the same backend out).

``block_diag_matmul`` multiplies each of G feature blocks of every row by its own matrix;
``grouped_matmul`` multiplies each of G contiguous runs of rows by its own matrix (the
routing of a mixture-of-experts layer). Neither ever copies a weight per row: each is one
BLAS/cuBLAS product per group on strided views of the caller's arrays (in one batched
``matmul`` call for the block-diagonal product), writing straight into the result. On
NumPy the views go to BLAS as they are; on the GPU the block-diagonal products, and grouped
products of equal groups, are one strided-batched cuBLAS GEMM on the views
(:func:`batched_matmul`: no operand copied), and ragged groups one pointer-array cuBLAS GEMM
over chunks of rows padded to at most twice the rows (:func:`ragged_plan`,
:func:`indexed_matmul`), each chunk reading its group's weight where it lies.

The gradients of both products are products of the same kind: the input gradient is the
product with the transposed weight, and the weight gradient of group g is
``x_gᵀ @ grad_g``. Each product is also an :class:`~spchain._op.Op` (:data:`BLOCK_DIAG`,
:data:`GROUPED`) that ``spchain.torch`` makes a torch operator of: its ``prepare`` validates,
the backward reuses the prepared operands (no residuals).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from . import _backend
from ._backend import Backend, backend_of
from ._checks import dense, float_dtype
from ._dask import scales_out
from ._op import Grads, Op, Saved
from ._typing import Array, Shape


def _blas_layout(xp: ModuleType, a: Array) -> Array:
    """``a``, or a C-contiguous copy of it if its last two axes are not a BLAS matrix layout.

    A matrix is a BLAS operand when one of its axes has unit stride and the other a positive
    stride at least as long as a row (column); anything else (a 0-stride broadcast, a sliced
    or reversed axis) would send NumPy to its slow non-BLAS loop, so it is copied once.
    """
    rows, cols = a.shape[-2:]
    row_stride, col_stride = a.strides[-2:]
    item = a.itemsize
    if (col_stride == item and row_stride >= item * max(cols, 1)) or (
        row_stride == item and col_stride >= item * max(rows, 1)
    ):
        return a
    return xp.ascontiguousarray(a)


@scales_out
def block_diag_matmul(x: Array, w: Array) -> Array:
    """Multiply each block of features by its own matrix: ``y[..., g, :] = x[..., g, :] @ w[g]``.

    The same as ``x.reshape(-1, G * d_in) @ scipy.linalg.block_diag(*w)`` (reshaped back),
    without building the block-diagonal matrix or any per-row copy of ``w``.

    Parameters
    ----------
    x : ndarray, shape (..., G, d_in)
        NumPy or CuPy array; float32 or float64. Any leading axes (none included).
    w : ndarray, shape (G, d_in, d_out)
        One matrix per block, on the same backend and device as ``x``.

    Returns
    -------
    ndarray, shape (..., G, d_out)
        C-contiguous, on ``x``'s backend; float64 if either input is float64.

    Raises
    ------
    ValueError
        If the shapes do not match, or the inputs are on different devices.
    TypeError
        For a dtype other than float32/float64, a torch tensor (use
        ``spchain.torch.block_diag_matmul``) or another array type.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> x = np.arange(8.0).reshape(2, 2, 2)       # 2 rows, 2 blocks of 2 features
    >>> w = np.stack([np.eye(2), 2 * np.eye(2)])  # block 1 is doubled
    >>> sc.block_diag_matmul(x, w)
    array([[[ 0.,  1.],
            [ 4.,  6.]],
    <BLANKLINE>
           [[ 4.,  5.],
            [12., 14.]]])
    """
    (out,), _ = BLOCK_DIAG.forward(prepare_block_diag(x, w))
    return out


def block_diag_matmul_shape(caller: str, x_shape: Sequence[int], w_shape: Sequence[int]) -> Shape:
    """The shape of ``block_diag_matmul(x, w)``; ``ValueError`` if the shapes do not match.

    The one shape rule, used by the product and by the torch operator's fake implementation.
    """
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    if len(w_shape) != 3 or len(x_shape) < 2 or x_shape[-2:] != w_shape[:2]:
        raise ValueError(f"{caller}: x (..., G, d_in) and w (G, d_in, d_out) do not match: "
                         f"x has shape {x_shape}, w has shape {w_shape}")
    return x_shape[:-1] + w_shape[2:]


def _block_diag_product(backend: Backend, x: Array, w: Array, dtype: np.dtype[Any]) -> Array:
    """``block_diag_matmul`` of checked operands, in ``dtype``."""
    groups, d_in, d_out = w.shape
    xp = backend.xp
    with backend.use():
        out = xp.empty(x.shape[:-1] + (d_out,), dtype)
        if out.size:
            rows = math.prod(x.shape[:-2])
            x = x.astype(dtype, copy=False).reshape(rows, groups, d_in)
            w = w.astype(dtype, copy=False)
            batched_matmul(xp, _blas_layout(xp, x.swapaxes(0, 1)), _blas_layout(xp, w),
                           out.reshape(rows, groups, d_out).swapaxes(0, 1))
    return out


def batched_matmul(xp: ModuleType, a: Array, b: Array, out: Array) -> None:
    """``out[g] = a[g] @ b[g]`` for (G, m, k), (G, k, n) and (G, m, n) strided views whose
    matrices have a unit stride (:func:`_blas_layout`) and ``out``'s rows a unit stride.

    On the GPU one strided-batched cuBLAS GEMM reads and writes the views where they lie
    (:func:`gemm_plan`), where ``cupy.matmul`` would copy a strided operand to a contiguous one
    and compute into a temporary; elsewhere ``matmul`` with ``out``.
    """
    plan = gemm_plan(a, b, out) if xp is not np and out.size and a.shape[-1] else None
    if plan is None:
        _backend.matmul(xp, a, b, out=out)
        return
    cublas = importlib.import_module("cupy_backends.cuda.libs.cublas")
    gemm = cublas.sgemmStridedBatched if out.dtype == np.float32 else cublas.dgemmStridedBatched
    one, zero = np.ones(1, out.dtype), np.zeros(1, out.dtype)
    handle = xp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, xp.cuda.get_current_stream().ptr)
    gemm(handle, plan["transa"], plan["transb"], plan["m"], plan["n"], plan["k"], one.ctypes.data,
         _address(b), plan["lda"], plan["stride_a"], _address(a), plan["ldb"], plan["stride_b"], zero.ctypes.data,
         _address(out), plan["ldc"], plan["stride_c"], plan["batch"])


def _address(a: Any) -> int:
    """The device address of a CuPy view's first element."""
    return int(a.data.ptr)


_NO_TRANS, _TRANS = 0, 1  # cuBLAS's CUBLAS_OP_N and CUBLAS_OP_T


def gemm_plan(a: Array, b: Array, out: Array) -> dict[str, int] | None:
    """The arguments of one column-major strided-batched GEMM (cuBLAS's ``gemmStridedBatched``)
    that computes ``out[g] = a[g] @ b[g]`` on the views as they lie, or ``None`` where none
    does (``out``'s rows not of unit stride, an operand without a unit stride, mixed dtypes,
    a size past int32).

    Column-major, ``out`` with unit-stride rows is ``outᵀ`` with leading dimension its row
    stride, and ``outᵀ = bᵀ aᵀ``: cuBLAS's first operand is ``b`` and its second ``a``, each
    as it lies (``N``) where its rows have unit stride, else transposed (``T``). Strides are in
    elements; a batch of one has batch stride 0.
    """
    item = out.itemsize

    def operand(v: Array) -> tuple[int, int] | None:
        """(op, leading dimension) of view ``v`` (r, s), seen column-major as ``vᵀ``."""
        r, s = v.shape[-2:]
        row, col = v.strides[-2] // item, v.strides[-1] // item
        if col == 1 or s == 1:
            return _NO_TRANS, max(row if r > 1 else s, s, 1)
        if row == 1 or r == 1:
            return _TRANS, max(col if s > 1 else r, r, 1)
        return None

    batch, m, n = out.shape
    k = a.shape[-1]
    first, second = operand(b), operand(a)
    if first is None or second is None or not (out.strides[-1] == item or n == 1) or \
            not a.dtype == b.dtype == out.dtype:
        return None
    plan = {"transa": first[0], "transb": second[0], "m": n, "n": m, "k": k, "lda": first[1],
            "ldb": second[1], "ldc": max(out.strides[-2] // item if m > 1 else n, n, 1), "batch": batch,
            "stride_a": b.strides[0] // item if batch > 1 else 0, "stride_b": a.strides[0] // item if batch > 1 else 0,
            "stride_c": out.strides[0] // item if batch > 1 else 0}
    if any(value < 0 or value >= 2**31 for value in plan.values()):
        return None
    return plan


@dataclasses.dataclass(frozen=True)
class Operands:
    """The operands of :func:`block_diag_matmul` or :func:`grouped_matmul`, validated: ``dtype``
    the result's, ``sizes`` the grouped product's group sizes (host int64; ``None`` for the
    block-diagonal one)."""

    backend: Backend
    x: Array
    w: Array
    dtype: np.dtype[Any]
    sizes: NDArray[np.int64] | None = None


@dataclasses.dataclass(frozen=True)
class MatmulGrads(Grads):
    """The gradients of a product's ``(x, w)``, ``None`` where not needed."""

    x: Array | None
    w: Array | None


def prepare_block_diag(x: Any, w: Any, *, caller: str = "spchain.block_diag_matmul",
                       check: bool = True) -> Operands:
    """The :class:`Operands` of :func:`block_diag_matmul` (``check=False``: operands that a
    ``prepare`` has validated)."""
    if not check:
        return Operands(backend_of(x, w), x, w, np.promote_types(x.dtype, w.dtype))
    x, w = dense(caller, x=x, w=w)
    backend = backend_of(x, w, caller=caller)
    dtype = float_dtype(caller, x=x, w=w)
    block_diag_matmul_shape(caller, x.shape, w.shape)
    return Operands(backend, x, w, dtype)


def _block_diag_forward(p: Operands) -> tuple[tuple[Array], Saved]:
    return (_block_diag_product(p.backend, p.x, p.w, p.dtype),), Saved()


def _block_diag_backward(p: Operands, saved: Saved, grads: Sequence[Array | None],
                         needs: Sequence[bool]) -> MatmulGrads:
    """``grad_x`` is the same product with ``w`` transposed (a view, never a copy),
    ``grad_w[g] = Σ_rows x_gᵀ grad_g``."""
    (grad,) = grads
    assert grad is not None  # the operator gives zeros for an unused output
    if grad.ndim > p.x.ndim:  # torch.func maps the backward over stacked incoming gradients (jacrev)
        return _per_gradient(_block_diag_backward, p, grad, needs)
    grad_x = _block_diag_product(p.backend, grad, p.w.swapaxes(1, 2), np.promote_types(grad.dtype, p.w.dtype)) \
        if needs[0] else None
    return MatmulGrads(grad_x, _block_diag_weight_grad(p.x, grad) if needs[1] else None)


BLOCK_DIAG: Op[Operands, Saved] = Op(prepare_block_diag, _block_diag_forward, Saved, _block_diag_backward,
                                     reads_outputs=False)
""":func:`block_diag_matmul` as an :class:`~spchain._op.Op`: outputs ``(y,)``, differentiable in ``(x, w)``."""


def _block_diag_weight_grad(x: Array, grad: Array) -> Array:
    """The gradient of ``block_diag_matmul(x, w)`` with respect to ``w``: ``Σ_rows x_gᵀ grad_g``.

    ``x`` is (..., G, d_in) and ``grad`` (..., G, d_out), on one backend, shapes checked by the
    forward; returns (G, d_in, d_out) in their promoted dtype.
    """
    backend = backend_of(x, grad)
    xp = backend.xp
    rows, (groups, d_in), d_out = math.prod(x.shape[:-2]), x.shape[-2:], grad.shape[-1]
    x = x.reshape(rows, groups, d_in).transpose(1, 2, 0)
    grad = grad.reshape(rows, groups, d_out).swapaxes(0, 1)
    with backend.use():
        if not backend.on_gpu or rows == 0:
            return _backend.matmul(xp, _blas_layout(xp, x), _blas_layout(xp, grad))
        out = xp.empty((groups, d_in, d_out), np.promote_types(x.dtype, grad.dtype))
        batched_matmul(xp, _blas_layout(xp, x), _blas_layout(xp, grad), out)
        return out


def _check_group_sizes(caller: str, group_sizes: Sequence[int] | Array, groups: int,
                       rows: int) -> NDArray[np.int64]:
    """``group_sizes`` as a host int64 array, checked to be G sizes in ``0..rows`` summing to ``rows``.

    The checks run on Python ints, so no size wraps around: ``[2**62] * 3 + [2**62 + 6]`` (an
    int64 sum of 6) and a uint64 ``2**64 - 1`` are errors, not groups.
    """
    if not isinstance(group_sizes, (list, tuple, range)):
        group_sizes = backend_of(group_sizes, caller=caller).to_host(group_sizes)
    sizes = np.asarray(group_sizes)
    if sizes.size == 0:
        sizes = sizes.astype(np.int64)
    if sizes.dtype.kind in "iu" and isinstance(group_sizes, (list, tuple)) \
            and any(isinstance(v, (bool, np.bool_)) for v in group_sizes):  # [True, 5] is an int64 array
        raise TypeError(f"{caller}: group_sizes must hold integers, not bool")
    if sizes.dtype.kind not in "iu" and not (sizes.dtype == object and all(map(_is_int, sizes.flat))):
        raise TypeError(f"{caller}: group_sizes must hold integers, not {sizes.dtype}")
    if sizes.shape != (groups,):
        raise ValueError(f"{caller}: group_sizes has shape {sizes.shape} but w has {groups} groups")
    values = sizes.tolist()
    if any(size < 0 for size in values):
        raise ValueError(f"{caller}: group_sizes must be non-negative, got {values}")
    if any(size > rows for size in values):
        raise ValueError(f"{caller}: group_sizes must each be at most the {rows} rows of x, got {values}")
    total = sum(values)
    if total != rows:
        raise ValueError(f"{caller}: group_sizes sum to {total} but x has {rows} rows")
    return np.array(values, np.int64)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _row_slices(sizes: NDArray[np.int64]) -> Iterator[tuple[int, slice]]:
    """``(g, rows of group g)`` for every non-empty group of checked ``sizes``."""
    stop = 0
    for g, size in enumerate(sizes.tolist()):
        start, stop = stop, stop + size
        if size:
            yield g, slice(start, stop)


@scales_out
def grouped_matmul(x: Array, w: Array, group_sizes: Sequence[int] | Array) -> Array:
    """Multiply each contiguous group of rows by its own matrix.

    Rows ``x[o_g : o_g + group_sizes[g]]`` are multiplied by ``w[g]``, where ``o_g`` is the sum
    of the earlier sizes: on the CPU one BLAS product per group, on views of ``x`` and of the
    result; on the GPU one batched cuBLAS GEMM (rows padded to at most 2 N + G for ragged
    groups). Nothing of size G × N is ever allocated, nor a copy of ``w``. Empty groups are
    allowed.

    Parameters
    ----------
    x : ndarray, shape (N, d_in)
        NumPy or CuPy array; float32 or float64; rows sorted by group.
    w : ndarray, shape (G, d_in, d_out)
        One matrix per group, on the same backend and device as ``x``.
    group_sizes : sequence of int or integer ndarray, shape (G,)
        Rows per group, non-negative, summing to N. A NumPy or CuPy array, a list or a tuple;
        a CuPy array is read back to the host once.

    Returns
    -------
    ndarray, shape (N, d_out)
        On ``x``'s backend; float64 if either input is float64.

    Raises
    ------
    ValueError
        If the shapes do not match, ``group_sizes`` is not G non-negative sizes summing to N,
        or the inputs are on different devices.
    TypeError
        For non-integer ``group_sizes``, a dtype other than float32/float64, a torch tensor
        (use ``spchain.torch.grouped_matmul``) or another array type.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> x = np.ones((3, 2))
    >>> w = np.stack([np.eye(2), 3 * np.eye(2)])
    >>> sc.grouped_matmul(x, w, [1, 2])           # row 0 by w[0], rows 1-2 by w[1]
    array([[1., 1.],
           [3., 3.],
           [3., 3.]])
    """
    (out,), _ = GROUPED.forward(prepare_grouped(x, w, group_sizes))
    return out


def prepare_grouped(x: Any, w: Any, group_sizes: Any, *, caller: str = "spchain.grouped_matmul",
                    check: bool = True) -> Operands:
    """The :class:`Operands` of :func:`grouped_matmul` (``check=False``: operands that a
    ``prepare`` has validated, ``group_sizes`` integers on the host)."""
    if not check:
        return Operands(backend_of(x, w), x, w, np.promote_types(x.dtype, w.dtype), np.asarray(group_sizes, np.int64))
    x, w = dense(caller, x=x, w=w)
    backend = backend_of(x, w, caller=caller)
    dtype = float_dtype(caller, x=x, w=w)
    if w.ndim != 3 or x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{caller}: x (N, d_in) and w (G, d_in, d_out) do not match: "
                         f"x has shape {x.shape}, w has shape {w.shape}")
    return Operands(backend, x, w, dtype, _check_group_sizes(caller, group_sizes, w.shape[0], x.shape[0]))


def _grouped_product(backend: Backend, x: Array, w: Array, sizes: NDArray[np.int64],
                     dtype: np.dtype[Any]) -> Array:
    """``grouped_matmul`` of checked operands and int64 ``sizes``, in ``dtype``.

    On the GPU one batched cuBLAS GEMM: over views for equal groups, over the chunks of
    :func:`ragged_plan` for ragged ones. On the CPU one BLAS product per group, on views.
    """
    xp = backend.xp
    with backend.use():
        x = _blas_layout(xp, x.astype(dtype, copy=False))
        w = _blas_layout(xp, w.astype(dtype, copy=False))
        out = xp.empty((x.shape[0], w.shape[2]), dtype)
        if _equal_groups(backend, sizes, x):
            n = int(sizes[0])
            batched_matmul(xp, x.reshape(-1, n, x.shape[1]), w, out.reshape(-1, n, w.shape[2]))
            return out
        if backend.on_gpu and out.size:
            plan = ragged_plan(sizes)
            dest = xp.asarray(plan.dest)
            padded = xp.empty((plan.chunk_group.size * plan.rows, x.shape[1]), dtype)
            padded[dest] = x
            result = xp.empty((plan.chunk_group.size, plan.rows, w.shape[2]), dtype)
            indexed_matmul(xp, padded.reshape(-1, plan.rows, x.shape[1]), w, plan.chunk_group, result)
            out[...] = result.reshape(-1, w.shape[2])[dest]
            return out
        for g, rows in _row_slices(sizes):
            _backend.matmul(xp, x[rows], w[g], out=out[rows])
    return out


def _equal_groups(backend: Backend, sizes: NDArray[np.int64], x: Array) -> bool:
    """Whether a grouped product on the GPU is one strided-batched GEMM on views: every group
    of one non-zero size, ``x`` with unit-stride rows of unit-stride entries (so its groups are
    views of equal stride). Ragged groups take :func:`ragged_plan`'s chunks."""
    return bool(backend.on_gpu and sizes.size and sizes[0] > 0 and (sizes == sizes[0]).all()
                and x.strides[1] == x.itemsize and x.strides[0] == x.itemsize * x.shape[1])


class RaggedPlan(NamedTuple):
    """Ragged groups cut into chunks of ``rows`` rows each, for one batched GEMM on the GPU.

    ``chunk_group[c]`` is the group of chunk c (chunks in group order, none for an empty
    group); row i of ``x`` goes to row ``dest[i]`` of the (chunks × ``rows``) padded layout.
    ``ranks[r]`` is ``(groups, chunks)``: the groups with more than r chunks and their r-th chunk.
    """

    rows: int
    chunk_group: NDArray[np.int64]
    dest: NDArray[np.int64]
    ranks: tuple[tuple[NDArray[np.int64], NDArray[np.int64]], ...]


def ragged_plan(sizes: NDArray[np.int64]) -> RaggedPlan:
    """The chunks of ragged groups of checked ``sizes`` (at least one row in all).

    Chunks have T = ⌈N / G'⌉ rows (G' the non-empty groups), so there are at most
    N / T + G' ≤ 2 G' chunks and at most 2 N + G' padded rows: the padding is bounded by the
    rows themselves, whatever the sizes, where padding to the largest group may take G × N.
    """
    total, nonempty = int(sizes.sum()), int(np.count_nonzero(sizes))
    rows = -(-total // nonempty)
    chunks = -(-sizes // rows)
    first_row = (np.cumsum(chunks) - chunks) * rows
    offsets = np.cumsum(sizes) - sizes
    dest = np.arange(total, dtype=np.int64) + np.repeat(first_row - offsets, sizes)
    first = np.cumsum(chunks) - chunks
    ranks = tuple((np.flatnonzero(chunks > r), first[chunks > r] + r) for r in range(int(chunks.max())))
    return RaggedPlan(rows, np.repeat(np.arange(sizes.size, dtype=np.int64), chunks), dest, ranks)


def indexed_matmul(xp: ModuleType, a: Array, b: Array, index: NDArray[np.int64], out: Array) -> None:
    """``out[c] = a[c] @ b[index[c]]`` for (C, m, k) ``a`` and ``out`` (C-contiguous) and
    (G, k, n) ``b`` with unit-stride matrices: no matrix of ``b`` copied.

    On the GPU one pointer-array cuBLAS GEMM (``gemmBatched``): each chunk points at its
    group's matrix where it lies (:func:`indexed_gemm_plan`); elsewhere ``matmul`` of a gather.
    """
    plan = indexed_gemm_plan(a, b, index, out) if xp is not np and a.shape[-1] else None
    if plan is None:
        _backend.matmul(xp, a, b[xp.asarray(index)], out=out)
        return
    cublas = importlib.import_module("cupy_backends.cuda.libs.cublas")
    gemm = cublas.sgemmBatched if out.dtype == np.float32 else cublas.dgemmBatched
    one, zero = np.ones(1, out.dtype), np.zeros(1, out.dtype)
    item = out.itemsize
    pointers = {name: xp.asarray(np.asarray(offsets, np.uint64) * np.uint64(item) + np.uint64(_address(base)))
                for name, base, offsets in (("a", b, plan["offsets_a"]), ("b", a, plan["offsets_b"]),
                                            ("c", out, plan["offsets_c"]))}
    handle = xp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, xp.cuda.get_current_stream().ptr)
    gemm(handle, plan["transa"], plan["transb"], plan["m"], plan["n"], plan["k"], one.ctypes.data,
         _address(pointers["a"]), plan["lda"], _address(pointers["b"]), plan["ldb"], zero.ctypes.data,
         _address(pointers["c"]), plan["ldc"], plan["batch"])


def indexed_gemm_plan(a: Array, b: Array, index: NDArray[np.int64], out: Array) -> dict[str, Any] | None:
    """The arguments of one column-major pointer-array GEMM (cuBLAS's ``gemmBatched``) that
    computes ``out[c] = a[c] @ b[index[c]]`` on the arrays as they lie, or ``None`` where none
    does: :func:`gemm_plan`'s arguments for one chunk, with the element offset of each
    chunk's matrices from each array's first element in place of batch strides.
    """
    plan = gemm_plan(a[:1], b[:1], out[:1]) if index.size else None
    if plan is None:
        return None
    item = out.itemsize
    chunks = np.arange(index.size, dtype=np.int64)
    return {**{key: plan[key] for key in ("transa", "transb", "m", "n", "k", "lda", "ldb", "ldc")},
            "batch": int(index.size), "offsets_a": index * (b.strides[0] // item),
            "offsets_b": chunks * (a.strides[0] // item), "offsets_c": chunks * (out.strides[0] // item)}


def _grouped_forward(p: Operands) -> tuple[tuple[Array], Saved]:
    assert p.sizes is not None  # a grouped product's operands
    return (_grouped_product(p.backend, p.x, p.w, p.sizes, p.dtype),), Saved()


def _grouped_backward(p: Operands, saved: Saved, grads: Sequence[Array | None], needs: Sequence[bool]) -> MatmulGrads:
    """``grad_x`` is the grouped product of the incoming gradient with ``w`` transposed,
    ``grad_w[g] = x_gᵀ grad_g`` (zeros for an empty group)."""
    (grad,) = grads
    assert grad is not None and p.sizes is not None  # zeros for an unused output; a grouped product's operands
    if grad.ndim > p.x.ndim:  # torch.func maps the backward over stacked incoming gradients (jacrev)
        return _per_gradient(_grouped_backward, p, grad, needs)
    grad_x = _grouped_product(p.backend, grad, p.w.swapaxes(1, 2), p.sizes, np.promote_types(grad.dtype, p.w.dtype)) \
        if needs[0] else None
    return MatmulGrads(grad_x, _grouped_weight_grad(p.x, grad, p.sizes) if needs[1] else None)


GROUPED: Op[Operands, Saved] = Op(prepare_grouped, _grouped_forward, Saved, _grouped_backward, reads_outputs=False)
""":func:`grouped_matmul` as an :class:`~spchain._op.Op`: outputs ``(y,)``, differentiable in ``(x, w)``."""


def _per_gradient(backward: Callable[[Operands, Saved, Sequence[Array | None], Sequence[bool]], MatmulGrads],
                  p: Operands, grad: Array, needs: Sequence[bool]) -> MatmulGrads:
    """``backward`` for a ``grad`` with leading axes of its own: one call per incoming gradient,
    the gradients stacked along those axes."""
    lead = grad.shape[:grad.ndim - p.x.ndim]  # the result has x's number of axes
    gradients = [backward(p, Saved(), [g], needs).ordered() for g in grad.reshape(-1, *grad.shape[len(lead):])]
    out: list[Array | None] = []
    for k, (a, need) in enumerate(zip((p.x, p.w), needs)):
        if not need:
            out.append(None)
        elif gradients:
            out.append(p.backend.xp.stack([g[k] for g in gradients]).reshape(lead + a.shape))
        else:
            out.append(p.backend.xp.zeros(lead + a.shape, grad.dtype))
    return MatmulGrads(*out)


def _grouped_weight_grad(x: Array, grad: Array, sizes: NDArray[np.int64]) -> Array:
    """The gradient of ``grouped_matmul(x, w, sizes)`` with respect to ``w``.

    Group g gets ``x_gᵀ @ grad_g`` (zeros for an empty group). ``x`` is (N, d_in) and ``grad``
    (N, d_out), on one backend, and ``sizes`` the int64 array of :func:`_check_group_sizes`
    (all checked by the forward); returns (G, d_in, d_out) in their promoted dtype.
    """
    backend = backend_of(x, grad)
    xp = backend.xp
    with backend.use():
        out = xp.zeros((sizes.size, x.shape[1], grad.shape[1]), np.promote_types(x.dtype, grad.dtype))
        x, grad = _blas_layout(xp, x), _blas_layout(xp, grad)
        if _equal_groups(backend, sizes, x) and _equal_groups(backend, sizes, grad):
            n = int(sizes[0])
            batched_matmul(xp, x.reshape(-1, n, x.shape[1]).swapaxes(1, 2), grad.reshape(-1, n, grad.shape[1]), out)
            return out
        if backend.on_gpu and x.shape[0] and out.size:
            _ragged_weight_grad(xp, x, grad, ragged_plan(sizes), out)
            return out
        for g, rows in _row_slices(sizes):
            _backend.matmul(xp, x[rows].T, grad[rows], out=out[g])
    return out


def _ragged_weight_grad(xp: ModuleType, x: Array, grad: Array, plan: RaggedPlan, out: Array) -> None:
    """``out[g] = x_gᵀ grad_g`` by the chunks of ``plan``: one strided-batched GEMM of the
    zero-padded chunks gives each chunk's product ((chunks, d_in, d_out): at most twice ``out``),
    and each group sums its chunks in order, one add per chunk rank (⌈max size / T⌉ in all).
    """
    dest = xp.asarray(plan.dest)
    chunks, dtype = plan.chunk_group.size, out.dtype
    padded = []
    for a in (x, grad):
        full = xp.zeros((chunks * plan.rows, a.shape[1]), dtype)
        full[dest] = a
        padded.append(full.reshape(chunks, plan.rows, a.shape[1]))
    partial = xp.empty((chunks, x.shape[1], grad.shape[1]), dtype)
    batched_matmul(xp, padded[0].swapaxes(1, 2), padded[1], partial)
    for rank, (groups, sources) in enumerate(plan.ranks):
        if rank:
            out[xp.asarray(groups)] += partial[xp.asarray(sources)]
        else:
            out[xp.asarray(groups)] = partial[xp.asarray(sources)]
