"""CPU twins of the GPU chain paths: the batched-GEMM transition gradient
(spchain/_chain_scaled.py ``transition_grad_gemm``) and the device-side fix-up of a scaled
log-space product (spchain/_logspace.py), run here on NumPy arrays by the same array-API code
the GPU runs on CuPy arrays, against the CPU results in float64, with ``-inf`` entries and
scaled sums that underflow."""

import numpy as np
import pytest

import positional
import spchain
from spchain import _chain_layout, _chain_scaled, _chain_sweep, _logspace
from spchain.kernels.cpu import chain as cpu_chain
from spchain.kernels.cpu import team


def problem(rng, scale, dtype, per_row, B=8, v=6, c=5):
    x = (rng.normal(size=(B, v, c)) * scale).astype(dtype)
    trans = (rng.normal(size=(v - 1, c, c) if per_row else (c, c)) * scale).astype(dtype)
    trans[..., 0, 2] = -np.inf
    trans[..., :, 4] = -np.inf  # a state never reached after the first position
    x[2, 1] = -np.inf  # an impossible chain
    x[3, 2, :2] = -np.inf
    init = rng.normal(size=c).astype(dtype)
    lengths = rng.integers(1, v + 1, B)
    lengths[:3] = v
    if per_row:  # one matrix per row and step: the log-space kernel sweep
        trans = np.broadcast_to(trans, (B, v - 1, c, c)).copy()
        trans[1] += 0.5
    return x, trans, init, lengths


def grads(x, trans, init, lengths, weight, sweep):
    with spchain.chain_sweep(sweep):
        results = positional.chain_logsumexp_forward(x, trans, init, lengths)
        return positional.chain_logsumexp_backward((x, trans, init, lengths), results, (weight,), (True, True, True))


@pytest.mark.parametrize("sweep", ["kernel", "gemm"])
@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("scale", [1.0, 300.0])  # 300: scale factors out of range, the exact fix-up
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_batched_counts_match_cpu_path(monkeypatch, rng, sweep, per_row, scale, dtype):
    x, trans, init, lengths = problem(rng, scale, dtype, per_row)
    weight = np.linspace(-0.5, 2.0, x.shape[0]).astype(dtype)
    want = grads(x, trans, init, lengths, weight, sweep)
    monkeypatch.setattr(_chain_sweep, "batched_counts", lambda chain: True)  # the GPU's paths, on NumPy
    monkeypatch.setattr(_chain_sweep, "fused_steps", lambda chain: False)
    got = grads(x, trans, init, lengths, weight, sweep)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * x.shape[0] * x.shape[1])
    assert (got[1][..., 4] == 0).all()


def layout_and_marginals(rng, scale, per_row):
    x, trans, init, lengths = problem(rng, scale, np.float64, per_row)
    chain = _chain_layout.prepare(x, trans, init, lengths, "t")
    rows, v, c = chain.x.shape
    pre, norm, beta = np.empty_like(chain.x), np.empty((rows, v)), np.empty_like(chain.x)
    team.run(cpu_chain.chain_forward, chain.x, chain.trans, chain.group, chain.init, chain.lengths, pre, norm)
    team.run(cpu_chain.chain_backward, chain.x, chain.trans, chain.group, chain.lengths, norm, beta)
    inside = (np.arange(v)[None, :] < chain.lengths[:, None])[..., None]
    with np.errstate(invalid="ignore"):
        marg, _ = _logspace.renormalise(
            np, np.where(inside, np.exp(_logspace.normalised(np, pre, chain.x, norm) + beta), 0))
    return chain, pre, norm, marg


@pytest.mark.parametrize("chunk", [1 << 20, 1])  # 1: a row at a time
@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_transition_grad_gemm_matches_kernel(monkeypatch, rng, per_row, scale, chunk):
    monkeypatch.setattr(_chain_scaled, "CHUNK", chunk)
    chain, pre, norm, marg = layout_and_marginals(rng, scale, per_row)
    weight = np.linspace(0.5, 2.0, chain.x.shape[0])
    want = np.empty_like(chain.trans)
    team.run(cpu_chain.chain_transition_grad, chain.x, chain.trans, chain.group, chain.lengths, pre, norm, marg, weight, want)
    fixed = []
    original = _chain_scaled._exact_where_not
    monkeypatch.setattr(_chain_scaled, "_exact_where_not",
                        lambda *args: (fixed.append(~args[5]), original(*args))[1])
    got = np.full_like(want, np.nan)
    _chain_scaled.transition_grad_gemm(chain, pre, norm, marg, weight, got)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert fixed[0].any() == (scale > 1), "the exact fix-up runs exactly where scale factors leave range"


def test_transition_grad_gemm_nan_and_single_position(rng):
    chain, pre, norm, marg = layout_and_marginals(rng, 1.0, False)
    weight = np.ones(chain.x.shape[0])
    weight[0] = np.nan
    want, got = np.empty_like(chain.trans), np.empty_like(chain.trans)
    team.run(cpu_chain.chain_transition_grad, chain.x, chain.trans, chain.group, chain.lengths, pre, norm, marg, weight, want)
    _chain_scaled.transition_grad_gemm(chain, pre, norm, marg, weight, got)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    one = _chain_layout.prepare(np.zeros((3, 1, 4)), np.zeros((4, 4)), None, None, "t")
    out = np.full((1, 1, 4, 4), np.nan)
    _chain_scaled.transition_grad_gemm(one, one.x, np.zeros((3, 1)), one.x, np.ones(3), out)
    assert (out == 0).all()


@pytest.mark.parametrize("scale", [1.0, 400.0])
def test_log_product_device_fixup_twin(monkeypatch, rng, scale):
    """The GPU branch of ``log_product`` (flags on the device, one fix-up kernel) gives what
    the NumPy branch gives; the kernel runs under the simulator (``cuda_kernel`` tests) and on
    the GPU; here its NumPy form stands in, with the same arguments."""
    a = rng.normal(size=(3, 4, 6)) * scale
    b = rng.normal(size=(6, 5)) * scale
    a[0, 1] = -np.inf
    b[:, 2] = -np.inf
    want = _logspace.log_matmul(np, a, b)
    calls = []

    def fixup(xp, a3, b3, out, lost):
        calls.append(int(lost.sum()))
        _logspace._recompute_lost(xp, a3, b3, out, lost.copy())

    monkeypatch.setattr(_logspace, "on_device", lambda xp: True)
    monkeypatch.setattr(_logspace, "_recompute_lost_on_device", fixup)
    got = _logspace.log_matmul(np, a, b, posinf=False)
    np.testing.assert_array_equal(got, want)
    assert calls and (calls[0] > 0) == (scale > 1)


def test_gpu_cost_model_picks_by_its_own_figures():
    """The GPU chooses by its own model: even at the chain workload's size, the GEMM sweep
    for many states or many rows, the kernel sweep for small chains (never the CPU's figures)."""
    assert not _chain_sweep.gpu_gemm_wins(rows=64, c=16, groups=1)
    assert _chain_sweep.gpu_gemm_wins(rows=500, c=1024, groups=1)
    assert _chain_sweep.gpu_gemm_wins(rows=50_000, c=200, groups=1)
    assert not _chain_sweep.gpu_gemm_wins(rows=50_000, c=200, groups=50_000)  # one matrix a row: exps dominate
