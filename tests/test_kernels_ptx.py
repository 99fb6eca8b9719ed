"""Every CUDA kernel compiles to PTX for sm_90: Numba's typing and code generation run here,
without a GPU, wherever a CUDA toolkit's NVVM is installed (the simulator checks neither, and
conftest.py leaves this module out under it).
"""

import re
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda, types

from spchain.kernels.cuda import blocksparse as cuda_blocksparse
from spchain.kernels.cuda import chain as cuda_chain
from spchain.kernels.cuda import logspace as cuda_logspace
from spchain.kernels.cuda import paths as cuda_paths
from spchain.kernels.cuda import semiring as cuda_semiring
from spchain.kernels.cuda import sparse as cuda_sparse
from spchain.kernels.cuda import sparse_chain as cuda_sparse_chain


def _nvvm_works() -> bool:
    def probe(a):
        a[0] = 1.0

    try:
        cuda.compile_ptx(probe, (types.float32[::1],), cc=(9, 0))
    except Exception:
        return False
    return True


pytestmark = pytest.mark.skipif(not _nvvm_works(), reason="needs a CUDA toolkit's NVVM to compile PTX")


def arr(dtype, ndim):
    return types.Array(dtype, ndim, "C")


i64 = types.int64


def kernels(dtype):
    """(name, python function, signature) of every CUDA kernel for one float dtype."""
    f = types.float32 if dtype == np.float32 else types.float64
    x, trans, init, lengths = arr(f, 3), arr(f, 4), arr(f, 2), arr(i64, 1)
    return [
        ("chain_forward", cuda_chain._forward_kernel(np.dtype(dtype)),
         (x, trans, i64, i64, init, lengths, arr(f, 3), arr(f, 2))),
        ("chain_backward", cuda_chain._backward_kernel(np.dtype(dtype)),
         (x, trans, i64, i64, lengths, arr(f, 2), arr(f, 3))),
        ("chain_transition_grad", cuda_chain.chain_transition_grad_kernel,
         (x, trans, i64, lengths, arr(f, 3), arr(f, 2), arr(f, 3), arr(f, 1), arr(f, 4))),
        ("chain_transition_grad_masked", cuda_chain.chain_transition_grad_masked_kernel,
         (x, trans, i64, lengths, arr(f, 3), arr(f, 2), arr(f, 3), arr(f, 1), arr(types.boolean, 2), arr(f, 4))),
        ("log_product_fixup", cuda_logspace.log_product_fixup_kernel,
         (arr(f, 3), arr(f, 3), arr(i64, 1), arr(i64, 1), arr(types.uint8, 3), arr(f, 3))),
        ("sparse_chain shifted_exp", cuda_sparse_chain.sparse_chain_shifted_exp_kernel,
         (lengths, arr(f, 1), arr(f, 1), arr(f, 1))),
        ("sparse_chain forward_scaled", cuda_sparse_chain._forward_scaled_kernel(np.dtype(dtype)),
         (x, lengths, lengths, arr(f, 1), arr(f, 1), arr(f, 1), f, init, lengths, arr(f, 2), arr(f, 3), arr(f, 2))),
        ("sparse_chain backward_scaled", cuda_sparse_chain._backward_scaled_kernel(np.dtype(dtype)),
         (x, lengths, lengths, arr(f, 1), arr(f, 1), arr(f, 1), f, lengths, arr(f, 2), arr(f, 2), arr(f, 3))),
        ("posinf_fixup", cuda_logspace.log_product_posinf_fixup_kernel,
         (arr(f, 3), arr(f, 3), arr(i64, 1), arr(i64, 1), arr(types.boolean, 1), arr(f, 3))),
        ("log_product_grads", cuda_logspace.log_product_grads_kernel,
         (arr(f, 3), arr(f, 3), arr(i64, 1), arr(i64, 1), arr(types.boolean, 1), arr(f, 3), arr(f, 3),
          arr(types.uint8, 3), arr(f, 3), arr(f, 3))),
        ("sparse_chain values_grad_masked", cuda_sparse_chain.sparse_chain_values_grad_masked_kernel,
         (x, lengths, lengths, arr(f, 1), lengths, arr(f, 3), arr(f, 2), arr(f, 3), arr(f, 1), arr(types.boolean, 1),
          arr(f, 2))),
        ("viterbi", cuda_chain._viterbi_kernel(np.dtype(dtype)),
         (x, trans, i64, i64, init, lengths, arr(f, 3), arr(types.int32, 3), arr(f, 1), arr(i64, 2))),
        ("chain_sample", cuda_paths.chain_sample_kernel,
         (arr(f, 3), arr(types.float64, 3), trans, arr(types.float64, 4), arr(types.float64, 3), types.float64, i64,
          lengths, arr(types.boolean, 1),
          arr(types.float64, 3), arr(i64, 3))),
        ("chain_kbest", cuda_paths.chain_kbest_kernel,
         (x, trans, i64, init, lengths, arr(f, 4), arr(i64, 4), arr(i64, 4), arr(f, 2), arr(i64, 3))),
        ("sparse_chain_kbest", cuda_paths.sparse_chain_kbest_kernel,
         (x, lengths, lengths, arr(f, 1), init, lengths, arr(f, 4), arr(i64, 4), arr(i64, 4), arr(f, 2), arr(i64, 3))),
        ("max_matmul", cuda_semiring.max_matmul_kernel,
         (arr(f, 3), arr(f, 3), arr(i64, 1), arr(i64, 1), arr(f, 3), arr(i64, 3))),
        *((f"sddmm {index}", cuda_sparse.sparse_sddmm_kernel,
           (arr(index, 1), arr(index, 1), arr(f, 2), arr(f, 2), arr(f, 1)))
          for index in (types.int32, i64)),
        *((f"sddmm warp {index}", cuda_sparse._sddmm_warp_kernel(np.dtype(dtype)),
           (arr(index, 1), arr(index, 1), arr(f, 2), arr(f, 2), arr(f, 1))) for index in (types.int32, i64)),
        *((f"block spmm {index}", cuda_blocksparse.blocksparse_spmm_kernel,
           (arr(index, 1), arr(index, 1), arr(index, 1), arr(f, 3), arr(f, 2), arr(f, 1), arr(f, 2)))
          for index in (types.int32, i64)),
        ("block sddmm", cuda_blocksparse.blocksparse_sddmm_kernel,
         (arr(i64, 1), arr(i64, 1), arr(f, 2), arr(f, 2), arr(f, 3))),
    ]


@pytest.fixture
def sm90(monkeypatch):
    """Device functions are compiled for the current device's compute capability: without a
    GPU, say it is 9.0."""
    if cuda.is_available():
        return
    dispatcher = pytest.importorskip("numba.cuda.dispatcher")
    if not hasattr(dispatcher, "get_current_device"):
        pytest.skip("this numba-cuda compiles device functions differently")
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: SimpleNamespace(compute_capability=(9, 0)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_kernel_compiles(sm90, dtype):
    for name, kernel, signature in kernels(dtype):
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
        assert ".entry" in ptx, name


FP64 = re.compile(r"^\s*(?:@!?%\w+\s+)?[a-z]+(?:\.\w+)*\.f64\b.*$", re.M)
"""A PTX instruction that works on a double: arithmetic, compares, moves and conversions
(``add.f64``, ``fma.rn.f64``, ``setp.lt.f64``, ``cvt.f64.f32``, ``cvt.rn.f32.f64``, ...)."""

FLOAT64_BY_DESIGN = {"chain_sample"}
"""Its probabilities, totals and uniforms are float64 for every input dtype (``spchain.paths``:
the same draws as the CPU, and ``TINY`` = 1e-130 is below float32's range)."""


def test_fp64_pattern_finds_double_instructions():
    ptx = "\tadd.f64 \t%fd1, %fd2, %fd3;\n\t@%p1 cvt.rn.f32.f64 %f1, %fd1;\n\tadd.f32 %f1, %f2, %f3;\n"
    assert len(FP64.findall(ptx)) == 2


@pytest.mark.slow  # compiles every kernel again; the default set compiles each once above
@pytest.mark.parametrize("name", [name for name, _, _ in kernels(np.float32) if name not in FLOAT64_BY_DESIGN])
def test_float32_kernels_have_no_fp64_instructions(sm90, name):
    """A float64 literal in a float32 kernel promotes what it meets: double ``exp`` and
    compares, at a fraction of float32's rate on a GPU."""
    [(kernel, signature)] = [(k, sig) for n, k, sig in kernels(np.float32) if n == name]
    ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
    assert FP64.findall(ptx) == []


@pytest.mark.slow
def test_float64_kernels_still_compute_in_float64(sm90):
    for name, kernel, signature in kernels(np.float64):
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
        assert FP64.search(ptx), name
