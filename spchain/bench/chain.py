"""The chain workload: batch 500, v 40, c 200, per-step transitions, float32 (docs/design.rst).

spchain's ``chain_logsumexp`` beside the two ways PyTorch users write it today:

- a pairwise tree of broadcast products: add ``x_i`` to every row of ``log P_i``, materialise all
  (batch, v-1, c, c) log-matrices and multiply them in pairs in log space with max shifts,
  padding an odd level with a zero log-matrix (the all-ones matrix, not the identity: wrong
  whenever v - 1 is not a power of two);
- the sequential ``torch.logsumexp`` recursion (exact, but a (batch, c, c) tensor per step).
"""

from collections.abc import Callable

import torch

from .. import torch as st
from .core import Case

CASES = ["forward", "forward + backward"]
SIZES = {False: {"batch": 500, "v": 40, "c": 200}, True: {"batch": 64, "v": 16, "c": 160}}


def pairwise_tree(x: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor) -> torch.Tensor:
    """A pairwise tree of broadcast log-space products (wrong for odd levels)."""
    mats = log_trans + x[:, :-1, :, None]  # (batch, v-1, c, c)
    while mats.shape[1] > 1:
        if mats.shape[1] % 2:
            mats = torch.cat([mats, torch.zeros_like(mats[:, :1])], 1)
        left, right = mats[:, 0::2], mats[:, 1::2]
        left_max = left.amax(-1, keepdim=True)
        right_max = right.amax(-2, keepdim=True)
        mats = torch.log(torch.exp(left - left_max) @ torch.exp(right - right_max)) + left_max + right_max
    return torch.logsumexp(log_init[:, None] + mats[:, 0] + x[:, -1, None, :], dim=(-2, -1))


def sequential(x: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor) -> torch.Tensor:
    """The exact sequential recursion with ``torch.logsumexp`` (a (batch, c, c) tensor a step)."""
    alpha = log_init + x[:, 0]
    for t in range(1, x.shape[1]):
        alpha = torch.logsumexp(alpha[:, :, None] + log_trans[0, t - 1], dim=1) + x[:, t]
    return torch.logsumexp(alpha, dim=-1)


def _with_grads(fn: Callable[..., torch.Tensor],
                inputs: tuple[torch.Tensor, ...]) -> Callable[[], tuple[torch.Tensor | None, ...]]:
    def run() -> tuple[torch.Tensor | None, ...]:
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        out.sum().backward()
        return (out.detach(), *(t.grad for t in inputs))

    return run


def _reference_with_grads(inputs: tuple[torch.Tensor, ...], chunk: int = 25
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Float64 sequential recursion under autograd, a chunk of the batch at a time."""
    x, log_trans, log_init = (t.detach().double() for t in inputs)
    log_trans.requires_grad_()
    log_init.requires_grad_()
    outs: list[torch.Tensor] = []
    grads_x: list[torch.Tensor] = []
    for start in range(0, x.shape[0], chunk):
        part = x[start:start + chunk].clone().requires_grad_()
        out = sequential(part, log_trans, log_init)
        out.sum().backward()
        outs.append(out.detach())
        assert part.grad is not None  # a leaf that requires grad
        grads_x.append(part.grad)
    return torch.cat(outs), torch.cat(grads_x), log_trans.grad, log_init.grad


def make_inputs(quick: bool, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, log_trans, log_init)`` of the chain workload: random emissions, per-step transitions."""
    batch, v, c = SIZES[quick].values()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, v, c, generator=g).to(device)
    log_trans = torch.log_softmax(torch.randn(1, v - 1, c, c, generator=g), -1).to(device)
    log_init = torch.log_softmax(torch.randn(c, generator=g), -1).to(device)
    return x, log_trans, log_init


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    inputs = make_inputs(quick, device)
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    methods: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "spchain": st.chain_logsumexp,
        "torch sequential logsumexp": sequential,
        "torch pairwise broadcast tree": pairwise_tree,
    }
    if name == "forward":
        def timed(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], object]:
            def run() -> object:
                with torch.no_grad():
                    out = fn(*inputs)
                sync()
                return out
            return run

        def reference() -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            return sequential(*(t.double() for t in inputs))
    else:
        for t in inputs:
            t.requires_grad_()

        def timed(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], object]:
            run_with_grads = _with_grads(fn, inputs)

            def run() -> object:
                out = run_with_grads()
                sync()
                return out
            return run

        def reference() -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            return _reference_with_grads(inputs)
    return Case("chain", name, {k: timed(fn) for k, fn in methods.items()}, reference, device,
                slow={"torch pairwise broadcast tree"})
