"""The CUDA kernels of the GPU paths of issue 23 against their CPU twins, on NumPy arrays under
NUMBA_ENABLE_CUDASIM=1 with tiny launch sizes (several blocks, grid-stride loops): the masked
exact transition counts (spchain/kernels/cuda/chain.py) and the device-side fix-up of a scaled
log-space product (spchain/kernels/cuda/logspace.py)."""

import numpy as np
import pytest

from spchain import _logspace
from spchain.kernels.cpu import chain as cpu_chain
from test_kernels_chain import normalised_problem, run


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("per_step", [True, False])
def test_masked_transition_grad_fills_only_flagged_matrices(small_launch, rng, per_step):
    from spchain.kernels.cuda import chain as cuda_chain

    x, trans, group, init, lengths = normalised_problem(rng, rows=6, group=3, per_step=per_step)
    pre, norm, marg, want = run(cpu_chain, "", x, trans, group, init, lengths)
    weight = np.linspace(0.5, 2.0, x.shape[0])
    ok = np.zeros(trans.shape[:2], bool)
    ok[0, 0] = True
    got = np.full_like(want, 7.0)
    cuda_chain.launch_chain_transition_grad_masked(x, trans, group, lengths, pre, norm, marg, weight, ok, got)
    np.testing.assert_allclose(got[~ok], want[~ok], rtol=1e-12, atol=1e-12)
    assert (got[ok] == 7.0).all()


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_log_product_fixup_matches_numpy_twin(small_launch, rng, dtype):
    from spchain.kernels.cuda import logspace as cuda_logspace

    a = (rng.normal(size=(2, 3, 5)) * 300).astype(dtype)
    b = (rng.normal(size=(1, 5, 4)) * 300).astype(dtype)
    a[0, 1] = -np.inf
    b[0, :, 2] = -np.inf
    b[0, 3, 1] = np.nan
    lost = rng.random((2, 3, 4)) < 0.6
    want = np.full((2, 3, 4), 5.0, dtype)
    with np.errstate(all="ignore"):  # the NaN entry: NumPy's shift is 0, its exp overflows
        _logspace._recompute_lost(np, a, b, want, lost.copy())
    got = np.full((2, 3, 4), 5.0, dtype)
    cuda_logspace.launch_log_product_fixup(a, b, np.arange(2), np.zeros(2, np.int64), lost.astype(np.uint8), got)
    tol = 1e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(got, want, rtol=tol)
    assert (got[~lost] == 5.0).all()
