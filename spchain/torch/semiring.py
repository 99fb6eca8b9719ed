"""logmatmul, maxmatmul and log_chain_product for torch tensors: the operators
``spchain::logmatmul``, ``spchain::maxmatmul`` and ``spchain::log_chain_product`` over the
array-level pairs of :mod:`spchain.semiring` (see :class:`._operator.Operator`)."""

import functools
from collections.abc import Callable

import torch

from .. import semiring as _semiring
from ._bridge import check_dense
from ._operator import Operator


def _product_fake(caller: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        shape = _semiring.product_shape(caller, tuple(a.shape), tuple(b.shape))
        return a.new_empty(shape, dtype=torch.promote_types(a.dtype, b.dtype))
    return fake


def _maxmatmul_fake(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = _product_fake("spchain.torch.maxmatmul")(a, b)
    return values, torch.empty_like(values, dtype=torch.int64)


def _log_chain_product_fake(m: torch.Tensor) -> torch.Tensor:
    return m.new_empty(m.shape[:-3] + m.shape[-2:])


# vmap: a call a slice for the products (one call with the batch leading would misalign the
# broadcast of operands with different numbers of batch axes); one call for the chain product.
_LOGMATMUL = Operator(
    "logmatmul", "(Tensor a, Tensor b) -> Tensor",
    functools.partial(_semiring.logmatmul_forward, caller="spchain.torch.logmatmul"),
    _product_fake("spchain.torch.logmatmul"),
    backward=_semiring.logmatmul_backward, differentiable=(0, 1))
_MAXMATMUL = Operator(
    "maxmatmul", "(Tensor a, Tensor b) -> (Tensor, Tensor)",
    functools.partial(_semiring.maxmatmul_forward, caller="spchain.torch.maxmatmul"), _maxmatmul_fake,
    outputs=2, backward=_semiring.maxmatmul_backward, differentiable=(0, 1))
_LOG_CHAIN_PRODUCT = Operator(
    "log_chain_product", "(Tensor m) -> Tensor",
    functools.partial(_semiring.log_chain_product_forward, caller="spchain.torch.log_chain_product"),
    _log_chain_product_fake,
    backward=_semiring.log_chain_product_backward, differentiable=(0,), leading_batch=(0,))


def logmatmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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
    check_dense("spchain.torch.logmatmul", a=a, b=b)
    out: torch.Tensor = _LOGMATMUL(a, b)
    return out


def maxmatmul(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    check_dense("spchain.torch.maxmatmul", a=a, b=b)
    values, argmax = _MAXMATMUL(a, b)
    return values, argmax


def log_chain_product(m: torch.Tensor) -> torch.Tensor:
    """:func:`spchain.log_chain_product` for tensors, differentiable in ``m``.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> m = torch.zeros(5, 2, 2)                # five all-ones matrices
    >>> st.log_chain_product(m).exp()           # 2**4 everywhere
    tensor([[16., 16.],
            [16., 16.]])
    """
    check_dense("spchain.torch.log_chain_product", m=m)
    out: torch.Tensor = _LOG_CHAIN_PRODUCT(m)
    return out
