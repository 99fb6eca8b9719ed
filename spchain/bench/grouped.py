"""The grouped workload: N = 16384 rows in 16 uneven groups, 512 → 512, float32, forward + backward.

Rows come sorted by group (a mixture-of-experts layer after routing); group g is multiplied by
``w[g]``. Every method returns ``y`` and the gradients in ``x`` and ``w`` of ``sum(y * grad)``:
``spchain.torch.grouped_matmul`` beside a per-group PyTorch loop (the baseline to beat), the
padded ``bmm`` of capacity-style MoE code (G × largest group rows), and torch's own
``nn.functional.grouped_mm`` where this torch has it for float32 on the device.
"""

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from .blockdiag import as_numpy, forward_backward
from .core import Case

if TYPE_CHECKING:
    import torch

CASES = ["16 uneven groups"]
METHODS = ("spchain", "torch per-group loop", "torch padded bmm", "torch grouped_mm")
SIZES = {False: {"rows": 16384, "groups": 16, "features in and out": 512},
         True: {"rows": 4096, "groups": 16, "features in and out": 256}}


def group_sizes(rows: int, groups: int) -> list[int]:
    """Uneven, reproducible group sizes summing to ``rows`` (Dirichlet(1) shares)."""
    rng = np.random.default_rng(0)
    sizes: list[int] = rng.multinomial(rows, rng.dirichlet(np.ones(groups))).tolist()
    return sizes


def _grouped_mm(torch: ModuleType, device: str) -> Callable[..., "torch.Tensor"] | None:
    """``torch.nn.functional.grouped_mm`` if it runs forward and backward in float32 on ``device``."""
    fn: Callable[..., Any] | None = getattr(torch.nn.functional, "grouped_mm", None)  # not in every torch
    if fn is None:
        return None
    try:
        a = torch.ones(8, 4, device=device, requires_grad=True)
        b = torch.ones(2, 4, 4, device=device, requires_grad=True)
        y = fn(a, b, offs=torch.tensor([3, 8], dtype=torch.int32, device=device))
        torch.autograd.grad(y, (a, b), torch.ones_like(y))
    except (RuntimeError, NotImplementedError):
        return None
    return fn


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    import torch

    import spchain.torch as sct

    rows, groups, d = SIZES[quick].values()
    sizes = group_sizes(rows, groups)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=gen).to(device).requires_grad_()
    w = (torch.randn(groups, d, d, generator=gen) / d**0.5).to(device).requires_grad_()
    grad = torch.randn(rows, d, generator=gen).to(device)
    offsets = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device=device)

    def padded_bmm() -> torch.Tensor:
        padded = torch.nn.utils.rnn.pad_sequence(x.split(sizes), batch_first=True)
        y = torch.bmm(padded, w)
        return torch.cat([y[g, :size] for g, size in enumerate(sizes)])

    products: dict[str, Callable[[], torch.Tensor]] = {
        "spchain": lambda: sct.grouped_matmul(x, w, sizes),
        "torch per-group loop": lambda: torch.cat([part @ w[g] for g, part in enumerate(x.split(sizes))]),
        "torch padded bmm": padded_bmm,
    }
    grouped_mm = _grouped_mm(torch, device)
    if grouped_mm is not None:
        products["torch grouped_mm"] = lambda: grouped_mm(x, w, offs=offsets)

    def reference() -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
        x64, w64, grad64 = as_numpy(x, w, grad)
        bounds = np.cumsum([0, *sizes])
        parts = [slice(bounds[g], bounds[g + 1]) for g in range(groups)]
        return (np.concatenate([x64[p] @ w64[g] for g, p in enumerate(parts)]),
                np.concatenate([grad64[p] @ w64[g].T for g, p in enumerate(parts)]),
                np.stack([x64[p].T @ grad64[p] for p in parts]))

    return Case(
        "grouped", name,
        methods={method: forward_backward(product, (x, w), grad, device) for method, product in products.items()},
        reference=reference, device=device,
    )
