"""The guarded log-space helpers of ``spchain.kernels.rules`` compiled for the CPU (``@njit``),
so that the tests run the same source on both targets (the package compiles them for CUDA only)."""

from numba import njit

from spchain.kernels import rules

log_add_exp = njit(cache=True)(rules.log_add_exp)
lse_push = njit(cache=True)(rules.lse_push)
lse_merge = njit(cache=True)(rules.lse_merge)
lse_value = njit(cache=True)(rules.lse_value)
