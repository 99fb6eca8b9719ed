"""spchain.torch's sparse layer (spchain/torch/linear.py, nn.py) and sparse products (sparse.py): results against dense masked float64
references, gradcheck, the transpose cache, SparseLinear and dynamic sparsity."""


import numpy as np
import pytest
import scipy.sparse

torch = pytest.importorskip("torch")

import reference  # noqa: E402
import spchain.torch as st  # noqa: E402
from spchain import _csr, _structures  # noqa: E402
from spchain.torch import linear as torch_linear  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def random_structure(rng, m, n, density, index_dtype=torch.int64, messy=False):
    """``(indptr, indices)`` tensors of an m x n CSR structure; ``messy`` adds duplicates and shuffles rows."""
    if messy:
        indptr, cols = reference.messy_csr(rng, m, n, density, duplicates=2)
    else:
        matrix = scipy.sparse.random(m, n, density=density, format="csr", random_state=rng)
        indptr, cols = matrix.indptr, matrix.indices
    return torch.tensor(indptr, dtype=index_dtype), torch.tensor(cols, dtype=index_dtype)


def dense_weight(values, indptr, indices, shape):
    """The float64 dense weight of a CSR structure (duplicates add up)."""
    rows, cols = reference.entries(indptr.cpu().numpy(), indices.cpu().numpy())
    w = np.zeros(shape)
    np.add.at(w, (rows, cols), values.detach().cpu().double().numpy())
    return w


def linear_reference(x, values, indptr, indices, shape, bias=None):
    w = dense_weight(values, indptr, indices, shape)
    y = x.detach().cpu().double().numpy() @ w.T
    return y if bias is None else y + bias.detach().cpu().double().numpy()


# --- sparse_linear: results and gradients --------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("messy", [False, True], ids=["canonical", "duplicates-unsorted"])
@pytest.mark.parametrize("leading", [(7,), (2, 3), ()], ids=["2d", "3d", "1d"])
def test_sparse_linear_matches_the_dense_masked_reference(rng, device, index_dtype, messy, leading):
    shape = (13, 11)
    indptr, indices = random_structure(rng, *shape, 0.3, index_dtype, messy)
    values = torch.tensor(rng.standard_normal(indices.numel()), dtype=torch.float32)
    bias = torch.randn(13)
    x = torch.tensor(rng.standard_normal((*leading, 11)), dtype=torch.float32)
    args = [t.to(device) for t in (x, values, indptr, indices)]
    y = st.sparse_linear(*args, shape, bias.to(device))
    assert y.shape == (*leading, 13) and y.dtype == torch.float32
    np.testing.assert_allclose(y.cpu().numpy(), linear_reference(x, values, indptr, indices, shape, bias),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("leading", [(7,), (2, 3), ()], ids=["2d", "3d", "1d"])
def test_inference_without_an_autograd_node_matches_the_differentiable_path(rng, leading):
    indptr, indices = random_structure(rng, 13, 11, 0.3, torch.int32, True)
    values = torch.randn(indices.numel())
    x = torch.randn(*leading, 11)
    plain = st.sparse_linear(x, values, indptr, indices, (13, 11))
    tracked = st.sparse_linear(x, values.requires_grad_(), indptr, indices, (13, 11))
    assert plain.grad_fn is None and tracked.grad_fn is not None
    torch.testing.assert_close(plain, tracked.detach(), rtol=0, atol=0)


def test_sparse_linear_gradients_match_the_dense_masked_product(rng):
    shape = (9, 14)
    indptr, indices = random_structure(rng, *shape, 0.4, messy=True)
    values = torch.tensor(rng.standard_normal(indices.numel()), requires_grad=True)
    values.data[0] = 0.0  # an explicit zero is trainable
    bias = torch.randn(9, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, 14, dtype=torch.float64, requires_grad=True)
    y = st.sparse_linear(x, values, indptr, indices, shape, bias)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    w = torch.tensor(dense_weight(values, indptr, indices, shape), requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    (x2 @ w.T + bias.detach()).backward(grad_y)
    torch.testing.assert_close(x.grad, x2.grad)
    rows, cols = reference.entries(indptr.numpy(), indices.numpy())
    torch.testing.assert_close(values.grad, w.grad[rows, cols])  # each duplicate gets the entry's gradient
    torch.testing.assert_close(bias.grad, grad_y.sum((0, 1)))
    assert values.grad[0] != 0


@pytest.mark.parametrize("messy", [False, True], ids=["canonical", "duplicates-unsorted"])
def test_gradcheck_float64_for_x_values_and_bias(rng, messy):
    shape = (6, 5)
    indptr, indices = random_structure(rng, *shape, 0.5, messy=messy)
    values = torch.tensor(rng.standard_normal(indices.numel()), requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)

    def f(x, values, bias):
        return st.sparse_linear(x, values, indptr, indices, shape, bias)

    assert torch.autograd.gradcheck(f, (x, values, bias), eps=1e-6, atol=1e-9, rtol=1e-7)
    assert torch.autograd.gradcheck(lambda x, v: st.sparse_linear(x.t(), v, indptr, indices, shape),
                                    (torch.randn(5, 4, dtype=torch.float64, requires_grad=True), values))


@pytest.mark.parametrize(
    "batch, out_features, in_features, density",
    [(0, 4, 3, 0.5), (3, 0, 4, 0.5), (3, 4, 0, 0.5), (3, 4, 5, 0.0), (2, 5, 3, 0.2)],
    ids=["batch-0", "out-0", "in-0", "nnz-0", "empty-rows"],
)
def test_empty_shapes_give_zero_results_and_zero_gradients(rng, batch, out_features, in_features, density):
    shape = (out_features, in_features)
    indptr, indices = random_structure(rng, *shape, density)
    values = torch.randn(indices.numel(), requires_grad=True)
    bias = torch.randn(out_features, requires_grad=True)
    x = torch.randn(batch, in_features, requires_grad=True)
    y = st.sparse_linear(x, values, indptr, indices, shape, bias)
    np.testing.assert_allclose(y.detach().numpy(), linear_reference(x, values, indptr, indices, shape, bias),
                               rtol=1e-6, atol=1e-6)
    y.sum().backward()
    assert x.grad.shape == x.shape and values.grad.shape == values.shape
    torch.testing.assert_close(bias.grad, torch.full_like(bias, float(batch)))


def test_mixed_float32_and_float64_computes_in_float64_and_returns_gradients_in_input_dtypes(rng):
    indptr, indices = random_structure(rng, 4, 3, 0.6)
    values = torch.randn(indices.numel(), dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    y = st.sparse_linear(x, values, indptr, indices, (4, 3), bias)
    assert y.dtype == torch.float64
    y.sum().backward()
    assert x.grad.dtype == torch.float32 and values.grad.dtype == torch.float64 and bias.grad.dtype == torch.float32


def test_nan_and_inf_propagate(rng):
    indptr, indices = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    x = torch.tensor([[np.nan, 1.0], [np.inf, 1.0]])
    y = st.sparse_linear(x, torch.tensor([1.0, 2.0]), indptr, indices, (2, 2))
    assert torch.isnan(y[0, 0]) and torch.isinf(y[1, 0]) and y[0, 1] == 2.0


def test_backward_twice_with_retain_graph_no_grad_and_unused_outputs(rng):
    indptr, indices = random_structure(rng, 5, 4, 0.5)
    values = torch.randn(indices.numel(), requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    y = st.sparse_linear(x, values, indptr, indices, (5, 4))
    y.sum().backward(retain_graph=True)
    first = values.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(values.grad, 2 * first)
    with torch.no_grad():
        assert st.sparse_linear(x, values, indptr, indices, (5, 4)).grad_fn is None
    x.grad = values.grad = None
    y = st.sparse_linear(x, values, indptr, indices, (5, 4))
    y[:, :2].sum().backward()  # the other outputs get zero gradients
    w = torch.tensor(dense_weight(values, indptr, indices, (5, 4)), dtype=torch.float32)
    torch.testing.assert_close(x.grad, torch.ones(3, 2) @ w[:2])


def test_only_the_needed_gradients_are_computed(rng, monkeypatch):
    indptr, indices = random_structure(rng, 5, 4, 0.5)
    values = torch.randn(indices.numel(), requires_grad=True)
    calls = []
    real = torch_linear._sparse.linear_backward
    monkeypatch.setattr(torch_linear._sparse, "linear_backward",
                        lambda *a: calls.append(a[-2:]) or real(*a))
    st.sparse_linear(torch.randn(3, 4), values, indptr, indices, (5, 4)).sum().backward()
    assert calls == [(False, True)]



def test_the_backward_reads_a_transposed_gradient_in_place_and_returns_rows(rng, monkeypatch):
    """The gradient of ``y`` (rows) reaches the backward as the column-major view of ``y.T``
    that autograd hands over (no torch copy on the way; the backward's transpose kernel reads
    it), and the input gradient of a row-major ``x`` comes back row-major (no copy by torch)."""
    indptr, indices = random_structure(rng, 5, 4, 0.5)
    values = torch.randn(indices.numel(), requires_grad=True)
    seen = []
    real = torch_linear._sparse.linear_backward
    monkeypatch.setattr(torch_linear._sparse, "linear_backward",
                        lambda *a: seen.append(a[3].flags.f_contiguous) or real(*a))
    x = torch.randn(3, 4, requires_grad=True)
    grad_y = torch.randn(3, 5)
    st.sparse_linear(x, values, indptr, indices, (5, 4)).backward(grad_y)
    assert seen == [True] and x.grad.is_contiguous()
    w = torch.sparse_csr_tensor(indptr, indices, values.detach(), (5, 4)).to_dense()
    torch.testing.assert_close(x.grad, grad_y @ w)

# --- the structure cache ----------------------------------------------------------------------------


def test_the_transpose_is_built_once_per_structure_and_rebuilt_after_in_place_changes(rng, monkeypatch):
    indptr, indices = random_structure(rng, 6, 5, 0.5)
    values = torch.randn(indices.numel(), requires_grad=True)
    built = []
    real = _csr._group  # sorts the entries by column: the transpose's one build step
    monkeypatch.setattr(_csr, "_group", lambda *a: built.append(1) or real(*a))
    x = torch.randn(2, 5, requires_grad=True)
    for _ in range(3):
        st.sparse_linear(x, values, indptr, indices, (6, 5)).sum().backward()
    assert len(built) == 1
    with torch.no_grad():
        indices[0] = (indices[0] + 1) % 5  # an in-place change bumps the version counter
    x.grad = values.grad = None
    y = st.sparse_linear(x, values, indptr, indices, (6, 5))
    y.sum().backward()
    assert len(built) == 2
    w = torch.tensor(dense_weight(values, indptr, indices, (6, 5)), dtype=torch.float32)
    torch.testing.assert_close(x.grad, torch.ones(2, 6) @ w)


def test_changing_the_structure_between_forward_and_backward_is_caught_by_autograd(rng):
    indptr, indices = random_structure(rng, 4, 4, 0.5)
    values = torch.randn(indices.numel(), requires_grad=True)
    y = st.sparse_linear(torch.randn(2, 4), values, indptr, indices, (4, 4))
    indices.add_(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("write", [
    lambda t, i, v: t.numpy().__setitem__(i, v),  # a NumPy view: no version bump
    lambda t, i, v: t.data.__setitem__(i, v),  # .data: no version bump either
], ids=["numpy-view", "data"])
@pytest.mark.parametrize("name, bad", [("indices", 10**8), ("indices", -1), ("indptr", 10**8)])
@pytest.mark.parametrize("shape", [(6, 6), (8200, 8)], ids=["small", "compared-by-memcmp"])  # index arrays over 32 KiB
def test_a_cached_structure_written_behind_autograd_s_back_is_validated_again(write, name, bad, shape):
    layer = st.SparseLinear(shape[1], shape[0], sparsity=0.5)
    x = torch.randn(3, shape[1], requires_grad=True)
    layer(x)
    write(getattr(layer, name), 1, bad)
    with pytest.raises(ValueError, match=f"{name} (holds|decreases|ends)"):
        layer(x)
    with torch.no_grad(), pytest.raises(ValueError, match=name):
        layer(x)


class _CountingOperator:
    """Counts the calls that reach the operator ``spchain::sparse_linear`` (its checks and
    ``prepare``) and those that the plan records on its kept structure."""

    def __init__(self, operator):
        self.operator, self.calls, self.recorded = operator, 0, 0

    def __call__(self, *args):
        self.calls += 1
        return self.operator(*args)

    def record(self, *args):
        self.recorded += 1
        return self.operator.record(*args)


def _forward_backward(layer, x, grad_y):
    """The layer's output and the gradients of ``x``, its values and its bias."""
    x = x.detach().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    y = layer(x)
    y.backward(grad_y)
    return y.detach(), x.grad, layer.weight_values.grad, None if layer.bias is None else layer.bias.grad


@pytest.mark.parametrize("block", [None, (2, 3)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["rows", "columns", "3-d", "empty"])
def test_the_cpu_takes_the_plan_and_gives_the_operator_s_bits(monkeypatch, block, bias, dtype, layout):
    torch.manual_seed(0)
    layer = st.SparseLinear(12, 6, bias=bias, sparsity=0.5, block=block, dtype=dtype)
    x = {"rows": torch.randn(5, 12), "columns": torch.randn(12, 5).t(), "3-d": torch.randn(2, 3, 12),
         "empty": torch.randn(0, 12)}[layout].to(dtype)
    grad_y = torch.randn(*x.shape[:-1], 6, dtype=dtype)
    args = (layer.weight_values, layer.indptr, layer.indices, (6, 12), layer.bias)
    with torch.no_grad():
        expected = st.sparse_linear(x, *args)  # the operator
    x_grad = x.detach().requires_grad_()
    expected_y = st.sparse_linear(x_grad, *args)
    expected_y.backward(grad_y)
    expected_grads = (x_grad.grad, layer.weight_values.grad, None if layer.bias is None else layer.bias.grad)
    counting = _CountingOperator(torch_linear._OPERATOR)
    monkeypatch.setattr(torch_linear, "_OPERATOR", counting)
    with torch.no_grad():
        y = layer(x)
        again = layer(x)  # the kept structure
    y_grad, *grads = _forward_backward(layer, x, grad_y)
    _, *grads_again = _forward_backward(layer, x, grad_y)
    assert counting.calls == 0 and counting.recorded == 2
    assert torch.equal(y, expected) and torch.equal(again, expected) and y.dtype == dtype
    assert torch.equal(y_grad, expected_y.detach()) and y.shape == (*x.shape[:-1], 6)
    for got in (grads, grads_again):
        for g, e in zip(got, expected_grads):
            assert (g is None and e is None) or (torch.equal(g, e) and g.dtype == dtype)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "recording"])
def test_the_plan_compares_its_kept_structure_with_the_tensors_at_every_call(rng, grad):
    torch.manual_seed(0)
    layer = st.SparseLinear(6, 4, sparsity=0.5)
    x = torch.randn(3, 6)

    def check():
        expected = linear_reference(x, layer.weight_values, layer.indptr, layer.indices, (4, 6), layer.bias)
        with torch.set_grad_enabled(grad):
            y = layer(x)
        assert y.requires_grad == grad
        np.testing.assert_allclose(y.detach().numpy(), expected, rtol=1e-5, atol=1e-6)
        if grad:  # the backward differentiates the structure the forward ran on
            y.sum().backward()
            torch.testing.assert_close(layer.weight_values.grad, x.sum(0)[layer.indices])
            layer.weight_values.grad = None

    check()  # the plan keeps this structure
    layer.indices.numpy()[:] = (layer.indices.numpy() + 1) % 6  # written behind it: no version bump
    check()
    layer.indices = torch.flip(layer.indices, (0,))  # a new tensor
    check()
    with torch.no_grad():
        layer.weight_values.mul_(2)  # values are read at every call
    check()
    layer.indptr.numpy()[1] = 10**6
    with pytest.raises(ValueError, match="indptr"), torch.set_grad_enabled(grad):
        layer(x)


@pytest.mark.parametrize("block", [None, (2, 3)])
@pytest.mark.parametrize("layout", ["rows", "3-d", "empty"])
def test_a_layer_that_stores_every_entry_runs_torch_s_dense_product(monkeypatch, block, layout):
    # sparsity 0 (GradualPruning's dense start): the weight's values are the dense weight
    # (CSR) or its blocks, so the plan runs nn.Linear's GEMM; an unsorted or partial
    # structure returns to the sparse kernels, with the same results
    torch.manual_seed(0)
    layer = st.SparseLinear(12, 6, sparsity=0.0, block=block, dtype=torch.float64)
    x = {"rows": torch.randn(5, 12), "3-d": torch.randn(2, 3, 12), "empty": torch.randn(0, 12)}[layout].double()
    grad_y = torch.randn(*x.shape[:-1], 6, dtype=torch.float64)

    def expected():
        x_grad = x.detach().requires_grad_()
        values = layer.weight_values.detach().requires_grad_()
        bias = layer.bias.detach().requires_grad_()
        y = st.sparse_linear(x_grad, values, layer.indptr, layer.indices, (6, 12), bias)  # the operator
        y.backward(grad_y)
        return y.detach(), x_grad.grad, values.grad, bias.grad

    counting = _CountingOperator(torch_linear._OPERATOR)
    monkeypatch.setattr(torch_linear, "_OPERATOR", counting)
    want = expected()
    got = _forward_backward(layer, x, grad_y)
    assert counting.recorded == 0 and got[0].is_contiguous()  # the GEMM's rows, not the kernels' y.T
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # two stored entries (blocks) of the first row swap places: the same weight
        layer.indices[:2] = layer.indices[:2].flip(0)
        layer.weight_values[:2] = layer.weight_values[:2].flip(0)
    y, x_grad, values_grad, bias_grad = _forward_backward(layer, x, grad_y)
    assert counting.recorded == 1
    swapped = torch.tensor([1, 0, *range(2, values_grad.shape[0])])
    for g, e in zip((y, x_grad, values_grad[swapped], bias_grad), want):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_calls_the_plan_cannot_take_reach_the_operator():
    torch.manual_seed(0)
    layer = st.SparseLinear(6, 4, sparsity=0.5)
    args = (layer.weight_values, layer.indptr, layer.indices, (4, 6), layer.bias)
    plan = torch_linear.LinearPlan()
    x = torch.randn(3, 6)
    with torch.autograd.forward_ad.dual_level():  # forward mode: the operator's jvp
        assert plan(x, *args) is None
    with torch.no_grad():
        assert plan(x, *args) is not None
        assert plan(x.double(), *args) is None  # mixed dtypes: the operator promotes
        assert plan(x.to(torch.bfloat16), *args) is None
        assert plan(torch.randn(3, 5), *args) is None  # wrong shapes: the operator's error
        assert plan(x, layer.weight_values[:-1], *args[1:]) is None
        assert plan(x.to_sparse(), *args) is None
        with torch.autocast("cpu"):
            assert plan(x, *args) is None
        torch.testing.assert_close(layer(x.double()), layer(x).double())
        with pytest.raises(ValueError, match="last axis must be 6"):
            layer(torch.randn(3, 5))


def test_copies_of_a_layer_prepare_their_own_plan():
    import copy
    import io

    torch.manual_seed(0)
    layer = st.SparseLinear(6, 4, sparsity=0.5)
    x = torch.randn(3, 6)
    with torch.no_grad():
        y = layer(x)
    assert layer.__dict__.get("_plan") is not None
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        assert twin.__dict__.get("_plan") is None
        with torch.no_grad():
            assert torch.equal(twin(x), y)


def test_a_structure_changed_through_data_never_pairs_with_a_stale_transpose(rng):
    indptr, indices = random_structure(rng, 6, 6, 0.5)
    values = torch.randn(indices.numel(), requires_grad=True)
    x = torch.randn(3, 6, requires_grad=True)
    st.sparse_linear(x, values, indptr, indices, (6, 6)).sum().backward()
    indices.data[:] = (indices + 1) % 6  # moves every entry, without a version bump
    x.grad = values.grad = None
    y = st.sparse_linear(x, values, indptr, indices, (6, 6))
    y.sum().backward()
    w = torch.tensor(dense_weight(values, indptr, indices, (6, 6)), dtype=torch.float32)
    torch.testing.assert_close(y, x.detach() @ w.T)
    torch.testing.assert_close(x.grad, torch.ones(3, 6) @ w)


def test_the_backward_differentiates_the_structure_its_forward_ran_on(rng):
    indptr, indices = random_structure(rng, 5, 4, 0.5)
    values = torch.randn(indices.numel(), requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.tensor(dense_weight(values, indptr, indices, (5, 4)), dtype=torch.float32)
    y = st.sparse_linear(x, values, indptr, indices, (5, 4))
    indices.data[:] = (indices + 1) % 4  # autograd cannot see this one
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 5) @ w)


@pytest.mark.parametrize("layout", ["row-major", "column-major", "3-d"])
@pytest.mark.parametrize("changed", ["x", "values", "indices", "indptr"])
def test_inputs_changed_in_place_before_backward_raise_as_nn_linear_does(rng, layout, changed):
    layer = st.SparseLinear(4, 5, sparsity=0.5)
    x = {"row-major": torch.randn(3, 4), "column-major": torch.randn(4, 3).t(),
         "3-d": torch.randn(2, 3, 4)}[layout].requires_grad_()
    y = layer(x)
    with torch.no_grad():
        {"x": x, "values": layer.weight_values, "indices": layer.indices, "indptr": layer.indptr}[changed].mul_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_double_backward_raises_instead_of_a_silent_first_order_gradient(rng):
    indptr, indices = random_structure(rng, 5, 4, 0.5)
    values = torch.randn(indices.numel(), requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    y = st.sparse_linear(x, values, indptr, indices, (5, 4))
    with pytest.raises(RuntimeError, match=r"sparse_linear: double backward \(create_graph=True"):
        torch.autograd.grad(y.square().sum(), (x, values), create_graph=True)
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]]).to_sparse_csr()
    b = torch.ones(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"spmm: double backward \(create_graph=True"):
        torch.autograd.grad(st.spmm(a, b).square().sum(), b, create_graph=True)
    torch.autograd.grad(st.spmm(a, b).sum(), b)  # first order is fine


def test_the_cache_holds_the_most_recently_used_structures_only(rng, monkeypatch):
    monkeypatch.setattr(_structures, "STRUCTURES", _structures.StructureCache(size=2))
    structures = [random_structure(rng, 4, 4, 0.5) for _ in range(3)]
    for indptr, indices in structures:
        st.sparse_linear(torch.randn(2, 4), torch.randn(indices.numel()), indptr, indices, (4, 4))
    assert len(_structures.STRUCTURES) == 2
    built = []
    real = _csr._group  # sorts the entries by column: the transpose's one build step
    monkeypatch.setattr(_csr, "_group", lambda *a: built.append(1) or real(*a))
    for indptr, indices in (structures[2], structures[1], structures[0]):  # the first was dropped
        st.sparse_linear(torch.randn(2, 4), torch.randn(indices.numel()), indptr, indices, (4, 4))
    assert len(built) == 1 and len(_structures.STRUCTURES) == 2


def test_structure_cache_is_bounded_by_bytes_and_keeps_the_latest(rng, monkeypatch):
    structures = [random_structure(rng, 8, 8, 0.5) for _ in range(3)]

    def call(cache, indptr, indices):
        monkeypatch.setattr(_structures, "STRUCTURES", cache)
        x = torch.randn(2, 8, requires_grad=True)
        st.sparse_linear(x, torch.randn(indices.numel()), indptr, indices, (8, 8)).sum().backward()

    one = _structures.StructureCache()
    call(one, *structures[0])
    entry = one.nbytes
    assert entry >= 3 * structures[0][1].numel() * structures[0][1].element_size()  # indices, transpose, order
    two = _structures.StructureCache(budget=2 * entry + entry // 2)  # room for two of about that size
    for indptr, indices in structures:
        call(two, indptr, indices)
    assert len(two) == 2 and two.nbytes <= 2 * entry + entry // 2
    tiny = _structures.StructureCache(budget=0)  # the most recent one stays, whatever its size
    for indptr, indices in structures:
        call(tiny, indptr, indices)
    assert len(tiny) == 1 and tiny.nbytes > 0
    built = []
    real = _csr._group  # sorts the entries by column: the transpose's one build step
    monkeypatch.setattr(_csr, "_group", lambda *a: built.append(1) or real(*a))
    call(tiny, *structures[2])
    assert not built


def test_a_new_structure_at_a_reused_address_is_validated_not_taken_from_the_cache(rng):
    indptr, indices = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    x = torch.randn(3, 2)
    st.sparse_linear(x, torch.ones(2), indptr, indices, (2, 2))
    indices.numpy()[:] = [1, 0]  # what a new tensor at the same address would hold
    torch.testing.assert_close(st.sparse_linear(x, torch.ones(2), indptr, indices, (2, 2)), x.flip(1))
    indices.numpy()[0] = 2
    with pytest.raises(ValueError, match="indices holds 2"):
        st.sparse_linear(x, torch.ones(2), indptr, indices, (2, 2))


def test_many_forward_backward_calls_keep_memory_bounded(rss_growth, monkeypatch):
    monkeypatch.setattr(_structures, "STRUCTURES", _structures.StructureCache())
    layer = st.SparseLinear(256, 256, sparsity=0.9)
    x = torch.randn(64, 256, requires_grad=True)

    def step():
        x.grad = layer.weight_values.grad = layer.bias.grad = None
        layer(x).square().mean().backward()

    assert rss_growth(step, 300) < 16 * 2**20  # 300 steps would leak far more than this if anything stayed
    assert len(_structures.STRUCTURES) == 1


# --- bad input (docs/design.rst) -------------------------------------------------------------------


def valid_args(rng):
    indptr, indices = torch.tensor([0, 2, 3]), torch.tensor([0, 2, 1])
    return torch.randn(4, 3), torch.randn(3), indptr, indices, (2, 3)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda a: a.update(indptr=torch.tensor([0, 2, 1])), ValueError, r"indptr decreases at position 2"),
        (lambda a: a.update(indptr=torch.tensor([0, 3])), ValueError, r"indptr has length 2; expected 3"),
        (lambda a: a.update(indptr=torch.tensor([1, 2, 3])), ValueError, r"indptr starts at 1, not 0"),
        (lambda a: a.update(indptr=torch.tensor([0, 2, 2])), ValueError, r"indptr ends at 2 but there are 3"),
        (lambda a: a.update(indices=torch.tensor([0, 3, 1])), ValueError, r"indices holds 3, out of range"),
        (lambda a: a.update(indices=torch.tensor([0, -1, 1])), ValueError, r"indices holds -1, out of range"),
        (lambda a: a.update(indices=torch.tensor([0.0, 2.0, 1.0])), TypeError, r"indices has dtype float32"),
        (lambda a: a.update(indices=torch.tensor([True, False, True])), TypeError, r"indices has dtype bool"),
        (lambda a: a.update(values=torch.randn(2)), ValueError, r"values \(2,\) and indices \(3,\) must be 1-D"),
        (lambda a: a.update(x=torch.randn(4, 5)), ValueError, r"x has shape \(4, 5\) but the weight has shape \(2, 3\)"),
        (lambda a: a.update(shape=(2, -3)), ValueError, r"shape must be non-negative"),
        (lambda a: a.update(shape=(2.5, 3)), TypeError, r"shape\[0\] must be an int, not float \(2.5\)"),
        (lambda a: a.update(shape=(2, True)), TypeError, r"shape\[1\] must be an int, not a bool"),
        (lambda a: a.update(shape=None), ValueError, r"shape must be a pair of ints, got None"),
        (lambda a: a.update(bias=torch.randn(3)), ValueError, r"bias has shape \(3,\); expected \(2,\)"),
        (lambda a: a.update(x=torch.ones(4, 3, dtype=torch.int64)), TypeError, "int64"),
        (lambda a: a.update(values=torch.randn(3, device="meta")), ValueError, r"x is on cpu but values is on meta"),
    ],
    ids=["indptr-decreasing", "indptr-length", "indptr-start", "indptr-end", "index-too-large", "index-negative",
         "float-indices", "bool-indices", "values-length", "x-shape", "bad-shape", "float-shape",
         "bool-shape", "no-shape", "bias-shape", "int-x", "devices"],
)
def test_sparse_linear_bad_input(rng, change, error, message):
    x, values, indptr, indices, shape = valid_args(rng)
    args = {"x": x, "values": values, "indptr": indptr, "indices": indices, "shape": shape, "bias": None}
    change(args)
    with pytest.raises(error, match=message):
        st.sparse_linear(**args)


def test_sparse_linear_never_writes_to_its_inputs(rng):
    x, values, indptr, indices, shape = valid_args(rng)
    x = x.t().contiguous().t()  # column-major: crosses to NumPy without a copy
    saved = [t.clone() for t in (x, values, indptr, indices)]
    st.sparse_linear(x, values.requires_grad_(), indptr, indices, shape).sum().backward()
    for t, s in zip((x, values.detach(), indptr, indices), saved):
        torch.testing.assert_close(t, s)


# --- spmm, sddmm and prune for tensors ----------------------------------------------------------------


def messy_coo(rng, m, n):
    i = torch.tensor(rng.integers(0, [[m], [n]], (2, 12)))
    return torch.sparse_coo_tensor(i, torch.tensor(rng.standard_normal(12)), (m, n), check_invariants=True)  # uncoalesced


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_torch_spmm_matches_the_dense_product_and_differentiates_b(rng, layout):
    a = messy_coo(rng, 6, 5)
    a = {"coo": a, "csr": a.coalesce().to_sparse_csr(), "csc": a.coalesce().to_sparse_csc()}[layout]
    b = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    out = st.spmm(a, b)
    torch.testing.assert_close(out, a.to_dense() @ b)
    assert torch.autograd.gradcheck(lambda b: st.spmm(a, b), (b,))
    v = torch.randn(5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(st.spmm(a, v), a.to_dense() @ v)
    assert torch.autograd.gradcheck(lambda v: st.spmm(a, v), (v,))


def test_torch_spmm_bad_input(rng):
    a = messy_coo(rng, 3, 3).coalesce()
    with pytest.raises(TypeError, match="differentiates with respect to the dense operand only"):
        st.spmm(a.clone().requires_grad_(), torch.randn(3, 2))
    with pytest.raises(TypeError, match="not one of layout torch.strided"):
        st.spmm(torch.randn(3, 3), torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"shapes \(3, 3\) and \(4, 2\) do not match"):
        st.spmm(a, torch.randn(4, 2))
    with pytest.raises(TypeError, match="b must be a dense tensor"):
        st.spmm(a, a)


@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_torch_spmm_values_changed_in_place_before_backward_raise(layout):
    dense = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 3.0], [0.0, 2.0, 0.0]])
    a = {"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "csc": dense.to_sparse_csc()}[layout]
    b = torch.ones(3, requires_grad=True)
    y = st.spmm(a, b)
    (a.values() if layout != "coo" else a._values()).mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_torch_spmm_non_contiguous_nan_retain_graph_no_grad_and_unused_outputs(rng):
    a = messy_coo(rng, 6, 5).coalesce().to_sparse_csr()
    dense = a.to_dense()
    for b in (torch.randn(3, 5, dtype=torch.float64).t(), torch.randn(5, 6, dtype=torch.float64)[:, ::2],
              torch.randn(5, 1, dtype=torch.float64).expand(5, 3)):
        torch.testing.assert_close(st.spmm(a, b), dense @ b)
    b = torch.randn(5, 3, dtype=torch.float64)
    b[0, 0], b[1, 1] = float("nan"), float("inf")
    # as in SciPy and torch.sparse: through stored entries only (an unstored zero times NaN adds nothing)
    torch.testing.assert_close(st.spmm(a, b), torch.sparse.mm(a.to_sparse_coo(), b), equal_nan=True)
    assert st.spmm(a, b).isnan().any()
    b = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y = st.spmm(a, b)
    y.sum().backward(retain_graph=True)
    first = b.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(b.grad, 2 * first)
    torch.testing.assert_close(first, dense.t() @ torch.ones(6, 3, dtype=torch.float64))
    with torch.no_grad():
        assert st.spmm(a, b).grad_fn is None
    b.grad = None
    st.spmm(a, b)[:2].sum().backward()  # the other rows get no incoming gradient
    torch.testing.assert_close(b.grad, dense[:2].t() @ torch.ones(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("m, k, n", [(0, 4, 3), (4, 0, 3), (4, 5, 0), (4, 5, 3)])
def test_torch_spmm_and_sddmm_of_empty_shapes_and_no_stored_entries(m, k, n):
    a = torch.zeros(m, k).to_sparse()  # nnz = 0
    b = torch.randn(k, n, requires_grad=True)
    y = st.spmm(a, b)
    assert y.shape == (m, n) and not y.any()
    y.sum().backward()
    torch.testing.assert_close(b.grad, torch.zeros(k, n))
    out = st.sddmm(a, torch.randn(m, n), torch.randn(k, n))
    assert out.shape == (m, k) and out.values().numel() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_spmm_sddmm_prune_half_precision_is_a_type_error_naming_the_dtype(dtype):
    name = str(dtype).removeprefix("torch.")
    a = torch.eye(3).to_sparse_csr()
    with pytest.raises(TypeError, match=name):
        st.spmm(a, torch.ones(3, 2, dtype=dtype))
    with pytest.raises(TypeError, match=name):
        st.spmm(torch.eye(3, dtype=dtype).to_sparse(), torch.ones(3, 2))
    with pytest.raises(TypeError, match=name):
        st.sddmm(a, torch.ones(3, 2, dtype=dtype), torch.ones(3, 2))
    with pytest.raises(TypeError, match=name):
        st.prune(torch.ones(3, 2, dtype=dtype), 0.5)


def test_sparse_linear_mixed_int32_and_int64_index_tensors(rng):
    indptr, indices = random_structure(rng, 7, 6, 0.4, messy=True)
    values = torch.randn(indices.numel(), dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    for first, second in ((indptr.int(), indices), (indptr, indices.int())):
        y = st.sparse_linear(x, values, first, second, (7, 6))
        np.testing.assert_allclose(y.detach().numpy(), linear_reference(x, values, indptr, indices, (7, 6)), atol=1e-12)
        assert torch.autograd.gradcheck(lambda x, v: st.sparse_linear(x, v, first, second, (7, 6)), (x, values))


def test_torch_sddmm_matches_the_dense_product_sampled_at_the_pattern(rng):
    pattern = messy_coo(rng, 7, 6)
    a, b = torch.randn(7, 4), torch.randn(6, 4)
    out = st.sddmm(pattern, a, b)
    assert out.layout == torch.sparse_csr and out.values().numel() == pattern._nnz()
    rows, cols = reference.entries(out.crow_indices().numpy(), out.col_indices().numpy())
    np.testing.assert_allclose(out.values().numpy(), reference.sampled_product(rows, cols, a, b), rtol=1e-5, atol=1e-6)
    csr = pattern.coalesce().to_sparse_csr()
    out = st.sddmm(csr, a, b)
    assert out.crow_indices().data_ptr() != csr.crow_indices().data_ptr()  # never aliases the pattern
    torch.testing.assert_close(out.to_dense(), (a @ b.T) * (csr.to_dense() != 0))


def test_torch_prune_matches_the_array_level_and_keeps_the_largest(rng):
    w = torch.randn(8, 9)
    out = st.prune(w, 0.75)
    assert out.layout == torch.sparse_csr and out.values().numel() == 72 - 54
    rows, cols = reference.entries(out.crow_indices().numpy(), out.col_indices().numpy())
    np.testing.assert_array_equal(rows * 9 + cols, reference.largest_positions(w.numpy(), 18))
    torch.testing.assert_close(out.values(), w[rows, cols])
    assert st.prune(w.t(), 0.5, method="random", seed=1).values().numel() == 36
    with pytest.raises(TypeError, match="w must be a dense tensor"):
        st.prune(w.to_sparse(), 0.5)


# --- SparseLinear ----------------------------------------------------------------------------------


def test_sparse_linear_module_layout_and_parameters():
    torch.manual_seed(0)
    layer = st.SparseLinear(50, 40, sparsity=0.9)
    assert layer.nnz == 2000 - 1800 and [n for n, _ in layer.named_parameters()] == ["weight_values", "bias"]
    assert set(layer.state_dict()) == {"weight_values", "indptr", "indices", "bias"}
    assert layer.indices.dtype == torch.int32 and layer.weight_values.shape == (200,)
    assert abs(layer.sparsity - 0.9) < 1e-12
    assert repr(layer) == "SparseLinear(in_features=50, out_features=40, bias=True, nnz=200, sparsity=0.9)"
    rows, cols = reference.entries(layer.indptr.numpy(), layer.indices.numpy())
    assert np.all(np.diff(rows * 50 + cols) > 0)  # canonical: sorted, no duplicates
    torch.manual_seed(0)
    again = st.SparseLinear(50, 40, sparsity=0.9)
    torch.testing.assert_close(again.indices, layer.indices)  # torch.manual_seed fixes the structure
    assert st.SparseLinear(3, 2, bias=False, sparsity=0.0).bias is None


def test_initialisation_keeps_the_output_variance_of_a_dense_layer():
    torch.manual_seed(1)
    x = torch.randn(4096, 400)
    for sparsity in (0.5, 0.95):
        sparse = st.SparseLinear(400, 300, sparsity=sparsity)
        dense = torch.nn.Linear(400, 300)
        with torch.no_grad():
            ratio = (sparse(x) - sparse.bias).var() / (dense(x) - dense.bias).var()
        assert 0.85 < float(ratio) < 1.15


def test_from_dense_to_dense_and_weight_csr(rng):
    dense = torch.nn.Linear(12, 7)
    layer = st.SparseLinear.from_dense(dense, 0.75)
    assert layer.nnz == 84 - 63
    w = dense.weight.detach()
    rows, cols = reference.entries(layer.indptr.numpy(), layer.indices.numpy())
    np.testing.assert_array_equal(rows * 12 + cols, reference.largest_positions(w.numpy(), 21))
    back = layer.to_dense()
    torch.testing.assert_close(back.weight, w * (back.weight != 0))
    x = torch.randn(5, 12)
    torch.testing.assert_close(layer(x), back(x))
    csr = layer.weight_csr()
    assert csr.values().data_ptr() == layer.weight_values.data_ptr() and csr.col_indices().data_ptr() == layer.indices.data_ptr()
    torch.testing.assert_close(csr.to_dense(), back.weight)
    assert st.SparseLinear.from_dense(torch.nn.Linear(4, 4, bias=False), 0.5, method="random").bias is None


def test_state_dict_round_trip_and_dtype_moves():
    layer = st.SparseLinear(10, 6, sparsity=0.5)
    other = st.SparseLinear(10, 6, sparsity=0.5)
    other.load_state_dict(layer.state_dict())
    x = torch.randn(3, 10)
    torch.testing.assert_close(other(x), layer(x))
    layer64 = layer.to(torch.float64)
    assert layer64.weight_values.dtype == torch.float64 and layer64.indices.dtype == torch.int32
    torch.testing.assert_close(layer64(x.double()), layer(x).double(), rtol=1e-6, atol=1e-6)


def test_pickling_and_deepcopy_drop_the_recorded_batch():
    import copy
    import io

    layer = st.SparseLinear(8, 4, sparsity=0.5)
    layer(torch.randn(3, 8)).sum().backward()
    assert layer._step
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(layer)):
        assert other._step == []
        x = torch.randn(2, 8)
        torch.testing.assert_close(other(x), layer(x))


@pytest.mark.parametrize("bad, error, message", [
    ({"sparsity": 1.2}, ValueError, r"sparsity must be in \[0, 1\]"),
    ({"sparsity": None}, TypeError, r"sparsity must be a number"),
    ({"in_features": -1}, ValueError, r"in_features must be non-negative"),
    ({"in_features": 2.5}, TypeError, r"in_features must be an int, not float \(2.5\)"),
    ({"in_features": 4.0}, TypeError, r"in_features must be an int, not float"),
    ({"out_features": True}, TypeError, r"out_features must be an int, not a bool"),
    ({"out_features": "3"}, TypeError, r"out_features must be an int, not str"),
])
def test_sparse_linear_module_bad_arguments(bad, error, message):
    kwargs = {"in_features": 4, "out_features": 3, "sparsity": 0.5} | bad
    with pytest.raises(error, match=message):
        st.SparseLinear(kwargs.pop("in_features"), kwargs.pop("out_features"), **kwargs)


def positions(layer):
    rows, cols = reference.entries(layer.indptr.numpy(), layer.indices.numpy())
    return rows * layer.in_features + cols


def train_step(layer, optimizer, x):
    optimizer.zero_grad()
    layer(x).square().mean().backward()


@pytest.mark.parametrize("regrow", ["random", "gradient"])
def test_prune_and_regrow_moves_weights_and_adam_state_with_them(regrow):
    torch.manual_seed(2)
    layer = st.SparseLinear(20, 16, sparsity=0.8)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.randn(32, 20)
    for _ in range(3):
        train_step(layer, optimizer, x)
        optimizer.step()
    train_step(layer, optimizer, x)
    before_pos, before_values = positions(layer), layer.weight_values.detach().clone()
    state = optimizer.state[layer.weight_values]
    before_state = {k: v.clone() for k, v in state.items()}
    before_grad = layer.weight_values.grad.clone()
    n_move = round(0.25 * layer.nnz)
    layer.prune_and_regrow(0.25, regrow=regrow, optimizer=optimizer)
    after_pos = positions(layer)
    assert layer.nnz == before_values.numel() and np.all(np.diff(after_pos) > 0)
    survivors = reference.largest_positions(before_values.numpy(), layer.nnz - n_move)  # the smallest |values| go
    slot = {p: s for s, p in enumerate(after_pos)}
    new_slots = np.array([slot[p] for p in before_pos[survivors]])
    for after, before in [(layer.weight_values.detach(), before_values), (layer.weight_values.grad, before_grad),
                          (state["exp_avg"], before_state["exp_avg"]), (state["exp_avg_sq"], before_state["exp_avg_sq"])]:
        torch.testing.assert_close(after[new_slots], before[survivors])
        fresh = np.setdiff1d(np.arange(layer.nnz), new_slots)
        assert fresh.size == n_move and bool((after[fresh] == 0).all())
    assert state["step"] == before_state["step"]
    optimizer.step()  # the optimizer works unchanged afterwards
    train_step(layer, optimizer, x)


def _twice(layer, x):
    """A layer used twice in one forward (shared, or a recurrence)."""
    return layer(x[:8]).pow(3).mean() + layer(torch.tanh(layer(x[8:]))).pow(3).mean()


def _after_an_earlier_step_and_an_unused_call(layer, x):
    layer(x.flip(0)).sum().backward()  # the step before: not this step's gradient
    layer.zero_grad()
    loss = layer(x).pow(3).mean()
    layer(x[:3])  # an output that gets no backward: not recorded
    return loss


def _in_place_relu(layer, x):
    """``nn.ReLU(inplace=True)`` on the output (a transposed view from the sparse product)."""
    return torch.nn.functional.relu(layer(x), inplace=True).pow(3).mean()


@pytest.mark.parametrize("loss", [lambda layer, x: layer(x).pow(3).mean(), _twice,
                                  _after_an_earlier_step_and_an_unused_call, _in_place_relu,
                                  lambda layer, x: _in_place_relu(layer, x.view(4, 4, 10))],
                         ids=["one call", "two calls", "after an earlier step and an unused call",
                              "in-place ReLU after", "in-place ReLU after, 3-D input"])
def test_regrow_by_gradient_picks_the_largest_dense_gradient(loss):
    torch.manual_seed(3)
    layer = st.SparseLinear(10, 10, sparsity=0.7)
    x = torch.randn(16, 10)
    dense = layer.to_dense()
    loss(layer, x).backward()
    dense.zero_grad()
    loss(dense, x).backward()
    before = positions(layer)
    n_move = round(0.5 * layer.nnz)
    survivors = reference.largest_positions(np.abs(layer.weight_values.detach().numpy()), layer.nnz - n_move)
    kept = before[survivors]
    scores = dense.weight.grad.numpy().ravel()
    free = np.setdiff1d(np.arange(scores.size), kept)
    want = np.sort(np.concatenate([kept, free[reference.largest_positions(scores[free], n_move)]]))
    layer.prune_and_regrow(0.5, regrow="gradient")
    np.testing.assert_array_equal(positions(layer), want)


def test_prune_and_regrow_bad_input():
    layer = st.SparseLinear(6, 5, sparsity=0.5)
    with pytest.raises(RuntimeError, match="needs a training batch's gradient"):
        layer.prune_and_regrow(0.2, regrow="gradient")
    with pytest.raises(ValueError, match="'random' or 'gradient'"):
        layer.prune_and_regrow(0.2, regrow="magnitude")
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\]"):
        layer.prune_and_regrow(-0.1)
    with pytest.raises(ValueError, match="does not hold this layer's weight_values"):
        layer.prune_and_regrow(0.2, optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0))
    layer.prune_and_regrow(0.0)
    layer.prune_and_regrow(1.0)
    assert layer.nnz == 15


def test_prune_and_regrow_and_from_dense_argument_types():
    layer = st.SparseLinear(6, 5, sparsity=0.5)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer .* not str"):
        layer.prune_and_regrow(0.2, optimizer="adam")
    with pytest.raises(TypeError, match="regrow must be a str .* not list"):
        layer.prune_and_regrow(0.2, regrow=["random"])
    with pytest.raises(TypeError, match="fraction must be a number in \\[0, 1\\], not str"):
        layer.prune_and_regrow("0.2")
    with pytest.raises(TypeError, match="from_dense takes a torch.nn.Linear, not str"):
        st.SparseLinear.from_dense("linear", 0.5)
    with pytest.raises(TypeError, match="from_dense takes a torch.nn.Linear, not Conv1d"):
        st.SparseLinear.from_dense(torch.nn.Conv1d(2, 2, 1), 0.5)
    with pytest.raises(TypeError, match="method must be a str"):
        st.SparseLinear.from_dense(torch.nn.Linear(2, 2), 0.5, method=1)
    with pytest.raises(TypeError, match="sparsity must be a number"):
        st.SparseLinear.from_dense(torch.nn.Linear(2, 2), "0.5")


@pytest.mark.parametrize("bad", [None, 2.0, [[1.0, 2.0]], "sparse"], ids=["None", "float", "list", "sparse"])
def test_non_dense_tensors_where_dense_ones_are_required_are_type_errors_naming_the_argument(bad):
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]]).to_sparse_csr()
    indptr, indices, values = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.ones(2)
    if bad == "sparse":
        bad, message = torch.ones(2, 2).to_sparse(), "must be a dense tensor, not one of layout torch.sparse_coo"
    else:
        message = f"must be a torch.Tensor, not {type(bad).__name__}"
    calls = {
        "spmm: b": lambda: st.spmm(a, bad),
        "sddmm: a": lambda: st.sddmm(a, bad, torch.ones(2, 2)),
        "sddmm: b": lambda: st.sddmm(a, torch.ones(2, 2), bad),
        "prune: w": lambda: st.prune(bad, 0.5),
        "sparse_linear: x": lambda: st.sparse_linear(bad, values, indptr, indices, (2, 2)),
        "sparse_linear: values": lambda: st.sparse_linear(torch.ones(2, 2), bad, indptr, indices, (2, 2)),
        "sparse_linear: indptr": lambda: st.sparse_linear(torch.ones(2, 2), values, bad, indices, (2, 2)),
        "sparse_linear: indices": lambda: st.sparse_linear(torch.ones(2, 2), values, indptr, bad, (2, 2)),
    }
    if bad is not None:
        calls["sparse_linear: bias"] = lambda: st.sparse_linear(torch.ones(2, 2), values, indptr, indices, (2, 2), bad)
    for name, call in calls.items():
        with pytest.raises(TypeError, match=f"spchain.torch.{name} {message}"):
            call()


def test_weight_memory_is_o_nnz_with_adam():
    layer = st.SparseLinear(2000, 1500, sparsity=0.99)
    optimizer = torch.optim.Adam(layer.parameters())
    x = torch.randn(8, 2000)
    train_step(layer, optimizer, x)
    optimizer.step()
    layer.prune_and_regrow(0.3, regrow="gradient", optimizer=optimizer)
    tensors = [*layer.parameters(), *layer.buffers(), *(p.grad for p in layer.parameters())]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    assert weight_bytes < 8 * (layer.nnz + layer.out_features) * 4  # a dense weight alone is 12 MB
    assert max(t.numel() for t in tensors) <= max(layer.nnz, layer.out_features + 1)


@pytest.mark.gpu
def test_sparse_linear_module_on_cuda_matches_cpu():
    layer = st.SparseLinear(30, 20, sparsity=0.8)
    x = torch.randn(5, 30, requires_grad=True)
    cuda = st.SparseLinear(30, 20, sparsity=0.8).cuda()
    cuda.load_state_dict(layer.state_dict())
    xc = x.detach().cuda().requires_grad_()
    layer(x).square().sum().backward()
    cuda(xc).square().sum().backward()
    torch.testing.assert_close(xc.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cuda.weight_values.grad.cpu(), layer.weight_values.grad, rtol=1e-5, atol=1e-5)
    cuda.prune_and_regrow(0.3, regrow="gradient")
    assert cuda.nnz == layer.nnz


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("low", ["x", "values", "all"])
def test_sparse_linear_half_precision_computes_in_float32_and_returns_the_promoted_dtype(rng, dtype, tol, low):
    x, values, indptr, indices, shape = valid_args(rng)
    bias = torch.randn(shape[0])
    cast = {"x": (dtype, torch.float32, torch.float32), "values": (torch.float32, dtype, torch.float32),
            "all": (dtype, dtype, dtype)}[low]
    x, values, bias = (t.to(c).requires_grad_() for t, c in zip((x, values, bias), cast))
    y = st.sparse_linear(x, values, indptr, indices, shape, bias)
    assert y.dtype == (dtype if low == "all" else torch.float32)  # torch.promote_types
    args64 = [t.detach().double().requires_grad_() for t in (x, values, bias)]
    y64 = st.sparse_linear(args64[0], args64[1], indptr, indices, shape, args64[2])
    torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
    grad = torch.randn(y.shape)
    y.backward(grad.to(dtype))
    y64.backward(grad.to(dtype).double())
    for t, t64 in zip((x, values, bias), args64):
        assert t.grad.dtype == t.dtype
        torch.testing.assert_close(t.grad.double(), t64.grad, rtol=4 * tol, atol=4 * tol)
