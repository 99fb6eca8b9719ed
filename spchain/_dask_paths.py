"""The path functions on Dask arrays: batch-parallel.

Reached through :func:`spchain._dask.scales_out`, as the chain functions of
``_dask_chain`` are: chunks of the leading (batch) axes of ``x``, ``log_trans``,
``log_init``, ``lengths`` (and ``path``) map blockwise, aligned and broadcast as in memory,
and every task calls the in-memory function on its chunks. A path needs its whole chain in
one task, so the time axis is gathered into one chunk first (``x.rechunk({-2: -1})``).

- ``chain_path_score`` and ``chain_kbest`` equal the in-memory results bit for bit;
  ``chain_entropy`` too where a task takes the chain sweep of the whole call (else to
  round-off, as in ``_dask_chain``).
- ``chain_sample`` draws each block's paths with its own generator, seeded from ``seed`` and
  the flat index of the block's first chain (``numpy.random.SeedSequence``): the draws follow
  the same posterior, are reproducible for a given ``seed`` and chunking (a task that a worker
  failure makes Dask rerun draws the same paths), and differ from the in-memory draws. With
  ``seed=None`` a fresh seed is chosen when the graph is built.
"""

from __future__ import annotations

from functools import partial
from typing import cast

import dask.array as da
import numpy as np

from . import paths
from ._dask_array import LETTERS, Lazy, as_dask, blockwise, part
from ._dask_chain import _args, _inputs
from ._typing import Array


def _gathered_args(x: da.Array, log_trans: Lazy, log_init: Lazy | None, lengths: Lazy | None, per_step: bool,
                   **extra: Lazy) -> tuple[dict[str, Lazy | None], dict[str, str]]:
    """The blockwise arguments of a path function, ``x``'s time axis in one chunk."""
    args, cores = _args(x.rechunk({-2: -1}), log_trans, log_init, lengths, per_step)
    for name, a in extra.items():
        args[name], cores[name] = (as_dask(a).rechunk({-1: -1}), "v") if name == "path" else (a, "")
    return args, cores


def chain_entropy(x: Lazy, log_trans: Lazy, log_init: Lazy | None = None, *,
                  lengths: Lazy | None = None) -> da.Array:
    x, log_trans, log_init, lengths, shape, per_step, result = _inputs(
        paths.chain_entropy, x, log_trans, log_init, lengths)
    args, cores = _gathered_args(x, log_trans, log_init, lengths, per_step)
    nb = len(shape)
    return blockwise(paths.chain_entropy, LETTERS[:nb], args, cores, nb, result.dtype, _empty_like(result, nb))


def chain_path_score(x: Lazy, log_trans: Lazy, log_init: Lazy | None, path: Lazy, *,
                     lengths: Lazy | None = None) -> da.Array:
    x, log_trans, log_init, lengths, shape, per_step, result = _inputs(
        paths.chain_path_score, x, log_trans, log_init, lengths, path)
    nb = len(shape)
    args, cores = _gathered_args(x, log_trans, log_init, lengths, per_step, path=path)
    return blockwise(_path_score_block, LETTERS[:nb], args, cores, nb, result.dtype, _empty_like(result, nb))


def _path_score_block(x: Array, log_trans: Array, path: Array, log_init: Array | None = None,
                      lengths: Array | None = None) -> Array:
    return paths.chain_path_score(x, log_trans, log_init, path, lengths=lengths)


def chain_kbest(x: Lazy, log_trans: Lazy, log_init: Lazy | None = None, *, k: int,
                lengths: Lazy | None = None) -> tuple[da.Array, da.Array]:
    x, log_trans, log_init, lengths, shape, per_step, (scores, best) = _inputs(
        paths.chain_kbest, x, log_trans, log_init, lengths, k=k)
    nb = len(shape)
    args, cores = _gathered_args(x, log_trans, log_init, lengths, per_step)
    pairs = blockwise(partial(paths.chain_kbest, k=k), LETTERS[:nb], args, cores, nb, object,
                      np.empty((0,) * nb, object))
    k_axis = ((k,),)
    return (part(pairs, 0, scores.dtype, x, new_axis=0, chunks=k_axis + pairs.chunks),
            part(pairs, 1, best.dtype, x, new_axis=[0, nb + 1], chunks=k_axis + pairs.chunks + ((x.shape[-2],),)))


def _sample_block(num_samples: int, root: int, first: Array, **blocks: Array) -> Array:
    """``chain_sample`` of one block, its generator seeded by ``root`` and its first chain's index."""
    seed = int(np.random.SeedSequence([root, int(first.flat[0]) if first.size else 0]).generate_state(1)[0])
    return paths.chain_sample(**blocks, num_samples=num_samples, seed=seed)


def chain_sample(x: Lazy, log_trans: Lazy, log_init: Lazy | None = None, *, lengths: Lazy | None = None,
                 num_samples: int = 1, seed: int | None = None) -> da.Array:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise TypeError(f"spchain.chain_sample: on Dask arrays seed must be a non-negative int or None, got {seed!r}")
    x, log_trans, log_init, lengths, shape, per_step, result = _inputs(
        paths.chain_sample, x, log_trans, log_init, lengths, num_samples=num_samples, seed=seed)
    nb = len(shape)
    # a fresh SeedSequence's entropy is an int (128 bits)
    root = cast(int, np.random.SeedSequence().entropy) if seed is None else int(seed)
    first = da.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    args, cores = _gathered_args(x, log_trans, log_init, lengths, per_step, first=first)
    return blockwise(partial(_sample_block, result.shape[0], root), "n" + LETTERS[:nb] + "v", args, cores, nb,
                     result.dtype, _empty_like(result, nb + 2), new_axes={"n": result.shape[0]})


def _empty_like(result: Array, ndim: int) -> Array:
    """An empty array of ``result``'s array type and dtype with ``ndim`` axes (a Dask meta)."""
    return result.reshape(-1)[:0].reshape((0,) * ndim)
