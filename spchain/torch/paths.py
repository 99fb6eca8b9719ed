"""chain_sample, chain_entropy, chain_kbest and chain_path_score for torch tensors."""

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from .. import _entropy
from .. import paths as _paths
from .. import chain as _chain
from .._chain_layout import prepare as _prepare
from ..chain import _viterbi_grads
from ._bridge import check_same_device, on_device, to_array, to_tensor
from .chain import _tensors

_QUIET = {"divide": "ignore", "invalid": "ignore", "over": "ignore"}


def _arrays(*tensors):
    return tuple(None if t is None else to_array(t) for t in tensors)


def _input_grads(chain, needs, x, log_trans, log_init, grad_x, grad_trans):
    """The input gradients as tensors of the inputs' dtypes (``None`` for ``lengths``)."""
    grads = _chain._input_grads(chain, needs[:3], (x, log_trans, log_init, None), grad_x, grad_trans)
    return tuple(None if g is None else to_tensor(g).to(t.dtype) for g, t in zip(grads, (x, log_trans, log_init))) + (None,)


class _ChainEntropy(torch.autograd.Function):
    """Forward: the forward sweep and the expected score carried beside it. Backward: the
    exact Hessian-vector product ``-∇²A θ`` by the expectation-semiring backward pass
    (``spchain/_entropy.py``)."""

    @staticmethod
    def forward(ctx, x, log_trans, log_init, lengths):
        caller = "spchain.torch.chain_entropy"
        device = check_same_device(caller, x=x, log_trans=log_trans, log_init=log_init, lengths=lengths)
        with on_device(device), np.errstate(**_QUIET):
            chain = _prepare(*_arrays(x, log_trans, log_init, lengths), caller)
            value, saved = _entropy.entropy(chain)
            out = to_tensor(chain.unrows(value))
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(x, log_trans, log_init, lengths, *(to_tensor(a) for a in saved))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, log_trans, log_init, lengths, *saved = ctx.saved_tensors
        with on_device(grad.device), np.errstate(**_QUIET):
            chain = _prepare(*_arrays(x, log_trans, log_init, lengths), "spchain.torch.chain_entropy")
            weight = chain.rows(to_array(grad).astype(chain.x.dtype, copy=False))
            grad_x, grad_trans = _entropy.entropy_grads(chain, [to_array(a) for a in saved], weight,
                                                        trans_grad=ctx.needs_input_grad[1])
            return _input_grads(chain, ctx.needs_input_grad, x, log_trans, log_init, grad_x, grad_trans)


class _ChainPathScore(torch.autograd.Function):
    """Forward: the scores gathered along the paths. Backward: the incoming gradient on every
    potential the path uses."""

    @staticmethod
    def forward(ctx, x, log_trans, log_init, path, lengths):
        caller = "spchain.torch.chain_path_score"
        device = check_same_device(caller, x=x, log_trans=log_trans, log_init=log_init, path=path, lengths=lengths)
        with on_device(device), np.errstate(**_QUIET):
            chain, rows = _paths._prepare_paths(*_arrays(x, log_trans, log_init, path, lengths), caller)
            out = to_tensor(chain.unrows(_paths._path_score(chain, rows)))
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(x, log_trans, log_init, path, lengths)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, log_trans, log_init, path, lengths = ctx.saved_tensors
        with on_device(grad.device):
            chain, rows = _paths._prepare_paths(*_arrays(x, log_trans, log_init, path, lengths),
                                                "spchain.torch.chain_path_score")
            weight = chain.rows(to_array(grad).astype(chain.x.dtype, copy=False))
            grad_x, grad_trans = _viterbi_grads(chain, rows, weight, ctx.needs_input_grad[1])
            return _input_grads(chain, ctx.needs_input_grad, x, log_trans, log_init, grad_x, grad_trans) + (None,)


def _init_like(x, log_trans, log_init):
    """``log_init``, or zeros when it is ``None`` (autograd needs a tensor to give a gradient to)."""
    if log_init is not None:
        return log_init
    return torch.zeros(x.shape[-1], dtype=torch.promote_types(x.dtype, log_trans.dtype), device=x.device)


def chain_sample(x, log_trans, log_init=None, *, lengths=None, num_samples=1, seed=None):
    """:func:`spchain.chain_sample` for tensors: int64 paths ``(num_samples, *batch, v)``.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> st.chain_sample(torch.zeros(4, 3), torch.zeros(3, 3), num_samples=2, seed=0).shape
    torch.Size([2, 4])
    """
    x, log_trans, log_init, lengths = _tensors("spchain.torch.chain_sample", x, log_trans, log_init, lengths)
    device = check_same_device("spchain.torch.chain_sample", x=x, log_trans=log_trans, log_init=log_init,
                               lengths=lengths)
    with on_device(device):
        return to_tensor(_paths.chain_sample(*_arrays(x.detach(), log_trans.detach(),
                                                       None if log_init is None else log_init.detach()),
                                             lengths=_arrays(lengths)[0], num_samples=num_samples, seed=seed))


def chain_entropy(x, log_trans, log_init=None, *, lengths=None):
    """:func:`spchain.chain_entropy` for tensors, differentiable in ``x``, ``log_trans`` and
    ``log_init`` (the exact gradient, a Hessian-vector product of the log-partition).

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> x = torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
    >>> h = st.chain_entropy(x, torch.zeros(2, 2, dtype=torch.float64))
    >>> h.backward(); h.item() / 0.6931471805599453, x.grad.abs().max().item()   # 8 paths, a maximum
    (3.0, 0.0)
    """
    x, log_trans, log_init, lengths = _tensors("spchain.torch.chain_entropy", x, log_trans, log_init, lengths)
    return _ChainEntropy.apply(x, log_trans, _init_like(x, log_trans, log_init), lengths)


def chain_kbest(x, log_trans, log_init=None, *, k, lengths=None):
    """:func:`spchain.chain_kbest` for tensors: ``(scores (k, *batch), paths (k, *batch, v))``
    (no gradient; :func:`chain_path_score` of a path gives a differentiable score).

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> scores, paths = st.chain_kbest(torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.zeros(2, 2), k=3)
    >>> scores, paths
    (tensor([3., 2., 1.]), tensor([[0, 1],
            [1, 1],
            [0, 0]]))
    """
    x, log_trans, log_init, lengths = _tensors("spchain.torch.chain_kbest", x, log_trans, log_init, lengths)
    device = check_same_device("spchain.torch.chain_kbest", x=x, log_trans=log_trans, log_init=log_init,
                               lengths=lengths)
    with on_device(device):
        scores, paths = _paths.chain_kbest(*_arrays(x.detach(), log_trans.detach(),
                                                    None if log_init is None else log_init.detach()),
                                           k=k, lengths=_arrays(lengths)[0])
        return to_tensor(scores), to_tensor(paths)


def chain_path_score(x, log_trans, log_init, path, *, lengths=None):
    """:func:`spchain.chain_path_score` for tensors, differentiable in ``x``, ``log_trans``
    and ``log_init``.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> x = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    >>> score = st.chain_path_score(x, torch.zeros(2, 2), None, torch.tensor([0, 1]))
    >>> score.backward(); score, x.grad
    (tensor(3., grad_fn=<_ChainPathScoreBackward>), tensor([[1., 0.],
            [0., 1.]]))
    """
    x, log_trans, log_init, lengths = _tensors("spchain.torch.chain_path_score", x, log_trans, log_init, lengths)
    path = torch.as_tensor(path, device=x.device)
    return _ChainPathScore.apply(x, log_trans, _init_like(x, log_trans, log_init), path, lengths)
