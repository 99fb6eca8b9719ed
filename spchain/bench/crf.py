"""The crf workload: a linear-chain CRF's negative log-likelihood, forward + backward, batch
256, v 64, 50 tags, float32, ragged lengths. spchain's ``LinearChainCRF.nll`` beside
pytorch-crf's ``CRF`` (PyPI ``pytorch-crf``, if installed) on the same parameters, and the
plain PyTorch recursion a user would write (``torch.logsumexp`` a step, gold score by gathers),
and torch-struct's ``LinearChainCRF`` (PyPI ``torch-struct``, if installed, full sizes only; 0.5 imports and runs
with torch 2.13) on the (batch, v - 1, c, c) edge potentials it takes, gold score by gathers.
"""

import warnings
from collections.abc import Callable

import torch

from .. import torch as st
from .core import Case

CASES = ["nll forward + backward"]
SIZES = {False: {"batch": 256, "v": 64, "tags": 50}, True: {"batch": 64, "v": 32, "tags": 50}}


def plain_nll(emissions: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor,
              start: torch.Tensor, trans: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """The summed NLL by the sequential ``torch.logsumexp`` recursion, masked past each length."""
    batch, v, _ = emissions.shape
    rows = torch.arange(batch, device=emissions.device)
    alpha = start + emissions[:, 0]
    score = start[tags[:, 0]] + emissions[rows, 0, tags[:, 0]]
    for t in range(1, v):
        step = torch.logsumexp(alpha[:, :, None] + trans, dim=1) + emissions[:, t]
        alpha = torch.where(mask[:, t, None], step, alpha)
        gold = trans[tags[:, t - 1], tags[:, t]] + emissions[rows, t, tags[:, t]]
        score = score + torch.where(mask[:, t], gold, torch.zeros_like(gold))
    last = tags[rows, mask.sum(1) - 1]
    return (torch.logsumexp(alpha + end, dim=-1) - score - end[last]).sum()


def gold_score(emissions: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor,
               start: torch.Tensor, trans: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """The summed scores of the gold tags, by gathers, masked past each length."""
    rows = torch.arange(emissions.shape[0], device=emissions.device)
    inside = mask.to(emissions.dtype)
    score = (emissions.gather(2, tags[..., None])[..., 0] * inside).sum() + start[tags[:, 0]].sum()
    score = score + (trans[tags[:, :-1], tags[:, 1:]] * inside[:, 1:]).sum()
    return score + end[tags[rows, mask.sum(1) - 1]].sum()


def struct_nll(emissions: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor,
               start: torch.Tensor, trans: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """The summed NLL with torch-struct's ``LinearChainCRF`` partition (edge potentials
    ``phi[b, n, j, i]``: state i at n → j at n + 1)."""
    import torch_struct

    lengths = mask.sum(1)
    last = torch.arange(emissions.shape[1], device=emissions.device) == (lengths[:, None] - 1)
    x = emissions + last[..., None] * end
    phi = x[:, 1:, :, None] + trans.T
    phi = torch.cat([phi[:, :1] + (start + x[:, 0])[:, None, None, :], phi[:, 1:]], 1)
    with warnings.catch_warnings():  # torch-struct 0.5 defines no arg_constraints
        warnings.simplefilter("ignore", UserWarning)
        log_z: torch.Tensor = torch_struct.LinearChainCRF(phi, lengths=lengths).partition
    return log_z.sum() - gold_score(emissions, tags, mask, start, trans, end)


def make_inputs(quick: bool, device: str, seed: int = 0) -> tuple[list[torch.Tensor], st.LinearChainCRF]:
    """``(emissions, tags, lengths, mask)`` and a LinearChainCRF with random parameters."""
    batch, v, tags = SIZES[quick].values()
    g = torch.Generator().manual_seed(seed)
    emissions = torch.randn(batch, v, tags, generator=g)
    gold = torch.randint(tags, (batch, v), generator=g)
    lengths = torch.randint(v // 2, v + 1, (batch,), generator=g)
    lengths[0] = v
    mask = torch.arange(v)[None, :] < lengths[:, None]
    crf = st.LinearChainCRF(tags)
    with torch.no_grad():
        for p in crf.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return [t.to(device) for t in (emissions, gold, lengths, mask)], crf.to(device)


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    (emissions, tags, lengths, mask), crf = make_inputs(quick, device)
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    emissions.requires_grad_()
    params = [crf.start_transitions, crf.transitions, crf.end_transitions]

    def timed(loss: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Callable[[], object]:
        def run() -> tuple[torch.Tensor | None, ...]:
            for t in leaves:
                t.grad = None
            out = loss()
            out.backward()
            sync()
            return (out.detach(), *(t.grad for t in leaves))
        return run

    methods = {"spchain": timed(lambda: crf.nll(emissions, tags, lengths, reduction="sum"), [emissions, *params]),
               "torch sequential logsumexp": timed(lambda: plain_nll(emissions, tags, mask, *params),
                                                   [emissions, *params])}
    try:
        import torchcrf
    except ImportError:
        torchcrf = None
    if torchcrf is not None:
        ref = torchcrf.CRF(crf.num_tags, batch_first=True).to(device)
        ref.load_state_dict(crf.state_dict())
        ref_params = [ref.start_transitions, ref.transitions, ref.end_transitions]
        methods["pytorch-crf CRF"] = timed(lambda: -ref(emissions, tags, mask, reduction="sum"),
                                           [emissions, *ref_params])

    try:
        import torch_struct  # noqa: F401
    except ImportError:
        torch_struct = None
    if torch_struct is not None and not quick:  # seconds a run even at the quick size: full runs only
        methods["torch-struct LinearChainCRF"] = timed(lambda: struct_nll(emissions, tags, mask, *params),
                                                       [emissions, *params])

    def reference() -> tuple[torch.Tensor | None, ...]:
        e = emissions.detach().double().requires_grad_()
        leaves = [p.detach().double().requires_grad_() for p in params]
        out = plain_nll(e, tags, mask, *leaves)
        out.backward()
        return (out.detach(), e.grad, *(p.grad for p in leaves))

    # torch-struct's log-semiring scan over (batch, v - 1, c, c) potentials takes minutes a run at full size
    return Case("crf", name, methods, reference, device, slow={"torch-struct LinearChainCRF"})
