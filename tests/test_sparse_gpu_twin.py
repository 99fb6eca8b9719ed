"""CPU twin of the GPU branch of the sparse linear layer (spchain/sparse.py): the same code runs
here on NumPy/SciPy arrays, with a stand-in for ``cupyx.cusparse.spmm`` that checks what
cuSPARSE requires (column-major operands, a canonical matrix: so no validation runs) and
computes ``alpha * op(a) @ b + beta * c`` in place, and must give the CPU's results."""

import contextlib
import weakref

import numpy as np
import pytest
import scipy.sparse

from spchain import _backend, _csr
from spchain import sparse as S


class FakeCusparse:
    def __init__(self):
        self.calls = []

    def spmm(self, a, b, c=None, alpha=1, beta=0, transa=False, transb=False):
        assert b.flags.f_contiguous and c is not None and c.flags.f_contiguous, "cupyx's requirements"
        assert a.has_canonical_format, "cupyx raises for a non-canonical matrix"
        self.calls.append((transa, beta))
        op = a.T if transa else a
        c[...] = alpha * (op @ b) + (beta * c if beta else 0)  # cuSPARSE never reads c when beta is 0
        return c


@pytest.fixture
def gpu_twin(monkeypatch):
    """A backend that takes the GPU branches, on NumPy arrays."""
    fake = FakeCusparse()
    monkeypatch.setattr(_csr, "_cusparse", lambda: fake)
    monkeypatch.setattr(_backend.Backend, "use", lambda self: contextlib.nullcontext())
    return _backend.Backend(np, scipy.sparse, 0), fake


def structure(rng, m, n, density, canonical=True):
    w = scipy.sparse.random(m, n, density=density, format="csr", random_state=rng)
    indptr, indices = w.indptr.astype(np.int64), w.indices.astype(np.int64)
    if not canonical and w.nnz > 1:  # unsorted within a row
        row = np.flatnonzero(np.diff(indptr) > 1)
        if row.size:
            start = indptr[row[0]]
            indices[start:start + 2] = indices[start:start + 2][::-1].copy()
    return _csr.to_csr(_backend.NUMPY, "csr", (m, n), None, indptr, indices, "t")


@pytest.mark.parametrize("canonical", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpu_linear_matches_cpu(rng, gpu_twin, canonical, bias, dtype):
    backend, fake = gpu_twin
    csr = structure(rng, 7, 5, 0.4, canonical)
    values = rng.normal(size=csr.nnz).astype(dtype)
    x = rng.normal(size=(6, 5)).astype(dtype)
    b = rng.normal(size=7).astype(dtype) if bias else None
    want_yt = S.linear(_backend.NUMPY, csr, values, x, b, np.dtype(dtype))
    got_yt = S.linear(backend, csr, values, x, b, np.dtype(dtype))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got_yt, want_yt, rtol=tol, atol=tol)
    assert got_yt.T.flags.c_contiguous, "y row-major from a column-major product"
    grad_yt = rng.normal(size=got_yt.shape).astype(dtype)
    want_x, _ = S.linear_backward(_backend.NUMPY, csr, values, grad_yt, x, np.dtype(dtype), True, False)
    got_x, _ = S.linear_backward(backend, csr, values, grad_yt, x, np.dtype(dtype), True, False)
    np.testing.assert_allclose(got_x, want_x, rtol=tol, atol=tol)
    assert fake.calls == [(False, 1.0 if bias else 0.0), (True, 0.0)], "bias folded; cuSPARSE transposes"


def test_gpu_structure_is_checked_once_per_prepared_structure_and_forgotten_with_it(rng, gpu_twin, monkeypatch):
    backend, _ = gpu_twin
    csr = structure(rng, 4, 4, 0.5)
    csr.prepare(backend)
    first = csr.__dict__["_gpu"]
    assert first.canonical and first.indices.dtype == np.int32
    monkeypatch.setattr(_csr, "_GpuStructure", None)  # a prepared structure builds no other
    assert _csr._cupyx_csr(backend, csr, np.ones(csr.nnz)).has_canonical_format
    gone = weakref.ref(first)
    del csr, first
    assert gone() is None, "kept on the structure, not in a dict of its own"


def test_gpu_empty_products(gpu_twin):
    backend, fake = gpu_twin
    csr = _csr.to_csr(_backend.NUMPY, "csr", (3, 2), None, np.zeros(4, np.int64), np.zeros(0, np.int64), "t")
    yt = S.linear(backend, csr, np.zeros(0), np.ones((5, 2)), np.arange(3.0), np.dtype(np.float64))
    np.testing.assert_array_equal(yt.T, np.broadcast_to(np.arange(3.0), (5, 3)))
    assert fake.calls == []
