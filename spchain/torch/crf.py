"""A linear-chain conditional random field layer on spchain's chains."""

from collections.abc import Sequence
from typing import Literal, TypeAlias

import torch
from torch import nn

from ._bridge import check_dense
from ._operator import Unscriptable
from .chain import (SPARSE_CHAIN_LOGSUMEXP, SPARSE_CHAIN_MARGINALS, SPARSE_VITERBI, chain_logsumexp, chain_marginals,
                    viterbi)
from .paths import SPARSE_CHAIN_PATH_SCORE, SPARSE_CHAIN_SAMPLE, chain_path_score, chain_sample
from .sparse import csr_tensor

REDUCTIONS = ("mean", "sum", "token_mean", "none")
Reduction: TypeAlias = Literal["mean", "sum", "token_mean", "none"]
Lengths: TypeAlias = torch.Tensor | Sequence[int] | None


class LinearChainCRF(Unscriptable, nn.Module):
    """A linear-chain CRF over ``num_tags`` tags: start, transition and end scores.

    A tag sequence ``y`` of length ``L`` scores
    ``start[y_0] + sum_t emissions[t, y_t] + sum_{t>0} transitions[y_{t-1}, y_t] + end[y_{L-1}]``;
    the end scores are folded into the last emission of each chain, so every method is one
    spchain chain function. The parameters have pytorch-crf's names (``start_transitions``,
    ``transitions``, ``end_transitions``) and initialisation, so a ``torchcrf.CRF``'s state
    dict loads into this layer and gives the same results.

    Parameters
    ----------
    num_tags : int
        The number of tags (states).
    batch_first : bool, optional
        Not given (default): spchain's convention (below). ``True`` or ``False``:
        pytorch-crf's, with emissions ``(batch, v, num_tags)`` or ``(v, batch, num_tags)``
        in every method. pytorch-crf's default is ``False`` (time-major): code ported from it
        passes ``batch_first`` explicitly, as calling the layer without it raises.
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
    Two calling conventions share the methods:

    - spchain's (``batch_first`` not given): emissions ``(batch, v, num_tags)``, ``lengths``
      (batch,) in 1..v (default: all ``v``; tags past a chain's length are ignored);
      ``nll`` gives the negative log-likelihood, ``decode`` an int64 ``(batch, v)`` tensor
      (-1 past each length). Calling the layer itself raises ``ValueError``: a time-major
      tensor of pytorch-crf's default layout is never read as batch-major.
    - pytorch-crf's (``batch_first=True`` or ``False``): ``crf(emissions, tags, mask=None,
      reduction="sum")`` returns the log-likelihood, ``crf.decode(emissions, mask=None)``
      lists of tag lists (of each sequence's unmasked positions); ``nll``, ``log_partition``,
      ``marginals`` and ``sample`` take the same layout.

    Every method takes ``lengths`` or a ``mask`` (bool or uint8, the shape of ``tags``): each
    sequence's unmasked positions must be one contiguous window, not only a prefix (left
    padding, a masked leading ``[CLS]``), checked eagerly (not under ``torch.compile``).
    The second positional argument of ``decode`` is ``lengths`` if it is 1-D and a mask if 2-D.
    The result's floating dtype is torch's promotion of the emissions' and the parameters'
    (a bfloat16 encoder under autocast into a float32 CRF: float32).

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

    pytorch-crf's convention, time-major, left padding:

    >>> tagger = st.LinearChainCRF(5, batch_first=False)
    >>> mask = torch.tensor([[True, False], [True, True], [True, True]])   # (v, batch)
    >>> llh = tagger(torch.randn(3, 2, 5), torch.zeros(3, 2, dtype=torch.int64), mask)
    >>> [len(tags) for tags in tagger.decode(torch.randn(3, 2, 5), mask)]
    [3, 2]
    """

    transition_indptr: torch.Tensor | None
    transition_indices: torch.Tensor | None

    def __init__(self, num_tags: int, *, batch_first: bool | None = None, sparse_transitions: object = None) -> None:
        super().__init__()
        if isinstance(num_tags, bool) or not isinstance(num_tags, int) or num_tags < 1:
            raise ValueError(f"LinearChainCRF: num_tags must be a positive int, got {num_tags!r}")
        if batch_first is not None and not isinstance(batch_first, bool):
            raise TypeError(f"LinearChainCRF: batch_first must be True, False or not given, got {batch_first!r}")
        self.num_tags, self.batch_first = num_tags, batch_first
        self.start_transitions = nn.Parameter(torch.empty(num_tags))
        self.end_transitions = nn.Parameter(torch.empty(num_tags))
        self._structure: tuple[torch.Tensor, torch.Tensor] | None = None
        if sparse_transitions is None:
            self.transitions = nn.Parameter(torch.empty(num_tags, num_tags))
            self.register_buffer("transition_indptr", None)
            self.register_buffer("transition_indices", None)
        else:
            allowed = _allowed(sparse_transitions, num_tags)
            counts = allowed.sum(1)
            self._structure = (torch.cat([counts.new_zeros(1), counts.cumsum(0)]), allowed.nonzero()[:, 1].contiguous())
            self.transitions = nn.Parameter(torch.empty(int(counts.sum())))
            # on torch's default device, as the parameters (the meta device inside ``with torch.device("meta")``)
            device = torch.get_default_device()
            self.register_buffer("transition_indptr", torch.empty_like(self._structure[0], device=device))
            self.register_buffer("transition_indices", torch.empty_like(self._structure[1], device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in (-0.1, 0.1), as pytorch-crf, and the sparse structure given at construction
        (so that a layer built on the ``meta`` device, then ``to_empty()``, becomes valid)."""
        for p in (self.start_transitions, self.end_transitions, self.transitions):
            nn.init.uniform_(p, -0.1, 0.1)
        if self._structure is not None and self.transition_indptr is not None and \
                self.transition_indices is not None:
            self.transition_indptr.copy_(self._structure[0])
            self.transition_indices.copy_(self._structure[1])

    def extra_repr(self) -> str:
        layout = "" if self.batch_first is None else f", batch_first={self.batch_first}"
        sparse = "" if self.transition_indptr is None else f", allowed_transitions={self.transitions.numel()}"
        return f"num_tags={self.num_tags}{layout}{sparse}"

    def log_trans(self) -> torch.Tensor:
        """The transition scores as the chain functions take them: the ``(num_tags, num_tags)``
        parameter, or a sparse CSR tensor over ``transitions`` (differentiable in it)."""
        if self.transition_indptr is None or self.transition_indices is None:
            return self.transitions
        return csr_tensor(self.transition_indptr, self.transition_indices, self.transitions,
                          (self.num_tags, self.num_tags))

    def _scores(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``(transitions, log_init)`` in ``dtype`` (differentiable in the parameters):
        ``[log_trans]``, or ``[indptr, indices, values]`` as the sparse operators take them (no
        sparse tensor, so that the layer compiles with ``fullgraph=True``)."""
        values = self.transitions.to(dtype)
        if self.transition_indptr is None or self.transition_indices is None:
            return [values], self.start_transitions.to(dtype)
        return [self.transition_indptr, self.transition_indices, values], self.start_transitions.to(dtype)

    def _batch_major(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1) if self.batch_first is False else t

    def _layout(self, shape: Sequence[int]) -> tuple[int, ...]:
        """A batch-major ``(batch, v, ...)`` shape in the layer's layout."""
        return (shape[1], shape[0], *shape[2:]) if self.batch_first is False else tuple(shape)

    def _chain(self, emissions: torch.Tensor, lengths: Lengths, mask: torch.Tensor | None,
               caller: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(x, lengths, offsets)``: the batch-major emissions with the end scores added at each
        chain's last position, each masked window moved to the front (``offsets`` (batch,) its
        starts; None without a mask)."""
        check_dense(caller, emissions=emissions)
        names = ("v", "batch") if self.batch_first is False else ("batch", "v")
        if emissions.ndim != 3 or emissions.shape[-1] != self.num_tags:
            raise ValueError(f"{caller}: emissions must have shape ({names[0]}, {names[1]}, num_tags = "
                             f"{self.num_tags}), got {getattr(emissions, 'shape', type(emissions).__name__)}")
        emissions = self._batch_major(emissions)
        batch, v, _ = emissions.shape
        if v == 0:
            raise ValueError(f"{caller}: emissions have shape {tuple(emissions.shape)} (batch-major): a chain needs "
                             "at least one position (v >= 1)")
        offsets = None
        if mask is not None:
            if lengths is not None:
                raise ValueError(f"{caller}: pass lengths or a mask, not both")
            lengths, offsets = self._window(mask, (batch, v), caller)
        elif lengths is None:
            lengths = torch.full((batch,), v, dtype=torch.int64, device=emissions.device)
        lengths = torch.as_tensor(lengths, device=emissions.device)
        if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
            raise TypeError(f"{caller}: lengths must hold integers, got dtype {lengths.dtype}")
        if lengths.shape != (batch,):
            raise ValueError(f"{caller}: lengths must have shape (batch,) = ({batch},), got {tuple(lengths.shape)}")
        # torch's promotion of the emissions and the parameters (a bfloat16 encoder into a float32 CRF: float32)
        x = emissions.to(torch.promote_types(emissions.dtype, self.transitions.dtype))
        if offsets is not None:
            x = x.gather(1, _shifts(offsets, v)[..., None].expand(batch, v, self.num_tags))
        # the chain functions check lengths (1..v); clamped, bad ones cannot index out of range first
        index = (torch.arange(batch, device=x.device), lengths.clamp(1, v) - 1)
        x = x.index_put(index, x[index] + self.end_transitions.to(x.dtype))  # one copy, no (batch, v) mask
        return x, lengths, offsets

    def _window(self, mask: torch.Tensor, shape: tuple[int, int], caller: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lengths, offsets)`` of a mask whose ones are one contiguous window per sequence."""
        if not isinstance(mask, torch.Tensor) or mask.dtype not in (torch.bool, torch.uint8):
            raise TypeError(f"{caller}: mask must be a bool (or uint8) tensor, got "
                            f"{getattr(mask, 'dtype', type(mask).__name__)}")
        mask = self._batch_major(mask)
        if tuple(mask.shape) != shape:
            raise ValueError(f"{caller}: mask must have the shape of tags, {self._layout(shape)}, "
                             f"got {self._layout(mask.shape)}")
        mask = mask.to(torch.bool)
        lengths = mask.sum(1)
        offsets = mask.to(torch.uint8).argmax(1)
        if not torch.compiler.is_compiling():
            if not bool((lengths > 0).all()):
                raise ValueError(f"{caller}: every sequence needs at least one unmasked position")
            positions = torch.arange(shape[1], device=mask.device)
            window = (positions >= offsets[:, None]) & (positions < (offsets + lengths)[:, None])
            if not bool((window == mask).all()):
                raise ValueError(f"{caller}: each sequence's unmasked positions must be one contiguous window")
        return lengths, offsets

    def _path(self, tags: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor | None, caller: str) -> torch.Tensor:
        """``tags`` batch-major, each masked window moved to the front as ``x``'s."""
        check_dense(caller, tags=tags)
        if tags.ndim != 2:
            raise ValueError(f"{caller}: tags must be a 2-D tensor, got {tuple(tags.shape)}")
        tags = self._batch_major(tags)
        if tags.shape != x.shape[:2]:
            raise ValueError(f"{caller}: tags must be a tensor of shape {self._layout(x.shape[:2])}, "
                             f"got {self._layout(tags.shape)}")
        return tags if offsets is None else tags.gather(1, _shifts(offsets, x.shape[1]))

    def _unshifted(self, t: torch.Tensor, offsets: torch.Tensor | None, axis: int) -> torch.Tensor:
        """A batch-major result ``t`` with positions on ``axis`` (-1 or -2) back at the masked
        windows' places, in the layer's layout: what the chain functions leave past a length
        (-1 or 0) lands outside each window."""
        if offsets is not None:
            index = _shifts(-offsets, t.shape[axis])
            t = t.gather(axis, (index if axis == -1 else index[..., None]).expand_as(t))
        return t.transpose(axis - 1, axis) if self.batch_first is False else t

    @staticmethod
    def _reduce(out: torch.Tensor, reduction: str, lengths: torch.Tensor) -> torch.Tensor:
        if reduction == "none":
            return out
        if reduction == "sum":
            return out.sum()
        return out.mean() if reduction == "mean" else out.sum() / lengths.sum()

    def forward(self, emissions: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor | None = None,
                reduction: Reduction = "sum") -> torch.Tensor:
        """pytorch-crf's ``CRF.forward``: the log-likelihood of ``tags``, ``score(tags) - log Z``.

        Needs ``batch_first`` given at construction (``ValueError`` otherwise). ``reduction``:
        ``"sum"`` (default), ``"mean"`` (over the batch), ``"token_mean"`` (over the unmasked
        positions) or ``"none"`` ((batch,)).
        """
        if self.batch_first is None:
            raise ValueError("LinearChainCRF(...)(emissions, tags, mask) is pytorch-crf's calling convention: "
                             "construct the layer with batch_first=True or batch_first=False (pytorch-crf's default, "
                             "time-major); spchain's own is crf.nll(emissions, tags, lengths), batch-major")
        return -self.nll(emissions, tags, mask=mask, reduction=reduction)

    def log_partition(self, emissions: torch.Tensor, lengths: Lengths = None, *,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """The log-partition of each chain, (batch,)."""
        x, lengths, _ = self._chain(emissions, lengths, mask, "LinearChainCRF.log_partition")
        return self._logsumexp(x, lengths)

    def _logsumexp(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        transitions, start = self._scores(x.dtype)
        if len(transitions) == 1:
            return chain_logsumexp(x, transitions[0], start, lengths=lengths)
        return SPARSE_CHAIN_LOGSUMEXP(x, *transitions, start, lengths)

    def nll(self, emissions: torch.Tensor, tags: torch.Tensor, lengths: Lengths = None,
            reduction: Reduction = "mean", *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The negative log-likelihood of ``tags`` (the shape of ``emissions`` but the last axis):
        ``log Z - score(tags)``.

        ``reduction``: ``"mean"`` (over the batch), ``"sum"``, ``"token_mean"`` (over the
        positions within the lengths or the mask) or ``"none"`` ((batch,)). pytorch-crf's
        ``CRF.forward`` returns the log-likelihood, summed by default:
        ``crf.nll(e, y, mask=m, reduction="sum") == -torchcrf_crf(e, y, m)``.
        """
        caller = "LinearChainCRF.nll"
        if reduction not in REDUCTIONS:
            raise ValueError(f"{caller}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        x, lengths, offsets = self._chain(emissions, lengths, mask, caller)
        path = self._path(tags, x, offsets, caller)
        transitions, start = self._scores(x.dtype)
        if len(transitions) == 1:
            score = chain_path_score(x, transitions[0], start, path, lengths=lengths)
        else:
            score = SPARSE_CHAIN_PATH_SCORE(x, *transitions, start, path, lengths)
        return self._reduce(self._logsumexp(x, lengths) - score, reduction, lengths)

    def decode(self, emissions: torch.Tensor, lengths: Lengths = None, *,
               mask: torch.Tensor | None = None) -> torch.Tensor | list[list[int]]:
        """The best tag sequences (Viterbi).

        spchain's convention: int64 (batch, v), -1 past each length (or outside the mask), and
        everywhere for a sequence that reads a NaN score (as :func:`spchain.viterbi`).
        pytorch-crf's (``batch_first`` given): a list over the batch of each sequence's tags at
        its unmasked positions. A 2-D ``lengths`` is taken as the mask (pytorch-crf's
        ``decode(emissions, mask)``).
        """
        caller = "LinearChainCRF.decode"
        if isinstance(lengths, torch.Tensor) and lengths.ndim == 2 and mask is None:
            lengths, mask = None, lengths
        with torch.no_grad():
            x, lengths, offsets = self._chain(emissions, lengths, mask, caller)
            transitions, start = self._scores(x.dtype)
            if len(transitions) == 1:
                path = viterbi(x, transitions[0], start, lengths=lengths)[1]
            else:
                path = SPARSE_VITERBI(x, *transitions, start, lengths)[1]
        if self.batch_first is not None:
            return [row[:n].tolist() for row, n in zip(path, lengths.tolist())]
        return self._unshifted(path, offsets, -1)

    def marginals(self, emissions: torch.Tensor, lengths: Lengths = None, *,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
        """The posterior marginals of each tag at each position, the shape of ``emissions``
        (0 past each length, or outside the mask)."""
        with torch.no_grad():
            x, lengths, offsets = self._chain(emissions, lengths, mask, "LinearChainCRF.marginals")
            transitions, start = self._scores(x.dtype)
            if len(transitions) == 1:
                out = chain_marginals(x, transitions[0], start, lengths=lengths)
            else:
                out = SPARSE_CHAIN_MARGINALS(x, *transitions, start, lengths)
        return self._unshifted(out, offsets, -2)

    def sample(self, emissions: torch.Tensor, lengths: Lengths = None, *, mask: torch.Tensor | None = None,
               num_samples: int = 1, seed: int | None = None) -> torch.Tensor:
        """Tag sequences drawn from the posterior, int64 (num_samples, batch, v) ((num_samples,
        v, batch) time-major), -1 past each length (or outside the mask)."""
        with torch.no_grad():
            x, lengths, offsets = self._chain(emissions, lengths, mask, "LinearChainCRF.sample")
            transitions, start = self._scores(x.dtype)
            if len(transitions) == 1:
                out = chain_sample(x, transitions[0], start, lengths=lengths, num_samples=num_samples, seed=seed)
            else:
                out = SPARSE_CHAIN_SAMPLE(x, *transitions, start, lengths, num_samples, seed)
        return self._unshifted(out, offsets, -1)


def _shifts(offsets: torch.Tensor, v: int) -> torch.Tensor:
    """``(batch, v)`` positions ``(t + offsets) mod v``: gathering by them moves each window to the front."""
    return (torch.arange(v, device=offsets.device) + offsets[:, None]) % v


def _allowed(structure: object, num_tags: int) -> torch.Tensor:
    """The ``(num_tags, num_tags)`` bool mask of a ``sparse_transitions`` argument."""
    caller = "LinearChainCRF: sparse_transitions"
    if isinstance(structure, torch.Tensor) and structure.is_meta:
        raise ValueError(f"{caller} is on the meta device, which holds no data: make it outside "
                         "'with torch.device(\"meta\")' (the layer itself may be made inside)")
    if isinstance(structure, torch.Tensor) and structure.layout != torch.strided:
        if structure.shape != (num_tags, num_tags):
            raise ValueError(f"{caller} must have shape ({num_tags}, {num_tags}), got {tuple(structure.shape)}")
        coo = structure.detach().to_sparse().coalesce().indices().cpu()
        allowed = torch.zeros(num_tags, num_tags, dtype=torch.bool, device="cpu")
        allowed[coo[0], coo[1]] = True
        return allowed
    try:
        allowed = torch.as_tensor(structure, device="cpu").detach()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{caller} must be a bool mask or a torch sparse tensor, not "
                        f"{type(structure).__name__}") from error
    if allowed.dtype != torch.bool:
        raise TypeError(f"{caller} must be a bool mask (or a torch sparse tensor), got dtype {allowed.dtype}")
    if allowed.shape != (num_tags, num_tags):
        raise ValueError(f"{caller} must have shape ({num_tags}, {num_tags}), got {tuple(allowed.shape)}")
    return allowed
