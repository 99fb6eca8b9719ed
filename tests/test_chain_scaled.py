"""The scaled kernel sweep (spchain/_chain_scaled.py, spchain/kernels/cpu/chain_scaled.py): shared
transitions give what the log-space kernels give on the same matrices repeated per row and
step (where the scaled kernels do not apply), also where scaled sums underflow and fall back
to log space."""

import numpy as np
import pytest

import positional
import spchain
from spchain import _chain_layout, _chain_scaled


def problem(rng, scale, dtype, B=9, v=7, c=6):
    x = (rng.normal(size=(B, v, c)) * scale).astype(dtype)
    trans = (rng.normal(size=(c, c)) * scale).astype(dtype)
    trans[0, 2] = -np.inf
    trans[:, 4] = -np.inf  # a state that is never reached after the first position
    x[2, 1] = -np.inf  # an impossible chain
    init = rng.normal(size=c).astype(dtype)
    lengths = rng.integers(1, v + 1, B)
    lengths[:3] = v
    return x, trans, init, lengths


def sweep(x, trans, init, lengths, weight):
    with spchain.chain_sweep("kernel"):
        results = positional.chain_logsumexp_forward(x, trans, init, lengths)
        grads = positional.chain_logsumexp_backward((x, trans, init, lengths), results, (weight,), (True, True, True))
    return results[0], grads


@pytest.mark.parametrize("scale", [1.0, 300.0])  # 300: most scaled sums underflow, recomputed in log space
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("size", [(9, 7, 6), (40, 21, 9)])  # the second fills the transition gradient's buffer
def test_scaled_kernels_match_log_space_kernels(rng, scale, dtype, size):
    x, trans, init, lengths = problem(rng, scale, dtype, *size)
    B, v, c = x.shape
    per_row = np.broadcast_to(trans, (B, v - 1, c, c)).copy()
    assert _chain_scaled.applies(_chain_layout.prepare(x, trans, init, lengths, "t"))
    assert not _chain_scaled.applies(_chain_layout.prepare(x, per_row, init, lengths, "t"))
    weight = np.linspace(-0.5, 2.0, B).astype(dtype)
    got_z, (got_x, got_trans, got_init) = sweep(x, trans, init, lengths, weight)
    want_z, (want_x, want_trans, want_init) = sweep(x, per_row, init, lengths, weight)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got_z, want_z, rtol=tol)
    assert got_z[2] == -np.inf
    np.testing.assert_allclose(got_x, want_x, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_init, want_init, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_trans, want_trans.sum((0, 1)), rtol=tol, atol=tol * B * v)
    assert (got_trans[:, 4] == 0).all()


def test_nan_propagates(rng):
    x, trans, init, lengths = problem(rng, 1.0, np.float64)
    trans[1, 1] = np.nan
    z, (grad_x, grad_trans, _) = sweep(x, trans, init, lengths, np.ones(x.shape[0]))
    reached = lengths > 1
    reached[2] = False
    assert np.isnan(z[reached]).all() and np.isnan(grad_trans).any()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_log_partition_alone_is_the_forward_sweeps(rng, monkeypatch, dtype):
    """``chain_logsumexp`` without a gradient keeps no messages (the scaled kernel in
    probability space); the rows it cannot do exactly (special values, scaled sums that could
    have lost terms) go through the forward sweep, and give its results."""
    from spchain import _chain_limits

    found = []
    monkeypatch.setattr(_chain_scaled, "log_partition",
                        lambda chain, kernel=_chain_scaled.log_partition: found.append(kernel(chain)) or found[-1])
    for trial in range(60):
        scale = (1.0, 30.0, 300.0)[trial % 3]
        x, trans, init, lengths = problem(rng, scale, dtype, B=12, v=6, c=5)
        if trial % 4 == 0:
            x[rng.integers(12), rng.integers(6), rng.integers(5)] = (np.nan, np.inf)[trial % 8 // 4]
        got = spchain.chain_logsumexp(x, trans, init, lengths=lengths)
        with np.errstate(all="ignore"):
            want = _chain_limits.forward(_chain_layout.prepare(x, trans, init, lengths, "t"))[0]
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == np.float32 else 1e-12)  # NaN, ±inf where want's
    lost = np.concatenate([rows for _, rows in found])
    assert len(found) == 60 and lost.any() and not lost.all()


@pytest.mark.parametrize("batch, v, c, per_step", [
    ((3, 5), 7, 6, False),  # three matrices of five rows each: blocks split at each matrix's rows
    ((20,), 7, 6, True),  # one matrix a step
    ((14,), 4, 200, False),  # blocks of six rows (a larger product would wake OpenBLAS's threads)
    ((5,), 3, 600, False),  # blocks of one row, multiplied without BLAS
])
def test_blocks_of_rows_step_together_as_rows_alone(rng, batch, v, c, per_step):
    """The scaled sweeps step blocks of rows of one matrix together (one BLAS product a step):
    rows of other lengths, of other matrices, without a path or with NaN give what each gives
    alone."""
    rows = int(np.prod(batch))
    x = rng.normal(size=(*batch, v, c))
    trans = rng.normal(size=(batch[0], 1, c, c) if len(batch) == 2 else (1, v - 1, c, c) if per_step else (c, c))
    init = rng.normal(size=c)
    lengths = rng.integers(1, v + 1, batch)
    lengths.flat[0] = v
    x.reshape(rows, v, c)[rows // 2, 1] = -np.inf  # no path
    assert _chain_scaled.applies(_chain_layout.prepare(x, trans, init, lengths, "t"))
    weight = rng.normal(size=batch)
    steps = trans[:, :, None] if len(batch) == 2 else trans  # (3, 1, c, c): one matrix for all steps of 5 rows
    per_row = np.broadcast_to(steps, (*batch, v - 1, c, c)).reshape(rows, v - 1, c, c).copy()
    for nan in (False, True):
        if nan:  # NaN in one row of a block: in that row's results alone (and the gradient of its matrix)
            x.reshape(rows, v, c)[rows // 3, 0, 1] = np.nan
        got_z, (got_x, got_trans, got_init) = sweep(x, trans, init, lengths, weight)
        want_z, (want_x, want_trans, want_init) = sweep(x.reshape(rows, v, c), per_row, init, lengths.ravel(),
                                                        weight.ravel())
        np.testing.assert_allclose(got_z.ravel(), want_z, rtol=1e-12)
        np.testing.assert_allclose(got_x.reshape(rows, v, c), want_x, rtol=1e-11, atol=1e-12)
        assert np.isnan(got_x.reshape(rows, v, c)).any(axis=(1, 2)).sum() == nan
        np.testing.assert_allclose(got_init, want_init, rtol=1e-11, atol=1e-12)
        summed = want_trans.reshape(*batch, v - 1, c, c)
        summed = summed.sum((1, 2)) if len(batch) == 2 else summed.sum(0) if per_step else summed.sum((0, 1))
        np.testing.assert_allclose(got_trans, summed.reshape(trans.shape), rtol=1e-10, atol=1e-10 * rows * v)
