"""The block-diag workload of DESIGN.md: x (8192, 512) as 8 groups of 64, float32, forward + backward.

Every method computes ``y[b, g] = x[b, g] @ w[g]`` and the gradients in ``x`` and ``w`` of
``sum(y * grad)``: ``spchain.torch.block_diag_matmul`` beside ``torch.einsum`` (the baseline to
beat), the seed code's ``torch.matmul`` of (B, G, 1, d) with (G, d, d) (which broadcasts ``w``
to one copy per row and keeps it for backward), and a per-group Python loop.
"""

import numpy as np

from .core import Case

CASES = ["8 groups of 64"]
METHODS = ("spchain", "torch.einsum", "torch.matmul broadcast", "torch per-group loop")
SIZES = {False: (8192, 8, 64), True: (512, 8, 64)}
"""``quick`` → (rows, groups, features per group)."""


def forward_backward(product, leaves, grad, device: str):
    """A callable that runs ``y = product()`` and returns ``(y, *gradients of sum(y * grad) in leaves)``."""
    import torch

    def run():
        y = product()
        grads = torch.autograd.grad(y, leaves, grad)
        if device == "cuda":
            torch.cuda.synchronize()
        return (y, *grads)

    return run


def as_numpy(*tensors):
    """Float64 NumPy copies of ``tensors``, for the references."""
    return [t.detach().cpu().double().numpy() for t in tensors]


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    import torch

    import spchain.torch as sct

    if name not in CASES:
        raise ValueError(f"block-diag has no case {name!r}; cases: {CASES}")
    rows, groups, d = SIZES[quick]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, groups * d, generator=gen).to(device).requires_grad_()
    w = (torch.randn(groups, d, d, generator=gen) / d**0.5).to(device).requires_grad_()
    grad = torch.randn(rows, groups, d, generator=gen).to(device)

    def blocks():
        return x.view(rows, groups, d)

    products = {
        "spchain": lambda: sct.block_diag_matmul(blocks(), w),
        "torch.einsum": lambda: torch.einsum("bgi,gio->bgo", blocks(), w),
        "torch.matmul broadcast": lambda: torch.matmul(x.view(rows, groups, 1, d), w).view(rows, groups, d),
        "torch per-group loop": lambda: torch.stack([blocks()[:, g] @ w[g] for g in range(groups)], dim=1),
    }

    def reference():
        x64, w64, grad64 = as_numpy(x.view(rows, groups, d), w, grad)
        return (np.einsum("bgi,gio->bgo", x64, w64),
                np.einsum("bgo,gio->bgi", grad64, w64).reshape(rows, groups * d),
                np.einsum("bgi,bgo->gio", x64, grad64))

    return Case(
        "block-diag", name,
        methods={method: forward_backward(products[method], (x, w), grad, device) for method in METHODS},
        reference=reference, device=device,
        slow=set() if quick else {"torch.matmul broadcast"},
    )
