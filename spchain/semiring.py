"""Log-semiring and max-plus matrix products: logmatmul, maxmatmul, log_chain_product.

``logmatmul`` is a scaled GEMM made exact (``_logspace.log_matmul``); ``maxmatmul`` a Numba
kernel; ``log_chain_product`` a pairwise reduction done in place in one buffer per chunk of
the batch, which carries the last matrix of an odd level up unchanged (padding with a zero
log-matrix would multiply by the all-ones matrix, not the identity).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

from . import _backend, _checks, _logspace
from ._dask import scales_out
from ._typing import Array, Shape
from .kernels import cpu, cuda

CHAIN_CHUNK_BYTES = 1 << 28
"""Bytes of input that ``log_chain_product`` reduces at a time (bounds its working memory)."""


def product_shape(caller: str, a_shape: Shape, b_shape: Shape) -> Shape:
    """The result shape of a product over the last two axes of operands of these shapes
    (leading axes broadcast); ``ValueError`` where they do not fit. The one shape rule of
    :func:`logmatmul` and :func:`maxmatmul`, which ``spchain.torch``'s fakes share.

    >>> product_shape("f", (2, 3, 4), (4, 5))
    (2, 3, 5)
    """
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ValueError(f"{caller}: a and b must have at least two axes, got shapes {a_shape} and {b_shape}")
    if a_shape[-1] != b_shape[-2]:
        raise ValueError(f"{caller}: shapes {a_shape} and {b_shape} do not match: "
                         f"a has {a_shape[-1]} columns but b has {b_shape[-2]} rows")
    try:
        batch_shape = _checks.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    except ValueError:
        raise ValueError(f"{caller}: batch shapes of {a_shape} and {b_shape} do not broadcast") from None
    return tuple(batch_shape) + (a_shape[-2], b_shape[-1])


def _operands(a: Array, b: Array, caller: str) -> tuple[_backend.Backend, Array, Array, Shape]:
    """Validated ``(backend, a, b, batch_shape)`` of a product over the last two axes."""
    a, b = _checks.dense(caller, a=a, b=b)
    backend = _backend.backend_of(a, b, caller=caller)
    dtype = _checks.float_dtype(caller, a=a, b=b)
    batch_shape = product_shape(caller, tuple(a.shape), tuple(b.shape))[:-2]
    return backend, a.astype(dtype, copy=False), b.astype(dtype, copy=False), batch_shape


def _trusted(a: Array, b: Array) -> tuple[ModuleType, Array, Array]:
    """``(xp, a, b)`` of operands that a forward has validated, in their common dtype."""
    dtype = np.promote_types(a.dtype, b.dtype)
    return _backend.backend_of(a, b).xp, a.astype(dtype, copy=False), b.astype(dtype, copy=False)


@scales_out
def logmatmul(a: Array, b: Array) -> Array:
    """Log-semiring product ``log(exp(a) @ exp(b))`` over the last two axes.

    Leading axes broadcast. Never builds the (..., m, k, n) intermediate: one GEMM in scaled
    space, with the entries that underflowed found and recomputed exactly in log space. An
    all ``-inf`` row or column gives ``-inf``; NaN propagates. ``+inf`` in gives ``+inf``
    out, never NaN: a term ``+inf + -inf`` is ``-inf`` (log-space zero, a structural zero,
    wins), and an output with any other ``+inf`` term is ``+inf``. In ``spchain.torch`` the
    gradient of a ``+inf`` output goes in equal shares to its ``+inf`` terms.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> a = np.array([[0.0, np.log(2.0)], [-np.inf, 0.0]])   # log of [[1, 2], [0, 1]]
    >>> np.exp(sc.logmatmul(a, a))
    array([[1., 4.],
           [0., 1.]])
    """
    return logmatmul_forward(a, b)


def logmatmul_forward(a: Array, b: Array, caller: str = "spchain.logmatmul") -> Array:
    """:func:`logmatmul` with its checks naming ``caller``; the result is also the only
    residual :func:`logmatmul_backward` needs."""
    backend, a, b, _ = _operands(a, b, caller)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), backend.use():
        return _logspace.log_matmul(backend.xp, a, b)


def logmatmul_backward(inputs: Sequence[Array], results: Sequence[Array], grads: Sequence[Array],
                       needs: Sequence[bool]) -> tuple[Array | None, Array | None]:
    """Gradients ``(d a, d b)`` of ``sum(grad * logmatmul(a, b))`` (``None`` where ``needs``
    is false), from ``inputs = (a, b)``, ``results = (out,)`` of :func:`logmatmul_forward`
    and ``grads = (grad,)``: the softmax weights rebuilt from the max shifts by GEMMs (as
    genbmm does), never an (m, k, n) array; a ``+inf`` output's gradient goes in equal shares
    to its ``+inf`` terms. The inputs are trusted (no second validation).
    """
    (a, b), (out,), (grad,) = inputs, results, grads
    xp, a_, b_ = _trusted(a, b)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        grad_a, grad_b = _logspace.log_matmul_grads(xp, a_, b_, out, grad.astype(a_.dtype, copy=False), *needs)
    return (_logspace.reduce_to(grad_a, a.shape) if needs[0] else None,
            _logspace.reduce_to(grad_b, b.shape) if needs[1] else None)


@scales_out
def maxmatmul(a: Array, b: Array) -> tuple[Array, Array]:
    """Max-plus product: ``values[..., i, j] = max_k a[..., i, k] + b[..., k, j]`` and its argmax.

    Leading axes broadcast. Ties go to the lowest ``k``; NaN wins over numbers (NaN out).
    A term with a ``-inf`` side is ``-inf``, even beside ``+inf`` (log-space zero is a
    structural zero), so ``+inf`` in gives ``+inf`` out, never NaN. Where every term is
    ``-inf`` (``k = 0`` included) the value is ``-inf`` and the argmax 0; its gradient in
    ``spchain.torch`` is 0 there, and a ``+inf`` value's goes in equal shares to its ``+inf`` terms.

    Returns
    -------
    values : array (..., m, n)
    argmax : int64 array (..., m, n)

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> values, argmax = sc.maxmatmul(np.array([[0.0, 1.0]]), np.array([[2.0], [2.0]]))
    >>> values, argmax
    (array([[3.]]), array([[1]]))
    """
    return maxmatmul_forward(a, b)


def maxmatmul_forward(a: Array, b: Array, caller: str = "spchain.maxmatmul") -> tuple[Array, Array]:
    """:func:`maxmatmul` with its checks naming ``caller``: ``(values, argmax)``, which are
    also what :func:`maxmatmul_backward` needs besides ``a`` and ``b``."""
    backend, a, b, batch_shape = _operands(a, b, caller)
    xp = backend.xp
    m, n = a.shape[-2], b.shape[-1]
    with backend.use():
        a3, b3, a_index, b_index = _logspace.batched_operands(xp, a, b, batch_shape)
        values = xp.empty(a_index.shape + (m, n), a.dtype)
        argmax = xp.empty(values.shape, np.int64)
        if values.size:
            kernel = cpu.semiring.max_matmul if not backend.on_gpu else backend.launcher(cuda.semiring.launch_max_matmul)
            kernel(a3, b3, a_index, b_index, values, argmax)
        return values.reshape(batch_shape + (m, n)), argmax.reshape(batch_shape + (m, n))


def maxmatmul_backward(inputs: Sequence[Array], results: Sequence[Array], grads: Sequence[Array],
                       needs: Sequence[bool]) -> tuple[Array, Array]:
    """Sub-gradients ``(d a, d b)`` of ``sum(grad * values)`` from ``inputs = (a, b)``,
    ``results = (values, argmax)`` of :func:`maxmatmul_forward` and ``grads = (grad, _)``
    (see :func:`maxmatmul_grads`); both are computed, whatever ``needs`` says."""
    (a, b), (values, argmax), grad = inputs, results, grads[0]
    xp, a_, b_ = _trusted(a, b)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if _logspace.on_device(xp):  # no synchronisation: the +inf shares are zero where no value is +inf
            infinite: _logspace.PosInf | None = _logspace.PosInf(xp, a_, b_)
        else:
            infinite = _logspace.PosInf(xp, a_, b_) if bool(xp.isposinf(values).any()) else None
        return maxmatmul_grads(xp, a.shape, b.shape, values, argmax, grad.astype(values.dtype, copy=False),
                               infinite)


def maxmatmul_grads(xp: ModuleType, a_shape: Shape, b_shape: Shape, values: Array, argmax: Array, grad: Array,
                    infinite: _logspace.PosInf | None = None) -> tuple[Array, Array]:
    """Sub-gradients of ``sum(grad * values)``, ``values, argmax = maxmatmul(a, b)``.

    ``grad`` goes to the argmax terms; nowhere where ``values`` is ``-inf`` (no term is
    possible); at a ``+inf`` value, in equal shares to its ``+inf`` terms, which
    ``infinite`` (the :class:`_logspace.PosInf` of ``a`` and ``b``) must then give.
    """
    batch_shape, (m, n), k = grad.shape[:-2], grad.shape[-2:], a_shape[-1]
    grad_a = xp.zeros(batch_shape + (m, k), grad.dtype)
    grad_b = xp.zeros(batch_shape + (k, n), grad.dtype)
    if grad.size == 0 or k == 0:
        return _logspace.reduce_to(grad_a, a_shape), _logspace.reduce_to(grad_b, b_shape)
    grad = xp.where(xp.isneginf(values), 0, grad)
    if infinite is not None:
        grad = infinite.add_grads(xp, values, grad, grad_a, grad_b)
    arg, flat_grad = _logspace.flat_batch(argmax), _logspace.flat_batch(grad)
    batch = xp.arange(arg.shape[0])[:, None, None]
    rows, cols = xp.arange(m)[None, :, None], xp.arange(n)[None, None, :]
    _backend.scatter_add(xp, _logspace.flat_batch(grad_a), (batch, rows, arg), flat_grad)
    _backend.scatter_add(xp, _logspace.flat_batch(grad_b), (batch, arg, cols), flat_grad)
    return _logspace.reduce_to(grad_a, a_shape), _logspace.reduce_to(grad_b, b_shape)


def _chain_operand(m: Array, caller: str) -> tuple[_backend.Backend, Array]:
    (m,) = _checks.dense(caller, m=m)
    backend = _backend.backend_of(m, caller=caller)
    dtype = _checks.float_dtype(caller, m=m)
    if m.ndim < 3 or m.shape[-1] != m.shape[-2]:
        raise ValueError(f"{caller}: m must have shape (..., L, c, c), got {m.shape}")
    if m.shape[-3] < 1:
        raise ValueError(f"{caller}: m has shape {m.shape}: a chain needs at least one matrix (L >= 1)")
    return backend, m.astype(dtype, copy=False)


def _row_chunks(m: Array) -> tuple[int, list[slice]]:
    """Slices of the flattened batch whose (rows, L, c, c) inputs stay under CHAIN_CHUNK_BYTES."""
    rows = int(np.prod(m.shape[:-3], dtype=np.int64))
    per_row = max(1, m.dtype.itemsize * int(np.prod(m.shape[-3:], dtype=np.int64)))
    step = max(1, CHAIN_CHUNK_BYTES // per_row)
    return rows, [slice(start, start + step) for start in range(0, rows, step)]


@scales_out
def log_chain_product(m: Array) -> Array:
    """Log-space product of a chain of matrices: ``log(exp(m_1) @ ... @ exp(m_L))``.

    ``m`` is (..., L, c, c), any ``L >= 1``; returns (..., c, c). The chain is reduced
    pairwise, in place in one buffer (a copy of a chunk of the batch, so the caller's array
    is never written), each level's products by :func:`logmatmul`'s exact scaled GEMM; an odd
    level carries its last matrix up unchanged.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> m = np.array([[[0.0, 0.0], [-np.inf, 0.0]]] * 3)   # log of three [[1, 1], [0, 1]]
    >>> np.exp(sc.log_chain_product(m))
    array([[1., 3.],
           [0., 1.]])
    """
    return log_chain_product_forward(m)


def log_chain_product_forward(m: Array, caller: str = "spchain.log_chain_product") -> Array:
    """:func:`log_chain_product` with its checks naming ``caller``; no residual (the backward
    recomputes the prefix products from ``m``)."""
    backend, m = _chain_operand(m, caller)
    xp = backend.xp
    length, c = m.shape[-3], m.shape[-1]
    flat = _logspace.flat_batch(m, 3)
    rows, chunks = _row_chunks(m)
    out = xp.empty((rows, c, c), m.dtype)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), backend.use():
        for rows_slice in chunks:
            buf = flat[rows_slice].copy()
            level = length
            while level > 1:
                half = level // 2
                buf[:, :half] = _logspace.log_matmul(xp, buf[:, 0:2 * half:2], buf[:, 1:2 * half:2])
                if level % 2:
                    buf[:, half] = buf[:, level - 1]
                level = half + level % 2
            out[rows_slice] = buf[:, 0]
    return out.reshape(m.shape[:-3] + (c, c))


def log_chain_product_backward(inputs: Sequence[Array], results: Sequence[Array], grads: Sequence[Array],
                               needs: Sequence[bool]) -> tuple[Array]:
    """``(d m,)`` of ``sum(grad * log_chain_product(m))`` from ``inputs = (m,)`` and
    ``grads = (grad,)`` (see :func:`log_chain_product_grad`); ``m`` is trusted."""
    (m,), (grad,) = inputs, grads
    xp = _backend.backend_of(m).xp
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return (log_chain_product_grad(xp, m, grad.astype(m.dtype, copy=False)),)


def log_chain_product_grad(xp: ModuleType, m: Array, grad: Array) -> Array:
    """Gradient of ``sum(grad * log_chain_product(m))`` with respect to ``m``.

    The chain is folded left to right (``P_l = P_{l-1} ⊗ m_l``), a chunk of the batch at a time,
    keeping the prefix products (the size of the chunk's input), then unwound with
    :func:`_logspace.log_matmul_grads`: O(input) memory, no (c, c, c) tensor.
    """
    length = m.shape[-3]
    flat = _logspace.flat_batch(m, 3)
    flat_grad = _logspace.flat_batch(grad)
    out = xp.empty(flat.shape, m.dtype)
    _, chunks = _row_chunks(m)
    for rows in chunks:
        mats = flat[rows]
        prefix = xp.empty(mats.shape, m.dtype)
        prefix[:, 0] = mats[:, 0]
        for step in range(1, length):
            prefix[:, step] = _logspace.log_matmul(xp, prefix[:, step - 1], mats[:, step])
        g = flat_grad[rows]
        for step in range(length - 1, 0, -1):
            g, out[rows, step] = _logspace.log_matmul_grads(xp, prefix[:, step - 1], mats[:, step], prefix[:, step], g)
        out[rows, 0] = g
    return out.reshape(m.shape)
