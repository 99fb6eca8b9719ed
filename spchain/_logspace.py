"""Array-level log-space building blocks, written once against ``xp`` (NumPy or CuPy).

``log_matmul`` is the fast and exact log-semiring product that the chain sweep, ``logmatmul``
and ``log_chain_product`` share: one GEMM in scaled (exp) space with max shifts on both sides,
then the entries where that product lost its answer to underflow are found and recomputed
exactly in log space.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from . import _backend
from .kernels import cuda
from ._typing import Array, Shape

FIXUP_CHUNK = 1 << 22
"""Elements gathered at a time when recomputing lost entries (bounds their extra memory)."""


def finite_or_zero(xp: ModuleType, shift: Array) -> Array:
    """``shift`` with non-finite entries replaced by 0, so ``exp(v - shift)`` never makes NaN
    from ``-inf - -inf``; a NaN shift also becomes 0, and the NaN then flows through ``v``."""
    return xp.where(xp.isfinite(shift), shift, 0)


def logsumexp(xp: ModuleType, v: Array, axis: int, keepdims: bool = False) -> Array:
    """``log(sum(exp(v)))`` along ``axis``, max-shifted; ``-inf`` for all ``-inf`` (or empty)."""
    if v.shape[axis] == 0:
        shape = list(v.shape)
        shape[axis] = 1
        out = xp.full(shape, -np.inf, dtype=v.dtype)
        return out if keepdims else out.squeeze(axis)
    shift = finite_or_zero(xp, v.max(axis=axis, keepdims=True))
    total = xp.exp(v - shift).sum(axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):
        out = xp.log(total) + shift
    return out if keepdims else out.squeeze(axis)


def normalised(xp: ModuleType, pre: Array, x: Array, norm: Array) -> Array:
    """The normalised forward message ``â_t`` from what the forward sweep saved."""
    return (pre + x) - finite_or_zero(xp, norm)[..., None]


def renormalise(xp: ModuleType, marginals: Array) -> tuple[Array, Array]:
    """``marginals`` divided by their sum over the last axis, and the log of that sum (0 where
    the sum is 0 or not finite, which stays as it is).

    In exact arithmetic each position's marginals sum to 1; in float32 the backward messages,
    scaled by the forward normalisers only, drift by a factor linear in the position (5e-4 at
    v = 10⁴). Renormalising every position removes that drift and changes nothing exact.
    """
    total = marginals.sum(axis=-1, keepdims=True)
    usable = (total > 0) & xp.isfinite(total)
    total = xp.where(usable, total, 1)
    return marginals / total, xp.log(total)


def underflow_threshold(dtype: np.dtype[Any], k: int) -> float:
    """Below this, a sum of ``k`` scaled products may have lost more than one ulp to underflow.

    Every term that underflowed is below ``tiny``, so together they are below ``k * tiny``;
    a sum of at least ``k * tiny / eps`` has lost less than ``eps`` of itself to them.
    """
    info = np.finfo(dtype)
    return float(max(k, 1) * info.tiny / info.eps)


def scaled(xp: ModuleType, a: Array, axis: int) -> tuple[Array, Array, Array]:
    """``(exp(a - shift), shift, top)``: ``a`` scaled by its maximum ``top`` along ``axis``
    (``shift`` is ``top`` made finite), an operand of a log-space product in scaled space."""
    top = a.max(axis=axis, keepdims=True)
    shift = finite_or_zero(xp, top)
    return xp.exp(a - shift), shift, top


def log_matmul(xp: ModuleType, a: Array, b: Array, out: Array | None = None, posinf: bool = True) -> Array:
    """``log(exp(a) @ exp(b))`` over the last two axes, leading axes broadcast.

    ``a`` (..., m, k) and ``b`` (..., k, n) of one float dtype. Never builds an (m, k, n)
    tensor: the product is one GEMM on ``exp(a - rowmax(a))`` and ``exp(b - colmax(b))``
    (:func:`log_product`). Writes into ``out`` if given. ``posinf=False`` promises operands
    without ``+inf`` (the chain sweeps'), which spares the search for them, a synchronisation
    on the GPU.
    """
    k = a.shape[-1]
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    if k == 0 or 0 in shape:
        if out is None:
            return xp.full(shape, -np.inf, dtype=a.dtype)
        out[...] = -np.inf
        return out
    if posinf and on_device(xp):
        return _log_matmul_on_device(xp, a, b, out)
    a_scaled, b_scaled = scaled(xp, a, -1), scaled(xp, b, -2)
    infinite = PosInf.of(xp, a, b, a_scaled[2], b_scaled[2]) if posinf else None
    if infinite is None:
        return log_product(xp, a_scaled, b_scaled, lambda: a, b, out)
    a, b = infinite.a, infinite.b
    out = log_product(xp, scaled(xp, a, -1), scaled(xp, b, -2), lambda: a, b, out)
    out[(infinite.count(xp) > 0) & ~xp.isnan(out)] = np.inf
    return out


class PosInf:
    """The ``+inf`` entries of the operands of a log-space (or max-plus) product.

    The rule (docs/design.rst, "Numerical rules"): a term ``a_ik + b_kj`` with a ``+inf`` side is ``+inf``,
    unless its other side is ``-inf``: log-space zero is a structural zero and wins
    (``0 · ∞ = 0``, as in a sparse product). An output with a ``+inf`` term is ``+inf`` (NaN
    stays NaN), and its gradient goes in equal shares to its ``+inf`` terms (the limit of
    the softmax as those terms grow). ``a`` and ``b`` here are the operands with ``+inf``
    made ``-inf``, whose product is the output everywhere else.
    """

    def __init__(self, xp: ModuleType, a: Array, b: Array) -> None:
        self.pa, self.pb = xp.isposinf(a), xp.isposinf(b)
        self.fa, self.fb = a > -np.inf, b > -np.inf  # the possible partners of a +inf
        self.a, self.b = xp.where(self.pa, -np.inf, a), xp.where(self.pb, -np.inf, b)
        self.dtype = a.dtype

    @classmethod
    def of(cls, xp: ModuleType, a: Array, b: Array, a_top: Array, b_top: Array) -> PosInf | None:
        """``PosInf(xp, a, b)``, or ``None`` if neither operand holds ``+inf`` (read from their
        row maxima ``a_top`` and column maxima ``b_top``: a row or column with NaN has a NaN
        maximum, and all its outputs are NaN whatever its ``+inf``)."""
        found = bool(xp.isposinf(a_top).any()) or bool(xp.isposinf(b_top).any())
        return cls(xp, a, b) if found else None

    def count(self, xp: ModuleType) -> Array:
        """The number of ``+inf`` terms of every output (by inclusion-exclusion, three 0/1 GEMMs)."""
        pa, pb, fa, fb = (t.astype(self.dtype) for t in (self.pa, self.pb, self.fa, self.fb))
        return _backend.matmul(xp, pa, fb) + _backend.matmul(xp, fa, pb) - _backend.matmul(xp, pa, pb)

    def add_grads(self, xp: ModuleType, out: Array, grad: Array, grad_a: Array | None,
                  grad_b: Array | None) -> Array:
        """Add the shares of ``grad`` at the ``+inf`` outputs to ``grad_a`` and ``grad_b`` (either
        may be ``None``); returns ``grad`` with those outputs zeroed, for the finite products."""
        at_inf = xp.isposinf(out)
        w = xp.where(at_inf, grad, 0) / xp.maximum(self.count(xp), 1)
        pa, pb = self.pa.astype(self.dtype), self.pb.astype(self.dtype)
        if grad_a is not None:  # term (i, k, j) is +inf: pa_ik and fb_kj, or else fa_ik and pb_kj
            grad_a += pa * _backend.matmul(xp, w, self.fb.astype(self.dtype).swapaxes(-1, -2))
            grad_a += (self.fa & ~self.pa) * _backend.matmul(xp, w, pb.swapaxes(-1, -2))
        if grad_b is not None:
            grad_b += pb * _backend.matmul(xp, self.fa.astype(self.dtype).swapaxes(-1, -2), w)
            grad_b += (self.fb & ~self.pb) * _backend.matmul(xp, pa.swapaxes(-1, -2), w)
        return xp.where(at_inf, 0, grad)


def log_product(xp: ModuleType, a_scaled: tuple[Array, Array, Array], b_scaled: tuple[Array, Array, Array],
                a: Callable[[], Array], b: Array, out: Array | None = None) -> Array:
    """``log(exp(a) @ exp(b))`` from the operands scaled by :func:`scaled`: one GEMM.

    An entry whose scaled sum fell below :func:`underflow_threshold` (the row's and the
    column's maxima sit at different ``k``, far apart) is recomputed exactly in log space
    from ``a()`` (a callable: the log operand is rebuilt only if something underflowed) and
    ``b``; rows or columns that are all ``-inf`` are exactly ``-inf`` and need no recompute.
    Writes into ``out`` if given (a view will do).
    """
    (ua, a_shift, a_top), (ub, b_shift, b_top) = a_scaled, b_scaled
    product = _backend.matmul(xp, ua, ub)
    threshold = underflow_threshold(product.dtype, ua.shape[-1])
    if on_device(xp):  # one fused pass; the flags stay on the device: no synchronisation
        out = xp.empty(product.shape, product.dtype) if out is None else out
        lost = xp.empty(product.shape, bool)
        product_epilogue(xp)(product, a_shift, b_shift, a_top, b_top, threshold, -np.inf, out, lost)
        _recompute_lost_on_device(xp, a(), b, out, lost)
        return out
    with np.errstate(divide="ignore"):
        out = xp.log(product, out=out)
    out += a_shift
    out += b_shift
    lost = product < threshold
    if lost.any():
        lost &= a_top > -np.inf
        lost &= b_top > -np.inf
        if lost.any():
            _recompute_lost(xp, a(), b, out, lost)
    return out


def _numpy_epilogue(product: Array, a_shift: Array, b_shift: Array, a_top: Array, b_top: Array, threshold: float,
                    neg_inf: float, out: Array, lost: Array) -> None:
    """The NumPy twin of the GPU's fused epilogue (:func:`product_epilogue`): the same
    arguments, the same results."""
    with np.errstate(divide="ignore"):
        np.log(product, out=out)
    out += a_shift
    out += b_shift
    np.logical_and(product < threshold, (a_top > neg_inf) & (b_top > neg_inf), out=lost)


@functools.cache
def product_epilogue(xp: ModuleType) -> Callable[..., Any]:
    """What follows the GEMM of :func:`log_product`, in one pass: ``out = log(product) +
    a_shift + b_shift`` and ``lost = product < threshold`` where the row's and the column's
    maxima are above ``neg_inf`` (arguments broadcast; ``out`` and ``lost`` written in place).
    On CuPy one ``ElementwiseKernel`` (instead of five passes and their temporaries), on
    NumPy its twin of identical semantics."""
    if xp is np:
        return _numpy_epilogue
    kernel: Callable[..., Any] = xp.ElementwiseKernel(
        "T product, T a_shift, T b_shift, T a_top, T b_top, T threshold, T neg_inf", "T out, bool lost",
        "out = log(product) + a_shift + b_shift; "
        "lost = product < threshold && a_top > neg_inf && b_top > neg_inf",
        "spchain_log_product_epilogue")
    return kernel


def on_device(xp: ModuleType) -> bool:
    """Whether ``xp`` is CuPy, whose hot paths must not synchronise with the host (checked by
    tests/test_gpu_sync.py): their flags stay on the device, read by the kernels themselves."""
    return xp is not np


def weighted(xp: ModuleType, marginals: Array, weight: Array) -> Array:
    """``marginals`` (B, v, c), a fresh array, times ``weight`` (B,) in place; on the CPU as is
    where every weight is 1 (an HMM's E-step), which saves a pass over them (the GPU skips the
    test: it would synchronise)."""
    if on_device(xp) or not bool((weight == 1).all()):
        marginals *= weight[:, None, None]
    return marginals


def log_matmul_grads(xp: ModuleType, a: Array, b: Array, out: Array, grad: Array, need_a: bool = True,
                     need_b: bool = True) -> tuple[Array | None, Array | None]:
    """Gradients of ``sum(grad * log_matmul(a, b))``: ``(d a, d b)``, of the broadcast batch shape.

    ``out`` is the forward result. Never builds an (m, k, n) tensor: with the forward's
    scaled product ``r`` recomputed, ``d a = u * ((grad / r) @ e^T)`` and
    ``d b = e * (u^T @ (grad / r))``, where ``u = exp(a - rowmax)`` and ``e = exp(b - colmax)``
    (the softmax weights, rebuilt from the max shifts); the weights ``grad / r`` are exact
    whatever the magnitude of the logs, and scaled per batch element, so each element gets its
    gradient as if computed alone, whatever the others' scale. Entries whose ``r`` underflowed
    contribute exactly, in log space, instead. Entries where ``out`` is ``-inf`` have no weight and contribute 0; where
    it is ``+inf``, ``grad`` goes in equal shares to the ``+inf`` terms (:class:`PosInf`).
    Returns ``None`` for a gradient that is not needed.
    """
    batch_shape = out.shape[:-2]
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    grad_a = xp.zeros(batch_shape + (m, k), a.dtype) if need_a else None
    grad_b = xp.zeros(batch_shape + (k, n), a.dtype) if need_b else None
    if 0 in out.shape or k == 0:
        return grad_a, grad_b
    if on_device(xp):
        _log_matmul_grads_on_device(xp, a, b, out, grad, grad_a, grad_b)
        return grad_a, grad_b
    a_top, b_top = a.max(axis=-1, keepdims=True), b.max(axis=-2, keepdims=True)
    infinite = PosInf.of(xp, a, b, a_top, b_top)
    if infinite is not None:
        grad = infinite.add_grads(xp, out, grad, grad_a, grad_b)
        a, b = infinite.a, infinite.b
        a_top, b_top = a.max(axis=-1, keepdims=True), b.max(axis=-2, keepdims=True)
    a_shift, b_shift = finite_or_zero(xp, a_top), finite_or_zero(xp, b_top)
    u = xp.exp(a - a_shift)
    e = xp.exp(b - b_shift)
    scaled = _backend.matmul(xp, u, e)
    lost = scaled < underflow_threshold(a.dtype, k)
    # weights scaled to at most 1 per batch element, so that grad / r cannot overflow and an
    # element of tiny gradients is not lost beside one of huge ones; NaN flows through
    scale = xp.where(xp.isfinite(grad), xp.abs(grad), 0).max(axis=(-2, -1), keepdims=True)
    scale = xp.where(scale > 0, scale, 1)
    # where no sum underflowed and none is NaN (the usual case), every r is a positive number
    # and the weights need no masks
    masked = bool(lost.any()) or bool(xp.isnan(scaled.sum()))
    if masked:
        w = xp.where(lost | (grad == 0), 0, (grad / scale) / xp.where(lost, 1, scaled))
    else:
        w = (grad / scale) / scaled
    if need_a:
        grad_a += scale * u * _backend.matmul(xp, w, e.swapaxes(-1, -2))
    if need_b:
        grad_b += scale * e * _backend.matmul(xp, u.swapaxes(-1, -2), w)
    exact = lost & (grad != 0) & (out > -np.inf) if masked else None
    if exact is not None and exact.any():
        a3, b3, a_index, b_index = batched_operands(xp, a, b, batch_shape)
        batch, rows, cols = xp.nonzero(flat_batch(exact))
        flat_grad, flat_out = flat_batch(grad), flat_batch(out)
        ks = xp.arange(k)[None, :]
        for p in _chunks(batch.shape[0], k):
            pb, pr, pc = batch[p], rows[p], cols[p]
            terms = flat_grad[pb, pr, pc][:, None] * xp.exp(
                a3[a_index[pb], pr, :] + b3[b_index[pb], :, pc] - flat_out[pb, pr, pc][:, None])
            if need_a:
                _backend.scatter_add(xp, flat_batch(grad_a), (pb[:, None], pr[:, None], ks), terms)
            if need_b:
                _backend.scatter_add(xp, flat_batch(grad_b), (pb[:, None], ks, pc[:, None]), terms)
    return grad_a, grad_b


def _without_posinf(xp: ModuleType, a: Array, b: Array) -> tuple[Array, Array, Array]:
    """``(found, a, b)``: whether ``a`` or ``b`` holds ``+inf`` (a device array of one flag) and
    the operands with ``+inf`` made ``-inf`` (:class:`PosInf`), without a synchronisation."""
    found = (xp.isposinf(a).any() | xp.isposinf(b).any()).reshape(1)
    return found, xp.where(xp.isposinf(a), -np.inf, a), xp.where(xp.isposinf(b), -np.inf, b)


def _log_matmul_on_device(xp: ModuleType, a: Array, b: Array, out: Array | None) -> Array:
    """:func:`log_matmul` on the GPU without a synchronisation: the product of the operands
    with ``+inf`` made ``-inf``, then one kernel sets the outputs with a ``+inf`` term to
    ``+inf`` (it reads on the device whether there is any, and returns at once if not)."""
    found, clean_a, clean_b = _without_posinf(xp, a, b)
    out = log_product(xp, scaled(xp, clean_a, -1), scaled(xp, clean_b, -2), lambda: clean_a, clean_b, out)
    _on_entries(xp, cuda.logspace.launch_log_product_posinf_fixup, a, b, out, found)
    return out


def _log_matmul_grads_on_device(xp: ModuleType, a: Array, b: Array, out: Array, grad: Array,
                                grad_a: Array | None, grad_b: Array | None) -> None:
    """:func:`log_matmul_grads` on the GPU without a synchronisation: the scaled GEMMs on the
    operands with ``+inf`` made ``-inf``, then one kernel adds, with atomics, the exact terms
    of the entries whose scaled sum underflowed and the shares of the ``+inf`` outputs (it
    reads both flags on the device)."""
    k = a.shape[-1]
    found, clean_a, clean_b = _without_posinf(xp, a, b)
    finite_grad = xp.where(xp.isposinf(out), 0, grad)
    u = xp.exp(clean_a - finite_or_zero(xp, clean_a.max(axis=-1, keepdims=True)))
    e = xp.exp(clean_b - finite_or_zero(xp, clean_b.max(axis=-2, keepdims=True)))
    scaled_sum = _backend.matmul(xp, u, e)
    lost = scaled_sum < underflow_threshold(a.dtype, k)
    scale = xp.where(xp.isfinite(finite_grad), xp.abs(finite_grad), 0).max(axis=(-2, -1), keepdims=True)
    scale = xp.where(scale > 0, scale, 1)
    w = xp.where(lost | (finite_grad == 0), 0, (finite_grad / scale) / xp.where(lost, 1, scaled_sum))
    if grad_a is not None:
        grad_a += scale * u * _backend.matmul(xp, w, e.swapaxes(-1, -2))
    if grad_b is not None:
        grad_b += scale * e * _backend.matmul(xp, u.swapaxes(-1, -2), w)
    exact = (lost & (finite_grad != 0) & (out > -np.inf)).astype(np.uint8)
    none = xp.zeros((0, 1, 1), a.dtype)
    _on_entries(xp, cuda.logspace.launch_log_product_grads, a, b, out, found,
                flat_batch(xp.broadcast_to(grad, out.shape)), flat_batch(exact),
                none if grad_a is None else flat_batch(grad_a), none if grad_b is None else flat_batch(grad_b))


def _on_entries(xp: ModuleType, launcher: Callable[..., Any], a: Array, b: Array, out: Array,
                *args: Array) -> None:
    """Launch ``launcher`` (of ``spchain.kernels.cuda.logspace``), a thread an entry of ``out``, with
    ``a`` and ``b`` as (B, m, k) and (B, k, n) and the index of each entry's own, and ``out``
    flattened to (P, m, n) (written back if that took a copy)."""
    a3, b3, a_index, b_index = batched_operands(xp, a, b, out.shape[:-2])
    view = out.ndim <= 3 or out.flags.c_contiguous  # then flat_batch(out) is a view of out
    flat_out = flat_batch(out if view else xp.ascontiguousarray(out))
    _backend.device_kernel(xp, launcher)(a3, b3, a_index, b_index, *args[:1], flat_out, *args[1:])
    if not view:
        out[...] = flat_out.reshape(out.shape)


def flat_batch(a: Array, tail: int = 2) -> Array:
    """``a`` with its leading axes (all but the last ``tail``) flattened into one."""
    return a.reshape((int(np.prod(a.shape[:a.ndim - tail], dtype=np.int64)),) + a.shape[a.ndim - tail:])


def reduce_to(grad: Array, shape: Shape) -> Array:
    """Sum ``grad`` over the leading and size-1 axes along which an operand of ``shape`` broadcast
    (an array also for ``shape`` (), not a NumPy scalar)."""
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + k for k, size in enumerate(shape) if size == 1 and grad.shape[lead + k] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape) if axes else grad


def batched_operands(xp: ModuleType, a: Array, b: Array, batch_shape: Shape) -> tuple[Array, Array, Array, Array]:
    """``a`` as (Ba, m, k), ``b`` as (Bb, k, n), and for each flat index of the broadcast
    ``batch_shape`` the index of its ``a`` and its ``b``."""
    full = batch_shape or (1,)
    a3, b3 = flat_batch(a), flat_batch(b)
    a_index = xp.broadcast_to(xp.arange(a3.shape[0]).reshape(a.shape[:-2] or (1,)), full).reshape(-1)
    b_index = xp.broadcast_to(xp.arange(b3.shape[0]).reshape(b.shape[:-2] or (1,)), full).reshape(-1)
    return a3, b3, a_index, b_index


def _chunks(count: int, width: int) -> list[slice]:
    """Slices of ``range(count)`` whose gathered ``(len, width)`` blocks stay under FIXUP_CHUNK."""
    step = max(1, FIXUP_CHUNK // max(width, 1))
    return [slice(start, start + step) for start in range(0, count, step)]


def _recompute_lost_on_device(xp: ModuleType, a: Array, b: Array, out: Array, lost: Array) -> None:
    """:func:`_recompute_lost` as one CUDA kernel that reads ``lost`` on the device and
    recomputes only the flagged entries (``spchain/kernels/cuda/logspace.py``)."""
    _on_entries(xp, cuda.logspace.launch_log_product_fixup, a, b, out, flat_batch(lost).astype(np.uint8))


def _recompute_lost(xp: ModuleType, a: Array, b: Array, out: Array, lost: Array) -> None:
    """Overwrite ``out`` where ``lost`` with the exact log-space sums.

    Where many entries are lost (structural zeros: a left-to-right chain, say), one 0/1 GEMM
    first rules out the entries with no finite term at all, which are exactly ``-inf``.
    """
    k = a.shape[-1]
    if int(lost.sum()) * k > FIXUP_CHUNK:
        dtype = a.dtype
        support = _backend.matmul(xp, (a > -np.inf).astype(dtype), (b > -np.inf).astype(dtype)) > 0
        lost &= support
    a3, b3, a_index, b_index = batched_operands(xp, a, b, out.shape[:-2])
    flat_out = flat_batch(out)
    batch, rows, cols = xp.nonzero(flat_batch(lost))
    for p in _chunks(batch.shape[0], k):
        pb, pr, pc = batch[p], rows[p], cols[p]
        flat_out[pb, pr, pc] = logsumexp(xp, a3[a_index[pb], pr, :] + b3[b_index[pb], :, pc], axis=-1)
