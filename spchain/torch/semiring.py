"""logmatmul, maxmatmul and log_chain_product for torch tensors, with autograd."""

import numpy as np
import torch

from .. import _backend, _checks, _logspace
from .. import semiring as _semiring
from ._bridge import check_same_device, first_order, on_device, to_array, to_tensor

_QUIET = {"divide": "ignore", "invalid": "ignore", "over": "ignore"}


class _LogMatmul(torch.autograd.Function):
    """Saves a, b and the result; the backward rebuilds the softmax weights from the max
    shifts by GEMMs (as genbmm does), never an (m, k, n) tensor."""

    @staticmethod
    def forward(ctx, a, b):
        device = check_same_device("spchain.torch.logmatmul", a=a, b=b)
        _checks.dense("spchain.torch.logmatmul", a=a, b=b)
        with on_device(device):
            out = to_tensor(_semiring.logmatmul(to_array(a), to_array(b)))
        ctx.save_for_backward(a, b, out)
        return out

    @staticmethod
    @first_order("spchain.torch.logmatmul")
    def backward(ctx, grad):
        a, b, out = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        with on_device(grad.device), np.errstate(**_QUIET):
            backend, a_, b_, _ = _semiring._operands(to_array(a), to_array(b), "spchain.torch.logmatmul")
            xp = backend.xp
            grad_a, grad_b = _logspace.log_matmul_grads(
                xp, a_, b_, to_array(out), to_array(grad).astype(a_.dtype, copy=False), need_a, need_b)
            return (to_tensor(_logspace.reduce_to(grad_a, a.shape)).to(a.dtype) if need_a else None,
                    to_tensor(_logspace.reduce_to(grad_b, b.shape)).to(b.dtype) if need_b else None)


class _MaxMatmul(torch.autograd.Function):
    """Saves the argmax and the values, and ``a`` and ``b`` only if a value is ``+inf`` (the
    backward then shares its gradient among the ``+inf`` terms)."""

    @staticmethod
    def forward(ctx, a, b):
        device = check_same_device("spchain.torch.maxmatmul", a=a, b=b)
        _checks.dense("spchain.torch.maxmatmul", a=a, b=b)
        with on_device(device):
            values, argmax = (to_tensor(r) for r in _semiring.maxmatmul(to_array(a), to_array(b)))
        ctx.mark_non_differentiable(argmax)
        ctx.save_for_backward(values, argmax, *((a, b) if bool(torch.isposinf(values).any()) else ()))
        ctx.shapes = a.shape, b.shape
        return values, argmax

    @staticmethod
    @first_order("spchain.torch.maxmatmul")
    def backward(ctx, grad, _):
        values, argmax, *operands = ctx.saved_tensors
        a_shape, b_shape = ctx.shapes
        with on_device(grad.device), np.errstate(**_QUIET):
            g = to_array(grad).astype(to_array(values).dtype, copy=False)
            xp = _backend.backend_of(g).xp
            infinite = None
            if operands:
                _, a, b, _ = _semiring._operands(*(to_array(t) for t in operands), "spchain.torch.maxmatmul")
                infinite = _logspace.PosInf(xp, a, b)
            grad_a, grad_b = _semiring.maxmatmul_grads(
                xp, a_shape, b_shape, to_array(values), to_array(argmax), g, infinite)
            return to_tensor(grad_a), to_tensor(grad_b)


class _LogChainProduct(torch.autograd.Function):
    """Saves only ``m``; the backward recomputes the prefix products, a chunk at a time."""

    @staticmethod
    def forward(ctx, m):
        device = check_same_device("spchain.torch.log_chain_product", m=m)
        _checks.dense("spchain.torch.log_chain_product", m=m)
        with on_device(device):
            out = to_tensor(_semiring.log_chain_product(to_array(m)))
        ctx.save_for_backward(m)
        return out

    @staticmethod
    @first_order("spchain.torch.log_chain_product")
    def backward(ctx, grad):
        (m,) = ctx.saved_tensors
        with on_device(grad.device), np.errstate(**_QUIET):
            backend, m_ = _semiring._chain_operand(to_array(m), "spchain.torch.log_chain_product")
            grad_m = _semiring.log_chain_product_grad(backend.xp, m_, to_array(grad).astype(m_.dtype, copy=False))
            return to_tensor(grad_m).to(m.dtype)


def logmatmul(a, b):
    """:func:`spchain.logmatmul` for tensors, differentiable in ``a`` and ``b``.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> a = torch.zeros(2, 3, requires_grad=True)
    >>> st.logmatmul(a, torch.zeros(3, 2)).sum().backward()
    >>> a.grad                                  # each term weighs 1/3 of its sum
    tensor([[0.6667, 0.6667, 0.6667],
            [0.6667, 0.6667, 0.6667]])
    """
    return _LogMatmul.apply(a, b)


def maxmatmul(a, b):
    """:func:`spchain.maxmatmul` for tensors: ``(values, argmax)``; ``values`` is
    differentiable (sub-gradients through the argmax), ``argmax`` is not.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> a = torch.tensor([[0.0, 1.0]], requires_grad=True)
    >>> values, argmax = st.maxmatmul(a, torch.tensor([[2.0], [2.0]]))
    >>> values.sum().backward()
    >>> a.grad
    tensor([[0., 1.]])
    """
    return _MaxMatmul.apply(a, b)


def log_chain_product(m):
    """:func:`spchain.log_chain_product` for tensors, differentiable in ``m``.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> m = torch.zeros(5, 2, 2)                # five all-ones matrices
    >>> st.log_chain_product(m).exp()           # 2**4 everywhere
    tensor([[16., 16.],
            [16., 16.]])
    """
    return _LogChainProduct.apply(m)
