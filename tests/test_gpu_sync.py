"""The GPU hot paths never wait for the device: no device-to-host copy or implicit
synchronisation (``.item()``, ``bool(array)``, ``int(array)``, ``float(array)``, ``cupy.asnumpy``,
``.get()``, ``nonzero``, or an ``if`` on a reduction of an array) in their GPU branches.

In CI a static check of the source (AST) says so; on a GPU the ``gpu`` tests run the same
paths under ``cupyx.allow_synchronize(False)``, where any synchronisation is an error.
"""

import ast
import contextlib
import importlib
import inspect
import textwrap

import numpy as np
import pytest

HOT_PATHS = {
    "spchain._backend": {"device_kernel": None},
    "spchain.blockdiag": {"batched_matmul": None, "gemm_plan": None, "_block_diag_product": None,
                          "_grouped_product": None, "_grouped_weight_grad": None,
                          "indexed_matmul": None, "indexed_gemm_plan": None, "_ragged_weight_grad": None},
    "spchain._csr": {"_gpu_spmm": None, "_cupyx_csr": "structure.canonical"},
    "spchain._sparse_chain": {"forward": None, "backward": None, "_values_grad_on_device": None},
    "spchain._logspace": {"log_product": "on_device(xp)", "_recompute_lost_on_device": None,
                          "product_epilogue": None, "log_matmul": "posinf and on_device(xp)",
                          "_log_matmul_on_device": None, "log_matmul_grads": "on_device(xp)",
                          "_log_matmul_grads_on_device": None, "_without_posinf": None, "_on_entries": None},
    "spchain.semiring": {"_maxmatmul_backward": "_logspace.on_device(xp)"},
    "spchain._structures": {"StructureCache.lookup": "backend.on_gpu", "_same_on_device": None,
                            "StructureCache.note_versions": None},
    "spchain.sparse": {"_linear_forward": None},
    "spchain._chain_scaled": {"transition_grad_gemm": None, "_exact_where_not": "chain.backend.on_gpu"},
    "spchain._chain_sweep": {"use_gemm": "chain.backend.on_gpu", "forward_finite": None, "_forward_gemm": None,
                             "backward_finite": None, "_backward_gemm": None, "normalise": None,
                             "normalised": None, "renormalise": None, "batched_counts": None},
}
"""Module → function → ``None`` (the whole function runs on the GPU) or the test of the ``if``
whose body is its GPU branch."""

REDUCTIONS = {"any", "all", "sum", "min", "max", "mean", "item", "count_nonzero"}
SYNCING_CALLS = {"item", "tolist", "get", "asnumpy", "to_host", "nonzero", "argwhere", "flatnonzero"}


def _reduces(node):
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in REDUCTIONS
               for n in ast.walk(node))


def sync_calls(tree):
    """``(line, source)`` of every synchronising construct under ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in SYNCING_CALLS or (name in {"bool", "int", "float"} and any(map(_reduces, node.args))):
                found.append(node)
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)) and _reduces(node.test):
            found.append(node.test)
        elif isinstance(node, ast.BoolOp) and any(map(_reduces, node.values)):
            found.append(node)
    return sorted((n.lineno, ast.unparse(n)) for n in found)


def gpu_branch(function, branch):
    """The AST of ``function``'s GPU branch: the whole function, or the body of ``if branch:``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    if branch is None:
        return tree
    bodies = [ast.Module(node.body, []) for node in ast.walk(tree)
              if isinstance(node, ast.If) and ast.unparse(node.test) == branch]
    assert len(bodies) == 1, f"{function.__qualname__} has no single `if {branch}:`"
    return bodies[0]


@pytest.mark.parametrize("module, name", [(m, f) for m, fs in HOT_PATHS.items() for f in fs])
def test_gpu_branches_do_not_synchronise(module, name):
    function = importlib.import_module(module)
    for part in name.split("."):
        function = getattr(function, part)
    assert sync_calls(gpu_branch(function, HOT_PATHS[module][name])) == []


def test_the_check_finds_synchronisations():
    source = textwrap.dedent("""
        def f(xp, a, lost):
            if lost.any():
                n = int(lost.sum())
            b = a.item() + bool(xp.isnan(a).all()) + xp.asnumpy(a)
            rows = xp.nonzero(lost)
            ok = int(a.shape[0])  # a host integer: fine
            return lost.any() and b
    """)
    assert [line for line, _ in sync_calls(ast.parse(source))] == [3, 4, 5, 5, 5, 6, 8]


@contextlib.contextmanager
def numba_never_waits():
    """Numba's launches make the host wait for no stream (``cupyx.allow_synchronize`` sees
    CuPy's synchronisations only; Numba waits on its own, by the CUDA array interface)."""
    import cupy as cp
    from numba import cuda

    stream_type = type(cuda.external_stream(cp.cuda.get_current_stream().ptr))

    def fail(self):
        raise AssertionError("a Numba launch made the host wait for a stream")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stream_type, "synchronize", fail)
        yield


@pytest.mark.gpu
@pytest.mark.parametrize("sweep", ["gemm", "kernel"])
@pytest.mark.parametrize("per_step", [False, True])
def test_chain_sweeps_run_without_synchronising(rng, sweep, per_step):
    import cupy as cp
    import cupyx

    import spchain
    from spchain import _chain_layout, _chain_sweep

    B, v, c = 16, 9, 12
    x = cp.asarray(rng.normal(size=(B, v, c)) * 40, cp.float32)
    trans = cp.asarray(rng.normal(size=(1, v - 1, c, c) if per_step else (c, c)) * 40, cp.float32)
    trans[..., 0, 1] = -cp.inf
    chain = _chain_layout.prepare(x, trans, None, None, "t")
    weight = cp.ones(B, cp.float32)
    with spchain.chain_sweep(sweep):
        _chain_sweep.forward_finite(chain)  # compiles and loads the kernels, which may synchronise
        _, pre, norm = _chain_sweep.forward_finite(chain)
        _chain_sweep.backward_finite(chain, pre, norm, weight)
        cp.cuda.get_current_stream().synchronize()
        with cupyx.allow_synchronize(False), numba_never_waits():
            _, pre, norm = _chain_sweep.forward_finite(chain)
            grad_x, grad_trans = _chain_sweep.backward_finite(chain, pre, norm, weight)
    with spchain.chain_sweep("kernel"):  # the CPU's result on the same inputs
        host = _chain_layout.prepare(cp.asnumpy(x).astype(np.float64), cp.asnumpy(trans).astype(np.float64),
                                     None, None, "t")
        _, pre64, norm64 = _chain_sweep.forward_finite(host)
        want_x, want_trans = _chain_sweep.backward_finite(host, pre64, norm64, np.ones(B))
    np.testing.assert_allclose(cp.asnumpy(grad_x), want_x, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(grad_trans), want_trans, rtol=1e-4, atol=1e-4 * B * v)


@pytest.mark.gpu
def test_log_product_runs_without_synchronising(rng):
    import cupy as cp
    import cupyx

    from spchain import _logspace

    a = cp.asarray(rng.normal(size=(4, 6, 7)) * 300)
    b = cp.asarray(rng.normal(size=(7, 5)) * 300)
    b[2, 3] = cp.inf
    grad = cp.asarray(rng.normal(size=(4, 6, 5)))
    _logspace.log_matmul_grads(cp, a, b, _logspace.log_matmul(cp, a, b), grad)
    cp.cuda.get_current_stream().synchronize()
    with cupyx.allow_synchronize(False), numba_never_waits():
        got = _logspace.log_matmul(cp, a, b)
        grads = _logspace.log_matmul_grads(cp, a, b, got, grad)
    host = cp.asnumpy(a), cp.asnumpy(b)
    want = _logspace.log_matmul(np, *host)
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-12)
    for g, w in zip(grads, _logspace.log_matmul_grads(np, *host, want, cp.asnumpy(grad))):
        np.testing.assert_allclose(cp.asnumpy(g), w, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
def test_block_diag_and_sparse_linear_run_without_synchronising(rng):
    import cupy as cp
    import cupyx
    import scipy.sparse

    import spchain
    from spchain import _backend
    from spchain import sparse as S
    from spchain._structures import STRUCTURES

    x = cp.asarray(rng.normal(size=(64, 4, 32)), cp.float32)
    w = cp.asarray(rng.normal(size=(4, 32, 16)), cp.float32)
    spchain.block_diag_matmul(x, w)
    pool = cp.get_default_memory_pool()
    cp.cuda.get_current_stream().synchronize()
    before = pool.used_bytes()
    with cupyx.allow_synchronize(False), numba_never_waits():
        y = spchain.block_diag_matmul(x, w)
    assert pool.used_bytes() - before <= y.nbytes + 512, "no copy of the strided operands"
    np.testing.assert_allclose(cp.asnumpy(y), np.einsum("rgi,gio->rgo", cp.asnumpy(x), cp.asnumpy(w)), rtol=1e-4,
                               atol=1e-4)
    host = scipy.sparse.random(48, 32, density=0.1, format="csr", random_state=1)
    backend = _backend.backend_of(x)
    csr, _ = STRUCTURES.lookup(backend, (cp.asarray(host.indptr), cp.asarray(host.indices)), host.shape, "t")
    values, xs = cp.asarray(host.data, cp.float32), cp.asarray(rng.normal(size=(8, 32)), cp.float32)
    bias = cp.ones(48, cp.float32)
    S.linear(backend, csr, values, xs, bias, np.dtype(np.float32))
    cp.cuda.get_current_stream().synchronize()
    with cupyx.allow_synchronize(False), numba_never_waits():
        out = S.linear(backend, csr, values, xs, bias, np.dtype(np.float32))
        grad_x, grad_values = S.linear_backward(backend, csr, values, cp.ones_like(out), xs,
                                                np.dtype(np.float32), True, True)
    want = cp.asnumpy(xs) @ host.toarray().T.astype(np.float32) + 1
    np.testing.assert_allclose(cp.asnumpy(out).T, want, rtol=1e-4, atol=1e-4)
