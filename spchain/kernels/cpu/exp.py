"""A vectorisable ``exp`` for the CPU kernels' inner loops.

Numba calls libm's ``exp`` one element at a time, which keeps LLVM from vectorising the loops
it sits in. ``exp_nonpositive`` is plain arithmetic (range reduction by ln 2, a degree-13
Taylor polynomial, the power of two built from its bits), so those loops vectorise. Within
2 ulp of ``numpy.exp`` in float64 for ``x <= 700``; results below 2**-1022 (the smallest
normal double) are flushed to 0, which a max-shifted sum of exponentials never notices;
``-inf`` gives 0, ``x > 709`` (``+inf`` included) gives ``+inf`` and NaN gives NaN.

For float32 results, ``exp_float32`` (a degree-7 polynomial, relative error below 1e-8) and
``log_float32`` (absolute error below 1e-9, for positive normal doubles) keep float64's range
at about half the cost; ``exp_like`` and ``log_like`` pick them or the float64 ones
(``exp_nonpositive``, ``math.log``) by the type of a sample of the data, at compile time.
"""

import math

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # ln 2 split in two (fdlibm), so t * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_FLUSH = -708.3964185322641  # ln(2**-1022)
_SQRT2 = 1.4142135623730951
_LN2 = 0.6931471805599453
_MANTISSA = (1 << 52) - 1
_ONE = 1023 << 52  # the bits of 1.0
_TWO52_BITS = 0x4330000000000000  # the bits of 2**52
_SHIFTER = 6755399441055744.0  # 1.5 * 2**52: adding it rounds to an integer, kept in the low bits
_COMPILE = {"fastmath": {"contract"}, "error_model": "numpy"}
"""How the functions below compile, once per argument type, whatever their caller's flags:
their polynomials in fused multiply-adds (which vectorise 2x faster) and no zero-division
check (it would keep a caller's loop from vectorising). LLVM inlines them into their callers;
Numba's own inlining would type and lower them again at each of their dozens of call sites
(about 8 % of the chain workloads' compile time)."""


@intrinsic
def _double_from_bits(typingctx, bits):
    """The float64 whose IEEE-754 bits are the int64 ``bits``."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float64))

    return types.float64(types.int64), codegen


@intrinsic
def _bits_of_double(typingctx, x):
    """The IEEE-754 bits of the float64 ``x``, as an int64."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.int64))

    return types.int64(types.float64), codegen


@njit(**_COMPILE)
def exp_nonpositive(x):
    """``exp(x)``, accurate for ``x <= 700`` (meant for max-shifted, non-positive arguments)."""
    x = np.float64(x)
    t = math.floor(x * _LOG2E + 0.5)
    if t < -1023.0:
        t = -1023.0
    r = (x - t * _LN2_HI) - t * _LN2_LO
    p = 1.0 / 6227020800.0
    p = p * r + 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    out = p * _double_from_bits((np.int64(t) + 1023) << 52)
    if x < _FLUSH:
        out = 0.0
    if x > 709.0:
        out = np.inf
    return out


@njit(**_COMPILE)
def exp_float32(x):
    """``exp(x)`` to float32 accuracy (relative error below 1e-8) for ``x <= 700``, in float64;
    the same range and special values as :func:`exp_nonpositive`. Rounds by adding
    ``1.5 * 2**52`` and builds the power of two by shifting bits, never converting a double to
    an integer (which AVX2 cannot do on vectors)."""
    x = np.float64(x)
    y = x
    if y < _FLUSH:  # NaN stays
        y = _FLUSH
    if y > 709.0:
        y = 709.0
    kd = y * _LOG2E + _SHIFTER
    t = kd - _SHIFTER
    r = (y - t * _LN2_HI) - t * _LN2_LO
    p = 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    out = p * _double_from_bits((_bits_of_double(kd) + 1023) << 52)
    if x < _FLUSH:
        out = 0.0
    if x > 709.0:
        out = np.inf
    return out


@njit(**_COMPILE)
def log_float32(x):
    """``log(x)`` within 1e-9 for a positive normal float64 ``x`` (meaningless otherwise: the
    callers check their arguments): ``e ln 2 + log m`` with ``m`` in [sqrt(1/2), sqrt(2)) and
    ``log m = 2 atanh((m - 1) / (m + 1))`` by its series to the 9th power."""
    bits = _bits_of_double(np.float64(x))
    e = _double_from_bits(((bits >> 52) & 2047) | _TWO52_BITS) - (4503599627370496.0 + 1023.0)
    m = _double_from_bits((bits & _MANTISSA) | _ONE)
    if m > _SQRT2:
        m *= 0.5
        e += 1.0
    f = (m - 1.0) / (m + 1.0)
    s = f * f
    p = 1.0 / 9.0
    p = p * s + 1.0 / 7.0
    p = p * s + 1.0 / 5.0
    p = p * s + 1.0 / 3.0
    p = p * s + 1.0
    return e * _LN2 + 2.0 * f * p


def _is_float32(like):
    return isinstance(like, types.Float) and like.bitwidth == 32


def exp_like(like, x):
    """``exp(x)`` (``x <= 700``) to the accuracy of ``like``'s type: :func:`exp_float32` for
    float32, :func:`exp_nonpositive` otherwise (for Numba-compiled callers only)."""
    raise NotImplementedError("exp_like is for Numba-compiled code")


def log_like(like, x):
    """``log(x)`` for a positive normal ``x`` to the accuracy of ``like``'s type:
    :func:`log_float32` for float32, ``math.log`` otherwise (for Numba-compiled callers only)."""
    raise NotImplementedError("log_like is for Numba-compiled code")


@overload(exp_like)
def _exp_like(like, x):
    if _is_float32(like):
        return lambda like, x: exp_float32(x)
    return lambda like, x: exp_nonpositive(x)


@overload(log_like)
def _log_like(like, x):
    if _is_float32(like):
        return lambda like, x: log_float32(x)
    return lambda like, x: math.log(x)
