"""A vectorisable ``exp`` for the CPU kernels' inner loops.

Numba calls libm's ``exp`` one element at a time, which keeps LLVM from vectorising the loops
it sits in. ``exp_nonpositive`` is plain arithmetic (range reduction by ln 2, a degree-13
Taylor polynomial, the power of two built from its bits), so those loops vectorise. Within
2 ulp of ``numpy.exp`` in float64 for ``x <= 700``; results below 2**-1022 (the smallest
normal double) are flushed to 0, which a max-shifted sum of exponentials never notices;
``-inf`` gives 0, ``x > 709`` (``+inf`` included) gives ``+inf`` and NaN gives NaN.
"""

import math

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # ln 2 split in two (fdlibm), so t * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_FLUSH = -708.3964185322641  # ln(2**-1022)


@intrinsic
def _double_from_bits(typingctx, bits):
    """The float64 whose IEEE-754 bits are the int64 ``bits``."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float64))

    return types.float64(types.int64), codegen


@njit(inline="always")
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
