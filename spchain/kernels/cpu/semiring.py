"""The max-plus (tropical) matrix product for the CPU.

Ties go to the lowest index; NaN counts as larger than any number (its first occurrence wins),
so NaN in gives NaN out, as in ``numpy.argmax``. A term with a ``-inf`` side is ``-inf``, even
against ``+inf`` (log-space zero is a structural zero: ``+inf + -inf`` is not NaN). An output
whose terms are all ``-inf`` is ``-inf`` with argmax 0.
"""

import numpy as np
from numba import njit

from .team import team_rows


@njit(inline="always")
def _fold(ui, mij, k, nan_term, best, arg):
    """One term ``ui + mij`` of index ``k`` folded into ``(best, arg)``: it wins if larger, or
    if it is NaN from a NaN term (``nan_term`` says whether ``mij`` or ``ui`` may be NaN)
    while ``best`` is a number. ``+inf + -inf`` (NaN from no NaN term) never wins: it is
    ``-inf``, and ties keep the first index. Branch-free, so the loops over ``j`` vectorise."""
    val = ui + mij
    take = (val > best) | (nan_term & ((mij != mij) | (ui != ui)) & (best == best))
    return (val if take else best), (k if take else arg)


@njit(inline="always")
def _fold4(u, m, i, nan_term, src_best, src_arg, best, arg):
    """Rows ``i .. i + 3`` of ``m`` folded into ``(src_best, src_arg)``, written to ``(best, arg)``:
    one pass over the outputs for four terms (the outputs are loaded and stored once)."""
    u0, u1, u2, u3 = u[i], u[i + 1], u[i + 2], u[i + 3]
    m0, m1, m2, m3 = m[i], m[i + 1], m[i + 2], m[i + 3]
    k0, k1, k2, k3 = arg.dtype.type(i), arg.dtype.type(i + 1), arg.dtype.type(i + 2), arg.dtype.type(i + 3)
    for j in range(m.shape[1]):
        b, a = _fold(u0, m0[j], k0, nan_term, src_best[j], src_arg[j])
        b, a = _fold(u1, m1[j], k1, nan_term, b, a)
        b, a = _fold(u2, m2[j], k2, nan_term, b, a)
        best[j], arg[j] = _fold(u3, m3[j], k3, nan_term, b, a)


@njit(inline="always")
def _fold1(u, m, i, src_best, src_arg, best, arg):
    """Row ``i`` of ``m`` folded in, as :func:`_fold4` (NaN-aware)."""
    ui, mi, k = u[i], m[i], arg.dtype.type(i)
    for j in range(m.shape[1]):
        best[j], arg[j] = _fold(ui, mi[j], k, True, src_best[j], src_arg[j])


@njit(cache=True)
def max_vecmat(u, m, nan_in_m, best, arg, scratch_best, scratch_arg):
    """``best[j] = max_i u[i] + m[i, j]`` and ``arg[j]`` the first such ``i`` (NaN wins):
    a max-plus vector-matrix product. ``nan_in_m`` says whether ``m`` may hold NaN.
    Overwrites ``best`` and ``arg``, and ``scratch_best`` / ``scratch_arg`` of their shapes
    and dtypes; O(c_in * c_out).

    Four rows of ``m`` at a time, in SIMD registers; each pass reads one pair of output
    buffers and writes the other (a pass that stored back what it loaded would let LLVM
    turn the stores into masked ones, slow on some CPUs). The NaN tests are compiled out
    where neither ``m`` nor ``u`` holds NaN.
    """
    c_in = m.shape[0]
    nan_term = nan_in_m
    for i in range(c_in):
        if u[i] != u[i]:
            nan_term = True
    passes = c_in // 4 + c_in % 4
    src_best, src_arg, dst_best, dst_arg = best, arg, scratch_best, scratch_arg
    if passes % 2:  # the last pass writes to best / arg
        src_best, src_arg, dst_best, dst_arg = scratch_best, scratch_arg, best, arg
    src_best[:] = -np.inf
    src_arg[:] = 0
    for i in range(0, c_in - c_in % 4, 4):
        if nan_term:
            _fold4(u, m, i, True, src_best, src_arg, dst_best, dst_arg)
        else:
            _fold4(u, m, i, False, src_best, src_arg, dst_best, dst_arg)
        src_best, src_arg, dst_best, dst_arg = dst_best, dst_arg, src_best, src_arg
    for i in range(c_in - c_in % 4, c_in):
        _fold1(u, m, i, src_best, src_arg, dst_best, dst_arg)
        src_best, src_arg, dst_best, dst_arg = dst_best, dst_arg, src_best, src_arg


@njit(cache=True)
def has_nan(m):
    """Whether the 2-d array ``m`` holds a NaN."""
    found = False
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            found |= m[i, j] != m[i, j]
    return found


@njit(nogil=True, cache=True)
def max_matmul(parallel, threads, a, b, a_index, b_index, values, argmax):
    """``values[p, i, j] = max_k a[a_index[p], i, k] + b[b_index[p], k, j]`` and its ``argmax``.

    ``a`` (Ba, m, k), ``b`` (Bb, k, n), ``a_index``/``b_index`` (P,); overwrites ``values``
    (P, m, n) and ``argmax`` (P, m, n, int64). With k = 0: ``-inf`` and 0. Parallel over
    the P * m output rows (on a team of threads: ``team.run``); O(P * m * k * n) time.
    """
    batches, m, n = values.shape
    nan_in_b = np.empty(b.shape[0], np.bool_)
    failed = team_rows(parallel, threads, _nan_matrices, b.shape[0], (b, nan_in_b))
    if failed:
        return failed
    return team_rows(parallel, threads, _max_matmul_rows, batches * m,
                     (a, b, a_index, b_index, nan_in_b, values, argmax))


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _nan_matrices(lo, hi, b, nan_in):
    """``nan_in[q]``: whether ``b[q]`` holds a NaN, for ``q`` in ``lo:hi``."""
    for q in range(lo, hi):
        nan_in[q] = has_nan(b[q])


@njit(cache=True, error_model="numpy")  # division by zero gives inf or NaN
def _max_matmul_rows(lo, hi, a, b, a_index, b_index, nan_in_b, values, argmax):
    """Output rows ``lo:hi`` (of the flattened (P, m)) of :func:`max_matmul`."""
    batches, m, n = values.shape
    for row in range(lo, hi):
        p = row // m
        i = row % m
        max_vecmat(a[a_index[p], i], b[b_index[p]], nan_in_b[b_index[p]], values[p, i], argmax[p, i],
                   np.empty(n, values.dtype), np.empty(n, argmax.dtype))
