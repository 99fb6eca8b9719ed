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


def dense(matrix):
    """A SciPy sparse matrix (or cupyx, or torch sparse tensor) as a float64 NumPy array;
    duplicate entries add up."""
    if hasattr(matrix, "get"):
        matrix = matrix.get()
    if hasattr(matrix, "to_dense"):
        return matrix.detach().cpu().to_dense().double().numpy()
    return np.asarray(matrix.toarray(), np.float64)


def entries(indptr, indices):
    """``(rows, cols)`` of every stored entry of a CSR structure, in storage order."""
    indptr, indices = np.asarray(indptr), np.asarray(indices)
    return np.repeat(np.arange(indptr.shape[0] - 1), np.diff(indptr)), indices.astype(np.int64)


def sampled_product(rows, cols, a, b):
    """The dense product ``a @ b.T`` in float64, read at ``(rows[p], cols[p])`` for every entry."""
    return (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T)[rows, cols]


def largest_positions(w, keep):
    """Sorted flat positions of the ``keep`` largest ``|w|``: NaN first, then by magnitude, ties to
    the earlier position (a plain Python sort)."""
    flat = np.abs(np.asarray(w, np.float64)).ravel()
    order = sorted(range(flat.size), key=lambda p: (0 if np.isnan(flat[p]) else 1, -flat[p], p))
    return np.sort(np.array(order[:keep], dtype=np.int64))
