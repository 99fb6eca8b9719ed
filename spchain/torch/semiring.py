"""logmatmul, maxmatmul and log_chain_product for torch tensors: the operators
``spchain::logmatmul``, ``spchain::maxmatmul`` and ``spchain::log_chain_product`` over the
array-level operations of :mod:`spchain.semiring` (see :class:`._operator.Operator`)."""

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import semiring as _semiring
from ._bridge import check_dense
from ._operator import Operator

_NEG_INF, _POS_INF = float("-inf"), float("inf")


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


def _log_parts(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log(max(d, 0))`` and ``log(max(-d, 0))``: a tangent as two log-space weights."""
    return d.clamp(min=0).log(), (-d).clamp(min=0).log()


def _ratio(parts: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``exp(positive - out) - exp(negative - out)``, 0 where ``out`` is ``-inf`` (no term)."""
    positive, negative = parts
    return torch.where(out == _NEG_INF, 0.0, (positive - out).exp() - (negative - out).exp())


def _product_tangent(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, da: torch.Tensor | None,
                     db: torch.Tensor | None) -> torch.Tensor:
    """The tangent of ``out = logmatmul(a, b)``: ``sum_k w[i, k, j] (da[i, k] + db[k, j])``,
    ``w = exp(a[i, k] + b[k, j] - out[i, j])``, each sign of a tangent as log-space weights, so
    the sums are log-space products (exact, no overflow). At a ``+inf`` output, the mean of its
    ``+inf`` terms' tangents (reverse mode's equal shares); elsewhere ``+inf`` terms are absent."""
    a_finite, b_finite = (t.masked_fill(t == _POS_INF, _NEG_INF) for t in (a, b))
    tangent, shares = torch.zeros_like(out), torch.zeros_like(out)
    # term (i, k, j) is +inf where pa_ik and fb_kj, or else fa_ik and pb_kj (as _logspace.PosInf)
    pa, pb = (t == _POS_INF for t in (a, b))
    fb, fa_only = (b > _NEG_INF).to(out.dtype), ((a > _NEG_INF) & ~pa).to(out.dtype)
    pa, pb = pa.to(out.dtype), pb.to(out.dtype)
    if da is not None:
        tangent = tangent + _ratio([_LOGMATMUL.op(a_finite + w, b_finite) for w in _log_parts(da)], out)
        shares = shares + (pa * da) @ fb + (fa_only * da) @ pb
    if db is not None:
        tangent = tangent + _ratio([_LOGMATMUL.op(a_finite, b_finite + w) for w in _log_parts(db)], out)
        shares = shares + pa @ (fb * db) + fa_only @ (pb * db)
    count = pa @ fb + fa_only @ pb
    return torch.where(out == _POS_INF, shares / count.clamp(min=1), tangent)


def _logmatmul_jvp(operator: Operator[Any], args: Sequence[Any], results: Sequence[torch.Tensor],
                   tangents: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """:func:`_product_tangent` of the product."""
    (a, b), (da, db) = args, tangents
    return [_product_tangent(a, b, results[0], da, db)]


def _maxmatmul_jvp(operator: Operator[Any], args: Sequence[Any], results: Sequence[torch.Tensor],
                   tangents: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The tangents of the argmax terms, ``da[i, k*] + db[k*, j]`` (0 where the value is ``-inf``,
    as everywhere when ``k = 0``)."""
    (values, argmax), (da, db) = results, tangents
    tangent = torch.zeros_like(values)
    for d, dim in ((da, -1), (db, -2)):
        if d is not None and d.shape[dim]:  # leading ones where the batch broadcasts
            tangent = tangent + torch.take_along_dim(d.reshape((1,) * (argmax.dim() - d.dim()) + d.shape), argmax, dim)
    return [torch.where(values == _NEG_INF, 0.0, tangent)]


def _log_chain_product_jvp(operator: Operator[Any], args: Sequence[Any], results: Sequence[torch.Tensor],
                           tangents: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """Each sign of the tangent as log-space weights ``w`` in the product of the block matrices
    ``[[m, m + w], [-inf, m]]`` (twice the states): its upper right block sums, over the paths,
    each path's weight times its tangent, in log space. With a ``+inf`` entry, the products
    folded left to right with :func:`_product_tangent`, the order of reverse mode's equal shares."""
    (m,), out, (dm,) = args, results[0], tangents
    assert dm is not None  # the one differentiable argument has the tangent
    if bool(torch.isposinf(m).any()):
        product, tangent = m[..., 0, :, :], dm[..., 0, :, :]
        for step in range(1, m.shape[-3]):
            following = _LOGMATMUL.op(product, m[..., step, :, :])
            tangent = _product_tangent(product, m[..., step, :, :], following, tangent, dm[..., step, :, :])
            product = following
        return [tangent]
    c = m.shape[-1]
    never = torch.full_like(m, _NEG_INF)
    parts = [operator.op(torch.cat([torch.cat([m, m + w], -1), torch.cat([never, m], -1)], -2))[..., :c, c:]
             for w in _log_parts(dm)]
    return [_ratio(parts, out)]


# vmap: a call a slice for the products (one call with the batch leading would misalign the
# broadcast of operands with different numbers of batch axes); one call for the chain product.
_LOGMATMUL = Operator(
    "logmatmul", "(Tensor a, Tensor b) -> Tensor", _semiring.LOGMATMUL, _product_fake("spchain.torch.logmatmul"),
    differentiable=(0, 1), jvp=_logmatmul_jvp, autocast="float32")
_MAXMATMUL = Operator(
    "maxmatmul", "(Tensor a, Tensor b) -> (Tensor, Tensor)", _semiring.MAXMATMUL, _maxmatmul_fake, outputs=2,
    differentiable=(0, 1), jvp=_maxmatmul_jvp, autocast="float32")
_LOG_CHAIN_PRODUCT = Operator(
    "log_chain_product", "(Tensor m) -> Tensor", _semiring.LOG_CHAIN_PRODUCT, _log_chain_product_fake,
    differentiable=(0,), leading_batch=(0,), jvp=_log_chain_product_jvp, autocast="float32")


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
