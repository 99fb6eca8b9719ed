"""The products of the array API on Dask arrays: lazy graphs of the in-memory functions.

Reached through :func:`spchain._dask.scales_out` when an argument is a ``dask.array.Array``
(NumPy or CuPy chunks, SciPy/cupyx sparse chunks for a sparse operand). In-memory arguments
join the graph as one chunk each. Every task calls the ordinary spchain function on its
chunks, so a result equals the in-memory result bit for bit wherever the chunks split only
independent rows, columns or batch entries:

- ``logmatmul``, ``maxmatmul``: the leading (batch) axes, the rows of ``a`` and the columns
  of ``b`` map blockwise (leading axes broadcast, size-1 axes included); the inner axis is
  gathered into one chunk.
- ``log_chain_product``: batch blockwise; a chunked L axis is a tree reduction whose combine
  step is ``log_chain_product`` itself (exact, to round-off: the pairing differs).
- ``block_diag_matmul``: the leading axes of ``x``, its groups (with ``w``'s) and ``w``'s
  output columns map blockwise. ``grouped_matmul``: row chunks of ``x`` each get the part of
  ``group_sizes`` they hold (``group_sizes`` is read eagerly, a Dask one computed).
- ``spmm``: ``b``'s column chunks (``a`` shared by all tasks) and ``a``'s row chunks.
  ``sddmm``: ``a``'s row chunks with the matching rows of a CSR ``pattern`` (a CSC or COO
  pattern is put in CSR order first, as the in-memory function orders it, duplicate entries
  kept); the result has CSR chunks. A BSR ``a`` of ``spmm`` is shared by the tasks of ``b``'s
  column chunks; a BSR ``pattern`` (SciPy or cupyx) makes one task, with a BSR result.

Shapes and dtypes are checked when the graph is built, by calling the in-memory function on
zero-stride probes of the inputs with their batch axes cut to length 1, so bad input fails
at once with the in-memory function's error, not later inside a task.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from types import ModuleType
from typing import Any, TypeAlias, Union, overload

import dask.array as da
import numpy as np
from numpy.typing import DTypeLike, NDArray

from . import _backend, blockdiag, blocksparse, semiring, sparse
from ._typing import Array, Shape

Lazy: TypeAlias = Union[da.Array, Array]
"""A Dask array, or an in-memory array that joins a graph as one chunk."""


@overload
def as_dask(a: Lazy) -> da.Array: ...
@overload
def as_dask(a: None) -> None: ...
def as_dask(a: Lazy | None) -> da.Array | None:
    """``a`` as a Dask array: itself, or an in-memory array as one chunk (NumPy, CuPy or sparse)."""
    if a is None or _backend.is_dask(a):
        return a
    out: da.Array = da.from_array(a, chunks=a.shape, asarray=False)
    return out


def xp_of(a: Lazy) -> ModuleType:
    """The array module of a Dask array's chunks, or of an in-memory array (NumPy or CuPy)."""
    return _backend.backend_of(getattr(a, "_meta", a)).xp


def gathered(a: Lazy, axes: Iterable[int]) -> Lazy:
    """``a`` with ``axes`` in one chunk each (an in-memory array as it is)."""
    return a.rechunk({k: -1 for k in axes}) if _backend.is_dask(a) else a


@overload
def probe(a: Lazy, core: int) -> Array: ...
@overload
def probe(a: None, core: int) -> None: ...
def probe(a: Lazy | None, core: int) -> Array | None:
    """A zero-stride in-memory stand-in for ``a``: its dtype and last ``core`` axes, batch axes 1."""
    if a is None:
        return None
    shape = tuple(min(n, 1) for n in a.shape[:a.ndim - core]) + a.shape[a.ndim - core:]
    stand_in: Array = xp_of(a).broadcast_to(xp_of(a).zeros((), a.dtype), shape)
    return stand_in


def batch_shape(caller: str, **shapes: Shape) -> Shape:
    """The broadcast of the named batch shapes; ``ValueError`` naming them if they do not broadcast."""
    try:
        return np.broadcast_shapes(*shapes.values())
    except ValueError:
        listed = ", ".join(f"{name} {tuple(s)}" for name, s in shapes.items())
        raise ValueError(f"{caller}: batch shapes do not broadcast: {listed}") from None


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""Blockwise index letters of the batch axes (the core axes use lower case)."""


def batch_index(nb: int, a: Lazy, core: str) -> str:
    """Blockwise index letters of ``a``: its batch axes (right-aligned among ``nb``), then ``core``."""
    return LETTERS[nb - (a.ndim - len(core)):nb] + core


def call(fn: Callable[..., Any], names: Sequence[str], *blocks: Any) -> Any:
    """``fn(**dict(zip(names, blocks)))``: a task body calling an in-memory spchain function."""
    return fn(**dict(zip(names, blocks)))


def blockwise(fn: Callable[..., Any], out_index: str, args: Mapping[str, Lazy | None], cores: Mapping[str, str],
              nb: int, dtype: DTypeLike, meta: Array, **kwargs: Any) -> da.Array:
    """``da.blockwise`` of ``call(fn, ...)`` over the non-``None`` named ``args``.

    ``cores[name]`` holds the index letters of the core (non-batch) axes of ``args[name]``.
    An in-memory argument without batch extent (a shared transition matrix, say) whose axes
    the Dask arguments also have joins every task as it is (so that Dask can still fuse the
    tasks with those that make their chunks); another becomes a Dask array of one chunk,
    which Dask splits to match.
    """
    present = {name: a for name, a in args.items() if a is not None}
    index = {name: batch_index(nb, a, cores[name]) for name, a in present.items()}
    provided = set("".join(index[name] for name, a in present.items() if _backend.is_dask(a)))
    pairs: list[Lazy | str | None] = []
    for name, a in present.items():
        batch = a.shape[:a.ndim - len(cores[name])]
        shared = all(n <= 1 for n in batch) and all(k in provided or k not in out_index for k in index[name])
        pairs += [a, None] if shared and not _backend.is_dask(a) else [as_dask(a), index[name]]
    token = getattr(fn, "func", fn).__name__
    out: da.Array = da.blockwise(partial(call, fn, tuple(present)), out_index, *pairs, dtype=dtype, meta=meta,
                                 concatenate=True, token=token, **kwargs)
    return out


def part(pairs: da.Array, k: int, dtype: DTypeLike, like: Lazy, **kwargs: Any) -> da.Array:
    """The ``k``-th result of a blockwise call that returns a tuple per chunk."""
    out: da.Array = da.map_blocks(operator.itemgetter(k), pairs, dtype=dtype,
                                  meta=xp_of(like).empty((0,) * pairs.ndim, dtype), **kwargs)
    return out


def _product(fn: Callable[[Array, Array], Any], a: Lazy, b: Lazy,
             caller: str) -> tuple[Lazy, Lazy, int, Any]:
    """``fn`` over the last two axes of ``a`` and ``b``, batch axes broadcast, blockwise."""
    out = fn(probe(a, 2), probe(b, 2))
    nb = len(batch_shape(caller, a=a.shape[:-2], b=b.shape[:-2]))
    return a, b, nb, out


def logmatmul(a: Lazy, b: Lazy) -> da.Array:
    a, b, nb, out = _product(semiring.logmatmul, a, b, "spchain.logmatmul")
    return blockwise(semiring.logmatmul, LETTERS[:nb] + "ij", {"a": a, "b": b}, {"a": "ik", "b": "kj"}, nb,
                     out.dtype, xp_of(a).empty((0,) * (nb + 2), out.dtype))


def maxmatmul(a: Lazy, b: Lazy) -> tuple[da.Array, da.Array]:
    a, b, nb, (values, argmax) = _product(semiring.maxmatmul, a, b, "spchain.maxmatmul")
    pairs = blockwise(semiring.maxmatmul, LETTERS[:nb] + "ij", {"a": a, "b": b}, {"a": "ik", "b": "kj"}, nb,
                      object, np.empty((0,) * (nb + 2), object))
    return part(pairs, 0, values.dtype, a), part(pairs, 1, argmax.dtype, a)


def _keep_product(m: Array, axis: Any, keepdims: bool) -> Array:
    """A chunk's (or a level's) product, keeping the reduced axis as length 1."""
    return semiring.log_chain_product(m)[..., None, :, :]


def _final_product(m: Array, axis: Any, keepdims: bool) -> Array:
    return semiring.log_chain_product(m)


def tree_product(m: da.Array, split_every: int | None = None) -> da.Array:
    """``log_chain_product`` of a Dask (..., L, c, c) array, L in any number of chunks: each
    chunk reduces to its product, and the products combine pairwise-in-order by the same
    function, a tree reduction over the chunks of L."""
    m = m.rechunk({-1: -1, -2: -1})
    meta = xp_of(m).empty((0,) * (m.ndim - 1), m.dtype)
    out: da.Array = da.reduction(m, _keep_product, _final_product, combine=_keep_product, axis=m.ndim - 3,
                                 keepdims=False, dtype=m.dtype, split_every=split_every, concatenate=True, meta=meta)
    return out


def log_chain_product(m: Lazy) -> da.Array:
    m = as_dask(m)
    out = semiring.log_chain_product(probe(m, 3))
    return tree_product(m.astype(out.dtype, copy=False))


def block_diag_matmul(x: Lazy, w: Lazy) -> da.Array:
    x, w = as_dask(x), as_dask(w)
    out = blockdiag.block_diag_matmul(probe(x, 2), probe(w, 3))
    nb = x.ndim - 2
    return blockwise(blockdiag.block_diag_matmul, LETTERS[:nb] + "go", {"x": x, "w": w}, {"x": "gk", "w": "gko"},
                     nb, out.dtype, xp_of(x).empty((0,) * x.ndim, out.dtype))


def _grouped_block(x: Array, w: Array, positions: NDArray[Any], sizes: NDArray[np.int64]) -> Array:
    """``grouped_matmul`` of the rows ``positions`` of ``x``: each group's share of them."""
    start, stop = (int(positions[0]), int(positions[-1]) + 1) if positions.size else (0, 0)
    ends = np.cumsum(sizes)
    local = np.clip(np.minimum(ends, stop) - np.maximum(ends - sizes, start), 0, None)
    return blockdiag.grouped_matmul(x, w, local)


def grouped_matmul(x: Lazy, w: Lazy, group_sizes: Sequence[int] | Lazy) -> da.Array:
    caller = "spchain.grouped_matmul"
    x, w = as_dask(x), as_dask(w)
    if _backend.is_dask(group_sizes):
        group_sizes = group_sizes.compute()
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{caller}: x (N, d_in) and w (G, d_in, d_out) do not match: "
                         f"x has shape {x.shape}, w has shape {w.shape}")
    out = blockdiag.grouped_matmul(probe(x, 2)[:0], probe(w, 3), [0] * w.shape[0])
    sizes = blockdiag._check_group_sizes(caller, group_sizes, w.shape[0], x.shape[0])
    positions = da.arange(x.shape[0], chunks=x.chunks[0])
    result: da.Array = da.blockwise(_grouped_block, "ro", x, "rk", w, "gko", positions, "r", sizes, None,
                                    dtype=out.dtype, meta=xp_of(x).empty((0, 0), out.dtype), concatenate=True)
    return result


def spmm(a: Any, b: Lazy) -> da.Array:
    caller = "spchain.spmm"
    if blocksparse.is_bsr(a):
        return _bsr_spmm(a, as_dask(b))
    a, b = as_dask(a), as_dask(b)
    if a.ndim != 2 or b.ndim not in (1, 2) or a.shape[1] != b.shape[0]:
        raise ValueError(f"{caller}: shapes {a.shape} and {b.shape} do not match")
    out = sparse.spmm(a._meta, xp_of(b).empty((0,) * b.ndim, b.dtype))
    meta = xp_of(b).empty((0,) * b.ndim, out.dtype)
    result: da.Array
    if b.ndim == 1:
        result = da.blockwise(sparse.spmm, "i", a, "ik", b, "k", dtype=out.dtype, meta=meta, concatenate=True)
    else:
        result = da.blockwise(sparse.spmm, "ij", a, "ik", b, "kj", dtype=out.dtype, meta=meta, concatenate=True)
    return result


def _bsr_spmm(a: Any, b: da.Array) -> da.Array:
    """:func:`spmm` of an in-memory BSR ``a`` (SciPy/cupyx or a tuple), shared by the tasks of
    ``b``'s column chunks (its row chunks gathered)."""
    shape = blocksparse.bsr_parts(a, "spchain.spmm")[3]
    if b.ndim not in (1, 2) or shape[1] != b.shape[0]:
        raise ValueError(f"spchain.spmm: shapes {tuple(shape)} and {b.shape} do not match")
    out = sparse.spmm(a, xp_of(b).zeros((shape[1],) + (0,) * (b.ndim - 1), b.dtype))
    index = "ij"[:b.ndim]
    result: da.Array = da.blockwise(partial(sparse.spmm, a), index, b, "kj"[:b.ndim], new_axes={"i": shape[0]},
                                    concatenate=True, dtype=out.dtype, meta=out[:0])
    return result


def _csr_rows(csr: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a CSR matrix, duplicates and explicit zeros kept."""
    begin, end = int(csr.indptr[start]), int(csr.indptr[stop])
    indptr = csr.indptr[start:stop + 1] - begin
    return type(csr)((csr.data[begin:end], csr.indices[begin:end], indptr), shape=(stop - start, csr.shape[1]))


def _sddmm_block(pattern: Any, a: Array, b: Array, block_info: Any = None) -> Any:
    start, stop = block_info[1]["array-location"][0]
    return sparse.sddmm(_csr_rows(pattern, start, stop), a, b)


def sddmm(pattern: Any, a: Lazy, b: Lazy) -> da.Array:
    caller = "spchain.sddmm"
    pattern = pattern.compute() if _backend.is_dask(pattern) else pattern
    if isinstance(pattern, tuple):
        raise TypeError(f"{caller}: a BSR pattern given as a tuple has a tuple result, which a Dask array cannot "
                        "hold: pass a SciPy or cupyx bsr_array")
    a, b = as_dask(a), as_dask(b)
    m, n = pattern.shape
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != m or b.shape[0] != n or a.shape[1] != b.shape[1]:
        raise ValueError(f"{caller}: pattern {pattern.shape}, a {a.shape} and b {b.shape} do not match")
    xp = xp_of(a)
    if blocksparse.is_bsr(pattern):  # one task: a block spans rows, and the result is a BSR as in memory
        meta = sparse.sddmm(pattern, xp.zeros((m, 0), a.dtype), xp.zeros((n, 0), b.dtype))
        single: da.Array = da.blockwise(partial(sparse.sddmm, pattern), "ij", a.rechunk({0: -1}), "ik",
                                        b.rechunk({0: -1}), "jk", concatenate=True, dtype=meta.dtype, meta=meta)
        return single
    if pattern.format != "csr":  # its entries in the CSR order the in-memory sddmm gives, duplicates kept
        pattern = sparse.sddmm(pattern, xp.empty((m, 0), a.dtype), xp.empty((n, 0), b.dtype))
    meta = sparse.sddmm(_csr_rows(pattern, 0, 0), xp.empty((0, a.shape[1]), a.dtype), probe(b, 2))
    a = a.rechunk({1: -1})
    result: da.Array = da.map_blocks(_sddmm_block, pattern, a, b.rechunk(-1), dtype=meta.dtype, meta=meta,
                                     chunks=(a.chunks[0], (n,)))
    return result
