"""chain_logsumexp, chain_marginals and viterbi for torch tensors: the operators
``spchain::chain_logsumexp`` (its gradient the forward-backward algorithm), ``spchain::chain_marginals``
and ``spchain::viterbi`` over the array-level pairs of :mod:`spchain.chain` (see
:class:`._operator.Operator`)."""

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, Union, cast

import torch

from .. import _chain_layout
from .. import chain as _chain
from .._typing import Shape
from . import _sparse_chain
from ._bridge import check_same_device
from ._operator import Jvp, Operator

TensorLike: TypeAlias = Union[torch.Tensor, Sequence[Any], float]
"""A tensor, or a (nested) list or a Python number that becomes one."""
ChainTensors: TypeAlias = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""``(x, log_trans, log_init, lengths)`` as dense tensors on one device."""
ChainFake: TypeAlias = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                                tuple[Shape, Shape, torch.Tensor]]
"""The batch shape, ``(v, c)`` and an empty tensor of the result dtype, of chain arguments."""


def _tensors(caller: str, x: TensorLike, log_trans: TensorLike, log_init: TensorLike | None,
             lengths: TensorLike | None) -> ChainTensors:
    """The arguments as dense tensors on one device: lists and Python numbers become tensors
    of the first tensor's floating dtype and device (numbers broadcast as in
    :func:`spchain.chain_logsumexp`); lengths may be a list, or on the CPU (as
    ``pack_padded_sequence`` wants them) with CUDA inputs. ``TypeError`` naming the argument
    for anything else, sparse tensors included."""
    named = {"x": x, "log_trans": log_trans, "log_init": log_init, "lengths": lengths}
    like = next((t for t in named.values() if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    dtype = like.dtype if like is not None else torch.get_default_dtype()
    device = like.device if like is not None else None
    out: list[torch.Tensor | None] = []
    for name, t in named.items():
        if t is None:
            if name in ("x", "log_trans"):
                raise TypeError(f"{caller}: {name} is required (a tensor), got None")
        elif isinstance(t, torch.Tensor):
            if t.layout != torch.strided:
                hint = " (or a sparse CSR (c, c) matrix)" if name == "log_trans" else ""
                raise TypeError(f"{caller}: {name} must be a dense tensor{hint}, not one of layout {t.layout}")
            if name == "lengths" and device is not None:
                t = t.to(device)
        elif isinstance(t, (list, tuple, int, float)) and not isinstance(t, bool):
            t = torch.as_tensor(t, dtype=None if name == "lengths" else dtype, device=device)
        else:
            raise TypeError(f"{caller}: {name} must be a tensor (or a list or a number), not {type(t).__name__}")
        out.append(t)
    check_same_device(caller, **dict(zip(named, out)))
    return cast(ChainTensors, tuple(out))  # x and log_trans are not None (checked above)


def _chain_fake(caller: str) -> ChainFake:
    """The shapes of the results of the chain functions, by the array level's one rule."""
    def fake(x: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor | None,
             lengths: torch.Tensor | None) -> tuple[Shape, Shape, torch.Tensor]:
        batch_shape, _ = _chain_layout.layout(caller, tuple(x.shape), tuple(log_trans.shape),
                                       None if log_init is None else tuple(log_init.shape),
                                       None if lengths is None else tuple(lengths.shape))
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in (x, log_trans, log_init) if t is not None])
        return batch_shape, tuple(x.shape[-2:]), x.new_empty(0, dtype=dtype)
    return fake


def _logsumexp_fake(x: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor | None,
                    lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch_shape, (v, c), like = _chain_fake("spchain.torch.chain_logsumexp")(x, log_trans, log_init, lengths)
    return like.new_empty(batch_shape), like.new_empty(batch_shape + (v, c)), like.new_empty(batch_shape + (v,))


def _marginals_fake(x: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor | None,
                    lengths: torch.Tensor | None) -> torch.Tensor:
    _, _, like = _chain_fake("spchain.torch.chain_marginals")(x, log_trans, log_init, lengths)
    return like.new_empty(x.shape)


def _viterbi_fake(x: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor | None,
                  lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    batch_shape, (v, _), like = _chain_fake("spchain.torch.viterbi")(x, log_trans, log_init, lengths)
    return like.new_empty(batch_shape), like.new_empty(batch_shape + (v,), dtype=torch.int64)


def batch_jvp(trans: int = 1) -> Jvp:
    """The ``jvp`` of a chain function whose first result holds one number a chain (the batch
    shape): the operator's reverse rule at the arguments broadcast to the batch, with unit
    incoming gradients, gives each chain's gradient, which the tangents contract; exact, at the
    cost of one backward. ``trans`` is the position of ``log_trans``, 3 for the values of a sparse
    one, which all chains share (forward-mode AD in those raises ``NotImplementedError``)."""
    def jvp(operator: Operator[Any], args: Sequence[Any], results: Sequence[torch.Tensor],
            tangents: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        if trans == 3 and tangents[1] is not None:
            raise NotImplementedError("spchain.torch: forward-mode AD in the values of a sparse log_trans is not "
                                      "implemented; use reverse mode, or a dense log_trans")
        batch = tuple(results[0].shape)
        args = list(args)
        x, c = args[0], args[0].shape[-1]
        slots = (0, trans, trans + 1)
        per_step = args[trans].dim() == x.dim() + 1
        args[0] = x.expand(batch + x.shape[-2:])
        if trans == 1:
            t = args[1] if args[1].dim() else args[1].expand(c, c)
            tail = t.shape[-3 if per_step else -2:]
            # broadcast only where a tangent needs each chain's gradient: else a view of leading ones keeps it shared
            args[1] = t.expand(batch + tail) if tangents[1] is not None else t.reshape(
                (1,) * (len(batch) + len(tail) - t.dim()) + tuple(t.shape))
        if tangents[2] is not None:
            args[trans + 1] = args[trans + 1].expand(batch + (c,))
        needs = [t is not None for t in tangents]
        out = results[0].new_zeros(batch)
        for k, g, t in zip(slots, operator.gradients(args, results, [torch.ones_like(results[0])], needs), tangents):
            if t is not None and g is not None:
                out = out + (g * t.expand(args[k].shape)).flatten(len(batch)).sum(-1)
        return [out]
    return jvp


_SCHEMA = "(Tensor x, Tensor log_trans, Tensor? log_init, Tensor? lengths)"
# vmap makes a call a slice: with the batch leading, x alone would gain an axis and turn
# per-step transitions (one more axis than x) into shared ones.
_CHAIN_LOGSUMEXP = Operator(
    "chain_logsumexp", f"{_SCHEMA} -> (Tensor, Tensor, Tensor)", _chain.LOGSUMEXP, _logsumexp_fake,
    differentiable=(0, 1, 2), jvp=batch_jvp(), autocast="float32")
_CHAIN_MARGINALS = Operator("chain_marginals", f"{_SCHEMA} -> Tensor", _chain.MARGINALS, _marginals_fake,
                            autocast="float32")
_VITERBI = Operator(
    "viterbi", f"{_SCHEMA} -> (Tensor, Tensor)", _chain.VITERBI, _viterbi_fake, outputs=2, differentiable=(0, 1, 2),
    jvp=batch_jvp(), autocast="float32")
SPARSE_CHAIN_LOGSUMEXP = _sparse_chain.operator(
    "chain_logsumexp", _chain.LOGSUMEXP, _logsumexp_fake, schema_tail=_sparse_chain.LENGTHS,
    returns="(Tensor, Tensor, Tensor)", jvp=batch_jvp(3))
SPARSE_CHAIN_MARGINALS = _sparse_chain.operator(
    "chain_marginals", _chain.MARGINALS, _marginals_fake, schema_tail=_sparse_chain.LENGTHS, returns="Tensor")
SPARSE_VITERBI = _sparse_chain.operator(
    "viterbi", _chain.VITERBI, _viterbi_fake, schema_tail=_sparse_chain.LENGTHS, returns="(Tensor, Tensor)",
    outputs=2, jvp=batch_jvp(3))


def chain_logsumexp(x: TensorLike, log_trans: TensorLike, log_init: TensorLike | None = None, *,
                    lengths: TensorLike | None = None) -> torch.Tensor:
    """:func:`spchain.chain_logsumexp` for tensors, differentiable in ``x``, ``log_trans``
    and ``log_init``.

    ``log_trans`` may be a sparse CSR (c, c) tensor of log-values shared by all steps (absent
    entries ``-inf``), here and in the other chain and path functions: the gradient of a
    leaf with ``requires_grad`` is then a sparse CSR tensor of its structure, and one built
    from a ``values`` tensor that requires grad (``torch.sparse_csr_tensor(crow, col,
    values)``) gives ``values.grad``. Its columns must be sorted within each row
    (``ValueError`` otherwise), and under ``torch.compile`` a call with it breaks the graph and
    runs eagerly (Dynamo cannot take sparse tensors).

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> x = torch.zeros(2, 3, 4, requires_grad=True)
    >>> st.chain_logsumexp(x, torch.full((4, 4), -1.3863)).sum().backward()
    >>> x.grad.sum(-1).round(decimals=5)      # the marginals sum to 1 at each position
    tensor([[1., 1., 1.],
            [1., 1., 1.]])
    """
    if _sparse_chain.is_csr(log_trans):
        return _sparse_chain.eagerly(SPARSE_CHAIN_LOGSUMEXP, "spchain.torch.chain_logsumexp", x, log_trans,
                                     log_init, lengths, _tensors)
    return _CHAIN_LOGSUMEXP(*_tensors("spchain.torch.chain_logsumexp", x, log_trans, log_init, lengths))


def chain_marginals(x: TensorLike, log_trans: TensorLike, log_init: TensorLike | None = None, *,
                    lengths: TensorLike | None = None) -> torch.Tensor:
    """:func:`spchain.chain_marginals` for tensors: the posterior marginals, shape of ``x``.

    No gradient (the marginals are :func:`chain_logsumexp`'s): a backward through the result
    raises ``NotImplementedError``; detach ``x`` to use them as constants.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> st.chain_marginals(torch.zeros(3, 2), torch.zeros(2, 2))
    tensor([[0.5000, 0.5000],
            [0.5000, 0.5000],
            [0.5000, 0.5000]])
    """
    if _sparse_chain.is_csr(log_trans):
        return _sparse_chain.eagerly(SPARSE_CHAIN_MARGINALS, "spchain.torch.chain_marginals", x, log_trans,
                                     log_init, lengths, _tensors)
    return _CHAIN_MARGINALS(*_tensors("spchain.torch.chain_marginals", x, log_trans, log_init, lengths))


def viterbi(x: TensorLike, log_trans: TensorLike, log_init: TensorLike | None = None, *,
            lengths: TensorLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`spchain.viterbi` for tensors: ``(score, path)``; ``score`` is differentiable
    (its gradient is the one-hot of the best path), ``path`` (int64) is not.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> x = torch.tensor([[0.0, 1.0], [2.0, 0.0]], requires_grad=True)
    >>> score, path = st.viterbi(x, torch.zeros(2, 2))
    >>> score.backward()
    >>> path, x.grad
    (tensor([1, 0]), tensor([[0., 1.],
            [1., 0.]]))
    """
    if _sparse_chain.is_csr(log_trans):
        return _sparse_chain.eagerly(SPARSE_VITERBI, "spchain.torch.viterbi", x, log_trans, log_init,
                                     lengths, _tensors)
    return _VITERBI(*_tensors("spchain.torch.viterbi", x, log_trans, log_init, lengths))
