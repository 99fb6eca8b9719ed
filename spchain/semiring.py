"""Log-semiring and max-plus matrix products: logmatmul, maxmatmul, log_chain_product.

``logmatmul`` is a scaled GEMM made exact (``_logspace.log_matmul``); ``maxmatmul`` a Numba
kernel; ``log_chain_product`` a pairwise reduction done in place in one buffer per chunk of
the batch, which carries the last matrix of an odd level up unchanged (padding with a zero
log-matrix would multiply by the all-ones matrix, not the identity). Each is also an
:class:`~spchain._op.Op` (:data:`LOGMATMUL`, :data:`MAXMATMUL`, :data:`LOG_CHAIN_PRODUCT`),
which ``spchain.torch`` makes a torch operator of.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from . import _backend, _checks, _logspace
from ._dask import scales_out
from ._op import Grads, Op, Saved
from ._typing import Array, Shape
from .kernels import cpu, cuda

S = TypeVar("S", bound=Saved)

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


@dataclasses.dataclass(frozen=True)
class Operands:
    """The operands of a product over the last two axes, validated, in their common dtype."""

    backend: _backend.Backend
    a: Array
    b: Array
    batch_shape: Shape


def prepare_product(a: Any, b: Any, *, caller: str, check: bool = True) -> Operands:
    """The :class:`Operands` of :func:`logmatmul` or :func:`maxmatmul` (``check=False``:
    operands that a ``prepare`` has validated)."""
    if check:
        a, b = _checks.dense(caller, a=a, b=b)
        backend = _backend.backend_of(a, b, caller=caller)
        dtype = _checks.float_dtype(caller, a=a, b=b)
    else:
        backend, dtype = _backend.backend_of(a, b), np.promote_types(a.dtype, b.dtype)
    batch_shape = product_shape(caller, tuple(a.shape), tuple(b.shape))[:-2]
    return Operands(backend, a.astype(dtype, copy=False), b.astype(dtype, copy=False), batch_shape)


@dataclasses.dataclass(frozen=True)
class ProductGrads(Grads):
    """The gradients of a product's ``(a, b)``, ``None`` where not needed."""

    a: Array | None
    b: Array | None


@dataclasses.dataclass(frozen=True)
class Product(Saved):
    """What :data:`LOGMATMUL`'s backward reads: its output ``out``."""

    out: Array


@dataclasses.dataclass(frozen=True)
class MaxProduct(Saved):
    """What :data:`MAXMATMUL`'s backward reads: its outputs ``values`` and ``argmax``."""

    values: Array
    argmax: Array


@dataclasses.dataclass(frozen=True)
class _FromOutputs(Op[Operands, S]):
    """An :class:`~spchain._op.Op` whose backward reads its outputs only (``saved(*outputs)``):
    a registered operator passes no residuals."""

    def residuals(self, saved: S) -> tuple[Array, ...]:
        return ()

    def restore(self, outputs: Sequence[Array], residuals: Sequence[Array]) -> S:
        return self.saved(*outputs)


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
    (out,), _ = LOGMATMUL.forward(prepare_product(a, b, caller="spchain.logmatmul"))
    return out


def _logmatmul_forward(p: Operands) -> tuple[tuple[Array], Product]:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), p.backend.use():
        out = _logspace.log_matmul(p.backend.xp, p.a, p.b)
    return (out,), Product(out)


def _logmatmul_backward(p: Operands, saved: Product, grads: Sequence[Array | None],
                        needs: Sequence[bool]) -> ProductGrads:
    """Gradients of ``sum(grad * out)``: the softmax weights rebuilt from the max shifts by
    GEMMs (as genbmm does), never an (m, k, n) array; a ``+inf`` output's gradient goes in
    equal shares to its ``+inf`` terms."""
    (grad,) = grads
    assert grad is not None  # the operator gives zeros for an unused output
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        grad = grad.astype(p.a.dtype, copy=False)
        grad_a, grad_b = _logspace.log_matmul_grads(p.backend.xp, p.a, p.b, saved.out, grad, *needs)
    return ProductGrads(_logspace.reduce_to(grad_a, p.a.shape) if needs[0] else None,
                        _logspace.reduce_to(grad_b, p.b.shape) if needs[1] else None)


LOGMATMUL: Op[Operands, Product] = _FromOutputs(prepare_product, _logmatmul_forward, Product, _logmatmul_backward)
""":func:`logmatmul` as an :class:`~spchain._op.Op`: outputs ``(out,)``, differentiable in ``(a, b)``."""


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
    (values, argmax), _ = MAXMATMUL.forward(prepare_product(a, b, caller="spchain.maxmatmul"))
    return values, argmax


def _maxmatmul_forward(p: Operands) -> tuple[tuple[Array, Array], MaxProduct]:
    xp, a, b = p.backend.xp, p.a, p.b
    m, n = a.shape[-2], b.shape[-1]
    with p.backend.use():
        a3, b3, a_index, b_index = _logspace.batched_operands(xp, a, b, p.batch_shape)
        values = xp.empty(a_index.shape + (m, n), a.dtype)
        argmax = xp.empty(values.shape, np.int64)
        if values.size:
            if p.backend.on_gpu:
                p.backend.launcher(cuda.semiring.launch_max_matmul)(a3, b3, a_index, b_index, values, argmax)
            else:
                cpu.team.run(cpu.semiring.max_matmul, a3, b3, a_index, b_index, values,
                             argmax)
        values, argmax = values.reshape(p.batch_shape + (m, n)), argmax.reshape(p.batch_shape + (m, n))
    return (values, argmax), MaxProduct(values, argmax)


def _maxmatmul_backward(p: Operands, saved: MaxProduct, grads: Sequence[Array | None],
                        needs: Sequence[bool]) -> ProductGrads:
    """Sub-gradients of ``sum(grad * values)`` (see :func:`maxmatmul_grads`); both are
    computed, whatever ``needs`` says."""
    xp, grad = p.backend.xp, grads[0]
    assert grad is not None  # the operator gives zeros for an unused output
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if _logspace.on_device(xp):  # no synchronisation: the +inf shares are zero where no value is +inf
            infinite: _logspace.PosInf | None = _logspace.PosInf(xp, p.a, p.b)
        else:
            infinite = _logspace.PosInf(xp, p.a, p.b) if bool(xp.isposinf(saved.values).any()) else None
        return ProductGrads(*maxmatmul_grads(xp, p.a.shape, p.b.shape, saved.values, saved.argmax,
                                             grad.astype(saved.values.dtype, copy=False), infinite))


MAXMATMUL: Op[Operands, MaxProduct] = _FromOutputs(prepare_product, _maxmatmul_forward, MaxProduct,
                                                   _maxmatmul_backward)
""":func:`maxmatmul` as an :class:`~spchain._op.Op`: outputs ``(values, argmax)``, ``values``
differentiable in ``(a, b)``."""


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


@dataclasses.dataclass(frozen=True)
class ChainOperand:
    """The operand ``m`` (..., L, c, c) of :func:`log_chain_product`, validated, floating."""

    backend: _backend.Backend
    m: Array


@dataclasses.dataclass(frozen=True)
class ChainProductGrads(Grads):
    """The gradient of :func:`log_chain_product`'s ``m``, ``None`` where not needed."""

    m: Array | None


def prepare_chain_product(m: Any, *, caller: str = "spchain.log_chain_product", check: bool = True) -> ChainOperand:
    """The :class:`ChainOperand` of :func:`log_chain_product` (``check=False``: an operand that
    a ``prepare`` has validated)."""
    if not check:
        return ChainOperand(_backend.backend_of(m), m)
    (m,) = _checks.dense(caller, m=m)
    backend = _backend.backend_of(m, caller=caller)
    dtype = _checks.float_dtype(caller, m=m)
    if m.ndim < 3 or m.shape[-1] != m.shape[-2]:
        raise ValueError(f"{caller}: m must have shape (..., L, c, c), got {m.shape}")
    if m.shape[-3] < 1:
        raise ValueError(f"{caller}: m has shape {m.shape}: a chain needs at least one matrix (L >= 1)")
    return ChainOperand(backend, m.astype(dtype, copy=False))


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
    (out,), _ = LOG_CHAIN_PRODUCT.forward(prepare_chain_product(m))
    return out


def _log_chain_product_forward(p: ChainOperand) -> tuple[tuple[Array], Saved]:
    """The product; no residual (the backward recomputes the prefix products from ``m``)."""
    backend, m = p.backend, p.m
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
    return (out.reshape(m.shape[:-3] + (c, c)),), Saved()


def _log_chain_product_backward(p: ChainOperand, saved: Saved, grads: Sequence[Array | None],
                                needs: Sequence[bool]) -> ChainProductGrads:
    """``d m`` of ``sum(grad * log_chain_product(m))`` (see :func:`log_chain_product_grad`)."""
    (grad,) = grads
    assert grad is not None  # the operator gives zeros for an unused output
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return ChainProductGrads(log_chain_product_grad(p.backend.xp, p.m, grad.astype(p.m.dtype, copy=False)))


LOG_CHAIN_PRODUCT: Op[ChainOperand, Saved] = Op(prepare_chain_product, _log_chain_product_forward, Saved,
                                                _log_chain_product_backward, reads_outputs=False)
""":func:`log_chain_product` as an :class:`~spchain._op.Op`: outputs ``(out,)``, differentiable in ``m``."""


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
