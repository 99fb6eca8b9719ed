"""The block-diag workload of the design (docs/design.rst): x (8192, 512) as 8 groups of 64, float32, forward + backward.

Every method computes ``y[b, g] = x[b, g] @ w[g]`` and the gradients in ``x`` and ``w`` of
``sum(y * grad)``: ``spchain.torch.block_diag_matmul`` beside ``torch.einsum`` (the baseline to
beat), the broadcasting ``torch.matmul`` of (B, G, 1, d) with (G, d, d) (which broadcasts ``w``
to one copy per row and keeps it for backward), and a per-group Python loop.

The second case puts the same product between two ``nn.Linear`` layers (with ReLUs), as in a
model: on the CPU it measures, too, what the product costs the torch operations around it
(spchain's products run in NumPy's BLAS threads, beside torch's own).
"""

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from numpy.typing import NDArray

from .core import Case

if TYPE_CHECKING:
    import torch

CASES = ["8 groups of 64", "8 groups of 64 between Linear layers"]
METHODS = ("spchain", "torch.einsum", "torch.matmul broadcast", "torch per-group loop")
SIZES = {False: {"rows": 8192, "groups": 8, "features per group": 64},
         True: {"rows": 2048, "groups": 8, "features per group": 64}}


def forward_backward(product: Callable[[], "torch.Tensor"], leaves: Sequence["torch.Tensor"], grad: "torch.Tensor",
                     device: str) -> Callable[[], tuple["torch.Tensor", ...]]:
    """A callable that runs ``y = product()`` and returns ``(y, *gradients of sum(y * grad) in leaves)``."""
    import torch

    def run() -> tuple["torch.Tensor", ...]:
        y = product()
        grads = torch.autograd.grad(y, leaves, grad)
        if device == "cuda":
            torch.cuda.synchronize()
        return (y, *grads)

    return run


def as_numpy(*tensors: "torch.Tensor") -> list[NDArray[Any]]:
    """Float64 NumPy copies of ``tensors``, for the references."""
    return [t.detach().cpu().double().numpy() for t in tensors]


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    import torch

    import spchain.torch as sct

    rows, groups, d = SIZES[quick].values()
    in_model = name == CASES[1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, groups * d, generator=gen).to(device).requires_grad_()
    w = (torch.randn(groups, d, d, generator=gen) / d**0.5).to(device).requires_grad_()
    grad = torch.randn(rows, groups, d, generator=gen).to(device)
    layers = [torch.nn.Linear(groups * d, groups * d, device=device) for _ in range(2)] if in_model else []

    products: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "spchain": sct.block_diag_matmul,
        "torch.einsum": lambda h, w: torch.einsum("bgi,gio->bgo", h, w),
        "torch.matmul broadcast": lambda h, w: torch.matmul(h.unsqueeze(-2), w).squeeze(-2),
        "torch per-group loop": lambda h, w: torch.stack([h[:, g] @ w[g] for g in range(groups)], dim=1),
    }
    if in_model:
        del products["torch.matmul broadcast"]

    def run(product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor,
            layers: list[torch.nn.Linear]) -> Callable[[], torch.Tensor]:
        """``product`` on x's blocks, or between the two layers in the model case."""
        if not layers:
            return lambda: product(x.view(rows, groups, d), w)
        first, last = layers
        relu = torch.nn.functional.relu
        return lambda: last(relu(product(relu(first(x)).view(rows, groups, d), w).flatten(1))).view(rows, groups, d)

    def reference() -> tuple[NDArray[Any], ...]:
        x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
        layers64 = [copy.deepcopy(layer).double() for layer in layers]
        einsum = run(products["torch.einsum"], x64, w64, layers64)
        return tuple(as_numpy(*forward_backward(einsum, (x64, w64), grad.double(), device)()))

    return Case(
        "block-diag", name,
        methods={method: forward_backward(run(product, x, w, layers), (x, w), grad, device)
                 for method, product in products.items()},
        reference=reference, device=device,
        slow={"torch.matmul broadcast"},
    )
