"""Row kernels on a team of threads (spchain/kernels/cpu/team.py): on torch's OpenMP threads the
same bits as on Numba's threads (on any number of them) and on the calling thread alone, for
every kernel."""

import math
import os
import platform
import sys
import time
from types import SimpleNamespace

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


@pytest.fixture(autouse=True)
def uncrowded():
    """Torch's team whenever it is found, whatever else runs on the machine (the tests' workers)."""
    with cpu.assume_idle():
        yield


def other_route(outputs, monkeypatch, route):
    """``outputs(rng)`` on another route than torch's team: Numba's threads (``"numba"``, the
    route without torch), one Numba thread (``"one numba thread"``) or the calling thread
    (``"one thread"``)."""
    if route == "one thread":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return outputs(np.random.default_rng(0))
        finally:
            torch.set_num_threads(threads)
    monkeypatch.setattr(cpu.team, "parallel", lambda: 0)
    threads = numba.get_num_threads()
    numba.set_num_threads(1 if route == "one numba thread" else threads)
    try:
        return outputs(np.random.default_rng(0))
    finally:
        numba.set_num_threads(threads)


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
    entry = cpu.chain_scaled.chain_forward_scaled
    monkeypatch.setattr(cpu.chain_scaled, "chain_forward_scaled", lambda *args: calls.append(args[0]) or entry(*args))
    team = outputs(np.random.default_rng(0))
    assert calls == [launcher()]  # the kernel sweep's forward
    other = other_route(outputs, monkeypatch, route)
    assert len(team) == len(other) == 16
    for got, want in zip(team, other):
        np.testing.assert_array_equal(got, want)


def launcher():
    """The team's launcher here: torch's ``GOMP_parallel`` where found, else Numba's threads."""
    return cpu.team.parallel() or cpu.team.numba_parallel()


def team_size():
    """The team's threads here (``team.run``, the machine taken as idle)."""
    if cpu.team.parallel():
        return min(torch.get_num_threads(), numba.get_num_threads())
    return numba.get_num_threads()


@LINUX_WHEEL
def test_torch_threads_are_found_where_torch_loaded_gnu_openmp():
    assert cpu.team.parallel() != 0


def sparse_outputs(rng):
    """Every sparse and block-sparse team kernel's results, above ``SERIAL_WORK`` (the parallel
    routes) and below (the team entry on the calling thread): CSR times dense, by
    the transpose, of a column-major ``b`` (read transposed), SDDMM of row-major and of
    column-major operands, the parallel transpose, BSR times dense (and by the transpose,
    which reads the blocks transposed) and the block SDDMM."""
    from spchain import _csr, blocksparse

    numpy = _backend.NUMPY
    pattern = random_pattern(rng, 300, 200, 0.1)
    csr = _csr.Csr(pattern.indptr.astype(np.int32), pattern.indices.astype(np.int32), None, (300, 200))
    values = rng.normal(size=csr.nnz)
    b, bias, c = rng.normal(size=(200, 64)), rng.normal(size=300), rng.normal(size=(300, 64))
    assert csr.nnz * 64 > _backend.SERIAL_WORK
    found = [csr.matmul(numpy, values, b, np.float64, bias), csr.matmul(numpy, values, c, np.float64, transpose=True),
             csr.matmul(numpy, values, np.asfortranarray(b), np.float64),
             csr.matmul(numpy, values, b[:, :3], np.float64),  # below SERIAL_WORK
             csr.sampled(numpy, c, b, np.float64), csr.sampled(numpy, np.asfortranarray(c), np.asfortranarray(b),
                                                                np.float64),
             csr.sampled(numpy, c[:, :3], b[:, :3], np.float64),  # below SERIAL_WORK
             _csr.contiguous(numpy, np.asfortranarray(rng.normal(size=(600, 300)))),
             _csr.contiguous(numpy, np.asfortranarray(rng.normal(size=(30, 70))))]  # below SERIAL_WORK
    grid = random_pattern(rng, 30, 20, 0.3)
    bsr = blocksparse.Bsr(grid.indptr.astype(np.int32), grid.indices.astype(np.int32), None, (240, 80), (8, 4))
    blocks = rng.normal(size=(bsr.nnzb, 8, 4))
    assert bsr.nnzb * 8 * 4 * 33 > _backend.SERIAL_WORK > bsr.nnzb * 8 * 4 * 3
    found += [bsr.matmul(numpy, blocks, rng.normal(size=(80, 40)), np.float64, rng.normal(size=240)),
              bsr.matmul(numpy, blocks, rng.normal(size=(240, 40)), np.float64, transpose=True),
              bsr.sampled(numpy, rng.normal(size=(240, 33)), rng.normal(size=(80, 33)), np.float64),
              bsr.matmul(numpy, blocks, rng.normal(size=(80, 3)), np.float64),  # below SERIAL_WORK
              bsr.sampled(numpy, rng.normal(size=(240, 3)), rng.normal(size=(80, 3)), np.float64)]
    return found


def random_pattern(rng, m, n, density):
    """A random (m, n) pattern: ``indptr`` and ``indices``."""
    rows, cols = np.nonzero(rng.random((m, n)) < density)
    return SimpleNamespace(indptr=np.searchsorted(rows, np.arange(m + 1)), indices=cols)


@pytest.mark.parametrize("route", ["numba", "one thread"])
def test_sparse_kernels_on_torch_threads_give_the_bits_of_the_other_routes(monkeypatch, route):
    calls = []
    for name in ("sparse_spmm", "sparse_sddmm", "transpose"):
        entry = getattr(cpu.sparse, name)
        monkeypatch.setattr(cpu.sparse, name, lambda *args, entry=entry: calls.append(args[:2]) or entry(*args))
    for name in ("blocksparse_spmm", "blocksparse_sddmm"):
        entry = getattr(cpu.blocksparse, name)
        monkeypatch.setattr(cpu.blocksparse, name, lambda *args, entry=entry: calls.append(args[:2]) or entry(*args))
    team = sparse_outputs(np.random.default_rng(0))
    # every product: nine on the team, the five small ones on the calling thread
    assert [args for args in calls if args[0]] == [(launcher(), team_size())] * 9
    assert [args for args in calls if not args[0]] == [(0, 1)] * 5
    other = other_route(sparse_outputs, monkeypatch, route)
    assert len(team) == len(other) == 14
    for got, want in zip(team, other):
        np.testing.assert_array_equal(got, want)


def sparse_chain_outputs(rng):
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
    cpu.team.run(cpu.sparse_chain.sparse_chain_values_grad, x, matrix.indptr, matrix.indices, matrix.data, lengths, pre,
                 norm, marg, np.abs(weight), partial)
    return found + [pre, norm, beta, partial]


@pytest.mark.parametrize("route", ["numba", "one numba thread", "one thread"])
def test_sparse_chain_kernels_on_torch_threads_give_the_bits_of_the_other_routes(monkeypatch, route):
    calls = []
    entry = cpu.sparse_chain_scaled.sparse_chain_backward_scaled
    monkeypatch.setattr(cpu.sparse_chain_scaled, "sparse_chain_backward_scaled",
                        lambda *args: calls.append(args[0]) or entry(*args))
    team = sparse_chain_outputs(np.random.default_rng(0))
    assert calls == [launcher()]
    other = other_route(sparse_chain_outputs, monkeypatch, route)
    assert len(team) == len(other) == 12
    for got, want in zip(team, other):
        np.testing.assert_array_equal(got, want)


def test_a_busy_machine_is_crowded_and_runs_kernels_on_the_calling_thread(monkeypatch):
    import subprocess

    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 20\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)
        assert cpu._others_running() >= 1
        assert not cpu.crowded()  # inside assume_idle()
        with cpu.assume_idle():
            pass  # leaving it: crowded() reads the machine again
        monkeypatch.setattr(cpu, "CROWDED_EVERY", 0.0)
        assert cpu.crowded()
        monkeypatch.setattr(cpu.team, "parallel", lambda: 12345)
        calls = []
        cpu.team.run(lambda *args: calls.append(args) or 0, 1, 2)
        assert calls == [(12345, 1, 1, 2)]  # one thread: GOMP_parallel is not called
    finally:
        busy.kill()


def path_outputs(rng):
    """The log-space chain kernels' results (one matrix per row and step: forward, backward,
    transition counts, Viterbi with a NaN matrix), posterior samples and k-best paths (dense
    and sparse transitions), and a max-plus product."""
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
    entries = [(cpu.chain, "chain_forward"), (cpu.chain, "chain_backward"),
               (cpu.chain, "chain_transition_grad"), (cpu.chain, "chain_viterbi"),
               (cpu.paths, "chain_sample"), (cpu.paths, "sparse_chain_sample"),
               (cpu.paths, "chain_kbest"), (cpu.paths, "sparse_chain_kbest"),
               (cpu.semiring, "max_matmul")]
    for module, name in entries:
        entry = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, entry=entry, name=name: calls.append(name) or entry(*args))
    team = path_outputs(np.random.default_rng(0))
    assert set(calls) == {name for _, name in entries}  # every kernel ran
    other = other_route(path_outputs, monkeypatch, route)
    assert len(team) == len(other) == 19
    for got, want in zip(team, other):
        np.testing.assert_array_equal(got, want)


@numba.extending.intrinsic
def _owned(typingctx, array):
    """Whether ``array`` carries the owner of its memory (a non-null ``meminfo``)."""
    def codegen(context, builder, signature, args):
        meminfo = builder.extract_value(args[0], 0)
        return builder.icmp_unsigned("!=", meminfo, meminfo.type(None))
    return numba.types.boolean(array), codegen


@numba.njit(cache=False)
def _owner_rows(lo, hi, x, owned):
    for b in range(lo, hi):
        owned[b] = _owned(x) or _owned(x[b])


@numba.njit(cache=False, nogil=True)
def _owner_on_team(parallel, threads, x, owned):
    return cpu.team.team_rows(parallel, threads, _owner_rows, x.shape[0], (x, owned))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("launch", ["torch", "numba"])
def test_team_bodies_take_arrays_without_their_owner(threads, launch):
    """A body sees its array arguments as a ``prange`` body does, without the owner of their
    memory: the views it takes count no references (an atomic add on one cache line from
    every thread, which kept the chain's GEMM-sweep step from scaling to two threads)."""
    x = np.zeros((64, 3))
    owned = np.ones(64, bool)
    address = cpu.team.parallel() if launch == "torch" else cpu.team.numba_parallel()
    assert _owner_on_team(address, threads, x, owned) == 0
    assert not owned.any()
    assert x.base is None and sys.getrefcount(x) == 2  # the caller's array, untouched


@numba.njit(cache=False)
def _thread_rows(lo, hi, ids):
    for b in range(lo, hi):
        total = 0.0
        for i in range(2_000_000):  # about a millisecond a row: time for every thread to join
            total += math.sqrt(i + b)
        ids[b] = numba.get_thread_id() if total > 0 else -2


@numba.njit(cache=False, nogil=True)
def _threads_on_team(parallel, threads, ids):
    return cpu.team.team_rows(parallel, threads, _thread_rows, ids.shape[0], (ids,))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core")
def test_numbas_threads_share_a_team_without_torch():
    """The launcher for a process without torch (or a forked child) runs the rows on Numba's
    threads: every row done once, by two threads (in one of three tries: a busy machine may
    not give the second thread a time slice in one); on the calling thread alone with one."""
    for _ in range(3):
        ids = np.full(256, -1)
        assert _threads_on_team(cpu.team.numba_parallel(), 2, ids) == 0
        assert set(ids) <= {0, 1}  # every row done, by the team's threads
        if set(ids) == {0, 1}:
            break
    assert set(ids) == {0, 1}
    ids[:] = -1
    assert _threads_on_team(cpu.team.numba_parallel(), 1, ids) == 0
    assert set(ids) == {0}


@numba.njit(cache=False)
def _failing_rows(lo, hi, out):
    for b in range(lo, hi):
        if b == 3:
            raise ValueError("row 3")
        out[b] = b


@numba.njit(cache=False, nogil=True)
def _failing_kernel(parallel, threads, out):
    return cpu.team.team_rows(parallel, threads, _failing_rows, out.shape[0], (out,))


def test_a_failed_chunk_raises_on_the_calling_thread_as_on_a_team():
    """A body that raises leaves its chunk's rows unwritten: ``team.serial`` (the small calls'
    route) raises as ``team.run`` does, never returns a partly written result."""
    for call in (cpu.team.serial, cpu.team.run):
        with pytest.raises(RuntimeError, match="_failing_kernel: 1 chunks of rows failed"):
            call(_failing_kernel, np.zeros(8))
