"""Entry selection of the sparse layer: the largest scores, random positions, positions to
CSR, and the drop-and-grow step of dynamic sparsity (SET, RigL)."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend
from ._backend import Backend
from ._csr import Csr, fits_int32, row_of_entries
from ._typing import Array, Seed, Shape

_SCORE_BLOCK = 1 << 20
"""Dense gradient entries scored at a time when regrowing by gradient (bounds its memory)."""
_DIGIT_BITS = 16
"""Bits of the scores that each pass of :func:`largest`'s radix selection counts."""


def largest(backend: Backend, scores: Array, count: int) -> Array:
    """Sorted positions of the ``count`` largest ``scores`` (1-D floats); NaN counts as the
    largest value, and ties go to the lower position. O(len(scores)) however many scores tie:
    a radix selection of the threshold (NumPy's partition slows down 20x on the zeros of an
    already pruned weight).

    >>> import numpy as np, spchain._backend as B
    >>> largest(B.NUMPY, np.array([0.0, 3.0, np.nan, 0.0, 3.0]), 3)
    array([1, 2, 4])
    """
    xp = backend.xp
    size = scores.shape[0]
    if count >= size:
        return xp.arange(size, dtype=np.int64)
    if count == 0:
        return xp.empty(0, np.int64)
    keys = _ordered_bits(xp, scores)
    threshold = _kth_largest(xp, keys, count)
    chosen = keys > threshold
    tied = xp.flatnonzero(keys == threshold)[: count - int(xp.count_nonzero(chosen))]
    chosen[tied] = True
    return xp.flatnonzero(chosen)  # in order: no sort


def _ordered_bits(xp: Any, scores: Array) -> Array:
    """Unsigned integers in the order of the floats ``scores``: every NaN one key above +inf,
    -0.0 as 0.0."""
    key = scores + 0  # a copy, -0.0 made 0.0; the steps below work in place on it
    nan = xp.isnan(key)
    if nan.any():
        key[nan] = xp.nan  # the positive quiet NaN, whose bits lie above +inf's
    width = 8 * key.dtype.itemsize
    bits = key.view(f"u{key.dtype.itemsize}")
    flip = (key.view(f"i{key.dtype.itemsize}") >> (width - 1)).view(bits.dtype)  # all ones for negatives
    flip |= bits.dtype.type(1 << (width - 1))
    bits ^= flip  # negative floats: every bit flipped; the others: the sign bit set
    return bits


def _kth_largest(xp: Any, keys: Array, k: int) -> Any:
    """The ``k``-th largest of the unsigned ``keys`` (1 <= k <= len(keys)), 16 bits a pass:
    each pass counts the candidates' digits and keeps those of the digit that holds it."""
    prefix, candidates = 0, keys
    for shift in range(8 * keys.dtype.itemsize - _DIGIT_BITS, -1, -_DIGIT_BITS):
        digits = (candidates >> shift).astype(np.uint16)  # the cast keeps the low 16 bits
        from_top = xp.cumsum(xp.bincount(digits, minlength=1 << _DIGIT_BITS)[::-1])
        j = int((from_top < k).sum())  # buckets from the top before the one holding it
        k -= int(from_top[j - 1]) if j else 0
        digit = (1 << _DIGIT_BITS) - 1 - j
        candidates = candidates[digits == digit]
        prefix |= digit << shift
    return keys.dtype.type(prefix)


def random_positions(backend: Backend, total: int, count: int, taken: Array | None = None,
                     seed: Seed = None) -> Array:
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
            values, first = np.unique(draws, return_index=True)  # each value once, where first drawn
            at = np.minimum(np.searchsorted(taken, values), taken.shape[0] - 1)  # both sorted: no np.isin sort
            chosen = draws[np.sort(first[taken[at] != values])[:count]]  # the free values' first draws, in order
    else:
        chosen = rng.choice(np.setdiff1d(np.arange(total), taken, assume_unique=True), count, replace=False)
    return backend.xp.asarray(np.sort(chosen).astype(np.int64))


def positions_to_csr(backend: Backend, positions: Array, shape: Shape) -> tuple[Array, Array]:
    """``(indptr, indices)`` of the sorted flat (row-major) ``positions`` in an ``shape`` matrix."""
    xp = backend.xp
    m, n = shape
    dtype = np.int32 if fits_int32(m, n, positions.shape[0]) else np.int64
    if positions.shape[0] == 0:
        return xp.zeros(m + 1, dtype), xp.empty(0, dtype)
    rows, cols = xp.divmod(positions, n)
    indptr = xp.searchsorted(rows, xp.arange(m + 1), side="left")
    return indptr.astype(dtype), cols.astype(dtype)


def drop_and_grow(backend: Backend, csr: Csr, values: Array, n_move: int, *, grad_y: Array | None = None,
                  x: Array | None = None, seed: Seed = None, caller: str) -> tuple[Array, Array, Array, Array]:
    """A new structure of the same size with ``n_move`` entries (or blocks) moved.

    ``values`` are a CSR weight's (nnz,) or a BSR weight's blocks (nnzb, R, C), ``csr`` its
    structure (over the block grid for blocks). Drops the ``n_move`` stored entries of smallest
    magnitude (``|value|``, a block's Frobenius norm; among equal magnitudes the later ones)
    and grows as many at positions not stored after the drop: where ``|grad_y.T @ x|``, the
    dense weight gradient of one batch, is largest (its block norms for blocks; RigL;
    ``grad_y`` (batch, out), ``x`` (batch, in); scored in row blocks, so it never holds the
    dense gradient), or uniformly at random (``seed``) if ``grad_y`` is None. A just-dropped
    position may be grown again.

    Returns ``(indptr, indices, old_slots, new_slots)``: the surviving entry in slot
    ``old_slots[t]`` sits in slot ``new_slots[t]`` of the new structure; the other new slots
    are the grown connections. ``csr`` must be canonical (sorted, no duplicates).
    """
    xp = backend.xp
    m, n = csr.shape
    block = (1, 1) if values.ndim == 1 else values.shape[1:]
    positions = row_of_entries(backend, csr).astype(np.int64) * n + csr.indices
    if positions.shape[0] > 1 and bool((positions[1:] <= positions[:-1]).any()):
        raise ValueError(f"{caller} needs a canonical structure: indices sorted within rows, no duplicates")
    old_slots = largest(backend, magnitudes(backend, values), csr.nnz - n_move)
    kept = positions[old_slots]
    if grad_y is None:
        grown = random_positions(backend, m * n, n_move, taken=kept, seed=seed)
    else:
        grown = _largest_gradients(backend, grad_y, x, block, n_move, kept)
    new_positions = xp.sort(xp.concatenate([kept, grown]))
    indptr, indices = positions_to_csr(backend, new_positions, (m, n))
    return indptr, indices, old_slots, xp.searchsorted(new_positions, kept)


def magnitudes(backend: Backend, values: Array, axes: tuple[int, int] = (1, 2)) -> Array:
    """The magnitude of each stored weight: ``|value|`` of (nnz,) values, the Frobenius norm
    (in float64) of each block of (nnzb, R, C) ones (of any other array: over its block
    ``axes``)."""
    xp = backend.xp
    if values.ndim == 1:
        return xp.abs(values)
    return xp.sqrt(xp.square(values, dtype=np.float64).sum(axis=axes))


def _largest_gradients(backend: Backend, grad_y: Array, x: Array, block: Shape, count: int, taken: Array) -> Array:
    """Sorted grid positions of the ``count`` largest ``|grad_y.T @ x|`` (block norms, for
    ``block`` other than (1, 1)) outside ``taken`` (sorted)."""
    xp = backend.xp
    r, c = block
    m, n = grad_y.shape[1] // r, x.shape[1] // c
    if block != (1, 1):
        grad_y, x = grad_y.astype(np.float64), x.astype(np.float64)
    best_scores, best_positions = xp.empty(0, grad_y.dtype), xp.empty(0, np.int64)
    rows = max(1, _SCORE_BLOCK // max(r * x.shape[1], 1))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        dense = _backend.matmul(xp, grad_y[:, r0 * r:r1 * r].T, x)
        blocks = dense.ravel() if block == (1, 1) else dense.reshape(r1 - r0, r, n, c)
        scores = magnitudes(backend, blocks, axes=(1, 3)).ravel()
        if best_scores.shape[0] < count:
            free = xp.ones(scores.shape[0], bool)
        else:  # a later position enters only above the least kept score (NaN counts as the largest)
            kept = best_scores[~xp.isnan(best_scores)]
            if not kept.shape[0]:
                break  # all NaN: nothing later comes before them
            free = (scores > kept.min()) | xp.isnan(scores)
        lo, hi = (int(i) for i in xp.searchsorted(taken, xp.asarray([r0 * n, r1 * n])))
        free[taken[lo:hi] - r0 * n] = False
        candidates = xp.flatnonzero(free)
        best_scores = xp.concatenate([best_scores, scores[candidates]])
        best_positions = xp.concatenate([best_positions, candidates + r0 * n])
        keep = largest(backend, best_scores, count)
        best_scores, best_positions = best_scores[keep], best_positions[keep]
    return best_positions
