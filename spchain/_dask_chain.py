"""The chain functions on Dask arrays: batch-parallel, and time-parallel for long chains.

Reached through :func:`spchain._dask.scales_out`. Every task calls the ordinary in-memory
spchain function on NumPy or CuPy chunks.

- **Batch-parallel.** Chunks of the leading (batch) axes of ``x``, ``log_trans``,
  ``log_init`` and ``lengths`` map blockwise; the inputs broadcast as in memory (a size-1
  axis joins every chunk of the others) and their chunks are aligned to one another. With one
  chunk along ``x``'s time axis, each task is the in-memory call on its rows: the same
  result, bit for bit where the task takes the sweep the whole call takes (the automatic
  choice of :func:`spchain.chain_sweep` weighs the rows sharing a transition matrix, so a
  chunk may take the other exact sweep: the same result to round-off). The state axes are
  gathered into one chunk.
- **Time-parallel** (``chain_logsumexp``, ``chain_marginals``; ``x`` chunked along its time
  axis): each time chunk reduces to its log transfer matrix, the log-space product of
  ``T_t + x_t`` over its positions (:func:`spchain.log_chain_product`; the first chunk's
  matrix carries ``log_init + x_0`` in its row 0, and positions past a chain's length are
  identities), and the chunks' matrices combine by a tree reduction whose combine step is
  ``log_chain_product`` again: exact, to round-off. A task holds its chunk's
  (rows, positions, c, c) matrices, so this suits long chains with few states. The marginals
  take a second pass: sequential prefix and suffix products of the transfer matrices give each
  chunk's incoming forward message and outgoing backward message (in float64, ``+inf`` terms
  counted as ``_chain_limits.LIMIT`` each, so that the messages keep the finite offsets of
  paths through ``+inf`` terms: the limit marginals, whatever the chunking), and each chunk runs the
  in-memory ``chain_marginals`` on itself with a virtual first position (the incoming
  message, as ``log_init``) and a virtual last one (the backward message, as a last
  transition into state 0).
- A sparse ``log_trans`` (SciPy or cupyx) joins every task as it is, and the time axis is
  gathered into one chunk: the chains run batch-parallel only.
- ``viterbi`` gathers the time axis into one chunk first (``x.rechunk({-2: -1})``) and is
  batch-parallel only: decoding needs the whole chain of a row in one task.
"""

from __future__ import annotations

from functools import partial
from collections.abc import Callable
from typing import Any

import dask.array as da
import numpy as np
from numpy.typing import DTypeLike

from . import _backend, _chain_limits, _checks, _sparse_chain, chain, semiring
from ._dask_array import LETTERS as _LETTERS
from ._dask_array import Lazy
from ._typing import Array, Shape
from ._dask_array import as_dask, batch_shape, blockwise, gathered, part, probe, tree_product, xp_of


def _inputs(fn: Callable[..., Any], x: Lazy, log_trans: Lazy, log_init: Lazy | None, lengths: Any,
            path: Lazy | None = None, **options: Any) -> tuple[da.Array, Lazy, Lazy | None, Any, Shape, bool, Any]:
    """Validated Dask inputs, their broadcast batch shape, whether ``log_trans`` is per step,
    and the in-memory function ``fn``'s result on probes (dtype, errors). ``path`` is
    :func:`spchain.chain_path_score`'s; ``options`` are ``fn``'s other keyword arguments."""
    caller = f"spchain.{fn.__name__}"
    if lengths is not None and not hasattr(lengths, "dtype"):
        lengths = np.asarray(lengths)
    x = as_dask(x)
    per_step = log_trans.ndim == x.ndim + 1
    t_core = 3 if per_step else 2
    probes = (probe(x, 2), probe(log_trans, t_core), probe(log_init, 1),
              None if lengths is None else xp_of(lengths).ones((1,) * lengths.ndim, lengths.dtype))
    with_path = {} if path is None else {"path": probe(path, 1)}
    result = fn(*probes[:3], lengths=probes[3], **with_path, **options)
    shape = batch_shape(caller, x=x.shape[:-2], log_trans=log_trans.shape[:-t_core],
                        log_init=() if log_init is None else log_init.shape[:-1],
                        lengths=() if lengths is None else lengths.shape,
                        path=() if path is None else path.shape[:-1])
    dtype = _checks.float_dtype(caller, x=x, log_trans=log_trans, log_init=log_init)
    x = x.astype(dtype, copy=False).rechunk({-1: -1})
    log_trans = gathered(log_trans.astype(dtype, copy=False), range(-t_core, 0))
    log_init = None if log_init is None else gathered(log_init.astype(dtype, copy=False), [-1])
    return x, log_trans, log_init, lengths, shape, per_step, result


def _args(x: Lazy, log_trans: Lazy, log_init: Lazy | None, lengths: Lazy | None,
          per_step: bool) -> tuple[dict[str, Lazy | None], dict[str, str]]:
    args = {"x": x, "log_trans": log_trans, "log_init": log_init, "lengths": lengths}
    cores = {"x": "vc", "log_trans": "sij" if per_step else "ij", "log_init": "c", "lengths": ""}
    return args, cores


def _sum_broadcast(out: da.Array, x_shape: Shape, nb: int) -> da.Array:
    """Sum per-block marginals of the full batch over the axes along which ``x`` broadcast.

    ``out`` has every batch axis; where ``x`` broadcast (an axis it lacks, or has as 1 against
    a longer one), each block's in-memory result is already summed over the block, and has
    length 1 there, so what is left is the sum over the blocks.
    """
    lead = nb - (len(x_shape) - 2)
    ones = tuple(lead + k for k, n in enumerate(x_shape[:-2]) if n == 1 and out.shape[lead + k] != 1)
    if ones:
        out = out.sum(axis=ones, keepdims=True)
    return out.sum(axis=tuple(range(lead))) if lead else out


def _marginal_block(nb: int, **blocks: Any) -> Array:
    """``chain_marginals`` of one block, with every batch axis (length 1 where ``x`` broadcast)."""
    out = chain.chain_marginals(**blocks)
    return out.reshape((1,) * (nb + 2 - out.ndim) + out.shape)


def _broadcast_chunks(x: Lazy, nb: int) -> dict[str, int]:
    """``adjust_chunks`` for the batch axes along which ``x`` broadcast (one entry per block)."""
    lead = nb - (x.ndim - 2)
    return {_LETTERS[k]: 1 for k in range(nb) if k < lead or x.shape[k - lead] == 1}


def chain_logsumexp(x: Lazy, log_trans: Lazy, log_init: Lazy | None = None, *,
                    lengths: Lazy | None = None) -> da.Array:
    x, log_trans, log_init, lengths, shape, per_step, result = _inputs(
        chain.chain_logsumexp, x, log_trans, log_init, lengths)
    nb = len(shape)
    if _sparse_chain.is_sparse(log_trans):  # batch-parallel only: a transfer matrix would be dense (c, c)
        x = x.rechunk({-2: -1})
    meta = xp_of(x).empty((0,) * nb, result.dtype)
    if x.numblocks[-2] > 1:
        product = tree_product(_transfer_matrices(x, log_trans, log_init, lengths, nb, per_step, result.dtype,
                                                     "spchain.chain_logsumexp"))
        total: da.Array = da.map_blocks(_first_row_lse, product, drop_axis=(nb, nb + 1), dtype=result.dtype,
                                        meta=meta)
        return total
    args, cores = _args(x, log_trans, log_init, lengths, per_step)
    return blockwise(chain.chain_logsumexp, _LETTERS[:nb], args, cores, nb, result.dtype, meta)


def chain_marginals(x: Lazy, log_trans: Lazy, log_init: Lazy | None = None, *,
                    lengths: Lazy | None = None) -> da.Array:
    x, log_trans, log_init, lengths, shape, per_step, result = _inputs(
        chain.chain_marginals, x, log_trans, log_init, lengths)
    nb = len(shape)
    if _sparse_chain.is_sparse(log_trans):  # batch-parallel only: a transfer matrix would be dense (c, c)
        x = x.rechunk({-2: -1})
    x_shape = x.shape
    meta = xp_of(x).empty((0,) * (nb + 2), result.dtype)
    if x.numblocks[-2] > 1:
        out = _marginals_in_time_chunks(x, log_trans, log_init, lengths, nb, per_step, result.dtype, meta)
    else:
        args, cores = _args(x, log_trans, log_init, lengths, per_step)
        out = blockwise(partial(_marginal_block, nb), _LETTERS[:nb] + "vc", args, cores, nb, result.dtype, meta,
                        adjust_chunks=_broadcast_chunks(x, nb))
    return _sum_broadcast(out, x_shape, nb)


def viterbi(x: Lazy, log_trans: Lazy, log_init: Lazy | None = None, *,
            lengths: Lazy | None = None) -> tuple[da.Array, da.Array]:
    x, log_trans, log_init, lengths, shape, per_step, (score, path) = _inputs(
        chain.viterbi, x, log_trans, log_init, lengths)
    nb = len(shape)
    args, cores = _args(x.rechunk({-2: -1}), log_trans, log_init, lengths, per_step)
    pairs = blockwise(chain.viterbi, _LETTERS[:nb], args, cores, nb, object, np.empty((0,) * nb, object))
    return part(pairs, 0, score.dtype, x), part(pairs, 1, path.dtype, x, new_axis=nb,
                                                  chunks=pairs.chunks + ((x.shape[-2],),))


# ---- time-parallel ---------------------------------------------------------------------------

def _padded_trans(log_trans: Lazy, x: da.Array, per_step: bool) -> Lazy:
    """Per-step ``log_trans`` with a first matrix prepended, so that its step axis lines up
    with ``x``'s positions (matrix t leads into position t), chunked as ``x``'s time axis."""
    if not per_step:
        return log_trans
    log_trans = as_dask(log_trans)
    first = da.zeros_like(log_trans[..., :1, :, :])
    return da.concatenate([first, log_trans], axis=-3).rechunk({-3: x.chunks[-2]})


def _time_inputs(x: da.Array, log_trans: Lazy, log_init: Lazy | None, lengths: Lazy | None,
                 per_step: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Named Dask inputs of a time-chunk task and the index letters of their core axes."""
    args = {"positions": da.arange(x.shape[-2], chunks=x.chunks[-2]), "x": x,
            "log_trans": _padded_trans(log_trans, x, per_step), "log_init": log_init, "lengths": lengths}
    cores = {"positions": "t", "x": "tj", "log_trans": "tij" if per_step else "ij", "log_init": "j", "lengths": ""}
    return args, cores


def _log_times(a: Array, b: Array) -> Array:
    """``a + b`` in log space: a term ``+inf + -inf`` is ``-inf`` (a structural zero wins); NaN stays."""
    xp = _backend.backend_of(a).xp
    with np.errstate(invalid="ignore"):
        out = a + b
        return xp.where(xp.isnan(out) & ~xp.isnan(a) & ~xp.isnan(b), -np.inf, out)


def _step_matrices(positions: Array, x: Array, log_trans: Array, log_init: Array | None, lengths: Array | None,
                   per_step: bool) -> Array:
    """``T_t + x_t`` (..., L, c, c) for one time chunk: row 0 of position 0's matrix is
    ``log_init + x_0`` (its other rows ``-inf``), and positions past a chain's length are identities."""
    xp = _backend.backend_of(x).xp
    c = x.shape[-1]
    trans = log_trans if per_step else log_trans[..., None, :, :]
    mats = xp.empty(_block_batch(x, trans[..., 0, :, :], log_init, lengths) + (x.shape[-2], c, c), x.dtype)
    mats[...] = _log_times(trans, x[..., :, None, :])
    if int(positions[0]) == 0:
        mats[..., 0, :, :] = -np.inf
        mats[..., 0, 0, :] = x[..., 0, :] if log_init is None else _log_times(log_init, x[..., 0, :])
    if lengths is not None:
        identity = xp.where(xp.eye(c, dtype=bool), 0.0, -np.inf).astype(x.dtype)
        inside = xp.asarray(positions) < lengths[..., None]
        mats = xp.where(inside[..., None, None], mats, identity)
    return mats


def _block_batch(x: Array, trans: Array, log_init: Array | None = None, lengths: Array | None = None,
                 *vectors: Array) -> Shape:
    """The broadcast batch shape of one task's blocks (``trans`` a (..., c, c) matrix)."""
    shapes = [x.shape[:-2], trans.shape[:-2]] + [a.shape[:-1] for a in (log_init, *vectors) if a is not None]
    return np.broadcast_shapes(*shapes, () if lengths is None else lengths.shape)


def _checked_lengths(lengths: Array | None, v: int, caller: str) -> None:
    """The in-memory functions' ``ValueError`` for ``lengths`` outside 1..v (a task of a time
    chunk sees only its positions, so it is told ``v``)."""
    if lengths is not None and lengths.size:
        low, high = int(lengths.min()), int(lengths.max())
        if low < 1 or high > v:
            raise ValueError(f"{caller}: lengths must lie in 1..v = 1..{v}, got values from {low} to {high}")


def _limit(a: Array | None) -> Array | None:
    """``a`` in float64 with ``+inf`` as ``_chain_limits.LIMIT``: a path's log-weight then
    counts its ``+inf`` terms, ``LIMIT`` each, beside its finite terms, and the weights of the
    paths through fewer ``+inf`` terms are 0 beside the others, as in the limit."""
    if a is None:
        return None
    xp = _backend.backend_of(a).xp
    return xp.where(xp.isposinf(a), _chain_limits.LIMIT, a).astype(np.float64)


def _transfer_block(positions: Array, x: Array, log_trans: Array, log_init: Array | None = None,
                    lengths: Array | None = None, *, per_step: bool, v: int, caller: str, limit: bool) -> Array:
    _checked_lengths(lengths, v, caller)
    xp = _backend.backend_of(x).xp
    if limit and any(a is not None and bool(xp.isposinf(a).any()) for a in (x, log_trans, log_init)):
        x, log_trans, log_init = _limit(x), _limit(log_trans), _limit(log_init)
    mats = _step_matrices(positions, x, log_trans, log_init, lengths, per_step)
    product = semiring.log_chain_product(mats)[..., None, :, :]
    return product.astype(np.float64) if limit else product


def _transfer_matrices(x: da.Array, log_trans: Lazy, log_init: Lazy | None, lengths: Lazy | None, nb: int,
                       per_step: bool, dtype: DTypeLike, caller: str, limit: bool = False) -> da.Array:
    """(batch..., K, c, c): the log transfer matrix of each of the K time chunks of ``x``
    (its tasks raise ``ValueError`` for ``lengths`` outside 1..v, naming ``caller``). With
    ``limit``, float64 matrices whose ``+inf`` terms count ``LIMIT`` each (:func:`_limit`), so
    that the finite offsets of the paths through ``+inf`` terms survive the product."""
    args, cores = _time_inputs(x, log_trans, log_init, lengths, per_step)
    block = partial(_transfer_block, per_step=per_step, v=x.shape[-2], caller=caller, limit=limit)
    dtype = np.float64 if limit else dtype
    return blockwise(block, _LETTERS[:nb] + "tij", args, cores, nb, dtype,
                     xp_of(x).empty((0,) * (nb + 3), dtype), adjust_chunks={"t": 1})


def _first_row_lse(product: Array) -> Array:
    """``logsumexp`` of row 0 of a chain's product: the log-partition."""
    return chain.chain_logsumexp(product[..., :1, :], product)


def _chunk_marginals(positions: Array, x: Array, log_trans: Array, alpha: Array, beta: Array,
                     log_init: Array | None = None, lengths: Array | None = None, *, per_step: bool) -> Array:
    """Marginals of one time chunk, given the forward message ``alpha`` (..., 1, c) that
    enters it (unused in the first chunk) and the backward message ``beta`` (..., c, 1) that
    leaves it: the in-memory ``chain_marginals`` of the chunk with a virtual position before
    it (``log_init = alpha``, emission 0; not in the first chunk) and one after it (reached
    from state i with weight ``beta[i]``, into state 0 only). The messages are float64 with
    ``+inf`` terms counted as ``LIMIT`` (:func:`_limit`); a chunk holding ``+inf`` runs in
    float64 as well, for its ``+inf`` terms can lift the entries of fewer ``+inf`` terms."""
    xp = _backend.backend_of(x).xp
    dtype = x.dtype
    if any(a is not None and bool(xp.isposinf(a).any()) for a in (x, log_trans, log_init)):
        x, log_trans, log_init = _limit(x), _limit(log_trans), _limit(log_init)
    alpha, beta = alpha.astype(x.dtype), beta.astype(x.dtype)
    start, size, c = int(positions[0]), x.shape[-2], x.shape[-1]
    first = start == 0
    lead = 0 if first else 1
    batch = _block_batch(x, log_trans if not per_step else log_trans[..., 0, :, :], log_init, lengths,
                         alpha[..., 0, :], beta[..., 0])
    ext = xp.zeros(batch + (lead + size + 1, c), x.dtype)
    ext[..., lead:lead + size, :] = x
    trans = log_trans[..., 1:, :, :] if first and per_step else log_trans
    steps = size - 1 if first else size
    ext_trans = xp.empty(batch + (steps + 1, c, c), x.dtype)
    ext_trans[..., :steps, :, :] = trans if per_step else trans[..., None, :, :]
    ext_trans[..., steps, :, :] = -np.inf
    ext_trans[..., steps, :, 0] = beta[..., 0]
    init = (log_init if first else alpha[..., 0, :])
    covered = xp.asarray(size + 1) if lengths is None else lengths - start  # positions of the chunk in the chain
    ext_lengths = xp.where(covered > size, lead + size + 1, xp.clip(lead + covered, 1, None))
    out = chain.chain_marginals(ext, ext_trans, init, lengths=xp.broadcast_to(ext_lengths, batch))
    out = out[..., lead:lead + size, :].astype(dtype)
    if lengths is None:
        return out
    # a chunk past a chain's end: 0, or NaN for a chain that read a NaN before it (its message
    # holds one), as the in-memory function makes that chain's marginals NaN at every position
    past = xp.where(xp.isnan(alpha).any(axis=-1)[..., None], np.nan, 0).astype(dtype)
    return xp.where((covered > 0)[..., None, None], out, past)


def _shifted(message: da.Array, axis: int) -> da.Array:
    """A message less its finite maximum over ``axis``: the marginals do not change, and the
    entries that matter (those of the most ``+inf`` terms, near 0) keep their precision in
    the input's dtype, the others falling ``LIMIT`` or more below them."""
    top = message.max(axis=axis, keepdims=True)
    out: da.Array = message - da.where(da.isfinite(top), top, 0)
    return out


def _marginals_in_time_chunks(x: da.Array, log_trans: Lazy, log_init: Lazy | None, lengths: Lazy | None, nb: int,
                              per_step: bool, dtype: DTypeLike, meta: Array) -> da.Array:
    """Marginals of time-chunked chains: a second pass over the chunks with boundary messages."""
    if not x.size:  # no chain, or no state: nothing to pass (the messages' maxima would have no identity)
        empty: da.Array = da.zeros_like(x, dtype=dtype)
        return empty
    mats = _transfer_matrices(x, log_trans, log_init, lengths, nb, per_step, dtype, "spchain.chain_marginals",
                              limit=True)
    chunks = x.numblocks[-2]
    mat = [mats[..., k, :, :] for k in range(chunks)]
    alpha = [mat[0][..., :1, :]]
    for k in range(1, chunks - 1):
        alpha.append(semiring.logmatmul(alpha[-1], mat[k]))
    beta = [da.zeros_like(mat[-1][..., :, :1])]
    for k in range(chunks - 1, 0, -1):
        beta.insert(0, semiring.logmatmul(mat[k], beta[0]))
    alpha, beta = [_shifted(a, -1) for a in alpha], [_shifted(b, -2) for b in beta]
    args, cores = _time_inputs(x, log_trans, log_init, lengths, per_step)
    cores.update(alpha="aj", beta="ib")
    bounds = np.cumsum((0,) + x.chunks[-2])
    parts = []
    for k in range(chunks):
        time = slice(int(bounds[k]), int(bounds[k + 1]))
        chunk_args = dict(args, alpha=alpha[max(k - 1, 0)], beta=beta[k], positions=args["positions"][time],
                          x=x[..., time, :])
        if per_step:
            chunk_args["log_trans"] = args["log_trans"][..., time, :, :]
        parts.append(blockwise(partial(_chunk_marginals, per_step=per_step), _LETTERS[:nb] + "tj", chunk_args,
                               cores, nb, dtype, meta))
    out: da.Array = da.concatenate(parts, axis=nb)
    return out
