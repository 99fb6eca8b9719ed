"""The sparse-chain workload: a large-state HMM with left-to-right banded transitions.

c = 4096 states, each to itself and its 7 successors (a sparse CSR ``log_trans`` shared by all
steps), batch 64, v 500, float32, forward + backward (the gradients of ``x`` and of the stored
transition values). spchain with the sparse matrix beside spchain's own dense chain (``-inf``
at absent entries) and the sequential ``torch.logsumexp`` recursion. At full size the dense
chain does c / 9 ≈ 455 times the work and the recursion needs a (batch, c, c) tensor a step
(4 GiB), so both run fewer steps (the dense chain at the full batch: its cost per step has a
part, the exponentials of the c × c matrix, that does not grow with the batch; the recursion
at batch 4 too); their labels give the factor by which their times scale (linearly in the
steps v - 1, and for the recursion about linearly in the batch), and they get no error
figure at full size.

The case "path functions (peak memory)" runs every path function on the same banded matrix at
c = 4096 (batch 8, v 64: the peaks, not the times, are its point): ``chain_entropy`` and
``chain_path_score`` with their gradients, ``chain_sample`` and ``chain_kbest``, beside
``chain_marginals``. On the stored entries each stays within a small factor of
``chain_marginals``' peak; the dense (c, c) float32 matrix alone would be 64 MiB.
"""

import warnings
from collections.abc import Callable

import torch

from .. import torch as st
from .chain import sequential
from .core import Case

CASES = ["forward + backward", "path functions (peak memory)"]
SIZES = {False: {"batch": 64, "v": 500, "c": 4096}, True: {"batch": 4, "v": 8, "c": 512}}
PATH_SIZES = {False: {"batch": 8, "v": 64, "c": 4096}, True: {"batch": 2, "v": 8, "c": 1024}}
"""The sizes of the path functions' case."""
DENSE_SIZE = {"spchain dense chain": (64, 3), "torch sequential logsumexp": (4, 3)}
"""(batch, v) of the dense baselines at full size."""
WIDTH = 7  # successors of each state besides itself


def make_inputs(quick: bool, device: str, seed: int = 0, sizes: dict[bool, dict[str, int]] = SIZES,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, log_trans CSR, dense log_trans, log_init)``: random emissions, a random band."""
    batch, v, c = sizes[quick].values()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, v, c, generator=g)
    rows = torch.arange(c).repeat_interleave(WIDTH + 1)
    cols = rows + torch.arange(WIDTH + 1).repeat(c)
    keep = cols < c
    rows, cols = rows[keep], cols[keep]
    values = torch.log_softmax(torch.randn(c, WIDTH + 1, generator=g), -1).reshape(-1)[keep]
    crow = torch.cat([torch.zeros(1, dtype=torch.int64), torch.bincount(rows, minlength=c).cumsum(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sparse = torch.sparse_csr_tensor(crow, cols, values, size=(c, c)).to(device)
    dense = torch.full((c, c), -torch.inf)
    dense[rows, cols] = values
    log_init = torch.log_softmax(torch.randn(c, generator=g), -1)
    return x.to(device), sparse, dense.to(device), log_init.to(device)


def path_case(quick: bool, device: str) -> Case:
    """Every path function on the sparse matrix beside ``chain_marginals`` (the method named
    ``spchain``, the base of the ratios), for their peaks."""
    x, sparse, _, log_init = make_inputs(quick, device, sizes=PATH_SIZES)
    path = st.viterbi(x, sparse, log_init)[1]
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def with_gradient(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            leaf = x.detach().requires_grad_()
            fn(leaf).sum().backward()
            sync()
        return run

    def plain(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            fn()
            sync()
        return run

    methods: dict[str, Callable[[], object]] = {
        "spchain": plain(lambda: st.chain_marginals(x, sparse, log_init)),
        "chain_entropy + gradient": with_gradient(lambda leaf: st.chain_entropy(leaf, sparse, log_init)),
        "chain_path_score + gradient": with_gradient(lambda leaf: st.chain_path_score(leaf, sparse, log_init, path)),
        "chain_sample (4 draws)": plain(lambda: st.chain_sample(x, sparse, log_init, num_samples=4, seed=0)),
        "chain_kbest (k 2)": plain(lambda: st.chain_kbest(x, sparse, log_init, k=2)),
    }
    return Case("sparse-chain", "path functions (peak memory)", methods, None, device, spchain_methods=set(methods))


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    if name == "path functions (peak memory)":
        return path_case(quick, device)
    x, sparse, dense, log_init = make_inputs(quick, device)
    batch, v, c = SIZES[quick].values()

    scale: dict[str, float] = {}

    def label(name: str) -> tuple[str, torch.Tensor]:
        if quick:
            return name, x
        small_batch, small_v = DENSE_SIZE[name]
        factor = batch * (v - 1) / (small_batch * (small_v - 1))
        name = f"{name} at batch {small_batch} v {small_v}: x{factor:.0f} less work, scale its time by that"
        scale[name] = factor
        return name, x[:small_batch, :small_v].clone()

    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
              trans: torch.Tensor, full: bool) -> Callable[[], object]:
        def run() -> tuple[torch.Tensor, torch.Tensor | None] | None:
            leaf = x.detach().requires_grad_()
            t = trans.detach().requires_grad_()
            out = fn(leaf, t, log_init)
            out.sum().backward()
            sync()
            return (out.detach(), leaf.grad) if full else None
        return run

    def torch_sequential(x: torch.Tensor, trans: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
        return sequential(x, trans[None, None].expand(1, x.shape[1] - 1, c, c), init)

    def reference() -> tuple[torch.Tensor, torch.Tensor | None]:  # the recursion in float64
        with torch.no_grad():
            x64 = x.double().requires_grad_()
        with torch.enable_grad():
            out = torch_sequential(x64, dense.double(), log_init.double())
            out.sum().backward()
        return out.detach(), x64.grad

    (dense_name, dense_x), (torch_name, torch_x) = label("spchain dense chain"), label("torch sequential logsumexp")
    methods = {
        "spchain": timed(st.chain_logsumexp, x, sparse, True),
        dense_name: timed(st.chain_logsumexp, dense_x, dense, quick),
        torch_name: timed(torch_sequential, torch_x, dense, quick),
    }
    return Case("sparse-chain", name, methods, reference if quick else None, device, scale=scale)
