"""The vectorisable exp of the CPU kernels (spchain/kernels/cpu/exp.py) against numpy.exp."""

import numpy as np
from numba import njit

from spchain.kernels.cpu.exp import exp_float32, exp_like, exp_nonpositive, log_float32, log_like


@njit
def apply(x, out):
    for i in range(x.size):
        out[i] = exp_nonpositive(x[i])


def run(x):
    out = np.empty(x.shape, np.float64)
    apply(x, out)
    return out


def test_within_two_ulp_of_numpy_exp():
    x = np.concatenate([np.linspace(-708.39, 700.0, 400_001), -np.logspace(-300, 2.8, 10_001), [0.0, -0.0]])
    got, want = run(x), np.exp(x)
    assert (np.abs(got - want) <= 2 * np.spacing(want)).all()


def test_float32_arguments():
    x = np.linspace(-100, 0, 10_001).astype(np.float32)
    np.testing.assert_allclose(run(x), np.exp(x.astype(np.float64)), rtol=5e-16)


def test_specials_and_underflow():
    got = run(np.array([-np.inf, np.nan, np.inf, -708.3964185322641 - 1e-9, -745.2, -1e300]))
    assert got[0] == 0 and np.isnan(got[1]) and got[2] == np.inf and (got[3:] == 0).all()
    # just above the flush point the result is a normal double, not flushed
    near = run(np.array([-708.39]))
    np.testing.assert_allclose(near, np.exp(-708.39), rtol=1e-15)


@njit
def apply_float32(x, out, logs):
    for i in range(x.size):
        out[i] = exp_float32(x[i])
        logs[i] = log_float32(out[i]) if out[i] > 0 else np.nan


@njit
def apply_like(x32, x64, out):
    for i in range(x32.size):
        out[0, i] = exp_like(x32[i], x64[i])
        out[1, i] = exp_like(x64[i], x64[i])
        out[2, i] = log_like(x32[i], x32[i])
        out[3, i] = log_like(x64[i], x64[i])


def test_float32_accuracy_over_the_float64_range():
    x = np.concatenate([np.linspace(-708.39, 700.0, 400_001), [0.0, -1e-300]])
    out, logs = np.empty_like(x), np.empty_like(x)
    apply_float32(x, out, logs)
    np.testing.assert_allclose(out, np.exp(x), rtol=1e-8, atol=0)
    np.testing.assert_allclose(logs, x, rtol=0, atol=2e-8)  # the exp's relative error and the log's
    special = np.array([-np.inf, np.nan, np.inf, -745.2])
    out, logs = np.empty(4), np.empty(4)
    apply_float32(special, out, logs)
    assert out[0] == 0 and np.isnan(out[1]) and out[2] == np.inf and out[3] == 0


@njit
def apply_log(x, out):
    for i in range(x.size):
        out[i] = log_float32(x[i])


def test_log_float32_over_mantissas_and_exponents():
    x = np.concatenate([np.linspace(0.5, 2.0, 100_001), np.logspace(-307, 307, 10_001), [np.sqrt(2.0)]])
    out = np.empty_like(x)
    apply_log(x, out)
    np.testing.assert_allclose(out, np.log(x), rtol=0, atol=1e-9)


def test_the_like_functions_pick_by_the_sample_type():
    x64 = np.linspace(0.01, 5.0, 1001)
    out = np.empty((4, x64.size))
    apply_like(x64.astype(np.float32), x64, out)
    x32 = x64.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(out[0], np.exp(x64), rtol=1e-8)
    assert (np.abs(out[1] - np.exp(x64)) <= 2 * np.spacing(np.exp(x64))).all()
    np.testing.assert_allclose(out[2], np.log(x32), rtol=0, atol=2e-9)
    # libm's log against NumPy's SIMD one (AVX-512 here): equal within one unit in the last place
    assert (np.abs(out[3] - np.log(x64)) <= np.abs(np.spacing(np.log(x64)))).all()
