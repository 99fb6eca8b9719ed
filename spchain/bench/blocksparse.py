"""The block-sparse workload: a 4096 x 4096 layer with block or N:M sparsity on x (256, 4096), float32.

``block_sparse_linear`` with 16 x 16 and 32 x 32 blocks at 90 % and 75 % beside the
dense ``nn.Linear`` and the unstructured (CSR) ``SparseLinear``, all three holding the same
weights; and a 2:4 (N:M, 50 %) weight through the unstructured ``SparseLinear`` beside the dense
layer. Forward (under ``torch.no_grad``) and forward + backward (``x`` requires grad; the result
is the output and the input gradient). torch is imported when a case is built.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .core import Case

if TYPE_CHECKING:
    import torch

CASES = [f"{name} {kind}" for name in ("90% block 16", "90% block 32", "75% block 16", "75% block 32", "2:4")
         for kind in ("forward", "forward+backward")]
METHODS = ["spchain", "nn.Linear (dense)", "SparseLinear (unstructured)"]
_Method = tuple[Callable[["torch.Tensor"], "torch.Tensor"], Sequence["torch.Tensor"]]
"""A method's layer and the leaves whose gradients it sets."""

SIZES = {False: {"batch": 256, "features": 4096}, True: {"batch": 64, "features": 2048}}


@functools.lru_cache(maxsize=1)
def _layers(pattern: str, quick: bool, device: str) -> tuple[dict[str, _Method], torch.nn.Linear]:
    """The methods' layers and the dense layer, holding the same weights, of one sparsity
    pattern (``"90% block 16"``, ``"2:4"``): built once for its forward and its forward +
    backward case, which run one after the other (pruning the weights twice took a second of
    the quick run)."""
    import torch

    import spchain as sc
    import spchain.torch as st

    _, features = SIZES[quick].values()
    torch.manual_seed(0)
    dense = torch.nn.Linear(features, features)
    weight = dense.weight.detach().numpy()
    if pattern == "2:4":
        mask = sc.prune(weight, method="n:m", n=2, m=4).toarray() != 0
        with torch.no_grad():
            dense.weight.mul_(torch.from_numpy(mask))
        layer = st.SparseLinear.from_dense(dense, 0.5).to(device)
        methods: dict[str, _Method] = {"spchain": (layer, list(layer.parameters()))}
    else:
        percent, _, size = pattern.split(" ")
        sparsity, block = int(percent.rstrip("%")) / 100, int(size)
        bsr = sc.prune(weight, sparsity, method="random", seed=0, block=(block, block))
        with torch.no_grad():
            dense.weight.copy_(torch.from_numpy(bsr.toarray()))
        values = torch.nn.Parameter(torch.from_numpy(bsr.data).to(device))
        bias = torch.nn.Parameter(dense.bias.detach().clone().to(device))
        indptr, indices = torch.from_numpy(bsr.indptr).to(device), torch.from_numpy(bsr.indices).to(device)

        def block_layer(x: torch.Tensor) -> torch.Tensor:
            return st.block_sparse_linear(x, values, indptr, indices, (features, features), bias)

        # exactly the block weights' entries (block counts round differently from entry counts)
        unstructured = st.SparseLinear.from_dense(dense, 1 - bsr.nnz / weight.size).to(device)
        methods = {"spchain": (block_layer, [values, bias]),
                   "SparseLinear (unstructured)": (unstructured, list(unstructured.parameters()))}
    dense = dense.to(device)
    methods["nn.Linear (dense)"] = (dense, list(dense.parameters()))
    return methods, dense


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    import torch

    pattern, kind = name.rsplit(" ", 1)
    backward = kind == "forward+backward"
    batch, features = SIZES[quick].values()
    methods, dense = _layers(pattern, quick, device)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, features, generator=generator).to(device).requires_grad_(backward)
    grad_y = torch.randn(batch, features, generator=generator).to(device)

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def run(layer: Callable[[torch.Tensor], torch.Tensor], leaves: Sequence[torch.Tensor]) -> Callable[[], object]:
        def forward() -> torch.Tensor:
            with torch.no_grad():
                y = layer(x)
            synchronize()
            return y

        def forward_backward() -> tuple[torch.Tensor, torch.Tensor | None]:
            for t in (x, *leaves):
                t.grad = None  # as optimizer.zero_grad() does
            y = layer(x)
            y.backward(grad_y)
            synchronize()
            return y.detach(), x.grad

        return forward_backward if backward else forward

    def reference() -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        w64, b64 = dense.weight.detach().double(), dense.bias.detach().double()
        y = x.detach().double() @ w64.T + b64
        return (y, grad_y.double() @ w64) if backward else y

    ordered = {m: run(*methods[m]) for m in METHODS if m in methods}
    return Case("block-sparse", name, ordered, reference, device)
