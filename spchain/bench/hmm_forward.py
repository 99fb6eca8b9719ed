"""The hmm-forward workload: the forward algorithm and posteriors of a dense HMM at the sizes
users run, 50 states, batch 256, length 64, float32, emission log-probabilities given.

spchain's ``chain_logsumexp`` (log-likelihood) and ``chain_marginals`` (posteriors), through
``spchain.torch`` under ``torch.no_grad``, beside pomegranate's ``DenseHMM`` (PyPI
``pomegranate``, if installed): ``forward`` then the log-sum-exp of its last messages (what its
``log_probability`` computes), and its ``forward`` and ``backward`` composed into posteriors
(its ``forward_backward`` also computes the expected transition counts, which this workload
does not ask for). pomegranate's recursions are torch loops, one matrix product a step; the
same loop written out stands beside them (and alone where pomegranate is not installed, and in
``--quick`` runs: importing pomegranate compiles apricot-select's Numba code, about 3 s of a
quick run's 25).
"""

from collections.abc import Callable
from typing import Any

import torch

from .. import _backend
from .. import torch as st
from .core import Case

CASES = ["log-likelihood (forward)", "posteriors (forward-backward)"]
SIZES = {False: {"batch": 256, "v": 64, "states": 50}, True: {"batch": 64, "v": 32, "states": 50}}
QUICK_CALLS = 20
"""Calls a timed run at the quick sizes (about 1-3 ms a call): single calls gave ratios from
1.3x to 4x on one machine within an hour, too loose for ``--check``."""


def forward_loop(emissions: torch.Tensor, log_trans: torch.Tensor, log_init: torch.Tensor) -> torch.Tensor:
    """The log forward messages (batch, v, c), one scaled product a step (pomegranate's loop)."""
    t_max = log_trans.max()
    trans = torch.exp(log_trans - t_max)
    f = emissions.permute(1, 0, 2).clone()
    f[0] += log_init
    for i in range(1, f.shape[0]):
        p_max = f[i - 1].max(dim=1, keepdim=True).values
        f[i] += torch.log(torch.exp(f[i - 1] - p_max) @ trans) + p_max + t_max
    return f.permute(1, 0, 2)


def backward_loop(emissions: torch.Tensor, log_trans: torch.Tensor) -> torch.Tensor:
    """The log backward messages (batch, v, c), the same loop run backwards."""
    t_max = log_trans.max()
    trans_t = torch.exp(log_trans - t_max).T
    b = torch.zeros_like(emissions.permute(1, 0, 2))
    for i in range(b.shape[0] - 2, -1, -1):
        p = b[i + 1] + emissions[:, i + 1]
        p_max = p.max(dim=1, keepdim=True).values
        b[i] = torch.log(torch.exp(p - p_max) @ trans_t) + p_max + t_max
    return b.permute(1, 0, 2)


def posteriors(f: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The posterior marginals (batch, v, c) from the forward and backward log messages."""
    r = f + b
    return torch.exp(r - torch.logsumexp(r, dim=2, keepdim=True))


def make_inputs(quick: bool, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(emissions, log_trans, log_init)``: random emission log-probabilities and a random
    dense transition matrix and start distribution, in log space."""
    batch, v, c = SIZES[quick].values()
    g = torch.Generator().manual_seed(seed)
    emissions = torch.log_softmax(torch.randn(batch, v, c, generator=g), -1)
    log_trans = torch.log_softmax(torch.randn(c, c, generator=g), -1)
    log_init = torch.log_softmax(torch.randn(c, generator=g), -1)
    return emissions.to(device), log_trans.to(device), log_init.to(device)


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    emissions, log_trans, log_init = make_inputs(quick, device)
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    likelihood = name == CASES[0]

    def timed(fn: Callable[[], torch.Tensor]) -> Callable[[], object]:
        def run() -> torch.Tensor:
            with torch.no_grad():
                out = fn()
            sync()
            return out
        return run

    def loop_likelihood() -> torch.Tensor:
        return torch.logsumexp(forward_loop(emissions, log_trans, log_init)[:, -1], dim=-1)

    def loop_posteriors() -> torch.Tensor:
        return posteriors(forward_loop(emissions, log_trans, log_init), backward_loop(emissions, log_trans))

    methods = {"spchain": timed(lambda: st.chain_logsumexp(emissions, log_trans, log_init)) if likelihood else
               timed(lambda: st.chain_marginals(emissions, log_trans, log_init))}
    model = None if quick else _pomegranate_model(log_trans, log_init, device)
    if model is not None:  # emissions are given, so the distributions are never evaluated
        def pomegranate_likelihood() -> torch.Tensor:
            return torch.logsumexp(model.forward(emissions=emissions)[:, -1], dim=-1)

        def pomegranate_posteriors() -> torch.Tensor:
            return posteriors(model.forward(emissions=emissions), model.backward(emissions=emissions))

        methods["pomegranate DenseHMM"] = timed(pomegranate_likelihood if likelihood else pomegranate_posteriors)
    methods["torch loop (pomegranate's)"] = timed(loop_likelihood if likelihood else loop_posteriors)

    def reference() -> torch.Tensor:
        e, t, i = (a.double() for a in (emissions, log_trans, log_init))
        f = forward_loop(e, t, i)
        return torch.logsumexp(f[:, -1], dim=-1) if likelihood else posteriors(f, backward_loop(e, t))

    return Case("hmm-forward", name, methods, reference, device, calls=QUICK_CALLS if quick else 1)


def _pomegranate_model(log_trans: torch.Tensor, log_init: torch.Tensor, device: str) -> Any:
    """pomegranate's ``DenseHMM`` with these transitions (``None`` where it is not installed)."""
    # pomegranate's import compiles Numba parallel code (through apricot-select), which would
    # start Numba's threads on its default layer (GNU OpenMP) before spchain selects TBB
    _backend.threading_layer()
    try:
        from pomegranate.distributions import Exponential
        from pomegranate.hmm import DenseHMM
    except ImportError:
        return None
    return DenseHMM([Exponential() for _ in range(log_trans.shape[0])], edges=log_trans.exp(),
                    starts=log_init.exp(), ends=torch.ones(log_trans.shape[0])).to(device)
