"""Row kernels on torch's OpenMP threads (spchain/kernels/cpu/team.py): the same bits as on
Numba's threads (on any number of them) and on the calling thread alone, for every kernel that
runs there."""

import platform
import sys

import numba
import numpy as np
import pytest
import scipy.sparse

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


def sparse_outputs(rng):
    """Every sparse chain kernel's results on a CSR ``log_trans``: the scaled forward and backward
    (marginals and the value gradient, summed over chunks of rows), Viterbi, and the log-space
    forward, backward and value gradient (spchain/kernels/cpu/sparse_chain.py), over 70 rows (3
    chunks, ``cpu.sparse_chain.chunks``)."""
    rows, v, c = 70, 9, 6
    x = rng.normal(size=(rows, v, c))
    x[3, 2] = -np.inf
    mask = rng.random((c, c)) < 0.5
    matrix = scipy.sparse.csr_matrix((rng.normal(size=mask.sum()), mask.nonzero()), shape=(c, c))
    init, lengths, weight = rng.normal(size=c), rng.integers(1, v + 1, rows), rng.normal(size=rows)
    results = positional.chain_logsumexp_forward(x, matrix, init, lengths)
    d_x, d_trans, d_init = positional.chain_logsumexp_backward((x, matrix, init, lengths), results, (weight,),
                                                               (True, True, True))
    found = [*results, d_x, d_trans.toarray(), d_init, *spchain.viterbi(x, matrix, init, lengths=lengths)]
    transpose = matrix.T.tocsr()
    pre, norm, beta = np.empty_like(x), np.empty((rows, v)), np.empty_like(x)
    inits = np.repeat(init[None], rows, axis=0)
    cpu.sparse_chain.sparse_chain_forward(x, transpose.indptr, transpose.indices, transpose.data, inits, lengths, pre,
                                          norm)
    cpu.sparse_chain.sparse_chain_backward(x, matrix.indptr, matrix.indices, matrix.data, lengths, norm, beta)
    partial = np.empty((cpu.sparse_chain.chunks(rows), matrix.nnz))
    inside = (np.arange(v)[None, :] < lengths[:, None])[..., None]
    with np.errstate(invalid="ignore"):
        marg = np.where(inside, np.exp(pre + x - np.where(np.isfinite(norm), norm, 0)[..., None] + beta), 0)
    cpu.team.run(cpu.sparse_chain.sparse_chain_values_grad, cpu.sparse_chain.sparse_chain_values_grad_team, x,
                 matrix.indptr, matrix.indices, matrix.data, lengths, pre, norm, marg, np.abs(weight), partial)
    return found + [pre, norm, beta, partial]


@pytest.mark.parametrize("route", ["numba", "one numba thread", "one thread"])
def test_sparse_chain_kernels_on_torch_threads_give_the_bits_of_the_other_routes(monkeypatch, route):
    calls = []
    entry = cpu.sparse_chain_scaled.sparse_chain_backward_scaled_team
    monkeypatch.setattr(cpu.sparse_chain_scaled, "sparse_chain_backward_scaled_team",
                        lambda *args: calls.append(1) or entry(*args))
    team = sparse_outputs(np.random.default_rng(0))
    assert len(calls) == (1 if cpu.team.parallel() else 0)
    if route == "one thread":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            other = sparse_outputs(np.random.default_rng(0))
        finally:
            torch.set_num_threads(threads)
    else:
        monkeypatch.setattr(cpu.team, "parallel", lambda: 0)
        threads = numba.get_num_threads()
        numba.set_num_threads(1 if route == "one numba thread" else threads)
        try:
            other = sparse_outputs(np.random.default_rng(0))
        finally:
            numba.set_num_threads(threads)
    assert len(team) == len(other) == 12
    for got, want in zip(team, other):
        np.testing.assert_array_equal(got, want)
