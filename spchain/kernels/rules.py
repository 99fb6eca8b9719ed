"""The arithmetic rules that the CPU and CUDA kernels share, in one place: the scaled sums'
thresholds, the chunk sizes both targets use, and the guarded scalar log-space helpers, one
Python source compiled for both targets (``kernels.cuda.logspace`` compiles them as CUDA device
functions; the tests compile them with ``@njit`` too, so both targets run the same arithmetic).

Rules (see docs/design.rst): ``-inf`` is log-space zero and is legal everywhere, an all ``-inf``
reduction gives ``-inf`` (never NaN), NaN in gives NaN out (NaN wins over every other value,
``+inf`` included), and no finite stand-in for ``-inf`` is ever used.

Scaled sums (the CPU chain kernels, the sampling kernels of both targets, and the host code
that prepares their factors) hold ``exp(a - max)`` in float64, 0 below :data:`FLUSH` (so no
product is subnormal, which is slow). Every dropped term is then below 1e-154; where a scaled
sum is below :data:`TINY` (so dropped terms could matter: they are under ``c · FLUSH``, below
1e-20 of the sum for c up to 10⁴) or not a number, that entry is recomputed in log space.

A running log-sum-exp is held as a pair ``(m, s)``: the largest value folded in so far and
the sum of ``exp(x - m)`` over the values folded in. The empty sum is ``(-inf, 0.0)``.

The k-best kernels of both targets run one row of the batch by the same helpers
(:func:`kbest_row`, :func:`sparse_kbest_row`, built on :func:`kbest_plus`, :func:`kbest_insert`
and :func:`kbest_backtrack`), registered as jitable: a CPU or CUDA kernel calls them as they
are, and only the loop over rows (a team's share, a grid stride) is each kernel's own.

Every constant in the helpers takes the float type of the value it meets (:func:`like`), so
float32 inputs are computed in float32 (float32 ``exp``/``log``, no float64 on a GPU) and
float64 inputs exactly as before.

This module imports Numba (for :func:`like`): host code reads it inside the functions that
launch a kernel, never at import.
"""

import math

from numba.extending import overload, register_jitable
from numba.np.numpy_support import as_dtype

FLUSH = 1e-154
"""Scaled factors below this are set to 0."""

TINY = 1e-130
"""A scaled sum below this is recomputed in log space."""

LIMIT = 299.0
"""``-log(TINY)``: the transition gradient's scale factors stay below ``exp(LIMIT)``."""

WALK_CHUNK = 16
"""States whose weights a draw sums at a time before walking through them one by one (both
targets: the same sums, so the same draws)."""


def like(x, value):
    """``value`` as the float type of ``x`` (a typed constant inside compiled code)."""
    return type(x)(value)


@overload(like)
def _like(x, value):
    cast = as_dtype(x).type
    return lambda x, value: cast(value)


def log_add_exp(a, b):
    """``log(exp(a) + exp(b))``; ``-inf`` if both are ``-inf``, NaN if either is NaN."""
    if a == like(a, -math.inf):
        return b
    if b == like(b, -math.inf):
        return a
    if a == b:  # also +inf + +inf, which would otherwise give inf - inf = NaN
        return a + math.log(like(a, 2.0))
    m = max(a, b)
    return m + math.log1p(math.exp(-abs(a - b)))


def lse_push(m, s, x):
    """Fold ``x`` into the running log-sum-exp ``(m, s)``; returns the new pair."""
    if x == like(x, -math.inf):
        return m, s
    if x > m:
        return x, s * math.exp(m - x) + like(s, 1.0)
    if x == m:  # also +inf twice, where exp(inf - inf) would be NaN
        return m, s + like(s, 1.0)
    if x < m:
        return m, s + math.exp(x - m)
    return x + m, s + like(s, 1.0)  # x or m is NaN: the sum stays NaN


def lse_merge(m1, s1, m2, s2):
    """Combine two running log-sum-exps into one; returns the new pair."""
    if m2 == like(m2, -math.inf):
        return m1, s1
    if m1 == like(m1, -math.inf):
        return m2, s2
    if m1 == m2:
        return m1, s1 + s2
    if m1 > m2:
        return m1, s1 + s2 * math.exp(m2 - m1)
    if m1 < m2:
        return m2, s2 + s1 * math.exp(m1 - m2)
    return m1 + m2, s1 + s2  # m1 or m2 is NaN: the sum stays NaN


def lse_value(m, s):
    """The log-sum-exp that ``(m, s)`` holds: ``m + log(s)``, ``-inf`` for the empty sum."""
    if m == like(m, -math.inf):
        return m
    return m + math.log(s)


@register_jitable
def kbest_plus(f, n, term):
    """A partial path's score ``(f, n)`` (its finite terms' sum ``f``, ``n`` terms ``+inf``)
    times one more log term: a ``+inf`` term counts, any other adds to ``f`` (so a ``-inf``
    term makes the path ``-inf`` whatever its ``+inf`` terms; NaN stays NaN)."""
    if term == math.inf:
        return f, n + 1
    return f + term, n


@register_jitable
def kbest_before(a, na, ia, b, nb, ib):
    """Whether candidate ``(a, na, ia)`` ranks before ``(b, nb, ib)``: NaN first, then more
    ``+inf`` terms, then the higher finite sum, ties to the lower index."""
    if a != a:
        return b == b or ia < ib
    if b != b:
        return False
    if na != nb:
        return na > nb
    return a > b or (a == b and ia < ib)


@register_jitable
def kbest_insert(score, count, index, k, val, n, idx):
    """Insert ``(val, n, idx)`` into the ranked list ``score``/``count``/``index`` of length
    ``k`` (-1 in ``index`` for empty slots); candidates of score ``-inf`` are dropped."""
    if val == -math.inf:
        return
    pos = k
    while pos > 0 and (index[pos - 1] < 0 or kbest_before(val, n, idx, score[pos - 1], count[pos - 1], index[pos - 1])):
        pos -= 1
    if pos == k:
        return
    for m in range(k - 1, pos, -1):
        score[m] = score[m - 1]
        count[m] = count[m - 1]
        index[m] = index[m - 1]
    score[pos] = val
    count[pos] = n
    index[pos] = idx


@register_jitable
def kbest_backtrack(paths, backptr, r, b, entry, length, k):
    """Write path ``r`` of row ``b`` into ``paths[r, b]``: ``-1`` throughout, then, from its last
    position's ``entry`` (``state * k + rank``; none where negative), the states that
    ``backptr`` (B, v, c, k) leads back through."""
    for t in range(paths.shape[2]):
        paths[r, b, t] = -1
    if entry < 0:
        return
    for t in range(length - 1, -1, -1):
        state = entry // k
        paths[r, b, t] = state
        if t > 0:
            entry = backptr[b, t, state, entry % k]


@register_jitable
def kbest_first(b, x, init, work, counts):
    """Position 0 of row ``b``: one partial path per state, in ``work[b, 0]`` / ``counts[b, 0]``."""
    for j in range(x.shape[2]):
        for r in range(work.shape[3]):
            work[b, 0, j, r] = -math.inf
            counts[b, 0, j, r] = 0
        f, n = kbest_plus(like(x[b, 0, j], 0.0), 0, init[b, j])
        f, n = kbest_plus(f, n, x[b, 0, j])
        work[b, 0, j, 0] = f
        counts[b, 0, j, 0] = n


@register_jitable
def kbest_clear(score, index, k):
    """Empty the ``k`` slots of a ranked list: ``-inf`` scores, ``index`` -1."""
    for r in range(k):
        score[r] = -math.inf
        index[r] = -1


@register_jitable
def kbest_candidate(work, counts, b, cur, i, k, value, new, new_counts, index):
    """Offer the ``k`` partial paths of state ``i`` times the log term ``value`` to ``new``."""
    for r in range(k):
        if work[b, cur, i, r] != -math.inf:  # an empty slot, or a path of weight 0
            f, n = kbest_plus(work[b, cur, i, r], counts[b, cur, i, r], value)
            kbest_insert(new, new_counts, index, k, f, n, i * k + r)


@register_jitable
def kbest_emit(new, new_counts, index, k, value):
    """The emission ``value`` times the kept partial paths of a state (not the empty slots)."""
    for r in range(k):
        if index[r] >= 0:
            f, n = kbest_plus(new[r], new_counts[r], value)
            new[r] = f
            new_counts[r] = n


@register_jitable
def kbest_last(b, length, cur, work, counts, backptr, scores, paths):
    """Rank the partial paths of the last position of row ``b`` into ``scores[:, b]`` (``+inf``
    for a path with ``+inf`` terms) and follow their back-pointers into ``paths[:, b]``."""
    c, k = work.shape[2], work.shape[3]
    best, best_counts = work[b, 1 - cur, 0], counts[b, 1 - cur, 0]  # free scratch now, as is backptr[b, 0]
    index = backptr[b, 0, 0]
    kbest_clear(best, index, k)
    for j in range(c):
        for r in range(k):
            kbest_insert(best, best_counts, index, k, work[b, cur, j, r], counts[b, cur, j, r], j * k + r)
    for r in range(k):
        if index[r] >= 0 and best_counts[r] > 0 and best[r] == best[r]:
            scores[r, b] = math.inf
        else:
            scores[r, b] = best[r]
        kbest_backtrack(paths, backptr, r, b, index[r], length, k)


@register_jitable
def kbest_row(b, x, trans, group, init, lengths, work, counts, backptr, scores, paths):
    """Row ``b`` of the k-best kernels (``kernels.cpu.paths.chain_kbest``): every predecessor of
    each state through ``trans`` (G, S, c, c)."""
    c, k = x.shape[2], scores.shape[0]
    g = b // group
    per_step = trans.shape[1] > 1
    kbest_first(b, x, init, work, counts)
    cur = 0
    for t in range(lengths[b] - 1):
        m = trans[g, t if per_step else 0]
        for j in range(c):
            new, new_counts, index = work[b, 1 - cur, j], counts[b, 1 - cur, j], backptr[b, t + 1, j]
            kbest_clear(new, index, k)
            for i in range(c):
                kbest_candidate(work, counts, b, cur, i, k, m[i, j], new, new_counts, index)
            kbest_emit(new, new_counts, index, k, x[b, t + 1, j])
        cur = 1 - cur
    kbest_last(b, lengths[b], cur, work, counts, backptr, scores, paths)


@register_jitable
def sparse_kbest_row(b, x, t_indptr, t_rows, t_values, init, lengths, work, counts, backptr, scores, paths):
    """Row ``b`` of the sparse k-best kernels (``kernels.cpu.paths.sparse_chain_kbest``): the
    stored predecessors of each state only, from the transpose's CSR structure."""
    c, k = x.shape[2], scores.shape[0]
    kbest_first(b, x, init, work, counts)
    cur = 0
    for t in range(lengths[b] - 1):
        for j in range(c):
            new, new_counts, index = work[b, 1 - cur, j], counts[b, 1 - cur, j], backptr[b, t + 1, j]
            kbest_clear(new, index, k)
            for q in range(t_indptr[j], t_indptr[j + 1]):
                kbest_candidate(work, counts, b, cur, t_rows[q], k, t_values[q], new, new_counts, index)
            kbest_emit(new, new_counts, index, k, x[b, t + 1, j])
        cur = 1 - cur
    kbest_last(b, lengths[b], cur, work, counts, backptr, scores, paths)
