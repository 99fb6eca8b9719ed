"""The max-plus kernel (spchain/kernels/cpu/semiring.py) and its CUDA twin, under the simulator."""

import numpy as np
import pytest

import reference
from kernel_calls import entry
from spchain.kernels.cpu import semiring as cpu_semiring


def problem(rng):
    a = rng.normal(size=(2, 5, 6))
    b = rng.normal(size=(3, 6, 7))
    a[0, 1, :] = -np.inf
    a[1, 2, 3] = np.nan
    b[2, 4, :] = a[1, 0].max() + 10  # a row that wins every column
    a_index, b_index = np.array([0, 1, 1, 0]), np.array([2, 0, 2, 1])
    return a, b, a_index, b_index


def run(fn, a, b, a_index, b_index):
    values = np.empty((len(a_index), a.shape[1], b.shape[2]))
    argmax = np.empty(values.shape, np.int64)
    fn(a, b, a_index, b_index, values, argmax)
    return values, argmax


def test_cpu_kernel_matches_reference(rng):
    a, b, a_index, b_index = problem(rng)
    values, argmax = run(entry(cpu_semiring, "", "max_matmul"), a, b, a_index, b_index)
    want_values, want_argmax = reference.max_matmul(a[a_index], b[b_index])
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(argmax, want_argmax)


@pytest.mark.cuda_kernel
def test_cuda_kernel_matches_cpu_twin(small_launch, rng):
    from spchain.kernels.cuda import semiring as cuda_semiring

    operands = problem(rng)
    want = run(entry(cpu_semiring, "", "max_matmul"), *operands)
    got = run(cuda_semiring.launch_max_matmul, *operands)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def infinite_problem(rng):
    """+inf beside -inf (a structural zero wins: the term is -inf), NaN, and all -inf columns."""
    a = rng.normal(size=(2, 5, 6))
    b = rng.normal(size=(3, 6, 7))
    a[rng.random(a.shape) < 0.2] = np.inf
    b[rng.random(b.shape) < 0.3] = -np.inf
    b[0, :, 2] = -np.inf
    a[1, 0, 0] = np.nan
    return a, b, np.array([0, 1, 1, 0]), np.array([2, 0, 2, 1])


def test_cpu_kernel_plus_inf_beside_minus_inf_is_minus_inf(rng):
    a, b, a_index, b_index = infinite_problem(rng)
    values, argmax = run(entry(cpu_semiring, "", "max_matmul"), a, b, a_index, b_index)
    terms = reference.semiring_terms(a[a_index], b[b_index])
    np.testing.assert_array_equal(values, np.take_along_axis(terms, argmax[..., None, :], axis=-2)[..., 0, :])
    np.testing.assert_array_equal(argmax, np.argmax(terms, axis=-2))
    assert np.isposinf(values).any() and not np.isnan(values[0]).any()


@pytest.mark.cuda_kernel
def test_cuda_kernel_matches_cpu_twin_with_infinities(small_launch, rng):
    from spchain.kernels.cuda import semiring as cuda_semiring

    operands = infinite_problem(rng)
    want = run(entry(cpu_semiring, "", "max_matmul"), *operands)
    got = run(cuda_semiring.launch_max_matmul, *operands)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_cpu_max_vecmat_every_input_length(rng, dtype, index):
    """Four terms at a time, then one at a time, with and without NaN (two code paths):
    every input length from 0 to 9, ties (integer values) and -inf, against the reference."""
    for k in range(10):
        for nan in (False, True):
            u = rng.integers(-2, 3, k).astype(dtype)
            m = rng.integers(-2, 3, (k, 9)).astype(dtype)
            u[rng.random(k) < 0.2] = -np.inf
            m[rng.random(m.shape) < 0.2] = -np.inf
            if nan:
                m[rng.random(m.shape) < 0.1] = np.nan
                u[rng.random(k) < 0.1] = np.nan
            best, arg = np.empty(9, dtype), np.empty(9, index)
            cpu_semiring.max_vecmat(u, m, cpu_semiring.has_nan(m), best, arg, np.empty_like(best),
                                    np.empty_like(arg))
            want_values, want_argmax = reference.max_matmul(u[None], m)
            np.testing.assert_array_equal(best, want_values[0])
            np.testing.assert_array_equal(arg, want_argmax[0])
