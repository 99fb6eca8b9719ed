"""The torch-layer workload: spchain's modules under ``torch.compile``, and small calls (issue 11).

- ``compiled <Module>``: a small model, Linear → module → ReLU → Linear, forward + backward,
  compiled with ``torch.compile`` (method ``spchain``) beside the same model in eager mode:
  the compiled one must be no slower.
- ``small <op>``: tiny sizes, where the call overhead dominates, forward + backward (``small
  <op> forward``: the forward alone, on the same inputs, which require grad as in training;
  ``small <op> inference``: the forward under ``torch.no_grad``),
  beside the torch op that the spchain call replaces (``nn.Linear``, the broadcasting
  logsumexp, einsum, the sequential ``torch.logsumexp`` recursion of a chain); a timed run is
  the mean of :data:`SMALL_CALLS` calls. ``small SparseLinear(64, 64)`` stores every entry
  (sparsity 0, which the layer runs as ``nn.Linear`` does), ``... 90 %`` a tenth of them (the
  sparse kernels through the operator's ``autograd.Function``).
"""

import copy
from collections.abc import Callable

import torch
from torch import nn

from .. import torch as st
from .chain import sequential
from .core import Case

CASES = ["compiled BlockDiagonalLinear", "compiled GroupedLinear", "compiled SparseLinear",
         "small SparseLinear(64, 64)", "small SparseLinear(64, 64) forward",
         "small SparseLinear(64, 64) inference", "small SparseLinear(64, 64) 90 %",
         "small SparseLinear(64, 64) 90 % forward", "small logmatmul 4x4",
         "small block_diag_matmul", "small chain_logsumexp (4, 8, 4)"]
SIZES = {False: {"rows": 2048, "features": 512}, True: {"rows": 512, "features": 256}}  # of the compiled models
FULL_ONLY = CASES[:3]
"""Cases that ``bench --quick`` leaves out: torch.compile takes 20-30 s for the three models on
2 cores with a cold cache, half of the quick run's minute (``--only torch-layer`` runs them)."""
GROUPS = 4
SMALL_CALLS = 100
"""Calls that make one timed run of a small case (1.5-70 ms here): one call alone, after the
other method's, timed the caches it left cold (``nn.Linear(64, 64)``'s forward at 68 us
against 12 us in a loop)."""


class _Model(nn.Module):
    """Linear → ``layer`` → ReLU → Linear; ``extra`` (group sizes) goes to ``layer``."""

    def __init__(self, layer: nn.Module, features: int) -> None:
        super().__init__()
        self.first, self.layer, self.last = nn.Linear(features, features), layer, nn.Linear(features, features)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.last(torch.relu(self.layer(self.first(x), *extra)))
        return out


def _layer(name: str, features: int) -> tuple[nn.Module, list[int] | tuple[()]]:
    if name == "compiled BlockDiagonalLinear":
        return st.BlockDiagonalLinear(features, features, groups=GROUPS), ()
    if name == "compiled SparseLinear":
        return st.SparseLinear(features, features, sparsity=0.9), ()
    sizes = [features // 2 - 1, 1, 0] + [0] * (GROUPS - 3)
    return st.GroupedLinear(GROUPS, features, features), sizes


def _compiled_case(name: str, quick: bool, device: str) -> Case:
    rows, features = SIZES[quick].values()
    torch.manual_seed(0)
    layer, sizes = _layer(name, features)
    model = _Model(layer, features).to(device)
    x = torch.randn(rows, features, device=device)
    extra: tuple[torch.Tensor, ...] = () if not sizes else (torch.tensor([rows - sum(sizes[1:])] + sizes[1:]),)
    compiled = torch.compile(model)
    double = copy.deepcopy(model).double()
    return Case("torch-layer", name, {"spchain": _step(compiled, model, x, extra, device),
                                      "eager": _step(model, model, x, extra, device)},
                lambda: _step(double, double, x.double(), extra, device)(), device)


def _step(fn: Callable[..., torch.Tensor], model: nn.Module, x: torch.Tensor, extra: tuple[torch.Tensor, ...],
          device: str) -> Callable[[], tuple[torch.Tensor | None, ...]]:
    """Forward + backward of ``fn``: the output and the parameters' gradients."""
    def run() -> tuple[torch.Tensor | None, ...]:
        model.zero_grad(set_to_none=True)
        out = fn(x, *extra)
        out.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return (out.detach(), *(p.grad for p in model.parameters()))
    return run


def _shared_sequential(x: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor) -> torch.Tensor:
    """The chain workload's torch loop with one ``log_trans`` (c, c) for every step."""
    return sequential(x, log_trans.expand(1, x.shape[1] - 1, *log_trans.shape), log_init)


def _small_case(name: str, device: str) -> Case:
    g = torch.Generator().manual_seed(0)
    ours: Callable[..., torch.Tensor]
    theirs: Callable[..., torch.Tensor]
    op = name.removesuffix(" forward").removesuffix(" inference")
    inference = name.endswith(" inference")
    if op.startswith("small SparseLinear(64, 64)"):
        torch.manual_seed(0)
        layer = st.SparseLinear(64, 64, sparsity=0.9 if op.endswith("90 %") else 0.0).to(device)
        dense = nn.Linear(64, 64).to(device)
        assert layer.bias is not None  # bias=True, the default
        with torch.no_grad():
            dense.weight.copy_(layer(torch.eye(64, device=device)).T - layer.bias[:, None])
            dense.bias.copy_(layer.bias)
        inputs = [torch.randn(16, 64, generator=g).to(device).requires_grad_()]
        ours, theirs = layer, dense
    elif op == "small logmatmul 4x4":
        inputs = [torch.randn(4, 4, generator=g).to(device).requires_grad_() for _ in range(2)]
        ours, theirs = st.logmatmul, lambda a, b: torch.logsumexp(a[:, :, None] + b[None, :, :], dim=1)
    elif op == "small chain_logsumexp (4, 8, 4)":  # (batch, length, states), one shared log_trans
        inputs = [torch.randn(4, 8, 4, generator=g), torch.log_softmax(torch.randn(4, 4, generator=g), -1),
                  torch.log_softmax(torch.randn(4, generator=g), -1)]
        inputs = [t.to(device).requires_grad_() for t in inputs]
        ours, theirs = st.chain_logsumexp, _shared_sequential
    else:
        inputs = [torch.randn(8, 4, 4, generator=g).to(device).requires_grad_(),
                  torch.randn(4, 4, 4, generator=g).to(device).requires_grad_()]
        ours, theirs = st.block_diag_matmul, lambda x, w: torch.einsum("rgi,gio->rgo", x, w)

    def timed(fn: Callable[..., torch.Tensor]) -> Callable[[], tuple[torch.Tensor, ...]]:
        def run() -> tuple[torch.Tensor, ...]:
            with torch.set_grad_enabled(not inference):
                out = fn(*inputs)
            grads = () if name.endswith((" forward", " inference")) else torch.autograd.grad(out.sum(), inputs)
            if device == "cuda":
                torch.cuda.synchronize()
            return (out.detach(), *grads)
        return run

    # The reference is the torch op itself: these cases time calls, the others check values.
    return Case("torch-layer", name, {"spchain": timed(ours), "torch": timed(theirs)},
                lambda: tuple(t.double() for t in timed(theirs)()), device, calls=SMALL_CALLS)


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    if name.startswith("compiled"):
        return _compiled_case(name, quick, device)
    return _small_case(name, device)
