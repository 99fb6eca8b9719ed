"""The max-plus (tropical) matrix product for the CPU.

Ties go to the lowest index; NaN counts as larger than any number (its first occurrence wins),
so NaN in gives NaN out, as in ``numpy.argmax``. A term with a ``-inf`` side is ``-inf``, even
against ``+inf`` (log-space zero is a structural zero: ``+inf + -inf`` is not NaN). An output
whose terms are all ``-inf`` is ``-inf`` with argmax 0.
"""

import numpy as np
from numba import njit, prange


@njit(cache=True)
def max_vecmat(u, m, best, arg):
    """``best[j] = max_i u[i] + m[i, j]`` and ``arg[j]`` the first such ``i`` (NaN wins):
    a max-plus vector-matrix product. Overwrites ``best`` and ``arg``; O(c_in * c_out)."""
    best[:] = -np.inf
    arg[:] = 0
    for i in range(m.shape[0]):
        ui = u[i]
        for j in range(m.shape[1]):
            val = ui + m[i, j]
            if val != val and ui == ui and m[i, j] == m[i, j]:  # +inf + -inf
                val = -np.inf
            if val > best[j] or (val != val and best[j] == best[j]):
                best[j] = val
                arg[j] = i


@njit(parallel=True, cache=True)
def max_matmul(a, b, a_index, b_index, values, argmax):
    """``values[p, i, j] = max_k a[a_index[p], i, k] + b[b_index[p], k, j]`` and its ``argmax``.

    ``a`` (Ba, m, k), ``b`` (Bb, k, n), ``a_index``/``b_index`` (P,); overwrites ``values``
    (P, m, n) and ``argmax`` (P, m, n, int64). With k = 0: ``-inf`` and 0. Parallel over
    the P * m output rows; O(P * m * k * n) time.
    """
    batches, m, n = values.shape
    for row in prange(batches * m):
        p = row // m
        i = row % m
        max_vecmat(a[a_index[p], i], b[b_index[p]], values[p, i], argmax[p, i])
