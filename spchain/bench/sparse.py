"""The sparse-linear workload: a 4096 x 4096 sparse layer on x (256, 4096), float32.

spchain's ``SparseLinear`` beside the dense ``nn.Linear`` it replaces and the layers PyTorch
users build today with ``torch.sparse.mm``: on a COO weight, and on a CSR weight (torch's
fastest sparse product on the CPU, MKL's), at 90 % and 99 % sparsity, forward
(inference, under ``torch.no_grad``) and forward + backward (``x`` requires grad; the returned
result is the output and the input gradient). All four hold the same weights, so each is
compared with one float64 dense reference. torch is imported when a case is built.
"""

import warnings
from collections.abc import Callable, Sequence

from .core import Case

CASES = ["99% forward", "99% forward+backward", "90% forward", "90% forward+backward"]
METHODS = ["spchain", "nn.Linear (dense)", "torch.sparse.mm (COO)", "torch.sparse.mm (CSR)"]

SIZES = {False: {"batch": 256, "features": 4096}, True: {"batch": 64, "features": 2048}}


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    import torch

    import spchain.torch as st

    percent, kind = name.split(" ")
    sparsity = int(percent.rstrip("%")) / 100
    backward = kind == "forward+backward"
    batch, features = SIZES[quick].values()
    torch.manual_seed(0)
    dense = torch.nn.Linear(features, features)
    sparse = st.SparseLinear.from_dense(dense, sparsity, method="random").to(device)
    dense = sparse.to_dense()
    coo_weight = dense.weight.detach().to_sparse().coalesce().requires_grad_()
    coo_bias = dense.bias.detach().clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
        csr_weight = dense.weight.detach().to_sparse_csr().requires_grad_()
    csr_bias = dense.bias.detach().clone().requires_grad_()
    x = torch.randn(batch, features).to(device).requires_grad_(backward)
    grad_y = torch.randn(batch, features).to(device)

    def coo_layer(x: torch.Tensor) -> torch.Tensor:
        product: torch.Tensor = torch.sparse.mm(coo_weight, x.t())  # torch.sparse.mm is unannotated
        return product.t() + coo_bias

    def csr_layer(x: torch.Tensor) -> torch.Tensor:
        product: torch.Tensor = torch.sparse.mm(csr_weight, x.t())
        return product.t() + csr_bias

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
                t.grad = None  # as optimizer.zero_grad() does: gradients are assigned, not accumulated
            y = layer(x)
            y.backward(grad_y)
            synchronize()
            return y.detach(), x.grad

        return forward_backward if backward else forward

    def reference() -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        w64, b64 = dense.weight.detach().double(), dense.bias.detach().double()
        y = x.detach().double() @ w64.T + b64
        return (y, grad_y.double() @ w64) if backward else y

    methods = dict(zip(METHODS, (run(sparse, list(sparse.parameters())), run(dense, list(dense.parameters())),
                                 run(coo_layer, [coo_weight, coo_bias]), run(csr_layer, [csr_weight, csr_bias]))))
    return Case("sparse-linear", name, methods, reference, device,
                slow={"torch.sparse.mm (COO)"} if sparsity < 0.95 else set())
