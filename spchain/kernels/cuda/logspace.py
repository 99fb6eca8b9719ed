"""The guarded log-space helpers of ``kernels.rules`` as CUDA device functions, and the
device-side fix-up of a scaled log-space product."""

import math

from numba import cuda

from .. import rules
from . import config

log_add_exp = cuda.jit(device=True)(rules.log_add_exp)
lse_push = cuda.jit(device=True)(rules.lse_push)
lse_merge = cuda.jit(device=True)(rules.lse_merge)
lse_value = cuda.jit(device=True)(rules.lse_value)


@cuda.jit
def log_product_fixup_kernel(a, b, a_index, b_index, lost, out):
    """``out[p, i, j] = log sum_k exp(a[a_index[p], i, k] + b[b_index[p], k, j])`` where
    ``lost[p, i, j]`` is set; elsewhere ``out`` is left as it is.

    The twin of ``spchain._logspace._recompute_lost`` (its NumPy form), without a
    synchronisation: the flags are read on the device, so a product that lost nothing costs
    one pass over them.

    Inputs: ``a`` (Ba, m, k), ``b`` (Bb, k, n), ``a_index``, ``b_index`` (P,), ``lost`` (P, m, n) uint8.
    Output: ``out`` (P, m, n), updated in place.
    Launch: grid ``blocks_for(P * m * n)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread an output entry
    (grid-stride).
    """
    batch, m, n = out.shape
    k = a.shape[2]
    for e in range(cuda.grid(1), batch * m * n, cuda.gridsize(1)):
        p = e // (m * n)
        i = (e // n) % m
        j = e % n
        if lost[p, i, j]:
            ap, bp = a_index[p], b_index[p]
            hi, total = out.dtype.type(-math.inf), out.dtype.type(0)
            for q in range(k):
                hi, total = lse_push(hi, total, a[ap, i, q] + b[bp, q, j])
            out[p, i, j] = lse_value(hi, total)


def launch_log_product_fixup(a, b, a_index, b_index, lost, out, stream=0):
    """Launch :func:`log_product_fixup_kernel` on ``stream`` (nothing for an empty ``out``)."""
    if out.size == 0:
        return
    log_product_fixup_kernel[config.blocks_for(out.size), config.THREADS_PER_BLOCK, stream](
        a, b, a_index, b_index, lost, out)


@cuda.jit
def log_product_posinf_fixup_kernel(a, b, a_index, b_index, found, out):
    """``out[p, i, j] = +inf`` where a term ``a[a_index[p], i, k] + b[b_index[p], k, j]`` has a
    ``+inf`` side and its other side is not ``-inf`` (nor NaN), unless ``out`` is NaN: the
    ``+inf`` rule of ``spchain._logspace.PosInf``. Returns at once unless ``found[0]`` (read on
    the device: whether the operands hold any ``+inf``).

    Inputs: ``a`` (Ba, m, k), ``b`` (Bb, k, n), ``a_index``, ``b_index`` (P,), ``found`` (1,). Output: ``out``
    (P, m, n), updated in place.
    Launch: grid ``blocks_for(P * m * n)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread an output entry
    (grid-stride)."""
    if not found[0]:
        return
    batch, m, n = out.shape
    k = a.shape[2]
    inf = out.dtype.type(math.inf)
    for e in range(cuda.grid(1), batch * m * n, cuda.gridsize(1)):
        p = e // (m * n)
        i = (e // n) % m
        j = e % n
        if out[p, i, j] == out[p, i, j]:
            ap, bp = a_index[p], b_index[p]
            for q in range(k):
                x, y = a[ap, i, q], b[bp, q, j]
                if (x == inf and y > -inf) or (y == inf and x > -inf):
                    out[p, i, j] = inf
                    break


@cuda.jit
def log_product_grads_kernel(a, b, a_index, b_index, found, out, grad, flags, grad_a, grad_b):
    """The terms of the gradient of ``sum(grad * log(exp(a) @ exp(b)))`` that the scaled GEMMs
    leave out, added with atomics to ``grad_a`` (P, m, k) and ``grad_b`` (P, k, n) (either may
    have no rows: not needed), one thread an output entry:

    - where ``flags[p, i, j]`` is 1 (the scaled sum underflowed): every term exactly,
      ``grad · exp(a + b - out)``, to both sides (a term with a ``+inf`` side is a zero one here);
    - if ``found[0]`` (the operands hold ``+inf``), where ``out`` is ``+inf``: ``grad`` in equal
      shares to the ``+inf`` terms, each share to both sides (``spchain._logspace.PosInf``).

    Inputs: ``a`` (Ba, m, k), ``b`` (Bb, k, n), ``a_index``, ``b_index`` (P,), ``found`` (1,), ``out``, ``grad``
    and ``flags`` (P, m, n). Outputs: ``grad_a``, ``grad_b``, added to.
    Launch: grid ``blocks_for(P * m * n)`` blocks of ``THREADS_PER_BLOCK`` threads, a thread an output entry
    (grid-stride).
    """
    batch, m, n = out.shape
    k = a.shape[2]
    inf = out.dtype.type(math.inf)
    need_a, need_b = grad_a.shape[0] > 0, grad_b.shape[0] > 0
    for e in range(cuda.grid(1), batch * m * n, cuda.gridsize(1)):
        p = e // (m * n)
        i = (e // n) % m
        j = e % n
        ap, bp = a_index[p], b_index[p]
        g, o = grad[p, i, j], out[p, i, j]
        if flags[p, i, j] and o != inf:
            for q in range(k):
                x, y = a[ap, i, q], b[bp, q, j]
                if x == inf or y == inf:  # its partner is -inf (else out would be +inf): a zero term
                    continue
                term = g * math.exp(x + y - o)
                if need_a:
                    cuda.atomic.add(grad_a, (p, i, q), term)
                if need_b:
                    cuda.atomic.add(grad_b, (p, q, j), term)
        elif found[0] and o == inf:
            count = 0
            for q in range(k):
                x, y = a[ap, i, q], b[bp, q, j]
                if (x == inf and y > -inf) or (y == inf and x > -inf):
                    count += 1
            share = g / out.dtype.type(count if count > 1 else 1)  # builtin max() fails to compile for CUDA here
            for q in range(k):
                x, y = a[ap, i, q], b[bp, q, j]
                if (x == inf and y > -inf) or (y == inf and x > -inf):
                    if need_a:
                        cuda.atomic.add(grad_a, (p, i, q), share)
                    if need_b:
                        cuda.atomic.add(grad_b, (p, q, j), share)


def launch_log_product_posinf_fixup(a, b, a_index, b_index, found, out, stream=0):
    """Launch :func:`log_product_posinf_fixup_kernel` on ``stream`` (nothing for an empty ``out``)."""
    if out.size == 0:
        return
    log_product_posinf_fixup_kernel[config.blocks_for(out.size), config.THREADS_PER_BLOCK, stream](
        a, b, a_index, b_index, found, out)


def launch_log_product_grads(a, b, a_index, b_index, found, out, grad, flags, grad_a, grad_b, stream=0):
    """Launch :func:`log_product_grads_kernel` on ``stream`` (nothing for an empty ``out``)."""
    if out.size == 0:
        return
    log_product_grads_kernel[config.blocks_for(out.size), config.THREADS_PER_BLOCK, stream](
        a, b, a_index, b_index, found, out, grad, flags, grad_a, grad_b)
