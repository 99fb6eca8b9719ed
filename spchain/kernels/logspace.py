"""Guarded scalar log-space helpers, one Python source compiled for both targets.

``kernels.cpu.logspace`` compiles them with ``@njit`` and ``kernels.cuda.logspace`` as CUDA
device functions, so the CPU and CUDA kernels share exactly the same arithmetic.

Rules (see docs/design.rst): ``-inf`` is log-space zero and is legal everywhere, an all ``-inf``
reduction gives ``-inf`` (never NaN), NaN in gives NaN out, and no finite stand-in for
``-inf`` is ever used.

A running log-sum-exp is held as a pair ``(m, s)``: the largest value folded in so far and
the sum of ``exp(x - m)`` over the values folded in. The empty sum is ``(-inf, 0.0)``.

Every constant takes the float type of the value it meets (:func:`like`), so float32 inputs
are computed in float32 (float32 ``exp``/``log``, no float64 on a GPU) and float64 inputs
exactly as before.
"""

import math

from numba.extending import overload
from numba.np.numpy_support import as_dtype


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
