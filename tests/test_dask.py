"""The array API on Dask arrays (spchain/_dask.py, _dask_array.py, _dask_chain.py), computed on a
two-worker ``distributed.LocalCluster`` (its workers threads of this process, or processes: slow)
and compared with the in-memory results."""

import os
import signal
import time

import numpy as np
import pytest
import scipy.sparse

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import spchain as sc  # noqa: E402


@pytest.fixture(scope="module", params=["threads", pytest.param("processes", marks=pytest.mark.slow)])
def client(request):
    # a limit on thread workers would measure this whole process and pause them (so hang) at 80 %
    processes = request.param == "processes"
    with distributed.LocalCluster(n_workers=2, processes=processes, threads_per_worker=1, dashboard_address=None,
                                  memory_limit="2GiB" if processes else 0) as cluster, distributed.Client(cluster) as client:
        yield client


def chunked(a, chunks):
    return da.from_array(a, chunks=chunks)


def log_stochastic(rng, shape):
    return np.log(rng.dirichlet(np.ones(shape[-1]), size=shape[:-1]))


def test_results_are_lazy_dask_arrays_on_the_chunks_backend(rng):
    x = chunked(rng.normal(size=(4, 5, 3)), (2, 5, 3))
    out = sc.chain_logsumexp(x, np.zeros((3, 3)))
    assert isinstance(out, da.Array) and out.shape == (4,) and out.chunks == ((2, 2),)
    assert type(out._meta) is np.ndarray and out.dtype == np.float64
    score, path = sc.viterbi(x, np.zeros((3, 3)))
    assert score.shape == (4,) and path.shape == (4, 5) and path.dtype == np.int64


def _make_chunk(block_info=None):
    return np.full(block_info[None]["chunk-shape"], block_info[None]["chunk-location"][0], np.float32)


def test_each_chain_task_fuses_with_the_task_making_its_chunk():
    x = da.map_blocks(_make_chunk, chunks=((3, 3, 3), (5,), (4,)), dtype=np.float32)
    (optimized,) = dask.optimize(sc.chain_logsumexp(x, np.zeros((4, 4), np.float32), np.zeros(4, np.float32)))
    assert len(optimized.__dask_graph__().layers) == 1  # one fused task per chunk: x never moves between workers


CHAIN_CASES = {
    "shared": dict(x=(6, 9, 4), trans=(4, 4), init=None, lengths=False, chunks=(4, 9, 4)),
    "per-step, lengths": dict(x=(7, 9, 3), trans=(7, 8, 3, 3), init=(3,), lengths=True, chunks=(3, 9, 3)),
    "broadcast (n, t, v, c) with (1, t, v-1, c, c)": dict(x=(5, 2, 6, 3), trans=(1, 2, 5, 3, 3), init=(1, 2, 3),
                                                         lengths=True, chunks=(2, 1, 6, 3)),
    # one time chunk: the batch axis that only log_init and lengths have is in the result too
    "log_init (2, 5, c) over x (5, t, c)": dict(x=(5, 7, 3), trans=(3, 3), init=(2, 5, 3), lengths=True,
                                                chunks=(2, 7, 3)),
}


def chain_inputs(rng, spec):
    """``(x, log_trans, log_init, lengths, batch shape)`` of a ``CHAIN_CASES`` entry, with a ``-inf``."""
    x = rng.normal(size=spec["x"])
    x[0, ..., 1, 0] = -np.inf
    trans = log_stochastic(rng, spec["trans"])
    init = None if spec["init"] is None else rng.normal(size=spec["init"])
    batch = np.broadcast_shapes(spec["x"][:-2], spec["trans"][:-3 if len(spec["trans"]) > len(spec["x"]) else -2],
                                (spec["init"] or (0,))[:-1])
    lengths = rng.integers(1, spec["x"][-2] + 1, batch) if spec["lengths"] else None
    return x, trans, init, lengths, batch


def batch_chunks(spec, batch):
    """Chunks of a batch-shaped array: ``x``'s batch chunks, right-aligned (axes only the other inputs have: whole)."""
    return (-1,) * (len(batch) - len(spec["x"]) + 2) + spec["chunks"][:-2]


def assert_same_results(got, want):
    """Paths bit for bit; scores to round-off (a chunk may take the other sweep)."""
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-13)
        else:
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("case", CHAIN_CASES)
def test_batch_chunks_equal_the_in_memory_result(client, rng, case):
    spec = CHAIN_CASES[case]
    x, trans, init, lengths, batch = chain_inputs(rng, spec)
    dx = chunked(x, spec["chunks"])
    dlengths = None if lengths is None else chunked(lengths, batch_chunks(spec, batch))
    got = client.compute([sc.chain_logsumexp(dx, trans, init, lengths=dlengths),
                          sc.chain_marginals(dx, trans, init, lengths=dlengths),
                          *sc.viterbi(dx, trans, init, lengths=dlengths)], sync=True)
    want = [sc.chain_logsumexp(x, trans, init, lengths=lengths), sc.chain_marginals(x, trans, init, lengths=lengths),
            *sc.viterbi(x, trans, init, lengths=lengths)]
    assert_same_results(got, want)


@pytest.mark.parametrize("case", CHAIN_CASES)
def test_path_functions_on_batch_chunks_equal_the_in_memory_results(client, rng, case):
    spec = CHAIN_CASES[case]
    x, trans, init, lengths, batch = chain_inputs(rng, spec)
    path = rng.integers(0, spec["x"][-1], batch + spec["x"][-2:-1])
    time_chunked = spec["chunks"][:-2] + (4,) + spec["chunks"][-1:]      # gathered into one chunk
    dx, dpath = chunked(x, time_chunked), chunked(path, batch_chunks(spec, batch) + spec["chunks"][-2:-1])
    dlengths = None if lengths is None else chunked(lengths, batch_chunks(spec, batch))
    got = client.compute([sc.chain_entropy(dx, trans, init, lengths=dlengths),
                          sc.chain_path_score(dx, trans, init, dpath, lengths=dlengths),
                          *sc.chain_kbest(dx, trans, init, k=3, lengths=dlengths)], sync=True)
    want = [sc.chain_entropy(x, trans, init, lengths=lengths), sc.chain_path_score(x, trans, init, path, lengths=lengths),
            *sc.chain_kbest(x, trans, init, k=3, lengths=lengths)]
    assert_same_results(got, want)


def test_samples_on_batch_chunks_follow_the_posterior_and_repeat_for_a_seed(client, rng):
    x = rng.normal(size=(6, 5, 3))
    trans = log_stochastic(rng, (3, 3))
    trans[0, 2] = -np.inf                               # a transition no path takes
    lengths = np.array([5, 1, 3, 4, 5, 2])
    dx = chunked(x, (2, 2, 3))
    draws = sc.chain_sample(dx, trans, lengths=lengths, num_samples=4000, seed=7)
    assert draws.shape == (4000, 6, 5) and draws.dtype == np.int64 and draws.chunks[1] == (2, 2, 2)
    first, again = client.compute([draws, draws], sync=True)
    np.testing.assert_array_equal(first, again)           # a rerun task (a lost worker) draws the same paths
    assert not np.array_equal(first, sc.chain_sample(dx, trans, lengths=lengths, num_samples=4000, seed=8).compute())
    inside = np.arange(5) < lengths[:, None]
    assert ((first >= 0) == inside).all()
    steps = (first[..., :-1] == 0) & (first[..., 1:] == 2) & inside[:, 1:]
    assert not steps.any()
    frequencies = (first[..., None] == np.arange(3)).mean(axis=0)
    np.testing.assert_allclose(frequencies, sc.chain_marginals(x, trans, lengths=lengths), atol=0.04)


def test_path_functions_reject_bad_arguments_when_the_graph_is_built(rng):
    x = chunked(rng.normal(size=(4, 5, 3)), (2, 5, 3))
    with pytest.raises(ValueError, match="k must be >= 1"):
        sc.chain_kbest(x, np.zeros((3, 3)), k=0)
    with pytest.raises(TypeError, match="seed must be a non-negative int"):
        sc.chain_sample(x, np.zeros((3, 3)), seed=np.random.default_rng(0))
    with pytest.raises(ValueError, match="batch shapes do not broadcast"):
        sc.chain_path_score(x, np.zeros((3, 3)), None, np.zeros((3, 5), np.int64))


def test_sparse_transitions_run_batch_parallel_and_equal_the_in_memory_results(client, rng):
    c = 6
    log_trans = scipy.sparse.random(c, c, density=0.5, format="csr", random_state=2)
    log_trans.data = np.log(log_trans.data)
    x = rng.normal(size=(8, 7, c))
    lengths = rng.integers(1, 8, 8)
    dx = chunked(x, (3, 3, c))                         # batch and time chunks
    got = client.compute([sc.chain_logsumexp(dx, log_trans, lengths=lengths),
                          sc.chain_marginals(dx, log_trans, lengths=lengths),
                          sc.viterbi(dx, log_trans, lengths=lengths)[1],
                          sc.chain_entropy(dx, log_trans, lengths=lengths)], sync=True)
    want = [sc.chain_logsumexp(x, log_trans, lengths=lengths), sc.chain_marginals(x, log_trans, lengths=lengths),
            sc.viterbi(x, log_trans, lengths=lengths)[1], sc.chain_entropy(x, log_trans, lengths=lengths)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_marginals_of_a_broadcast_x_sum_over_the_chunks(client, rng):
    x = rng.normal(size=(1, 6, 3))                      # one x for 5 transition matrices
    trans = log_stochastic(rng, (5, 3, 3))
    got = sc.chain_marginals(chunked(x, (1, 6, 3)), chunked(trans, (2, 3, 3))).compute()
    np.testing.assert_allclose(got, sc.chain_marginals(x, trans), rtol=1e-13)
    assert got.shape == (1, 6, 3)


@pytest.mark.parametrize("per_step", [False, True])
def test_time_chunks_match_one_sweep_of_a_long_chain(client, rng, per_step):
    v, c = 10**4, 3
    x = rng.normal(size=(2, v, c))
    trans = log_stochastic(rng, (1, v - 1, c, c) if per_step else (c, c))
    trans[..., 2, 0] = -np.inf                          # a structural zero
    lengths = np.array([v, 6789])
    dx = chunked(x, (1, 1500, c))                      # 7 time chunks, uneven
    log_z, marginals = client.compute([sc.chain_logsumexp(dx, trans, lengths=lengths),
                                       sc.chain_marginals(dx, trans, lengths=lengths)], sync=True)
    np.testing.assert_allclose(log_z, sc.chain_logsumexp(x, trans, lengths=lengths), rtol=1e-12)
    np.testing.assert_allclose(marginals, sc.chain_marginals(x, trans, lengths=lengths), rtol=0, atol=1e-11)
    assert (marginals[1, 6789:] == 0).all()


def test_time_chunks_of_short_chains_with_lengths_and_init(rng):
    x = rng.normal(size=(5, 11, 4))
    x[1] = -np.inf                                      # an impossible chain
    trans, init = log_stochastic(rng, (1, 10, 4, 4)), rng.normal(size=(5, 4))
    lengths = np.array([1, 11, 3, 4, 9])
    dx = chunked(x, (2, 3, 4))
    got_z = sc.chain_logsumexp(dx, trans, init, lengths=lengths).compute(scheduler="sync")
    got_m = sc.chain_marginals(dx, trans, init, lengths=lengths).compute(scheduler="sync")
    np.testing.assert_allclose(got_z, sc.chain_logsumexp(x, trans, init, lengths=lengths), rtol=1e-13)
    np.testing.assert_allclose(got_m, sc.chain_marginals(x, trans, init, lengths=lengths), atol=1e-13)
    score, path = sc.viterbi(dx, trans, init, lengths=lengths)
    np.testing.assert_array_equal(path.compute(scheduler="sync"), sc.viterbi(x, trans, init, lengths=lengths)[1])


def test_products_equal_the_in_memory_results(client, rng):
    a, b = rng.normal(size=(6, 5, 4)), rng.normal(size=(1, 4, 7))
    a[0, 0] = -np.inf
    m = rng.normal(size=(3, 11, 4, 4))
    x, w = rng.normal(size=(10, 4, 3)), rng.normal(size=(4, 3, 5))
    rows, experts = rng.normal(size=(10, 3)), rng.normal(size=(3, 3, 5))
    s = scipy.sparse.random(8, 6, density=0.4, format="csr", random_state=1)
    dense, left, right = rng.normal(size=(6, 9)), rng.normal(size=(8, 3)), rng.normal(size=(6, 3))
    exact = client.compute([sc.logmatmul(chunked(a, (2, 3, 4)), b), *sc.maxmatmul(chunked(a, (2, 3, 4)), b),
                            sc.log_chain_product(chunked(m, (2, 11, 4, 4))),
                            sc.block_diag_matmul(chunked(x, (10, 2, 3)), chunked(w, (2, 3, 5)))], sync=True)
    for g, want in zip(exact, [sc.logmatmul(a, b), *sc.maxmatmul(a, b), sc.log_chain_product(m),
                               sc.block_diag_matmul(x, w)]):
        np.testing.assert_array_equal(g, want)
    # chunks that change a BLAS call's shape (columns of b, rows of x) agree to round-off
    close = client.compute([sc.logmatmul(a, chunked(b, (1, 4, 3))), sc.log_chain_product(chunked(m, (3, 4, 4, 4))),
                            sc.block_diag_matmul(chunked(x, (3, 4, 3)), w),
                            sc.grouped_matmul(chunked(rows, (4, 3)), experts, [3, 0, 7]),
                            sc.spmm(s, chunked(dense, (6, 4))), sc.spmm(s, chunked(dense[:, 0], 3)),
                            sc.spmm(da.from_array(s, chunks=(3, 6), asarray=False), dense)], sync=True)
    for g, want in zip(close, [sc.logmatmul(a, b), sc.log_chain_product(m), sc.block_diag_matmul(x, w),
                               sc.grouped_matmul(rows, experts, [3, 0, 7]), sc.spmm(s, dense), sc.spmm(s, dense[:, 0]),
                               sc.spmm(s, dense)]):
        np.testing.assert_allclose(g, want, rtol=1e-13, atol=1e-13)
    got = sc.sddmm(s, chunked(left, (3, 3)), right).compute()
    want = sc.sddmm(s, left, right)
    assert scipy.sparse.issparse(got) and got.nnz == want.nnz
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_allclose(got.data, want.data, rtol=1e-13)


def test_bad_input_fails_when_the_graph_is_built(rng):
    x = chunked(rng.normal(size=(4, 5, 3)), (2, 5, 3))
    with pytest.raises(ValueError, match="log_trans must end in"):
        sc.chain_logsumexp(x, np.zeros((4, 4)))
    with pytest.raises(ValueError, match="batch shapes do not broadcast"):
        sc.chain_logsumexp(x, np.zeros((3, 3, 3)))
    with pytest.raises(TypeError, match="float32 and float64"):
        sc.chain_marginals(x.astype(np.float16), np.zeros((3, 3)))
    with pytest.raises(ValueError, match="do not match"):
        sc.logmatmul(x, chunked(np.zeros((4, 4, 4)), 2))
    with pytest.raises(ValueError, match="group_sizes sum to 9"):
        sc.grouped_matmul(chunked(np.ones((10, 3)), 4), np.ones((2, 3, 1)), [4, 5])
    with pytest.raises(ValueError, match="do not match"):
        sc.spmm(scipy.sparse.eye(3, format="csr"), chunked(np.ones((4, 2)), 2))
    for block in (None, (2, 2)):  # pruning needs the whole weight: in memory only
        with pytest.raises(TypeError, match=r"spchain.prune takes in-memory arrays, not a dask.array.Array"):
            sc.prune(chunked(np.ones((4, 4)), 2), 0.5, block=block)


@pytest.mark.parametrize("time_chunks", [5, 2], ids=["one time chunk", "time chunks"])
@pytest.mark.parametrize("bad", [0, 6])
@pytest.mark.parametrize("fn", [sc.chain_logsumexp, sc.chain_marginals])
def test_lengths_out_of_range_fail_in_the_task(rng, fn, bad, time_chunks):
    x = chunked(rng.normal(size=(4, 5, 3)), (2, time_chunks, 3))
    lengths = np.array([1, 2, bad, 1])
    for given in (lengths, chunked(lengths, 2)):
        out = fn(x, np.zeros((3, 3)), lengths=given)
        with pytest.raises(ValueError, match=f"{fn.__name__}: lengths must lie in 1..v = 1..5, got values from "):
            out.compute(scheduler="sync")


def _slow(block):
    time.sleep(0.25)
    return block


def test_a_worker_killed_mid_computation_gives_the_same_result(client, rng):
    if not client.cluster.processes:
        pytest.skip("kills a worker process")
    x = rng.normal(size=(16, 30, 4))
    trans = log_stochastic(rng, (4, 4))
    future = client.compute(sc.chain_marginals(chunked(x, (2, 10, 4)).map_blocks(_slow), trans))
    while not any(state == "memory" for state in client.run_on_scheduler(
            lambda dask_scheduler: [t.state for t in dask_scheduler.tasks.values()])):
        time.sleep(0.05)
    assert not future.done()
    victim, pid = next(iter(client.run(os.getpid).items()))
    os.kill(pid, signal.SIGKILL)
    np.testing.assert_allclose(future.result(timeout=120), sc.chain_marginals(x, trans), atol=1e-13)
    assert victim not in client.scheduler_info()["workers"]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("per_step", [False, True])
def test_time_chunked_marginals_with_plus_inf_equal_the_in_memory_result(rng, per_step, dtype):
    """Rows with a ``+inf`` term have the limit marginals (the paths through the most ``+inf``
    terms), whatever the chunking: the messages between chunks keep the offsets of their ``+inf``."""
    v, c = 7, 3
    x = rng.normal(size=(6, v, c))
    trans = log_stochastic(rng, (1, v - 1, c, c) if per_step else (c, c))
    x[0, 4, 1] = np.inf                                  # one +inf late in the chain
    x[1, 1, 0] = x[1, 5, 2] = np.inf                     # two, in different chunks
    x[2, 2, 1] = np.inf
    x[2, 3] = -np.inf                                    # on impossible paths only: no effect
    x[3, 0, 2] = np.inf                                  # at the first position
    trans[..., 0, 1] = np.inf                            # a +inf transition, for every row
    trans[..., 2, 2] = -np.inf
    init = rng.normal(size=c)
    lengths = np.array([v, v, v, 4, 2, 6])
    x, trans, init = x.astype(dtype), trans.astype(dtype), init.astype(dtype)
    want = sc.chain_marginals(x, trans, init, lengths=lengths)
    want_z = sc.chain_logsumexp(x, trans, init, lengths=lengths)
    assert np.isfinite(want).all() and np.isposinf(want_z).sum() == 5
    for time_chunks in [(1,) * v, (2, 5), (1, 2, 4), (3, 3, 1), (6, 1)]:
        dx = chunked(x, (2, time_chunks, c))
        got, got_z = dask.compute(sc.chain_marginals(dx, trans, init, lengths=lengths),
                                  sc.chain_logsumexp(dx, trans, init, lengths=lengths), scheduler="sync")
        assert got.dtype == got_z.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 if dtype == np.float32 else 1e-9,
                                   err_msg=f"time chunks {time_chunks}")
        np.testing.assert_allclose(got_z, want_z, rtol=1e-5 if dtype == np.float32 else 1e-12)


def test_time_chunked_marginals_of_a_nan_chain_and_of_no_chain_equal_the_in_memory_result():
    """A chain that reads a NaN has NaN marginals at every position, also in a time chunk past
    its length (which gave 0: the answer hung on the chunking); an empty batch gives an empty
    result under time chunks (it raised NumPy's zero-size reduction error)."""
    x = np.zeros((2, 4, 2))
    x[0, 0, 0] = np.nan
    x[1, 3, 1] = np.nan  # past chain 1's length: not read
    trans, lengths = np.log(np.full((2, 2), 0.5)), np.array([2, 3])
    want = sc.chain_marginals(x, trans, lengths=lengths)
    assert np.isnan(want[0]).all() and not np.isnan(want[1]).any()
    for time_chunks in [(4,), (2, 2), (1, 1, 2), (3, 1)]:
        got = sc.chain_marginals(chunked(x, (1, time_chunks, 2)), trans, lengths=lengths).compute(scheduler="sync")
        np.testing.assert_array_equal(got, want)
    empty = np.zeros((0, 8, 3))
    got = sc.chain_marginals(chunked(empty, (1, 4, 3)), np.zeros((3, 3))).compute(scheduler="sync")
    assert got.shape == (0, 8, 3)


def test_sparse_products_with_coo_duplicates_and_bsr_operands_equal_the_in_memory_ones():
    """A COO pattern's duplicate entries stay separate under Dask (they were added up), and BSR
    operands work with Dask arrays as in memory: a BSR result for a BSR pattern (a CSR came
    back), products by a BSR ``a`` as a SciPy object or a tuple (they raised)."""
    a, b = np.array([[1.0, 2.0], [3.0, 4.0]]), np.eye(2)
    coo = scipy.sparse.coo_array(([1.0, 1.0, 1.0], ([0, 0, 1], [1, 1, 0])), shape=(2, 2))  # (0, 1) twice
    got, want = sc.sddmm(coo, chunked(a, (1, 2)), b).compute(scheduler="sync"), sc.sddmm(coo, a, b)
    assert got.nnz == want.nnz == 3
    np.testing.assert_array_equal(got.data, want.data)
    bsr = scipy.sparse.bsr_array(np.kron(np.eye(2), np.ones((2, 2))), blocksize=(2, 2))
    left, right = np.arange(8.0).reshape(4, 2), np.ones((4, 2))
    got, want = sc.sddmm(bsr, chunked(left, (2, 1)), right).compute(scheduler="sync"), sc.sddmm(bsr, left, right)
    assert got.format == "bsr" and got.data.shape == want.data.shape
    np.testing.assert_array_equal(got.toarray(), want.toarray())
    for operand in (bsr, ((bsr.data, bsr.indices, bsr.indptr), bsr.shape)):
        for dense in (left, left[:, 0]):
            got = sc.spmm(operand, chunked(dense, (2,) + (1,) * (dense.ndim - 1))).compute(scheduler="sync")
            np.testing.assert_array_equal(got, sc.spmm(operand, dense))
    with pytest.raises(TypeError, match="tuple"):
        sc.sddmm(((bsr.data, bsr.indices, bsr.indptr), bsr.shape), chunked(left, 2), right)
