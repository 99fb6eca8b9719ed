"""Slow, obvious float64 references that spchain's results are checked against."""

import numpy as np
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
