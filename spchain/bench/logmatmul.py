"""The logmatmul workload: (64, 256, 256) @ (64, 256, 256), float32 (issue 5).

spchain's ``logmatmul`` beside the broadcasting PyTorch version,
``(a[..., :, :, None] + b[..., None, :, :]).logsumexp(-2)``, which builds (and keeps for
backward) a (64, 256, 256, 256) tensor.
"""

from collections.abc import Callable

import torch

from .. import torch as st
from .core import Case

CASES = ["forward", "forward + backward"]
SIZES = {False: {"batch": 64, "n": 256}, True: {"batch": 2, "n": 192}}


def broadcasting(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The obvious PyTorch log-semiring product: an (..., m, k, n) tensor."""
    return torch.logsumexp(a[..., :, :, None] + b[..., None, :, :], dim=-2)


def _reference(a: torch.Tensor, b: torch.Tensor,
               grads: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 broadcasting product, one matrix of the batch at a time (bounded memory)."""
    outs: list[torch.Tensor] = []
    grads_a: list[torch.Tensor] = []
    grads_b: list[torch.Tensor] = []
    for i in range(a.shape[0]):
        ai = a[i].detach().double().requires_grad_(grads)
        bi = b[i].detach().double().requires_grad_(grads)
        out = broadcasting(ai, bi)
        if grads:
            out.sum().backward()
            assert ai.grad is not None and bi.grad is not None  # leaves that require grad
            grads_a.append(ai.grad)
            grads_b.append(bi.grad)
        outs.append(out.detach())
    if not grads:
        return torch.stack(outs)
    return torch.stack(outs), torch.stack(grads_a), torch.stack(grads_b)


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    batch, n = SIZES[quick].values()
    g = torch.Generator().manual_seed(0)
    a = (3 * torch.randn(batch, n, n, generator=g)).to(device)
    b = (3 * torch.randn(batch, n, n, generator=g)).to(device)
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    grads = name == "forward + backward"
    if grads:
        a.requires_grad_()
        b.requires_grad_()

    def timed(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            if not grads:
                with torch.no_grad():
                    out = fn(a, b)
                sync()
                return out
            a.grad = b.grad = None
            out = fn(a, b)
            out.sum().backward()
            sync()
            return out.detach(), a.grad, b.grad
        return run

    methods = {"spchain": timed(st.logmatmul), "torch broadcasting logsumexp": timed(broadcasting)}
    return Case("logmatmul", name, methods, lambda: _reference(a, b, grads), device)
