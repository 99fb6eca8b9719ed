"""Sparse transitions of the chain and path functions (spchain/_sparse_chain.py,
spchain/kernels/cpu/sparse_chain.py): equal to the dense chain with ``-inf`` at absent entries."""

import numpy as np
import pytest
import scipy.sparse

import spchain as sc
from positional import chain_logsumexp_backward, chain_logsumexp_forward, viterbi_backward
from spchain.chain import viterbi_forward
from spchain.paths import ENTROPY, PATH_SCORE


def outputs_and_grads(op, args, weight, needs=(True, True, True)):
    """``(outputs, gradients)`` of the array-level ``op`` at ``args``, the incoming gradient
    ``weight``: one ``prepare``, its forward and its backward."""
    problem = op.prepare(*args)
    outputs, saved = op.forward(problem)
    return outputs, op.backward(problem, saved, (weight,), needs).ordered()


def sparse_trans(rng, c, density=0.4, fmt="csr", dtype=np.float64, minus_inf=True):
    """A random sparse log_trans and its dense twin (``-inf`` where absent); some stored
    entries are ``-inf``, some rows and columns empty."""
    mask = rng.random((c, c)) < density
    if c > 2:
        mask[1] = False  # a state with no successor
        mask[:, 2] = False  # a state with no predecessor
    values = rng.normal(size=(c, c))
    if minus_inf and mask.any():
        values[tuple(np.argwhere(mask)[0])] = -np.inf  # a stored -inf
    dense = np.where(mask, values, -np.inf).astype(dtype)
    rows, cols = np.nonzero(mask)
    matrix = scipy.sparse.coo_matrix((values[mask].astype(dtype), (rows, cols)), shape=(c, c)).asformat(fmt)
    return matrix, dense


def banded(c, width, dtype=np.float64, rng=None):
    """Left-to-right transitions: each state to itself and its ``width`` successors."""
    rows = np.repeat(np.arange(c), width + 1)
    cols = rows + np.tile(np.arange(width + 1), c)
    keep = cols < c
    values = (rng.normal(size=keep.sum()) if rng is not None else np.full(keep.sum(), -np.log(width + 1)))
    matrix = scipy.sparse.csr_matrix((values.astype(dtype), (rows[keep], cols[keep])), shape=(c, c))
    return matrix, np.where(matrix.toarray() != 0, matrix.toarray(), -np.inf).astype(dtype)


def values_of(matrix, dense_grad):
    """A dense gradient at the stored entries of ``matrix``, in its CSR order."""
    csr = matrix.tocsr()
    rows = np.repeat(np.arange(csr.shape[0]), np.diff(csr.indptr))
    return dense_grad[rows, csr.indices]


CASES = [  # (batch, v, c, lengths)
    ((3,), 5, 7, None),
    ((4,), 6, 5, [6, 1, 3, 2]),
    ((2, 3), 4, 9, None),
    ((), 3, 4, None),
    ((0,), 4, 3, None),
    ((3,), 1, 5, None),
    ((5,), 7, 1, [7, 2, 1, 5, 3]),
    ((2,), 11, 13, [11, 6]),
]


@pytest.mark.parametrize("batch, v, c, lengths", CASES)
@pytest.mark.parametrize("fmt", ["csr", "csc", "coo"])
def test_chain_functions_equal_the_dense_chain(rng, batch, v, c, lengths, fmt):
    x = rng.normal(size=batch + (v, c))
    x[(..., 0, 0)] = -np.inf
    init = rng.normal(size=c)
    matrix, dense = sparse_trans(rng, c, fmt=fmt)
    kw = {} if lengths is None else {"lengths": np.array(lengths)}
    np.testing.assert_allclose(sc.chain_logsumexp(x, matrix, init, **kw), sc.chain_logsumexp(x, dense, init, **kw),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sc.chain_marginals(x, matrix, init, **kw), sc.chain_marginals(x, dense, init, **kw),
                               rtol=1e-12, atol=1e-12)
    score, path = sc.viterbi(x, matrix, init, **kw)
    want_score, want_path = sc.viterbi(x, dense, init, **kw)
    np.testing.assert_array_equal(score, want_score)
    np.testing.assert_array_equal(path, want_path)


@pytest.mark.parametrize("batch, v, c, lengths", CASES)
def test_gradients_equal_the_dense_ones_at_the_stored_entries(rng, batch, v, c, lengths):
    x = rng.normal(size=batch + (v, c))
    init = rng.normal(size=c)
    matrix, dense = sparse_trans(rng, c)
    lengths = None if lengths is None else np.array(lengths)
    weight = rng.normal(size=batch)
    needs = (True, True, True)
    for forward, backward, grads in ((chain_logsumexp_forward, chain_logsumexp_backward, (weight,)),
                                     (viterbi_forward, viterbi_backward, (weight, None))):
        got = backward((x, matrix, init, lengths), forward(x, matrix, init, lengths), grads, needs)
        want = backward((x, dense, init, lengths), forward(x, dense, init, lengths), grads, needs)
        assert scipy.sparse.isspmatrix_csr(got[1]) and got[1].shape == (c, c)
        np.testing.assert_array_equal(got[1].indptr, matrix.indptr)
        np.testing.assert_array_equal(got[1].indices, matrix.indices)
        np.testing.assert_allclose(got[1].data, values_of(matrix, want[1]), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got[2], want[2], rtol=1e-10, atol=1e-12)


def test_value_gradient_is_a_finite_difference(rng):
    x = rng.normal(size=(3, 6, 5))
    matrix, _ = sparse_trans(rng, 5, density=0.6, minus_inf=False)
    results = chain_logsumexp_forward(x, matrix)
    grad = chain_logsumexp_backward((x, matrix, None, None), results, (np.ones(3),), (False, True, False))[1]
    eps = 1e-6
    for q in range(matrix.nnz):
        up, down = matrix.copy(), matrix.copy()
        up.data[q] += eps
        down.data[q] -= eps
        numeric = (sc.chain_logsumexp(x, up).sum() - sc.chain_logsumexp(x, down).sum()) / (2 * eps)
        assert abs(grad.data[q] - numeric) < 1e-6


@pytest.mark.gpu
def test_kbest_of_a_sparse_chain_on_the_gpu_runs_on_its_entries_and_equals_the_cpu_s(rng, monkeypatch):
    import cupy as cp
    import cupyx.scipy.sparse

    from spchain import _sparse_chain

    def densified(chain):
        raise AssertionError("chain_kbest densified the sparse log_trans")

    monkeypatch.setattr(_sparse_chain, "densified", densified)
    x, init = rng.normal(size=(3, 6, 5)), rng.normal(size=5)
    matrix, _ = sparse_trans(rng, 5, density=0.5)
    lengths = np.array([6, 1, 4])
    want = sc.chain_kbest(x, matrix, init, k=3, lengths=lengths)
    got = sc.chain_kbest(cp.asarray(x), cupyx.scipy.sparse.csr_matrix(matrix), cp.asarray(init), k=3,
                         lengths=cp.asarray(lengths))
    np.testing.assert_allclose(cp.asnumpy(got[0]), want[0], rtol=1e-12)
    np.testing.assert_array_equal(cp.asnumpy(got[1]), want[1])


@pytest.mark.parametrize("batch, v, c, lengths", CASES)
def test_path_functions_equal_the_dense_chain(rng, batch, v, c, lengths):
    x = rng.normal(size=batch + (v, c))
    init = rng.normal(size=c)
    matrix, dense = sparse_trans(rng, c, density=0.7)
    lengths = None if lengths is None else np.array(lengths)
    kw = {} if lengths is None else {"lengths": lengths}
    np.testing.assert_allclose(sc.chain_entropy(x, matrix, init, **kw), sc.chain_entropy(x, dense, init, **kw),
                               rtol=1e-12, atol=1e-12)
    got, want = (sc.chain_kbest(x, t, init, k=3, **kw) for t in (matrix, dense))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    got, want = (sc.chain_sample(x, t, init, num_samples=2, seed=5, **kw) for t in (matrix, dense))
    np.testing.assert_array_equal(got, want)
    path = np.maximum(sc.viterbi(x, dense, init, **kw)[1], 0)  # any path, possible or not
    np.testing.assert_array_equal(sc.chain_path_score(x, matrix, init, path, **kw),
                                  sc.chain_path_score(x, dense, init, path, **kw))
    weight = rng.normal(size=batch)
    for op, args in ((ENTROPY, (x, matrix, init, lengths)), (PATH_SCORE, (x, matrix, init, path, lengths))):
        dense_args = tuple(dense if a is matrix else a for a in args)
        _, got = outputs_and_grads(op, args, weight)
        _, want = outputs_and_grads(op, dense_args, weight)
        np.testing.assert_allclose(got[1].data, values_of(matrix, want[1]), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=1e-12)


def test_left_to_right_band_float32_and_long_chain(rng):
    matrix, dense = banded(31, 7, np.float32, rng)
    x = rng.normal(size=(4, 300, 31)).astype(np.float32)
    got, want = sc.chain_logsumexp(x, matrix), sc.chain_logsumexp(x, dense)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(sc.chain_marginals(x, matrix), sc.chain_marginals(x, dense), atol=1e-5)
    np.testing.assert_array_equal(sc.viterbi(x, matrix)[1], sc.viterbi(x, dense)[1])


def test_plus_inf_and_all_minus_inf_values_equal_the_dense_chain(rng):
    x = rng.normal(size=(3, 4, 4))
    matrix, dense = sparse_trans(rng, 4, density=0.8, minus_inf=False)
    matrix.data[1] = np.inf
    dense = np.where(matrix.toarray() != 0, matrix.toarray(), -np.inf)
    np.testing.assert_array_equal(sc.chain_logsumexp(x, matrix), sc.chain_logsumexp(x, dense))
    np.testing.assert_array_equal(sc.viterbi(x, matrix)[1], sc.viterbi(x, dense)[1])
    matrix.data[:] = -np.inf
    assert (sc.chain_logsumexp(x, matrix) == -np.inf).all()
    assert (sc.viterbi(x, matrix)[1] == -1).all()
    empty = scipy.sparse.csr_matrix((4, 4))
    assert (sc.chain_logsumexp(x, empty) == -np.inf).all()
    np.testing.assert_array_equal(sc.chain_logsumexp(x[:, :1], empty), sc.chain_logsumexp(x[:, :1], np.zeros((4, 4))))


def test_the_callers_matrix_is_not_written(rng):
    matrix, _ = sparse_trans(rng, 6)
    before = matrix.copy()
    x = rng.normal(size=(2, 5, 6))
    results = chain_logsumexp_forward(x, matrix)
    chain_logsumexp_backward((x, matrix, None, None), results, (np.ones(2),), (True, True, False))
    for name in ("data", "indices", "indptr"):
        np.testing.assert_array_equal(getattr(matrix, name), getattr(before, name))


@pytest.mark.parametrize("trans, error, match", [
    (scipy.sparse.csr_matrix(np.ones((3, 4))), ValueError, r"log_trans must end in \(c, c\) = \(4, 4\)"),
    (scipy.sparse.csr_matrix(np.ones((3, 3))), ValueError, r"log_trans must end in \(c, c\) = \(4, 4\)"),
    (scipy.sparse.csr_matrix((np.ones(2), np.array([1, 1]), np.array([0, 2, 2, 2, 2])), shape=(4, 4)),
     ValueError, r"log_trans stores the entry \(0, 1\) more than once"),
    (scipy.sparse.csr_matrix((np.ones(1), np.array([5]), np.array([0, 1, 1, 1, 1])), shape=(4, 4)),
     ValueError, "log_trans: indices holds 5"),
    (scipy.sparse.csr_matrix(np.ones((4, 4), np.int64)), TypeError, "log_trans has dtype int64"),
    (scipy.sparse.dia_matrix(np.ones((4, 4))), TypeError, "not DIA"),
])
def test_bad_sparse_transitions(trans, error, match):
    with pytest.raises(error, match=match):
        sc.chain_logsumexp(np.zeros((2, 3, 4)), trans)


@pytest.mark.parametrize("scale", [1.0, 300.0])  # 300: most scaled sums underflow, recomputed in log space
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_scaled_sweeps_equal_the_dense_chain_where_sums_underflow(rng, scale, dtype):
    """The CPU sweeps exponentiate the stored values once (spchain/kernels/cpu/sparse_chain_scaled.py);
    at scale 300 most scaled sums and gradient factors leave their range and the entries are
    recomputed in log space. Ragged lengths, an impossible chain, -inf emissions and values."""
    batch, v, c = 9, 7, 11
    x = (rng.normal(size=(batch, v, c)) * scale).astype(dtype)
    x[2, 1] = -np.inf  # an impossible chain
    x[3, 2, :4] = -np.inf
    matrix, dense = sparse_trans(rng, c, density=0.3, dtype=dtype)
    matrix.data *= scale
    dense = (dense * scale).astype(dtype)
    init = (rng.normal(size=c) * scale).astype(dtype)
    lengths = rng.integers(1, v + 1, batch)
    lengths[:3] = v
    weight = np.linspace(-0.5, 2.0, batch).astype(dtype)
    needs = (True, True, True)
    got_z, want_z = (chain_logsumexp_forward(x, t, init, lengths) for t in (matrix, dense))
    got = chain_logsumexp_backward((x, matrix, init, lengths), got_z, (weight,), needs)
    want = chain_logsumexp_backward((x, dense, init, lengths), want_z, (weight,), needs)
    tol = 2e-5 if dtype == np.float32 else 1e-11
    np.testing.assert_allclose(got_z[0], want_z[0], rtol=tol)
    assert got_z[0][2] == -np.inf
    assert got[1].dtype == dtype and got[0].dtype == dtype
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(got[2], want[2], rtol=tol, atol=tol)
    np.testing.assert_allclose(got[1].data, values_of(matrix, want[1]), rtol=tol, atol=tol * batch * v)


def test_nan_propagates_as_in_the_dense_chain(rng):
    x = rng.normal(size=(4, 5, 6))
    x[1, 2, 3] = np.nan
    matrix, dense = sparse_trans(rng, 6, density=0.6, minus_inf=False)
    got, want = sc.chain_logsumexp(x, matrix), sc.chain_logsumexp(x, dense)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[1]) and not np.isnan(got[[0, 2, 3]]).any()
    np.testing.assert_allclose(got[[0, 2, 3]], want[[0, 2, 3]], rtol=1e-12)
    matrix.data[0] = np.nan
    results = chain_logsumexp_forward(x[[0]], matrix)
    grads = chain_logsumexp_backward((x[[0]], matrix, None, None), results, (np.ones(1),), (True, True, False))
    assert np.isnan(results[0]).all() and np.isnan(grads[1].data).any()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("special", ["-inf", "nan", "+inf"])
def test_path_functions_on_the_stored_entries_equal_the_dense_chain(rng, dtype, special):
    """Every path function and gradient, ``-inf`` emissions and stored values, and a NaN or a
    ``+inf`` in a stored value and an emission, in float32 and float64."""
    batch, v, c = 5, 6, 7
    x = rng.normal(size=(batch, v, c)).astype(dtype)
    x[0, 2, :3] = -np.inf
    init = rng.normal(size=c).astype(dtype)
    matrix, _ = sparse_trans(rng, c, density=0.5, dtype=dtype)
    value = {"-inf": -np.inf, "nan": np.nan, "+inf": np.inf}[special]
    matrix.data[2] = value
    x[3, 4, 1] = value
    dense = np.full((c, c), -np.inf, dtype)
    rows = np.repeat(np.arange(c), np.diff(matrix.indptr))
    dense[rows, matrix.indices] = matrix.data
    lengths = np.array([6, 6, 2, 5, 1])
    kw = {"lengths": lengths}
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)
    if special == "+inf" and dtype == np.float64:
        # the +inf limit's expected scores carry 2**20 a term (_chain_limits.LIMIT), so the two
        # sweeps' roundings differ by 2**20 ulp of them: up to 2e-9 of the largest gradient
        # entry over 60 random chains
        tol["atol"] = 1e-8
    got, want = (sc.chain_entropy(x, t, init, **kw) for t in (matrix, dense))
    assert got.dtype == dtype
    np.testing.assert_allclose(got, want, **tol)
    got, want = (sc.chain_kbest(x, t, init, k=4, **kw) for t in (matrix, dense))
    # a NaN partial path goes on along the stored entries only (as in the sparse sweeps), in the
    # dense chain through the -inf ones too: the rows without NaN are equal
    same = ~np.isnan(want[0]).any(axis=0)
    assert not np.isnan(got[0][:, same]).any()
    np.testing.assert_array_equal(got[1][:, same], want[1][:, same])
    np.testing.assert_allclose(got[0][:, same], want[0][:, same], **tol)
    got, want = (sc.chain_sample(x, t, init, num_samples=50, seed=1, **kw) for t in (matrix, dense))
    np.testing.assert_array_equal(got, want)
    path = rng.integers(0, c, (batch, v))
    path[1] = np.maximum(sc.viterbi(x, dense, init, **kw)[1][1], 0)
    got, want = (sc.chain_path_score(x, t, init, path, **kw) for t in (matrix, dense))
    np.testing.assert_allclose(got, want, **tol)
    weight = rng.normal(size=batch).astype(dtype)
    for op, args in ((ENTROPY, (x, matrix, init, lengths)), (PATH_SCORE, (x, matrix, init, path, lengths))):
        dense_args = tuple(dense if a is matrix else a for a in args)
        (result,), got = outputs_and_grads(op, args, weight)
        (dense_result,), want = outputs_and_grads(op, dense_args, weight)
        rows = ~(np.isnan(np.asarray(result)) | np.isnan(np.asarray(dense_result)))
        if special != "nan":  # the value gradient sums over the rows, NaN ones included
            np.testing.assert_allclose(got[1].data, values_of(matrix, want[1]), **tol)
        np.testing.assert_allclose(got[0][rows], want[0][rows], **tol)


def test_path_functions_never_build_the_dense_matrix():
    """Peak memory of each path function (and gradient) on a banded 3000-state chain: far below
    the 72 MB of the dense (c, c) matrix (tracemalloc sees NumPy's allocations)."""
    import tracemalloc

    c = 3000
    matrix, _ = banded(c, 2)
    x = np.random.default_rng(0).normal(size=(2, 6, c))
    path = np.zeros((2, 6), np.int64)
    calls = {
        "entropy": lambda: outputs_and_grads(ENTROPY, (x, matrix, None, None), np.ones(2), (True, True, False)),
        "sample": lambda: sc.chain_sample(x, matrix, num_samples=3, seed=0),
        "kbest": lambda: sc.chain_kbest(x, matrix, k=2),
        "path score": lambda: outputs_and_grads(PATH_SCORE, (x, matrix, None, path, None), np.ones(2),
                                                (True, True, False)),
    }
    for name, call in calls.items():
        call()  # compiled, cached
        tracemalloc.start()
        call()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 8 * 2**20, f"{name}: peak {peak / 2**20:.1f} MiB"
