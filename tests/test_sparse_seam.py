"""One prepared problem per call for ``sparse_linear`` (issue 21): a forward and its backward
validate the weight's structure once and prepare (transpose) it once, for CSR and BSR weights
alike, from the one array-level structure cache (spchain/_structures.py)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import spchain.torch as st  # noqa: E402
from spchain import _backend, _csr, _structures  # noqa: E402


def weights(kind):
    """``(values, indptr, indices, shape)`` of a small CSR or BSR weight, new index tensors
    (new to the structure cache: a reused address holds other contents, which it compares)."""
    indptr, indices = torch.tensor([0, 2, 2, 3]), torch.tensor([0, 2, 1 + torch.randint(0, 2, ()).item()])
    values = torch.randn(3, requires_grad=True) if kind == "csr" else torch.randn(3, 2, 2, requires_grad=True)
    r = 1 if kind == "csr" else 2
    return values, indptr, indices, (3 * r, 3 * r)


@pytest.fixture
def counts(monkeypatch):
    """Calls of the structure validation (``to_csr``, which ``to_bsr`` runs on the block grid)
    and of the transpose's build (``_group``)."""
    found = {"validated": 0, "transposed": 0}
    for name, key in (("to_csr", "validated"), ("_group", "transposed")):
        real = getattr(_csr, name)

        def counted(*args, real=real, key=key, **kwargs):
            found[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(_csr, name, counted)
    return found


@pytest.mark.parametrize("layer, kind", [(st.sparse_linear, "csr"), (st.sparse_linear, "bsr"),
                                         (st.block_sparse_linear, "bsr")], ids=["csr", "bsr", "block_sparse_linear"])
def test_one_structure_validation_per_forward_and_backward(counts, layer, kind):
    values, indptr, indices, shape = weights(kind)
    x = torch.randn(4, shape[1], requires_grad=True)
    layer(x, values, indptr, indices, shape).square().sum().backward()
    assert counts == {"validated": 1, "transposed": 1}
    layer(x, values, indptr, indices, shape).square().sum().backward()
    assert counts == {"validated": 1, "transposed": 1}, "a second call reuses the prepared structure"


@pytest.mark.parametrize("kind", ["csr", "bsr"])
def test_an_eager_backward_reuses_its_forwards_structure_without_a_lookup(monkeypatch, kind):
    """The eager route keeps the prepared problem: one cache lookup a forward and backward;
    the registered operators (here under torch.func) look the forward's structure up again."""
    values, indptr, indices, shape = weights(kind)
    x = torch.randn(4, shape[1], requires_grad=True)
    calls = []
    real = _structures.StructureCache.lookup
    monkeypatch.setattr(_structures.StructureCache, "lookup",
                        lambda self, *a, **k: calls.append(k.get("key_arrays")) or real(self, *a, **k))
    st.sparse_linear(x, values, indptr, indices, shape).square().sum().backward()
    assert calls == [None]
    calls.clear()
    grads = torch.func.grad(lambda v: st.sparse_linear(x, v, indptr, indices, shape).square().sum())(values.detach())
    assert len(calls) == 2 and calls[1] is not None
    torch.testing.assert_close(grads, values.grad)


@pytest.mark.parametrize("kind", ["csr", "bsr"])
def test_sparse_linear_takes_csr_and_bsr_weights(kind):
    values, indptr, indices, shape = weights(kind)
    x = torch.randn(2, 5, shape[1])
    y = st.sparse_linear(x, values, indptr, indices, shape)
    dense = st.SparseLinear.__new__(st.SparseLinear)  # the dense weight, through the layer's own helper
    torch.nn.Module.__init__(dense)
    dense._setup(shape[1], shape[0], indptr, indices, values.detach(), None)
    torch.testing.assert_close(y, x @ dense.weight.T)


def test_one_cache_serves_sparse_linear_and_a_sparse_log_trans(counts, monkeypatch):
    """The chain functions find a structure by content (SciPy copies a matrix's index arrays
    into its own dtype), also one that ``sparse_linear`` validated: one validation in all."""
    import scipy.sparse

    import spchain

    cache = _structures.StructureCache()
    monkeypatch.setattr(_structures, "STRUCTURES", cache)
    values, indptr, indices, shape = weights("csr")
    st.sparse_linear(torch.randn(2, 3), values, indptr, indices, shape)
    log_trans = scipy.sparse.csr_matrix((values.detach().numpy(), indices.numpy(), indptr.numpy()), shape=shape)
    assert log_trans.indices.dtype == np.int32 and indices.dtype == torch.int64  # SciPy's own copies
    x = np.random.default_rng(0).normal(size=(2, 5, 3))
    first = spchain.chain_logsumexp(x, log_trans)
    again = scipy.sparse.csr_matrix((log_trans.data, log_trans.indices.copy(), log_trans.indptr.copy()), shape=shape)
    np.testing.assert_array_equal(spchain.chain_logsumexp(x, again), first)
    assert counts["validated"] == 1 and len(cache) == 1


def test_a_stream_of_new_log_trans_structures_keeps_the_cache_bounded(monkeypatch):
    """Each new structure enters the one cache; the oldest leave it, and what was kept on them
    (the chain's transposed structure) goes with them: nothing else holds them."""
    import gc
    import weakref

    import scipy.sparse

    import spchain

    monkeypatch.setattr(_structures, "STRUCTURES", _structures.StructureCache(size=4))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 6))
    gone = []
    for _ in range(12):
        log_trans = scipy.sparse.random(6, 6, density=0.5, format="csr", random_state=rng)
        spchain.chain_logsumexp(x, log_trans)
        entry = next(reversed(_structures.STRUCTURES._entries.values()))
        gone.append((weakref.ref(entry), weakref.ref(entry.__dict__["_kept"]["sparse_chain"])))
    gc.collect()
    assert len(_structures.STRUCTURES) == 4
    assert [s() is None and k() is None for s, k in gone] == [True] * 8 + [False] * 4


@pytest.mark.parametrize("rows", [3, 9000], ids=["compared as bytes", "compared by memcmp"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_a_lookup_rebuilds_after_any_change_of_the_index_arrays_contents(rows, dtype):
    """The same arrays changed in place (one index, the last pointer) validate and rebuild;
    the same contents in a new array of another dtype find the cached entry; on both sides
    of the size up to which the cache compares bytes."""
    cache = _structures.StructureCache()
    indptr, indices = np.arange(rows + 1, dtype=dtype), np.zeros(rows, dtype)
    assert (_structures._BYTES < indices.nbytes) == (rows == 9000)
    first, _ = cache.lookup(_backend.NUMPY, (indptr, indices), (rows, 2), "t")
    assert cache.lookup(_backend.NUMPY, (indptr, indices), (rows, 2), "t")[0] is first
    indices[-1] = 1
    second, _ = cache.lookup(_backend.NUMPY, (indptr, indices), (rows, 2), "t")
    assert second is not first and second.indices[-1] == 1
    indptr[-1] -= 1  # the last row emptied: the entry before it holds it
    third, _ = cache.lookup(_backend.NUMPY, (indptr, indices[:-1].copy()), (rows, 2), "t")
    assert third is not second and third.nnz == rows - 1
    other = np.int64 if dtype == np.int32 else np.int32
    again = cache.lookup(_backend.NUMPY, (indptr.astype(other), indices[:-1].astype(other)), (rows, 2), "t",
                         by_content=True)[0]
    assert again is third


def test_a_repeated_entry_of_a_log_trans_raises_at_every_call(monkeypatch):
    import scipy.sparse

    import spchain

    monkeypatch.setattr(_structures, "STRUCTURES", _structures.StructureCache())
    log_trans = scipy.sparse.csr_matrix((np.zeros(2), np.array([1, 1]), np.array([0, 2, 2])), shape=(2, 2))
    for _ in range(2):  # the structure is cached, its check kept only once it passes
        with pytest.raises(ValueError, match=r"stores the entry \(0, 1\) more than once"):
            spchain.chain_logsumexp(np.zeros((3, 2)), log_trans)


def test_a_column_major_x_is_read_in_place_and_a_stack_of_layers_copies_no_activation(monkeypatch):
    """``y`` of a sparse layer is the transposed view of what the kernel wrote: the next layer
    takes it as it is (no contiguous copy at the seam, no transpose), with the same values and
    gradients as a row-major ``x`` (which the forward does not transpose either)."""
    from spchain.kernels import cpu

    torch.manual_seed(0)
    first, second = st.SparseLinear(64, 48, sparsity=0.8), st.SparseLinear(48, 32, sparsity=0.8)
    x = torch.randn(40, 64, requires_grad=True)
    y = first(x)
    assert not y.is_contiguous() and y.t().is_contiguous()  # the kernel's layout, transposed
    transposes = []
    real = cpu.sparse.transpose
    monkeypatch.setattr(cpu.sparse, "transpose", lambda *a: (transposes.append(1), real(*a))[1])
    z = second(y)
    assert transposes == []
    want = second(y.contiguous())
    assert transposes == [], "a row-major x is read as it is, its tiles transposed into the kernel's buffer"
    torch.testing.assert_close(z, want, rtol=0, atol=0)
    (grad_in,) = torch.autograd.grad(z.square().sum(), y, retain_graph=True)
    (grad_want,) = torch.autograd.grad(want.square().sum(), y)
    torch.testing.assert_close(grad_in, grad_want)


def test_the_forward_hands_its_backward_the_cached_structure_without_a_copy_or_a_comparison(monkeypatch):
    """The forward leaves the cache's private index arrays for its backward (no copy per call);
    the backward's lookup of them recognises them by address and compares nothing (O(nnz)
    saved twice a step)."""
    from spchain import sparse as S

    cache = _structures.StructureCache()
    monkeypatch.setattr(_structures, "STRUCTURES", cache)
    values, indptr, indices, shape = weights("csr")
    x = np.ones((4, shape[1]), np.float32)
    _, saved = S.LINEAR.forward(S.LINEAR.prepare(x, values.detach().numpy(), indptr.numpy(), indices.numpy(), shape,
                                                 None))
    ran_indptr, ran_indices = saved.indptr, saved.indices
    structure, _ = cache.lookup(_backend.NUMPY, (indptr.numpy(), indices.numpy()), shape, "t")
    assert ran_indptr is structure.indptr and ran_indices is structure.indices

    class Uncomparable(np.ndarray):
        def __eq__(self, other):
            raise AssertionError("compared")

    own = (ran_indptr.view(Uncomparable), ran_indices.view(Uncomparable))
    assert cache.lookup(_backend.NUMPY, own, shape, "t", key_arrays=(indptr.numpy(), indices.numpy()))[0] is structure
    with pytest.raises(AssertionError, match="compared"):  # the caller's arrays are compared
        cache.lookup(_backend.NUMPY, (indptr.numpy().view(Uncomparable), indices.numpy()), shape, "t")


def test_a_row_major_x_and_gradient_are_read_as_they_are_by_forward_and_backward(monkeypatch):
    """A forward and backward of row-major ``x`` and output gradient transpose no whole array:
    the kernels read ``x``, ``x.T``'s gradient and ``x.T`` for the value gradient through their
    transposing buffers, and write the input gradient in rows, as ``x`` is."""
    from spchain.kernels import cpu

    torch.manual_seed(0)
    layer = st.SparseLinear(64, 48, sparsity=0.8)
    x = torch.randn(40, 64, requires_grad=True)
    grad_y = torch.randn(40, 48)
    transposes = []
    real = cpu.sparse.transpose
    monkeypatch.setattr(cpu.sparse, "transpose", lambda *a: (transposes.append(a[2].shape), real(*a))[1])
    layer(x).backward(grad_y)
    assert transposes == [] and x.grad.is_contiguous()
    w = layer.to_dense().weight.detach()
    torch.testing.assert_close(x.grad, grad_y @ w)
    rows = torch.repeat_interleave(torch.arange(48), layer.indptr.diff())
    torch.testing.assert_close(layer.weight_values.grad, (grad_y.T @ x.detach())[rows, layer.indices.long()])
