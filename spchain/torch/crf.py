"""A linear-chain conditional random field layer on spchain's chains."""

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from .chain import chain_logsumexp, chain_marginals, viterbi
from .paths import chain_path_score, chain_sample

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
    sparse_transitions : optional
        Reserved for sparse transition structures (large tag sets); not implemented yet: any
        value but ``None`` raises ``NotImplementedError``.

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
    """

    def __init__(self, num_tags: int, *, sparse_transitions: None = None) -> None:
        super().__init__()
        if sparse_transitions is not None:
            raise NotImplementedError("LinearChainCRF: sparse_transitions is not implemented yet "
                                      "(it needs the sparse chain of issue 13); leave it None")
        if isinstance(num_tags, bool) or not isinstance(num_tags, int) or num_tags < 1:
            raise ValueError(f"LinearChainCRF: num_tags must be a positive int, got {num_tags!r}")
        self.num_tags = num_tags
        self.start_transitions = nn.Parameter(torch.empty(num_tags))
        self.end_transitions = nn.Parameter(torch.empty(num_tags))
        self.transitions = nn.Parameter(torch.empty(num_tags, num_tags))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in (-0.1, 0.1), as pytorch-crf."""
        for p in (self.start_transitions, self.end_transitions, self.transitions):
            nn.init.uniform_(p, -0.1, 0.1)

    def extra_repr(self) -> str:
        return f"num_tags={self.num_tags}"

    def _chain(self, emissions: torch.Tensor, lengths: torch.Tensor | Sequence[int] | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, lengths)``: the emissions with the end scores added at each chain's last position."""
        if not isinstance(emissions, torch.Tensor) or emissions.ndim != 3 or emissions.shape[-1] != self.num_tags:
            raise ValueError(f"LinearChainCRF: emissions must have shape (batch, v, num_tags = {self.num_tags}), "
                             f"got {getattr(emissions, 'shape', type(emissions).__name__)}")
        batch, v, _ = emissions.shape
        if lengths is None:
            lengths = torch.full((batch,), v, dtype=torch.int64, device=emissions.device)
        lengths = torch.as_tensor(lengths, device=emissions.device)
        if lengths.shape != (batch,):
            raise ValueError(f"LinearChainCRF: lengths must have shape (batch,) = ({batch},), got {tuple(lengths.shape)}")
        # the chain functions check lengths (1..v); clamped, bad ones cannot index out of range first
        index = (torch.arange(batch, device=emissions.device), lengths.clamp(1, max(v, 1)) - 1)
        x = emissions.index_put(index, emissions[index] + self.end_transitions)  # one copy, no (batch, v) mask
        return x, lengths

    def log_partition(self, emissions: torch.Tensor,
                      lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """The log-partition of each chain, (batch,)."""
        x, lengths = self._chain(emissions, lengths)
        return chain_logsumexp(x, self.transitions, self.start_transitions, lengths=lengths)

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
        log_z = chain_logsumexp(x, self.transitions, self.start_transitions, lengths=lengths)
        score = chain_path_score(x, self.transitions, self.start_transitions, tags, lengths=lengths)
        out = log_z - score
        return out if reduction == "none" else out.sum() if reduction == "sum" else out.mean()

    def decode(self, emissions: torch.Tensor,
               lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """The best tag sequences (Viterbi), int64 (batch, v), -1 past each length."""
        x, lengths = self._chain(emissions.detach(), lengths)
        with torch.no_grad():
            return viterbi(x, self.transitions, self.start_transitions, lengths=lengths)[1]

    def marginals(self, emissions: torch.Tensor,
                  lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """The posterior marginals of each tag at each position, (batch, v, num_tags)
        (0 past each length)."""
        x, lengths = self._chain(emissions.detach(), lengths)
        with torch.no_grad():
            return chain_marginals(x, self.transitions.detach(), self.start_transitions.detach(), lengths=lengths)

    def sample(self, emissions: torch.Tensor, lengths: torch.Tensor | Sequence[int] | None = None, *,
               num_samples: int = 1, seed: int | None = None) -> torch.Tensor:
        """Tag sequences drawn from the posterior, int64 (num_samples, batch, v), -1 past each length."""
        x, lengths = self._chain(emissions.detach(), lengths)
        with torch.no_grad():
            return chain_sample(x, self.transitions, self.start_transitions, lengths=lengths,
                                num_samples=num_samples, seed=seed)
