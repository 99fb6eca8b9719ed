"""A linear-chain conditional random field layer on spchain's chains."""

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from .chain import chain_logsumexp, chain_marginals, viterbi
from .paths import chain_path_score, chain_sample
from .sparse import csr_tensor

REDUCTIONS = ("mean", "sum", "none")


class LinearChainCRF(nn.Module):
    """A linear-chain CRF over ``num_tags`` tags: start, transition and end scores.

    A tag sequence ``y`` of length ``L`` scores
    ``start[y_0] + sum_t emissions[t, y_t] + sum_{t>0} transitions[y_{t-1}, y_t] + end[y_{L-1}]``;
    the end scores are folded into the last emission of each chain (respecting ``lengths``),
    so every method is one spchain chain function. The parameters have pytorch-crf's names
    (``start_transitions``, ``transitions``, ``end_transitions``) and initialisation, so a
    ``torchcrf.CRF``'s state dict loads into this layer and gives the same results.

    Parameters
    ----------
    num_tags : int
        The number of tags (states).
    sparse_transitions : (num_tags, num_tags) bool tensor or array, or torch sparse tensor, optional
        The allowed transitions (``True``, or the stored positions of a sparse tensor); all
        others score ``-inf``. ``transitions`` then holds the scores of the allowed ones only
        (shape ``(nnz,)``, row-major order, structure in the buffers ``transition_indptr`` and
        ``transition_indices``), and every method runs the sparse chain: time and memory grow
        with the allowed transitions, not ``num_tags ** 2`` (large tag sets, banded or
        left-to-right models). ``None`` (default): all transitions, a dense ``(num_tags,
        num_tags)`` matrix.

    Notes
    -----
    Emissions are ``(batch, v, num_tags)`` (batch first) and ``lengths`` (batch,) gives each
    chain's length in 1..v (default: all ``v``); tags past a chain's length are ignored.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> crf = st.LinearChainCRF(5)
    >>> emissions = torch.randn(2, 7, 5)
    >>> loss = crf.nll(emissions, torch.randint(5, (2, 7)), lengths=torch.tensor([7, 4]))
    >>> loss.backward()
    >>> crf.decode(emissions, lengths=torch.tensor([7, 4])).shape
    torch.Size([2, 7])
    >>> banded = st.LinearChainCRF(5, sparse_transitions=torch.ones(5, 5, dtype=torch.bool).triu().tril(1))
    >>> banded.transitions.shape                          # stay, or move one tag on
    torch.Size([9])
    >>> steps = banded.decode(emissions).diff()
    >>> bool(((steps == 0) | (steps == 1)).all())
    True
    """

    transition_indptr: torch.Tensor | None
    transition_indices: torch.Tensor | None

    def __init__(self, num_tags: int, *, sparse_transitions: object = None) -> None:
        super().__init__()
        if isinstance(num_tags, bool) or not isinstance(num_tags, int) or num_tags < 1:
            raise ValueError(f"LinearChainCRF: num_tags must be a positive int, got {num_tags!r}")
        self.num_tags = num_tags
        self.start_transitions = nn.Parameter(torch.empty(num_tags))
        self.end_transitions = nn.Parameter(torch.empty(num_tags))
        if sparse_transitions is None:
            self.transitions = nn.Parameter(torch.empty(num_tags, num_tags))
            self.register_buffer("transition_indptr", None)
            self.register_buffer("transition_indices", None)
        else:
            allowed = _allowed(sparse_transitions, num_tags)
            self.transitions = nn.Parameter(torch.empty(int(allowed.sum())))
            self.register_buffer("transition_indptr", torch.cat([allowed.new_zeros(1, dtype=torch.int64),
                                                                 allowed.sum(1).cumsum(0)]))
            self.register_buffer("transition_indices", allowed.nonzero()[:, 1].contiguous())
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in (-0.1, 0.1), as pytorch-crf."""
        for p in (self.start_transitions, self.end_transitions, self.transitions):
            nn.init.uniform_(p, -0.1, 0.1)

    def extra_repr(self) -> str:
        sparse = "" if self.transition_indptr is None else f", allowed_transitions={self.transitions.numel()}"
        return f"num_tags={self.num_tags}{sparse}"

    def log_trans(self) -> torch.Tensor:
        """The transition scores as the chain functions take them: the ``(num_tags, num_tags)``
        parameter, or a sparse CSR tensor over ``transitions`` (differentiable in it)."""
        if self.transition_indptr is None or self.transition_indices is None:
            return self.transitions
        return csr_tensor(self.transition_indptr, self.transition_indices, self.transitions,
                          (self.num_tags, self.num_tags))

    def _scores(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log_trans, log_init)`` in ``dtype`` (differentiable in the parameters)."""
        log_trans = self.log_trans()
        log_trans = log_trans if log_trans.dtype == dtype else log_trans.to(dtype)
        return log_trans, self.start_transitions.to(dtype)

    def _chain(self, emissions: torch.Tensor, lengths: torch.Tensor | Sequence[int] | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, lengths)``: the emissions with the end scores added at each chain's last position."""
        if not isinstance(emissions, torch.Tensor) or emissions.ndim != 3 or emissions.shape[-1] != self.num_tags:
            raise ValueError(f"LinearChainCRF: emissions must have shape (batch, v, num_tags = {self.num_tags}), "
                             f"got {getattr(emissions, 'shape', type(emissions).__name__)}")
        batch, v, _ = emissions.shape
        if v == 0:
            raise ValueError(f"LinearChainCRF: emissions have shape {tuple(emissions.shape)}: a chain needs at least "
                             "one position (v >= 1)")
        if lengths is None:
            lengths = torch.full((batch,), v, dtype=torch.int64, device=emissions.device)
        lengths = torch.as_tensor(lengths, device=emissions.device)
        if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
            raise TypeError(f"LinearChainCRF: lengths must hold integers, got dtype {lengths.dtype}")
        if lengths.shape != (batch,):
            raise ValueError(f"LinearChainCRF: lengths must have shape (batch,) = ({batch},), got {tuple(lengths.shape)}")
        # torch's promotion of the emissions and the parameters (a bfloat16 encoder into a float32 CRF: float32)
        dtype = torch.promote_types(emissions.dtype, self.transitions.dtype)
        x = emissions.to(dtype)
        # the chain functions check lengths (1..v); clamped, bad ones cannot index out of range first
        index = (torch.arange(batch, device=emissions.device), lengths.clamp(1, v) - 1)
        x = x.index_put(index, x[index] + self.end_transitions.to(dtype))  # one copy, no (batch, v) mask
        return x, lengths

    def log_partition(self, emissions: torch.Tensor,
                      lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """The log-partition of each chain, (batch,)."""
        x, lengths = self._chain(emissions, lengths)
        return chain_logsumexp(x, *self._scores(x.dtype), lengths=lengths)

    def nll(self, emissions: torch.Tensor, tags: torch.Tensor, lengths: torch.Tensor | Sequence[int] | None = None,
            reduction: Literal["mean", "sum", "none"] = "mean") -> torch.Tensor:
        """The negative log-likelihood of ``tags`` (batch, v): ``log Z - score(tags)``.

        ``reduction``: ``"mean"`` (over the batch), ``"sum"`` or ``"none"`` ((batch,)).
        pytorch-crf's ``CRF.forward`` returns the log-likelihood, summed by default:
        ``crf.nll(e, y, reduction="sum") == -torchcrf_crf(e, y, mask)``.
        """
        if reduction not in REDUCTIONS:
            raise ValueError(f"LinearChainCRF.nll: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        x, lengths = self._chain(emissions, lengths)
        if not isinstance(tags, torch.Tensor) or tags.shape != emissions.shape[:2]:
            raise ValueError(f"LinearChainCRF.nll: tags must be a tensor of shape (batch, v) = "
                             f"{tuple(emissions.shape[:2])}, got {getattr(tags, 'shape', type(tags).__name__)}")
        log_z = chain_logsumexp(x, *self._scores(x.dtype), lengths=lengths)
        score = chain_path_score(x, *self._scores(x.dtype), tags, lengths=lengths)
        out = log_z - score
        return out if reduction == "none" else out.sum() if reduction == "sum" else out.mean()

    def decode(self, emissions: torch.Tensor,
               lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """The best tag sequences (Viterbi), int64 (batch, v), -1 past each length."""
        x, lengths = self._chain(emissions.detach(), lengths)
        with torch.no_grad():
            return viterbi(x, *self._scores(x.dtype), lengths=lengths)[1]

    def marginals(self, emissions: torch.Tensor,
                  lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """The posterior marginals of each tag at each position, (batch, v, num_tags)
        (0 past each length)."""
        x, lengths = self._chain(emissions.detach(), lengths)
        with torch.no_grad():
            return chain_marginals(x, *(t.detach() for t in self._scores(x.dtype)), lengths=lengths)

    def sample(self, emissions: torch.Tensor, lengths: torch.Tensor | Sequence[int] | None = None, *,
               num_samples: int = 1, seed: int | None = None) -> torch.Tensor:
        """Tag sequences drawn from the posterior, int64 (num_samples, batch, v), -1 past each length."""
        x, lengths = self._chain(emissions.detach(), lengths)
        with torch.no_grad():
            return chain_sample(x, *self._scores(x.dtype), lengths=lengths,
                                num_samples=num_samples, seed=seed)


def _allowed(structure: object, num_tags: int) -> torch.Tensor:
    """The ``(num_tags, num_tags)`` bool mask of a ``sparse_transitions`` argument."""
    caller = "LinearChainCRF: sparse_transitions"
    if isinstance(structure, torch.Tensor) and structure.layout != torch.strided:
        if structure.shape != (num_tags, num_tags):
            raise ValueError(f"{caller} must have shape ({num_tags}, {num_tags}), got {tuple(structure.shape)}")
        coo = structure.detach().to_sparse().coalesce().indices().cpu()
        allowed = torch.zeros(num_tags, num_tags, dtype=torch.bool)
        allowed[coo[0], coo[1]] = True
        return allowed
    try:
        allowed = torch.as_tensor(structure).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{caller} must be a bool mask or a torch sparse tensor, not "
                        f"{type(structure).__name__}") from error
    if allowed.dtype != torch.bool:
        raise TypeError(f"{caller} must be a bool mask (or a torch sparse tensor), got dtype {allowed.dtype}")
    if allowed.shape != (num_tags, num_tags):
        raise ValueError(f"{caller} must have shape ({num_tags}, {num_tags}), got {tuple(allowed.shape)}")
    return allowed
