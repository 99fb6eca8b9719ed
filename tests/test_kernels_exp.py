"""The vectorisable exp of the CPU kernels (kernels/cpu/exp.py) against numpy.exp."""

import numpy as np
from numba import njit

from spchain.kernels.cpu.exp import exp_nonpositive


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
