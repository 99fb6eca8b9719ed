"""chain_logsumexp and chain_marginals for torch tensors, with a forward-backward gradient."""

import numpy as np
import torch

from .. import _logspace
from .. import chain as _chain
from ._bridge import check_same_device, first_order, on_device, to_array, to_tensor

_QUIET = {"divide": "ignore", "invalid": "ignore", "over": "ignore"}


def _arrays(*tensors):
    return tuple(None if t is None else to_array(t) for t in tensors)


def _tensors(caller, x, log_trans, log_init, lengths):
    """The arguments as dense tensors on one device: lists and Python numbers become tensors
    of the first tensor's floating dtype and device (numbers broadcast as in
    :func:`spchain.chain_logsumexp`); lengths may be a list, or on the CPU (as
    ``pack_padded_sequence`` wants them) with CUDA inputs. ``TypeError`` naming the argument
    for anything else, sparse tensors included."""
    named = {"x": x, "log_trans": log_trans, "log_init": log_init, "lengths": lengths}
    like = next((t for t in named.values() if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    dtype = like.dtype if like is not None else torch.get_default_dtype()
    device = like.device if like is not None else None
    out = []
    for name, t in named.items():
        if t is None:
            if name in ("x", "log_trans"):
                raise TypeError(f"{caller}: {name} is required (a tensor), got None")
        elif isinstance(t, torch.Tensor):
            if t.layout != torch.strided:
                raise TypeError(f"{caller}: {name} must be a dense tensor, not one of layout {t.layout}")
            if name == "lengths" and device is not None:
                t = t.to(device)
        elif isinstance(t, (list, tuple, int, float)) and not isinstance(t, bool):
            t = torch.as_tensor(t, dtype=None if name == "lengths" else dtype, device=device)
        else:
            raise TypeError(f"{caller}: {name} must be a tensor (or a list or a number), not {type(t).__name__}")
        out.append(t)
    return out


def _input_grads(chain, needs, x, log_trans, log_init, grad_x, grad_trans):
    """The gradients of the inputs that need one, from the sweeps' (B, v, c) / (G, S, c, c) ones."""
    need_x, need_trans, need_init = needs[:3]
    grads = [None, None, None, None]
    if need_x:
        grads[0] = to_tensor(_logspace.reduce_to(chain.unrows(grad_x), x.shape)).to(x.dtype)
    if need_trans:
        grads[1] = to_tensor(grad_trans.reshape(log_trans.shape)).to(log_trans.dtype)
    if need_init:
        grads[2] = to_tensor(_logspace.reduce_to(chain.unrows(grad_x[:, 0]), log_init.shape)).to(log_init.dtype)
    return tuple(grads)


class _ChainLogSumExp(torch.autograd.Function):
    """Forward: the normalised forward sweep, saving its messages (O(batch · v · c)).
    Backward: the backward sweep by the same kernels; d x = marginals, d trans = expected
    transition counts, d init = first marginals, each times the incoming gradient."""

    @staticmethod
    def forward(ctx, x, log_trans, log_init, lengths):
        caller = "spchain.torch.chain_logsumexp"
        device = check_same_device(caller, x=x, log_trans=log_trans, log_init=log_init, lengths=lengths)
        with on_device(device), np.errstate(**_QUIET):
            chain = _chain._prepare(*_arrays(x, log_trans, log_init, lengths), caller)
            log_partition, pre, norm = _chain._forward(chain)
            out = to_tensor(chain.unrows(log_partition))
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(x, log_trans, log_init, lengths, to_tensor(pre), to_tensor(norm))
        return out

    @staticmethod
    @first_order("spchain.torch.chain_logsumexp")
    def backward(ctx, grad):
        x, log_trans, log_init, lengths, pre, norm = ctx.saved_tensors
        with on_device(grad.device), np.errstate(**_QUIET):
            chain = _chain._prepare(*_arrays(x, log_trans, log_init, lengths), "spchain.torch.chain_logsumexp")
            weight = chain.rows(to_array(grad).astype(chain.x.dtype, copy=False))
            grad_x, grad_trans = _chain._backward(chain, to_array(pre), to_array(norm), weight,
                                                  trans_grad=ctx.needs_input_grad[1])
            return _input_grads(chain, ctx.needs_input_grad, x, log_trans, log_init, grad_x, grad_trans)


class _Viterbi(torch.autograd.Function):
    """Forward: the max-product sweep and backtracking. Backward: the incoming gradient on
    every step of the best path (the sub-gradient of the score)."""

    @staticmethod
    def forward(ctx, x, log_trans, log_init, lengths):
        caller = "spchain.torch.viterbi"
        device = check_same_device(caller, x=x, log_trans=log_trans, log_init=log_init, lengths=lengths)
        with on_device(device):
            chain = _chain._prepare(*_arrays(x, log_trans, log_init, lengths), caller)
            score, path = _chain._viterbi(chain)
            outs = to_tensor(chain.unrows(score)), to_tensor(chain.unrows(path))
        ctx.mark_non_differentiable(outs[1])
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(x, log_trans, log_init, lengths, to_tensor(path))
        return outs

    @staticmethod
    @first_order("spchain.torch.viterbi")
    def backward(ctx, grad, _):
        x, log_trans, log_init, lengths, path = ctx.saved_tensors
        with on_device(grad.device):
            chain = _chain._prepare(*_arrays(x, log_trans, log_init, lengths), "spchain.torch.viterbi")
            weight = chain.rows(to_array(grad).astype(chain.x.dtype, copy=False))
            grad_x, grad_trans = _chain._viterbi_grads(chain, to_array(path), weight, ctx.needs_input_grad[1])
            return _input_grads(chain, ctx.needs_input_grad, x, log_trans, log_init, grad_x, grad_trans)


def chain_logsumexp(x, log_trans, log_init=None, *, lengths=None):
    """:func:`spchain.chain_logsumexp` for tensors, differentiable in ``x``, ``log_trans``
    and ``log_init``.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> x = torch.zeros(2, 3, 4, requires_grad=True)
    >>> st.chain_logsumexp(x, torch.full((4, 4), -1.3863)).sum().backward()
    >>> x.grad.sum(-1).round(decimals=5)      # the marginals sum to 1 at each position
    tensor([[1., 1., 1.],
            [1., 1., 1.]])
    """
    return _ChainLogSumExp.apply(*_tensors("spchain.torch.chain_logsumexp", x, log_trans, log_init, lengths))


def chain_marginals(x, log_trans, log_init=None, *, lengths=None):
    """:func:`spchain.chain_marginals` for tensors: the posterior marginals, shape of ``x``.

    The result carries no graph (it is itself a gradient).

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> st.chain_marginals(torch.zeros(3, 2), torch.zeros(2, 2))
    tensor([[0.5000, 0.5000],
            [0.5000, 0.5000],
            [0.5000, 0.5000]])
    """
    caller = "spchain.torch.chain_marginals"
    x, log_trans, log_init, lengths = _tensors(caller, x, log_trans, log_init, lengths)
    device = check_same_device(caller, x=x, log_trans=log_trans, log_init=log_init, lengths=lengths)
    with on_device(device):
        return to_tensor(_chain.chain_marginals(*_arrays(x, log_trans, log_init), lengths=_arrays(lengths)[0]))


def viterbi(x, log_trans, log_init=None, *, lengths=None):
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
    return _Viterbi.apply(*_tensors("spchain.torch.viterbi", x, log_trans, log_init, lengths))
