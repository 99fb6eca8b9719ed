"""The path kernels: CPU (spchain/kernels/cpu/paths.py) and their CUDA twins (spchain/kernels/cuda/paths.py).

The CUDA launchers run here on NumPy arrays under NUMBA_ENABLE_CUDASIM=1 with tiny launch
sizes (several blocks, grid-stride loops) and must give what the CPU kernels give.
"""

import numpy as np
import pytest

import reference
from kernel_calls import entry
from spchain.kernels.cpu import chain as cpu_chain
from spchain.kernels.cpu import paths as cpu_paths
from spchain.kernels.cpu import team
from spchain.kernels.rules import TINY
from spchain.paths import _scaled_exp
from test_kernels_chain import normalised_problem


def forward_messages(x, trans, group, init, lengths):
    """The normalised forward messages â_t and whether each row has a path."""
    rows, v, c = x.shape
    pre, norm = np.empty_like(x), np.empty((rows, v), x.dtype)
    team.run(cpu_chain.chain_forward, x, trans, group, init, lengths, pre, norm)
    with np.errstate(invalid="ignore"):
        alpha = pre + x - np.where(np.isfinite(norm), norm, 0)[..., None]
        log_partition = np.where(np.arange(v) < lengths[:, None], norm, 0).sum(1)
    return alpha, np.isfinite(log_partition)


def run_sample(module, prefix, x, trans, group, init, lengths, samples=6, seed=0):
    alpha, possible = forward_messages(x, trans, group, init, lengths)
    uniforms = np.random.default_rng(seed).random((samples,) + x.shape[:2])
    paths = np.empty((samples,) + x.shape[:2], np.int64)
    trans_t = np.ascontiguousarray(trans.swapaxes(-1, -2))
    probs, trans_probs = _scaled_exp(np, alpha), _scaled_exp(np, trans_t)
    rows, v, c = x.shape
    totals = np.empty((rows, v - 1, c))
    for b, t in np.ndindex(rows, v - 1):
        totals[b, t] = trans_probs[b // group, t if trans.shape[1] > 1 else 0] @ probs[b, t]
    entry(module, prefix, "chain_sample")(alpha, probs, trans_t, trans_probs, totals, TINY, group,
                                             lengths, possible, uniforms, paths)
    return paths


def run_kbest(module, prefix, x, trans, group, init, lengths, k):
    rows, v, c = x.shape
    scores, paths = np.empty((k, rows), x.dtype), np.empty((k, rows, v), np.int64)
    entry(module, prefix, "chain_kbest")(x, trans, group, init, lengths, np.empty((rows, 2, c, k), x.dtype),
                                            np.empty((rows, 2, c, k), np.int64), np.empty((rows, v, c, k), np.int64),
                                            scores, paths)
    return scores, paths


def test_cpu_kbest_matches_brute_force(rng):
    x, trans, group, init, lengths = normalised_problem(rng, v=4, c=3)
    scores, paths = run_kbest(cpu_paths, "", x, trans, group, init, lengths, k=5)
    for b in range(x.shape[0]):
        want_scores, want_paths = reference.chain_kbest_by_paths(x[b], trans[0], init[b], lengths[b], k=5)
        np.testing.assert_allclose(scores[:, b], want_scores, rtol=1e-12)
        np.testing.assert_array_equal(paths[:, b], want_paths)


def test_cpu_sample_draws_only_paths_of_weight():
    rng = np.random.default_rng(0)
    x, trans, group, init, lengths = normalised_problem(rng, v=4, c=3)
    paths = run_sample(cpu_paths, "", x, trans, group, init, lengths, samples=50)
    np.testing.assert_array_equal(paths[:, 2], -1)  # the impossible chain
    for b in (0, 1, 3, 4, 5, 6):
        scores, all_paths = reference.chain_paths(x[b], trans[0], init[b], lengths[b])
        possible = {tuple(p) for p, s in zip(all_paths, scores) if s > -np.inf} or {(-1,) * int(lengths[b])}
        assert {tuple(p[:lengths[b]]) for p in paths[:, b]} <= possible
        np.testing.assert_array_equal(paths[:, b, lengths[b]:], -1)


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("per_step, group, dtype", [(True, 7, np.float64), (False, 1, np.float64), (True, 1, np.float32)])
def test_cuda_sample_matches_cpu_twin(small_launch, rng, per_step, group, dtype):
    from spchain.kernels.cuda import paths as cuda_paths

    problem = normalised_problem(rng, per_step=per_step, group=group, dtype=dtype)
    np.testing.assert_array_equal(run_sample(cuda_paths, "launch_", *problem),
                                  run_sample(cpu_paths, "", *problem))


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("per_step, group, k", [(True, 7, 3), (False, 1, 1), (True, 1, 4)])
def test_cuda_kbest_matches_cpu_twin(small_launch, rng, per_step, group, k):
    from spchain.kernels.cuda import paths as cuda_paths

    problem = normalised_problem(rng, c=4, per_step=per_step, group=group)
    problem[0][4, 3, 1] = problem[0][4, 3, 2] = problem[0][4, 3].max() + 1  # a tie, to the lowest state
    want = run_kbest(cpu_paths, "", *problem, k)
    got = run_kbest(cuda_paths, "launch_", *problem, k)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    np.testing.assert_array_equal(got[1], want[1])


def run_sparse_kbest(module, prefix, x, transpose, init, lengths, k):
    """k-best over the stored entries of a transition matrix, given by its transpose's CSR."""
    rows, v, c = x.shape
    scores, paths = np.empty((k, rows), x.dtype), np.empty((k, rows, v), np.int64)
    scratch = np.empty((rows, 2, c, k), x.dtype), np.empty((rows, 2, c, k), np.int64), np.empty((rows, v, c, k), np.int64)
    entry(module, prefix, "sparse_chain_kbest")(x, transpose.indptr, transpose.indices, transpose.data, init, lengths,
                                                   *scratch, scores, paths)
    return scores, paths


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("k", [1, 3])
def test_cuda_sparse_kbest_matches_cpu_twin_and_the_dense_kernel(small_launch, rng, k):
    from spchain.kernels.cuda import paths as cuda_paths
    from test_kernels_sparse_chain import problem

    x, _, transpose, dense, init, lengths = problem(rng, c=5)
    j = np.searchsorted(transpose.indptr, 1, side="right") - 1  # the column of transpose's entry 1
    transpose.data[1] = dense[transpose.indices[1], j] = np.inf
    want = run_sparse_kbest(cpu_paths, "", x, transpose, init, lengths, k)
    got = run_sparse_kbest(cuda_paths, "launch_", x, transpose, init, lengths, k)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    np.testing.assert_array_equal(got[1], want[1])
    dense_kbest = run_kbest(cpu_paths, "", x, dense[None, None], x.shape[0], init, lengths, k)
    np.testing.assert_allclose(got[0], dense_kbest[0], rtol=1e-12)
    np.testing.assert_array_equal(got[1], dense_kbest[1])


@pytest.mark.cuda_kernel
def test_cuda_path_kernels_skip_empty_launches(small_launch):
    from spchain.kernels.cuda import paths as cuda_paths

    x = np.zeros((0, 3, 2))
    cuda_paths.launch_chain_kbest(x, np.zeros((0, 2, 2, 2)), 1, np.zeros((0, 2)), np.zeros(0, np.int64),
                                  np.zeros((0, 2, 2, 1)), np.zeros((0, 2, 2, 1), np.int64),
                                  np.zeros((0, 3, 2, 1), np.int64), np.zeros((1, 0)),
                                  np.zeros((1, 0, 3), np.int64))
    trans = np.zeros((0, 2, 2, 2))
    cuda_paths.launch_chain_sample(x, x, trans, trans, np.zeros((0, 2, 2)), 1e-250, 1, np.zeros(0, np.int64), np.zeros(0, bool),
                                   np.zeros((2, 0, 3)), np.zeros((2, 0, 3), np.int64))


def plus_inf(problem, rng):
    """``normalised_problem`` with ``+inf`` in x, the transitions and init (beside its ``-inf``)."""
    x, trans, group, init, lengths = (a.copy() if isinstance(a, np.ndarray) else a for a in problem)
    for a, share in ((x, 0.1), (trans, 0.1), (init, 0.1)):
        a[rng.random(a.shape) < share] = np.inf
    return x, trans, group, init, lengths


def test_cpu_kbest_with_plus_inf_has_no_nan_or_holes(rng):
    problem = plus_inf(normalised_problem(rng, v=4, c=3), rng)
    scores, paths = run_kbest(cpu_paths, "", *problem, k=6)
    x, lengths = problem[0], problem[4]
    assert not np.isnan(scores).any()
    for b in range(x.shape[0]):
        listed = scores[:, b] > -np.inf
        assert (paths[listed, b, :lengths[b]] >= 0).all() and (paths[~listed, b] == -1).all()
        assert len({tuple(p) for p in paths[listed, b]}) == listed.sum(), "a path listed twice"


@pytest.mark.cuda_kernel
@pytest.mark.parametrize("per_step, group, k", [(True, 7, 3), (False, 1, 5)])
def test_cuda_kbest_with_plus_inf_matches_cpu_twin(small_launch, rng, per_step, group, k):
    from spchain.kernels.cuda import paths as cuda_paths

    problem = plus_inf(normalised_problem(rng, c=4, per_step=per_step, group=group), rng)
    want = run_kbest(cpu_paths, "", *problem, k)
    got = run_kbest(cuda_paths, "launch_", *problem, k)
    assert not np.isnan(want[0]).any()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    np.testing.assert_array_equal(got[1], want[1])
