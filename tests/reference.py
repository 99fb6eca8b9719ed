"""Slow, obvious float64 references that spchain's results are checked against."""

import math

import numpy as np
import scipy.linalg
from scipy.special import logsumexp


def log_add_exp(a, b):
    """``log(exp(a) + exp(b))`` elementwise, in float64."""
    with np.errstate(invalid="ignore"):
        return np.logaddexp(np.asarray(a, np.float64), np.asarray(b, np.float64))


def log_sum_exp(values, axis=None):
    """``log(sum(exp(values)))`` in float64; ``-inf`` for an empty or all ``-inf`` input."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return np.full(np.sum(values, axis=axis).shape, -np.inf) if axis is not None else -np.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        return logsumexp(values, axis=axis)


def block_diag_matmul(x, w):
    """``x`` (..., G, d_in) times the block-diagonal matrix of ``w`` (G, d_in, d_out), in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    groups, d_in, d_out = w.shape
    dense = scipy.linalg.block_diag(*w) if groups else np.zeros((0, 0))
    return (x.reshape(math.prod(x.shape[:-2]), groups * d_in) @ dense).reshape(x.shape[:-1] + (d_out,))


def grouped_matmul(x, w, group_sizes):
    """Rows of ``x`` (N, d_in) in contiguous groups, group g times ``w[g]``: a per-group loop in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(group_sizes):
        out[start:start + size] = x[start:start + size] @ w[g]
        start += size
    return out


def grouped_weight_grad(x, grad, group_sizes):
    """The gradient of ``sum(grad * grouped_matmul(x, w, group_sizes))`` in ``w``: ``x_gᵀ grad_g`` per group."""
    x, grad = np.asarray(x, np.float64), np.asarray(grad, np.float64)
    out = np.zeros((len(group_sizes), x.shape[1], grad.shape[1]))
    start = 0
    for g, size in enumerate(group_sizes):
        out[g] = x[start:start + size].T @ grad[start:start + size]
        start += size
    return out


def block_diag_weight_grad(x, grad):
    """The gradient of ``sum(grad * block_diag_matmul(x, w))`` in ``w``: the diagonal blocks of the dense one."""
    x, grad = np.asarray(x, np.float64), np.asarray(grad, np.float64)
    groups, d_in, d_out = x.shape[-2], x.shape[-1], grad.shape[-1]
    rows = math.prod(x.shape[:-2])
    dense = x.reshape(rows, groups * d_in).T @ grad.reshape(rows, groups * d_out)
    out = np.zeros((groups, d_in, d_out))
    for g in range(groups):
        out[g] = dense[g * d_in:(g + 1) * d_in, g * d_out:(g + 1) * d_out]
    return out
