"""The viterbi workload: the chain workload's sizes (batch 500, v 40, c 200, per-step
transitions, float32), decoding. spchain's ``viterbi`` beside the broadcasting PyTorch
max-product recursion with stored argmaxes and a gather-based backtrack.
"""

from collections.abc import Callable

import torch

from .. import torch as st
from .chain import SIZES as _CHAIN_SIZES
from .chain import make_inputs
from .core import Case

CASES = ["decode"]
SIZES = _CHAIN_SIZES  # the chain workload's


def broadcasting(x: torch.Tensor, log_trans: torch.Tensor,
                 log_init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The obvious PyTorch Viterbi: a (batch, c, c) tensor a step, then backtracking."""
    delta = log_init + x[:, 0]
    backptrs = []
    for t in range(1, x.shape[1]):
        delta, arg = (delta[:, :, None] + log_trans[0, t - 1]).max(dim=1)
        delta = delta + x[:, t]
        backptrs.append(arg)
    score, state = delta.max(dim=-1)
    path = [state]
    for arg in reversed(backptrs):
        state = arg.gather(1, state[:, None])[:, 0]
        path.append(state)
    return score, torch.stack(path[::-1], 1)


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    x, log_trans, log_init = make_inputs(quick, device, seed=1)
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                out = fn(x, log_trans, log_init)
            sync()
            return out
        return run

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        return broadcasting(x.double(), log_trans.double(), log_init.double())

    methods = {"spchain": timed(st.viterbi), "torch broadcasting max": timed(broadcasting)}
    return Case("viterbi", name, methods, reference, device)
