"""Numba's threading layer (spchain/kernels/cpu/__init__.py ``threading_layer``) and torch's threads
(spchain/kernels/cpu/team.py): forked workers and threads.

Each fork scenario runs in a fresh interpreter, so that it starts the way a user's program does
(``import spchain``, a parallel kernel in the parent, then a fork), whatever this test process ran.
"""

import platform
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import scipy.sparse

import reference
import spchain as sc

PARENT = """
import multiprocessing, sys
import numpy as np, scipy.sparse
{block_tbb}
import spchain as sc

a = scipy.sparse.random(300, 200, density=0.1, format="csr", random_state=0)
b = np.random.default_rng(0).standard_normal((200, 64))  # above spchain._backend.SERIAL_WORK
want = a @ b
assert np.allclose(sc.spmm(a, b), want)  # the parent runs a parallel kernel first


def work(_=None):
    return float(np.abs(sc.spmm(a, b) - want).max())
"""

FORK = """
ctx = multiprocessing.get_context("fork")
queue = ctx.SimpleQueue()
child = ctx.Process(target=lambda: queue.put(work()))
child.start()
child.join(60)
print("exit", child.exitcode, "child error", queue.get() if child.exitcode == 0 else None)
import numba
print("layer", numba.threading_layer())
"""

DATALOADER = """
import torch


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return work()


loader = torch.utils.data.DataLoader(Data(), num_workers=1, multiprocessing_context="fork", timeout=60)
print("child error", max(float(e) for e in loader))
"""

NO_TBB = 'sys.modules["numba.np.ufunc.tbbpool"] = None  # as on a machine without TBB'


def run(script: str):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)


TBB = pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                         reason="spchain depends on pip's tbb on x86-64 Linux and Windows only")


@TBB
def test_a_forked_multiprocessing_child_runs_kernels_after_the_parent_did():
    result = run(PARENT.format(block_tbb="") + FORK)
    assert result.returncode == 0, result.stderr
    assert "exit 0 " in result.stdout and "layer tbb" in result.stdout
    assert float(result.stdout.split("child error")[1].split()[0]) < 1e-12


@TBB
@pytest.mark.slow
def test_a_torch_dataloader_worker_runs_kernels_after_the_parent_did():
    pytest.importorskip("torch")
    result = run(PARENT.format(block_tbb="") + DATALOADER)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split("child error")[1].split()[0]) < 1e-12


@TBB
def test_a_forked_child_runs_the_chain_kernels_that_the_parent_ran_on_torch_threads():
    pytest.importorskip("torch")
    result = run("""
        import multiprocessing, os
        import numpy as np, torch
        import spchain as sc
        from spchain.kernels import cpu

        torch.exp(torch.ones(1000, 1000)).sum()  # torch's OpenMP threads start
        rng = np.random.default_rng(0)
        x, trans = rng.standard_normal((64, 16, 8)), rng.standard_normal((8, 8))
        want = sc.chain_marginals(x, trans)  # on torch's threads (spchain/kernels/cpu/team.py)

        def work(_=None):
            return cpu.team.parallel(), float(np.abs(sc.chain_marginals(x, trans) - want).max())

        with multiprocessing.get_context("fork").Pool(1) as pool:
            print("pool", *pool.map(work, [0])[0])
        child = os.fork()
        if child == 0:
            print("fork", *work(), flush=True)
            os._exit(0)
        os.waitpid(child, 0)
        print("parent", cpu.team.parallel() != 0)
    """)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["pool"] == "0 0.0" and lines["fork"] == "0 0.0" and lines["parent"] == "True", result.stdout


@pytest.mark.slow
def test_without_tbb_numba_default_layer_still_runs_kernels():
    result = run(PARENT.format(block_tbb=NO_TBB) + "print('ok', work(), sc._backend.threading_layer())")
    assert result.returncode == 0, result.stderr
    ok, error, layer = result.stdout.split()
    assert ok == "ok" and float(error) < 1e-12 and layer == "default"


def test_threads_calling_spchain_at_once_get_correct_results(rng):
    a = scipy.sparse.random(400, 300, density=0.05, format="csr", random_state=1)
    b = rng.standard_normal((300, 32))
    x = rng.standard_normal((20, 9, 5))
    trans = rng.standard_normal((5, 5))
    m1, m2 = rng.standard_normal((30, 6, 7)), rng.standard_normal((7, 8))
    want = (a @ b, reference.chain_logsumexp(x, trans), reference.max_matmul(m1, m2)[0])
    errors = []

    def work():
        for _ in range(20):
            got = (sc.spmm(a, b), sc.chain_logsumexp(x, trans), sc.maxmatmul(m1, m2)[0])
            errors.append(max(float(np.abs(g - w).max()) for g, w in zip(got, want)))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 80 and max(errors) < 1e-10


@TBB
def test_threads_that_another_library_started_first_on_another_layer_give_a_warning():
    result = run("""
        import warnings, numba, numpy as np

        @numba.njit(parallel=True)
        def fill(a):
            for i in numba.prange(a.shape[0]):
                a[i] = i

        fill(np.zeros(4))  # another library's parallel code starts Numba's threads on its default layer
        from spchain import _backend
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer = _backend.threading_layer()
        print(layer == numba.threading_layer() != "tbb", [str(w.message) for w in caught])
    """)
    assert result.stdout.startswith("True") and "NUMBA_THREADING_LAYER=tbb" in result.stdout, result.stderr
