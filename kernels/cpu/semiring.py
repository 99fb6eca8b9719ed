"""The max-plus (tropical) matrix product for the CPU.

Ties go to the lowest index; NaN counts as larger than any number (its first occurrence wins),
so NaN in gives NaN out, as in ``numpy.argmax``.
"""

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def max_matmul(a, b, a_index, b_index, values, argmax):
    """``values[p, i, j] = max_k a[a_index[p], i, k] + b[b_index[p], k, j]`` and its ``argmax``.

    ``a`` (Ba, m, k), ``b`` (Bb, k, n), ``a_index``/``b_index`` (P,); overwrites ``values``
    (P, m, n) and ``argmax`` (P, m, n, int64). With k = 0: ``-inf`` and 0. Parallel over
    the P * m output rows; O(P * m * k * n) time.
    """
    batches, m, n = values.shape
    k = a.shape[2]
    for row in prange(batches * m):
        p = row // m
        i = row % m
        a_row = a[a_index[p], i]
        mat = b[b_index[p]]
        best = values[p, i]
        arg = argmax[p, i]
        best[:] = -np.inf
        arg[:] = 0
        for kk in range(k):
            aik = a_row[kk]
            for j in range(n):
                val = aik + mat[kk, j]
                if val > best[j] or (val != val and best[j] == best[j]):
                    best[j] = val
                    arg[j] = kk
