"""The chain kernels: CPU (spchain/kernels/cpu/chain.py) and their CUDA twins (spchain/kernels/cuda/chain.py).

The CUDA launchers run here on NumPy arrays under NUMBA_ENABLE_CUDASIM=1 with tiny launch
sizes (several blocks, grid-stride loops, several state chunks and state tiles), and must
give what the CPU kernels give.
"""

import numpy as np
import pytest

import reference
from kernel_calls import entry
from spchain.kernels.cpu import chain as cpu_chain


def normalised_problem(rng, rows=7, v=5, c=6, group=7, per_step=True, dtype=np.float64):
    x = rng.normal(scale=2.0, size=(rows, v, c)).astype(dtype)
    trans = np.log(rng.dirichlet(np.ones(c), size=(rows // group, v - 1 if per_step else 1, c))).astype(dtype)
    trans[..., 0, 2] = -np.inf
    x[1, 2, :3] = -np.inf
    x[2, 1, :] = -np.inf  # an impossible chain
    init = np.log(rng.dirichlet(np.ones(c), size=rows)).astype(dtype)
    lengths = rng.integers(1, v + 1, size=rows).astype(np.int64)
    lengths[:3] = v
    return x, trans, group, init, lengths


def run(module, prefix, x, trans, group, init, lengths):
    rows, v, c = x.shape
    pre, norm = np.empty_like(x), np.empty((rows, v), x.dtype)
    beta = np.empty_like(x)
    entry(module, prefix, "chain_forward")(x, trans, group, init, lengths, pre, norm)
    entry(module, prefix, "chain_backward")(x, trans, group, lengths, norm, beta)
    inside = (np.arange(v)[None, :] < lengths[:, None])[..., None]
    offset = np.where(np.isfinite(norm), norm, 0)[..., None]
    with np.errstate(invalid="ignore"):
        marg = np.where(inside, np.exp(pre + x - offset + beta), 0)
    weight = np.linspace(0.5, 2.0, rows).astype(x.dtype)
    grad = np.empty_like(trans)
    entry(module, prefix, "chain_transition_grad")(x, trans, group, lengths, pre, norm, marg, weight, grad)
    return pre, norm, marg, grad


@pytest.mark.parametrize("per_step", [True, False])
def test_cpu_kernels_match_reference(rng, per_step):
    x, trans, group, init, lengths = normalised_problem(rng, per_step=per_step)
    pre, norm, marg, _ = run(cpu_chain, "", x, trans, group, init, lengths)
    inside = np.arange(x.shape[1])[None, :] < lengths[:, None]
    log_partition = np.where(inside, norm, 0).sum(1)
    one_trans = trans if per_step else trans[0, 0]
    want = reference.chain_logsumexp(x, one_trans, init, lengths)
    np.testing.assert_allclose(log_partition, want, rtol=1e-12)
    assert log_partition[2] == -np.inf and (marg[2] == 0).all()
    for b in (0, 1, 3):
        want = reference.chain_marginals_by_paths(x[b], one_trans[0] if per_step else one_trans, init[b], lengths[b])
        np.testing.assert_allclose(marg[b], want, rtol=1e-10, atol=1e-12)


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("per_step, group, dtype", [(True, 7, np.float64), (False, 1, np.float64), (True, 1, np.float32)])
def test_cuda_kernels_match_cpu_twins(small_launch, rng, per_step, group, dtype):
    from spchain.kernels.cuda import chain as cuda_chain

    problem = normalised_problem(rng, per_step=per_step, group=group, dtype=dtype)
    want = run(cpu_chain, "", *problem)
    got = run(cuda_chain, "launch_", *problem)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.cuda_kernel
def test_cuda_kernels_skip_empty_launches(small_launch):
    from spchain.kernels.cuda import chain as cuda_chain

    x = np.zeros((0, 3, 2))
    trans = np.zeros((0, 2, 2, 2))
    cuda_chain.launch_chain_forward(x, trans, 1, np.zeros((0, 2)), np.zeros(0, np.int64), x.copy(), np.zeros((0, 3)))
    cuda_chain.launch_chain_transition_grad(x, trans, 1, np.zeros(0, np.int64), x, np.zeros((0, 3)), x, np.zeros(0),
                                            trans.copy())


def run_viterbi(module, prefix, x, trans, group, init, lengths):
    rows, v, c = x.shape
    score, path = np.empty(rows, x.dtype), np.empty((rows, v), np.int64)
    entry(module, prefix, "chain_viterbi")(x, trans, group, init, lengths, np.empty((rows, 2, c), x.dtype),
                                        np.empty((rows, v, c), np.int32), score, path)
    return score, path


def test_cpu_viterbi_matches_brute_force(rng):
    x, trans, group, init, lengths = normalised_problem(rng)
    score, path = run_viterbi(cpu_chain, "", x, trans, group, init, lengths)
    for b in range(x.shape[0]):
        want_score, want_path = reference.viterbi_by_paths(x[b], trans[0], init[b], lengths[b])
        np.testing.assert_allclose(score[b], want_score, rtol=1e-12)
        if np.isfinite(want_score):
            np.testing.assert_array_equal(path[b], want_path)


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("per_step, group", [(True, 7), (False, 1)])
def test_cuda_viterbi_matches_cpu_twin(small_launch, rng, per_step, group):
    from spchain.kernels.cuda import chain as cuda_chain

    problem = normalised_problem(rng, per_step=per_step, group=group)
    x = problem[0]
    x[4, 3, 1] = x[4, 3, 2] = x[4, 3].max() + 1  # a tie, resolved to the lowest state by both
    want = run_viterbi(cpu_chain, "", *problem)
    got = run_viterbi(cuda_chain, "launch_", *problem)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    np.testing.assert_array_equal(got[1], want[1])
