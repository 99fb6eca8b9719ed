"""The guarded log-space helpers of ``kernels.logspace`` as CUDA device functions."""

from numba import cuda

from .. import logspace

log_add_exp = cuda.jit(device=True)(logspace.log_add_exp)
lse_push = cuda.jit(device=True)(logspace.lse_push)
lse_merge = cuda.jit(device=True)(logspace.lse_merge)
lse_value = cuda.jit(device=True)(logspace.lse_value)
