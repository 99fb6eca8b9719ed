"""The guarded log-space helpers: CPU directly, CUDA through tiny wrapper kernels."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda, njit, types

import cpu_logspace
import reference
from spchain.kernels.cuda import logspace as cuda_logspace

SPECIAL = [-math.inf, math.inf, math.nan, 0.0, -1e300, 1e300, -745.0, 3.5]
logs = st.one_of(st.sampled_from([-math.inf, math.nan]), st.floats(-1e4, 1e4))


def fold(module, values):
    m, s = -math.inf, 0.0
    for v in values:
        m, s = module.lse_push(m, s, v)
    return module.lse_value(m, s)


def assert_same(got, want):
    # relative to the magnitude of the logs: a sum near 1 has a log near 0
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("a", SPECIAL)
@pytest.mark.parametrize("b", SPECIAL)
def test_log_add_exp_special_values(a, b):
    assert_same(cpu_logspace.log_add_exp(a, b), reference.log_add_exp(a, b))


@given(logs, logs)
def test_log_add_exp_matches_reference(a, b):
    assert_same(cpu_logspace.log_add_exp(a, b), reference.log_add_exp(a, b))


@given(st.lists(logs, max_size=12))
def test_running_log_sum_exp_matches_reference(values):
    assert_same(fold(cpu_logspace, values), reference.log_sum_exp(values))


@given(st.lists(logs, max_size=8), st.lists(logs, max_size=8))
def test_merged_log_sum_exps_match_reference(left, right):
    module = cpu_logspace
    m1, s1 = -math.inf, 0.0
    for v in left:
        m1, s1 = module.lse_push(m1, s1, v)
    m2, s2 = -math.inf, 0.0
    for v in right:
        m2, s2 = module.lse_push(m2, s2, v)
    m, s = module.lse_merge(m1, s1, m2, s2)
    assert_same(module.lse_value(m, s), reference.log_sum_exp(left + right))


def test_all_minus_inf_gives_minus_inf_not_nan():
    module = cpu_logspace
    assert fold(module, [-math.inf] * 5) == -math.inf
    assert module.log_add_exp(-math.inf, -math.inf) == -math.inf


@pytest.mark.parametrize("helper, arity", [("log_add_exp", 2), ("lse_push", 3), ("lse_merge", 4), ("lse_value", 2)])
def test_helpers_compute_in_the_type_of_their_inputs(helper, arity):
    """float32 in, float32 state out (no float64 literal promotes it); float64 unchanged."""
    dispatcher = getattr(cpu_logspace, helper)
    for numba_type in (types.float32, types.float64):
        signature = (numba_type,) * arity
        dispatcher.compile(signature)
        returned = dispatcher.overloads[signature].signature.return_type
        assert set(getattr(returned, "types", [returned])) == {numba_type}


@njit
def fold_in_input_type(values):
    m, s = values.dtype.type(-np.inf), values.dtype.type(0)
    for v in values:
        m, s = cpu_logspace.lse_push(m, s, v)
    return cpu_logspace.lse_value(m, s)


@njit
def forward_in_input_type(x, trans, init):
    """The recursion of the CUDA forward kernel for one row (``pre`` messages normalised by
    the previous step's log-sum-exp ``d``), in the input's type: returns the ``norm`` of each step."""
    v, c = x.shape
    zero = x.dtype.type(0)
    norm = np.empty(v, x.dtype)
    msg = init + x[0]
    norm[0] = fold_in_input_type(msg)
    for t in range(v - 1):
        msg = msg - norm[t]
        pre = np.empty(c, x.dtype)
        for j in range(c):
            m, s = x.dtype.type(-np.inf), zero
            for i in range(c):
                m, s = cpu_logspace.lse_push(m, s, msg[i] + trans[i, j])
            pre[j] = cpu_logspace.lse_value(m, s)
        msg = pre + x[t + 1]
        norm[t + 1] = fold_in_input_type(msg)
    return norm


def test_float32_running_log_sum_exp_of_many_terms_is_within_1e_5(rng):
    values = rng.normal(scale=20.0, size=100_000).astype(np.float32)
    values[::7] = -np.inf
    got = fold_in_input_type(values)
    want = reference.log_sum_exp(values.astype(np.float64))
    assert abs(got - want) <= 1e-5 * abs(want)


@pytest.mark.parametrize("v, c", [(40, 500), (10_000, 4)])
def test_float32_state_keeps_chain_log_partitions_within_1e_5(rng, v, c):
    """Benchmark-like (a step of 500 states) and long (10⁴ steps) chains, float32 inputs,
    float32 state throughout, against the float64 forward algorithm on the same inputs."""
    x = rng.normal(scale=2.0, size=(v, c)).astype(np.float32)
    trans = np.log(rng.dirichlet(np.ones(c), size=c)).astype(np.float32)
    init = np.log(rng.dirichlet(np.ones(c))).astype(np.float32)
    got = forward_in_input_type(x, trans, init).sum()
    want = reference.chain_logsumexp(x, trans, init)
    assert abs(got - want) <= 1e-5 * abs(want)


# Wrapper kernels live at module level: the simulator swaps the `cuda` module only in globals.
@cuda.jit
def log_add_exp_kernel(a, b, out):
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, a.size, step):
        out[i] = cuda_logspace.log_add_exp(a[i], b[i])


@cuda.jit
def row_log_sum_exp_kernel(x, out):
    """One row per block (grid-stride over rows): each of 4 threads folds a strided part with
    lse_push, then thread 0 merges the partial sums with lse_merge."""
    m_part = cuda.shared.array(4, np.float64)
    s_part = cuda.shared.array(4, np.float64)
    for row in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        m, s = -math.inf, 0.0
        for j in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            m, s = cuda_logspace.lse_push(m, s, x[row, j])
        m_part[cuda.threadIdx.x] = m
        s_part[cuda.threadIdx.x] = s
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            m, s = m_part[0], s_part[0]
            for t in range(1, cuda.blockDim.x):
                m, s = cuda_logspace.lse_merge(m, s, m_part[t], s_part[t])
            out[row] = cuda_logspace.lse_value(m, s)
        cuda.syncthreads()


@pytest.mark.cuda_kernel
def test_cuda_log_add_exp_matches_reference(small_launch):
    a = np.array(SPECIAL * len(SPECIAL))
    b = np.repeat(SPECIAL, len(SPECIAL))
    out = np.empty_like(a)
    log_add_exp_kernel[small_launch.blocks_for(a.size), small_launch.THREADS_PER_BLOCK](a, b, out)
    assert_same(out, reference.log_add_exp(a, b))


@pytest.mark.cuda_kernel
def test_cuda_running_and_merged_log_sum_exp_match_reference(rng):
    x = rng.normal(scale=50, size=(7, 9))
    x[1] = -math.inf
    x[2, 3] = math.nan
    x[3, ::2] = -math.inf
    x[4, 5] = math.inf
    out = np.empty(7)
    row_log_sum_exp_kernel[3, 4](x, out)
    assert_same(out, reference.log_sum_exp(x, axis=1))
