"""Row kernels on torch's OpenMP threads (spchain/kernels/cpu/team.py): the same bits as on
Numba's threads and on the calling thread alone, for every kernel that runs there."""

import platform
import sys

import numpy as np
import pytest

import positional
import spchain
from spchain import _backend, _chain_scaled

torch = pytest.importorskip("torch")
from spchain.kernels import cpu  # noqa: E402  (after torch: what the kernels run on depends on it)

LINUX_WHEEL = pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                                 reason="torch's Linux x86-64 wheels load GNU OpenMP")


def outputs(rng):
    """Every team kernel's results: a scaled chain's forward and backward (marginals and
    transition counts), the GEMM sweep's backward steps, an HMM's E-step."""
    x = rng.normal(size=(40, 9, 6))
    x[3, 2] = -np.inf
    trans, init = rng.normal(size=(6, 6)), rng.normal(size=6)
    lengths = rng.integers(1, 10, 40)
    weight = rng.normal(size=40)
    found = []
    for sweep in ("kernel", "gemm"):
        with spchain.chain_sweep(sweep):
            results = positional.chain_logsumexp_forward(x, trans, init, lengths)
            grads = positional.chain_logsumexp_backward((x, trans, init, lengths), results, (weight,),
                                                        (True, True, True))
        found += [*results, *grads]
    starts = np.array([0, 7, 8, 20, 45])  # lengths 7, 1, 12, 25 (spchain.hmm admits no empty one)
    emissions = rng.normal(size=(45, 6))
    found += [a for a in _chain_scaled.hmm_posteriors(_backend.NUMPY, emissions, None, starts, np.full(6, 1 / 6),
                                                       np.full((6, 6), 1 / 6), True, False) if a is not None]
    return found


@pytest.mark.parametrize("route", ["numba", "one thread"])
def test_kernels_on_torch_threads_give_the_bits_of_the_other_routes(monkeypatch, route):
    calls = []
    entry = cpu.chain_scaled.chain_forward_scaled_team
    monkeypatch.setattr(cpu.chain_scaled, "chain_forward_scaled_team", lambda *args: calls.append(1) or entry(*args))
    team = outputs(np.random.default_rng(0))
    assert len(calls) == (1 if cpu.team.parallel() else 0)  # the kernel sweep's forward, where torch's threads are found
    if route == "numba":
        monkeypatch.setattr(cpu.team, "parallel", lambda: 0)
        other = outputs(np.random.default_rng(0))
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            other = outputs(np.random.default_rng(0))
        finally:
            torch.set_num_threads(threads)
    assert len(team) == len(other) == 16
    for got, want in zip(team, other):
        np.testing.assert_array_equal(got, want)


@LINUX_WHEEL
def test_torch_threads_are_found_where_torch_loaded_gnu_openmp():
    assert cpu.team.parallel() != 0
