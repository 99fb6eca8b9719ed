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


def path_outputs(rng):
    """The log-space chain kernels' results (one matrix per row and step: forward, backward,
    transition counts, Viterbi with a NaN matrix), posterior samples and k-best paths (dense
    and sparse transitions), and a max-plus product."""
    import scipy.sparse

    x = rng.normal(size=(40, 9, 6))
    x[3, 2] = -np.inf
    trans, init = rng.normal(size=(40, 8, 6, 6)), rng.normal(size=6)
    lengths = rng.integers(1, 10, 40)
    weight = rng.normal(size=40)
    with spchain.chain_sweep("kernel"):
        results = positional.chain_logsumexp_forward(x, trans, init, lengths)
        grads = positional.chain_logsumexp_backward((x, trans, init, lengths), results, (weight,), (True, True, True))
    nan_trans = trans.copy()
    nan_trans[5, 1, 2, 3] = np.nan
    shared = rng.normal(size=(6, 6))
    sparse = scipy.sparse.csr_matrix(np.where(rng.random((6, 6)) < 0.5, shared, 0.0))
    found = [*results, *grads, *spchain.viterbi(x, nan_trans, init, lengths=lengths)]
    for t in (trans, shared, sparse):
        found += [spchain.chain_sample(x, t, init, lengths=lengths, num_samples=3, seed=1),
                  *spchain.chain_kbest(x, t, init, k=3, lengths=lengths)]
    a, b = rng.normal(size=(3, 5, 7)), rng.normal(size=(7, 4))
    b[2, 1] = np.nan
    found += [*spchain.maxmatmul(a, b)]
    return found


@pytest.mark.parametrize("route", ["numba", "one thread"])
def test_path_kernels_on_torch_threads_give_the_bits_of_the_other_routes(monkeypatch, route):
    calls = []
    entries = [(cpu.chain, "chain_forward_team"), (cpu.chain, "chain_backward_team"),
               (cpu.chain, "chain_transition_grad_team"), (cpu.chain, "chain_viterbi_team"),
               (cpu.paths, "chain_sample_team"), (cpu.paths, "sparse_chain_sample_team"),
               (cpu.semiring, "max_matmul_team")]
    for module, name in entries:
        entry = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, entry=entry, name=name: calls.append(name) or entry(*args))
    team = path_outputs(np.random.default_rng(0))
    # every team entry ran, where torch's threads are found
    assert set(calls) == ({name for _, name in entries} if cpu.team.parallel() else set())
    if route == "numba":
        monkeypatch.setattr(cpu.team, "parallel", lambda: 0)
        other = path_outputs(np.random.default_rng(0))
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            other = path_outputs(np.random.default_rng(0))
        finally:
            torch.set_num_threads(threads)
    assert len(team) == len(other) == 19
    for got, want in zip(team, other):
        np.testing.assert_array_equal(got, want)
