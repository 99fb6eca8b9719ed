"""The guarded log-space helpers of ``kernels.logspace`` compiled for the CPU (``@njit``)."""

from numba import njit

from .. import logspace

log_add_exp = njit(cache=True)(logspace.log_add_exp)
lse_push = njit(cache=True)(logspace.lse_push)
lse_merge = njit(cache=True)(logspace.lse_merge)
lse_value = njit(cache=True)(logspace.lse_value)
