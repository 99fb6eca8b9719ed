"""chain_sample, chain_entropy, chain_kbest and chain_path_score for torch tensors: the
operators ``spchain::chain_sample``, ``spchain::chain_entropy`` (its gradient an exact
Hessian-vector product), ``spchain::chain_kbest`` and ``spchain::chain_path_score`` over the
array-level functions of :mod:`spchain.paths` (see :class:`._operator.Operator`)."""

import torch

from .. import paths as _paths
from . import _sparse_chain
from ._operator import Operator, linear_jvp, run_eagerly
from .chain import TensorLike, _chain_fake, _tensors, batch_jvp


def _entropy_fake(x: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor | None,
                  lengths: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    batch_shape, (v, c), like = _chain_fake("spchain.torch.chain_entropy")(x, log_trans, log_init, lengths)
    return (like.new_empty(batch_shape), like.new_empty(batch_shape + (v, c)), like.new_empty(batch_shape + (v,)),
            like.new_empty(batch_shape + (v, c)), like.new_empty(batch_shape, dtype=torch.float64),
            like.new_empty(batch_shape, dtype=torch.bool), like.new_empty(batch_shape + (v,), dtype=torch.float64))


def _sample_fake(x: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor | None, lengths: torch.Tensor | None,
                 num_samples: int, seed: int | None) -> torch.Tensor:
    caller = "spchain.torch.chain_sample"
    num_samples = _paths._count(caller, "num_samples", num_samples, 0)
    batch_shape, (v, _), like = _chain_fake(caller)(x, log_trans, log_init, lengths)
    return like.new_empty((num_samples,) + batch_shape + (v,), dtype=torch.int64)


def _kbest_fake(x: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor | None, lengths: torch.Tensor | None,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    caller = "spchain.torch.chain_kbest"
    k = _paths._count(caller, "k", k, 1)
    batch_shape, (v, _), like = _chain_fake(caller)(x, log_trans, log_init, lengths)
    return like.new_empty((k,) + batch_shape), like.new_empty((k,) + batch_shape + (v,), dtype=torch.int64)


def _path_score_fake(x: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor | None, path: torch.Tensor,
                     lengths: torch.Tensor | None) -> torch.Tensor:
    caller = "spchain.torch.chain_path_score"
    batch_shape, _, like = _chain_fake(caller)(x, log_trans, log_init, lengths)
    return like.new_empty(_paths.path_layout(caller, tuple(x.shape), batch_shape, tuple(path.shape)))


_SCHEMA = "Tensor x, Tensor log_trans, Tensor? log_init, Tensor? lengths"
# vmap makes a call a slice (as for chain_logsumexp: per-step transitions have one more axis than x).
# Forward-mode AD: the entropy's by its exact reverse rule (batch_jvp), the path score's by linearity;
# chain_kbest's scores raise NotImplementedError, chain_sample's paths are integers.
_CHAIN_ENTROPY = Operator(
    "chain_entropy", f"({_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _paths.ENTROPY,
    _entropy_fake, differentiable=(0, 1, 2), jvp=batch_jvp(), autocast="float32")
_CHAIN_SAMPLE = Operator(
    "chain_sample", f"({_SCHEMA}, int num_samples, int? seed) -> Tensor", _paths.SAMPLE, _sample_fake,
    autocast="float32")
_CHAIN_KBEST = Operator(
    "chain_kbest", f"({_SCHEMA}, int k) -> (Tensor, Tensor)", _paths.KBEST, _kbest_fake, outputs=2,
    autocast="float32")
_CHAIN_PATH_SCORE = Operator(
    "chain_path_score", "(Tensor x, Tensor log_trans, Tensor? log_init, Tensor path, Tensor? lengths) -> Tensor",
    _paths.PATH_SCORE, _path_score_fake, differentiable=(0, 1, 2), jvp=linear_jvp, autocast="float32")
SPARSE_CHAIN_ENTROPY = _sparse_chain.operator(
    "chain_entropy", _paths.ENTROPY, _entropy_fake, schema_tail=_sparse_chain.LENGTHS,
    returns="(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", jvp=batch_jvp(3))
SPARSE_CHAIN_SAMPLE = _sparse_chain.operator(
    "chain_sample", _paths.SAMPLE, _sample_fake,
    schema_tail=f"{_sparse_chain.LENGTHS}, int num_samples, int? seed", returns="Tensor")
SPARSE_CHAIN_KBEST = _sparse_chain.operator(
    "chain_kbest", _paths.KBEST, _kbest_fake, schema_tail=f"{_sparse_chain.LENGTHS}, int k",
    returns="(Tensor, Tensor)", outputs=2)
SPARSE_CHAIN_PATH_SCORE = _sparse_chain.operator(
    "chain_path_score", _paths.PATH_SCORE, _path_score_fake, schema_tail=f", Tensor path{_sparse_chain.LENGTHS}",
    returns="Tensor", jvp=linear_jvp)


def chain_sample(x: TensorLike, log_trans: TensorLike, log_init: TensorLike | None = None, *,
                 lengths: TensorLike | None = None, num_samples: int = 1, seed: int | None = None) -> torch.Tensor:
    """:func:`spchain.chain_sample` for tensors: int64 paths ``(num_samples, *batch, v)``.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> st.chain_sample(torch.zeros(4, 3), torch.zeros(3, 3), num_samples=2, seed=0).shape
    torch.Size([2, 4])
    """
    if _sparse_chain.is_csr(log_trans):
        return _sparse_chain.eagerly(SPARSE_CHAIN_SAMPLE, "spchain.torch.chain_sample", x, log_trans, log_init,
                                     lengths, _tensors, num_samples, seed)
    return _CHAIN_SAMPLE(*_tensors("spchain.torch.chain_sample", x, log_trans, log_init, lengths), num_samples, seed)


def chain_entropy(x: TensorLike, log_trans: TensorLike, log_init: TensorLike | None = None, *,
                  lengths: TensorLike | None = None) -> torch.Tensor:
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
    if _sparse_chain.is_csr(log_trans):
        return _sparse_chain.eagerly(SPARSE_CHAIN_ENTROPY, "spchain.torch.chain_entropy", x, log_trans, log_init,
                                     lengths, _tensors)
    return _CHAIN_ENTROPY(*_tensors("spchain.torch.chain_entropy", x, log_trans, log_init, lengths))


def chain_kbest(x: TensorLike, log_trans: TensorLike, log_init: TensorLike | None = None, *, k: int,
                lengths: TensorLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`spchain.chain_kbest` for tensors: ``(scores (k, *batch), paths (k, *batch, v))``
    (no gradient: a backward through the scores raises ``NotImplementedError``;
    :func:`chain_path_score` of the paths gives differentiable scores).

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> scores, paths = st.chain_kbest(torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.zeros(2, 2), k=3)
    >>> scores, paths
    (tensor([3., 2., 1.]), tensor([[0, 1],
            [1, 1],
            [0, 0]]))
    """
    if _sparse_chain.is_csr(log_trans):
        return _sparse_chain.eagerly(SPARSE_CHAIN_KBEST, "spchain.torch.chain_kbest", x, log_trans, log_init,
                                     lengths, _tensors, k)
    return _CHAIN_KBEST(*_tensors("spchain.torch.chain_kbest", x, log_trans, log_init, lengths), k)


def chain_path_score(x: TensorLike, log_trans: TensorLike, log_init: TensorLike | None, path: TensorLike, *,
                     lengths: TensorLike | None = None) -> torch.Tensor:
    """:func:`spchain.chain_path_score` for tensors, differentiable in ``x``, ``log_trans``
    and ``log_init``.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> x = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    >>> score = st.chain_path_score(x, torch.zeros(2, 2), None, torch.tensor([0, 1]))
    >>> score.backward(); score, x.grad
    (tensor(3., grad_fn=<EagerBackward>), tensor([[1., 0.],
            [0., 1.]]))
    """
    caller = "spchain.torch.chain_path_score"
    if _sparse_chain.is_csr(log_trans):
        return _sparse_path_score(x, log_trans, log_init, path, lengths)
    x, log_trans, log_init, lengths = _tensors(caller, x, log_trans, log_init, lengths)
    return _CHAIN_PATH_SCORE(x, log_trans, log_init, _path(caller, path, x), lengths)


@run_eagerly
def _sparse_path_score(x: TensorLike, log_trans: torch.Tensor, log_init: TensorLike | None, path: TensorLike,
                       lengths: TensorLike | None) -> torch.Tensor:
    """:func:`chain_path_score` with a sparse CSR ``log_trans``, run eagerly (see ``_sparse_chain.eagerly``)."""
    caller = "spchain.torch.chain_path_score"
    x, *trans, log_init, lengths = _sparse_chain.tensors(caller, x, log_trans, log_init, lengths, _tensors)
    return SPARSE_CHAIN_PATH_SCORE(x, *trans, log_init, _path(caller, path, x), lengths)


def _path(caller: str, path: TensorLike, x: torch.Tensor) -> torch.Tensor:
    """``path`` as a dense tensor on ``x``'s device."""
    if not isinstance(path, torch.Tensor):
        return torch.as_tensor(path, device=x.device)
    if path.layout != torch.strided:
        raise TypeError(f"{caller}: path must be a dense tensor, not one of layout {path.layout}")
    return path
