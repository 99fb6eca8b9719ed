"""spchain.torch.nn (spchain/torch/nn.py): SparseLinear with torch's utilities (parametrize,
nn.utils.prune, ao.pruning), its dense ``weight`` copy, meta-device construction and
``prune_and_regrow`` under torch.distributed."""

import os
import tempfile
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.nn.utils.prune  # noqa: E402

import spchain.torch as st  # noqa: E402


def _layer(seed=0, **kwargs):
    torch.manual_seed(seed)
    return st.SparseLinear(12, 6, sparsity=0.5, **kwargs)


def test_weight_is_a_fresh_dense_copy_differentiable_in_weight_values():
    layer = _layer()
    weight = layer.weight
    torch.testing.assert_close(weight, layer.to_dense().weight.detach())
    x = torch.randn(4, 12)
    torch.testing.assert_close(layer(x), x @ weight.T + layer.bias)
    weight.sum().backward()
    assert torch.equal(layer.weight_values.grad, torch.ones(layer.nnz))
    with pytest.raises(AttributeError):
        layer.weight = torch.zeros(6, 12)


@pytest.mark.parametrize("write", [
    torch.nn.init.kaiming_uniform_, torch.nn.init.xavier_normal_, torch.nn.init.orthogonal_, torch.nn.init.zeros_,
    lambda w: torch.nn.init.constant_(w, 0.5), lambda w: w.zero_(), lambda w: w.copy_(torch.ones(6, 12)),
    lambda w: w.__setitem__((0, 0), 1.0), lambda w: torch.mul(w, 2, out=w),
])
def test_writes_to_the_dense_weight_copy_raise(write):
    # issue 26 item 4: they had no effect
    layer = _layer()
    before = layer.weight_values.detach().clone()
    with pytest.raises(RuntimeError, match="fresh dense copy.*weight_values"), torch.no_grad():
        write(layer.weight)
    assert torch.equal(layer.weight_values.detach(), before)
    assert type(layer.weight * 2) is torch.Tensor  # reading is unchanged: plain tensors out


def test_model_apply_of_an_init_function_raises_and_nn_init_on_weight_values_works():
    def init(m):
        if hasattr(m, "weight"):
            torch.nn.init.xavier_uniform_(m.weight)

    model = torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    st.sparsify(model, 0.5)
    with pytest.raises(RuntimeError, match="fresh dense copy"):
        model.apply(init)
    torch.nn.init.constant_(model[2].weight_values, 0.25)
    assert bool((model[2].weight[model[2].weight != 0] == 0.25).all())


@pytest.mark.parametrize("norm", [
    lambda layer: torch.nn.utils.parametrizations.weight_norm(layer, "weight_values"),
    lambda layer: torch.nn.utils.parametrizations.spectral_norm(layer, "weight_values"),
    lambda layer: torch.nn.utils.weight_norm(layer, "weight_values"),
    lambda layer: torch.nn.utils.spectral_norm(layer, "weight_values"),
])
def test_weight_and_spectral_norm_on_weight_values_raise(norm):
    # issue 26 item 3: they normalised each stored value, not each output row
    layer = _layer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        norm(layer)
    with pytest.raises(ValueError, match="(weight|spectral)_norm on weight_values.*not each output row"):
        layer(torch.randn(3, 12))


def _attach_ao_sparsifier(layer):
    from torch.ao.pruning import BaseSparsifier

    class Keep(BaseSparsifier):
        def update_mask(self, module, tensor_name, **kwargs):
            pass

    Keep(defaults={}).prepare(torch.nn.Sequential(layer), [{"tensor_fqn": "0.weight_values"}])


@pytest.mark.parametrize("attach, name", [
    (lambda layer: torch.nn.utils.parametrize.register_parametrization(layer, "weight_values", torch.nn.Identity()),
     "Identity"),
    (lambda layer: torch.nn.utils.prune.l1_unstructured(layer, "weight_values", amount=0.3), "L1Unstructured"),
    (_attach_ao_sparsifier, "FakeSparsity"),
    (lambda layer: torch.nn.utils.parametrizations.weight_norm(layer, "weight_values"), "_WeightNorm"),
])
@pytest.mark.parametrize("block", [None, (2, 3)])
def test_structure_changes_refuse_attached_utilities_instead_of_scrambling_weights(attach, name, block):
    # issue 26 item 2: 184 of 216 surviving weights changed value
    from spchain.torch import pruning

    layer = _layer(block=block)
    attach(layer)
    before = (layer.indptr.clone(), layer.indices.clone(), layer.state_dict())
    for change in (lambda: layer.prune_and_regrow(0.3), lambda: pruning.prune_to(layer, 12)):
        with pytest.raises(ValueError, match=f"torch utilities attached \\({name}"):
            change()
    assert torch.equal(layer.indptr, before[0]) and torch.equal(layer.indices, before[1])
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[2][key])


def test_parametrize_accepts_weight_values():
    class Double(torch.nn.Module):
        def forward(self, v):
            return 2 * v

    layer = _layer()
    x = torch.randn(3, 12)
    before = layer(x) - layer.bias
    torch.nn.utils.parametrize.register_parametrization(layer, "weight_values", Double())
    torch.testing.assert_close(layer(x) - layer.bias, 2 * before)
    layer(x).sum().backward()
    assert layer.parametrizations.weight_values.original.grad is not None


def test_a_parameter_replaced_by_a_plain_attribute_is_the_one_used():
    layer = _layer()
    x = torch.randn(3, 12)
    before = layer(x) - layer.bias
    values = layer.weight_values.detach().clone()
    del layer.weight_values, layer.bias
    layer.weight_values, layer.bias = 3 * values, None  # plain attributes, not parameters
    assert "weight_values" not in layer._parameters
    torch.testing.assert_close(layer(x), 3 * before)


def test_nn_utils_prune_masks_weight_values():
    from torch.nn.utils import prune

    layer = _layer()
    prune.l1_unstructured(layer, "weight_values", amount=0.5)
    assert int((layer.weight_values == 0).sum()) == layer.nnz // 2
    x = torch.randn(3, 12)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)
    prune.remove(layer, "weight_values")
    assert isinstance(layer.weight_values, torch.nn.Parameter)


def test_ao_pruning_sparsifies_weight_values():
    from torch.ao.pruning import BaseSparsifier

    class Magnitude(BaseSparsifier):  # ao.pruning's built-in sparsifiers take 2-D weights only
        def update_mask(self, module, tensor_name, **kwargs):
            mask = getattr(module.parametrizations, tensor_name)[0].mask
            values = getattr(module.parametrizations, tensor_name).original
            mask[values.abs().argsort()[:values.numel() // 2]] = False

    model = torch.nn.Sequential(_layer())
    sparsifier = Magnitude(defaults={})
    sparsifier.prepare(model, [{"tensor_fqn": "0.weight_values"}])
    sparsifier.step()
    sparsifier.squash_mask()
    assert int((model[0].weight_values == 0).sum()) == model[0].nnz // 2


def test_meta_construction_then_to_empty_and_reset_parameters_is_a_valid_layer():
    layer = _layer(device="meta")
    assert layer.weight_values.is_meta
    layer.to_empty(device="cpu")
    torch.manual_seed(0)
    layer.reset_parameters()
    reference = _layer()  # the same draws
    for name in ("indptr", "indices", "weight_values", "bias"):
        torch.testing.assert_close(getattr(layer, name), getattr(reference, name))
    x = torch.randn(3, 12)
    torch.testing.assert_close(layer(x), reference(x))


def test_construction_inside_the_meta_device_context():
    # issue 26 item 11: "Tensor.item() cannot be called on meta tensors" before
    with torch.device("meta"):
        layers = [_layer(), _layer(block=(2, 3)), st.BlockDiagonalLinear(12, 6, 3), st.GroupedLinear(2, 4, 3)]
    assert all(p.is_meta for layer in layers for p in layer.parameters())
    for layer, reference in zip(layers[:2], [_layer(), _layer(block=(2, 3))]):
        layer.to_empty(device="cpu")
        torch.manual_seed(0)
        layer.reset_parameters()
        for name in ("indptr", "indices", "weight_values", "bias"):
            torch.testing.assert_close(getattr(layer, name), getattr(reference, name))


def _regrow_worker(rank, init, regrow, block, out):
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                                         timeout=__import__("datetime").timedelta(seconds=60))
    try:
        layer = _layer(seed=0, block=block)
        optimizer = torch.optim.Adam(layer.parameters())
        torch.manual_seed(100 + rank)  # per-rank draws and batches: the replicas would diverge
        layer(torch.randn(5, 12)).square().sum().backward()
        optimizer.step()
        torch.distributed.all_reduce(layer.weight_values.data)  # as DDP keeps values in step
        layer.weight_values.data /= 2
        layer.prune_and_regrow(0.5, regrow=regrow, optimizer=optimizer)
        torch.save({k: v.clone() for k, v in layer.state_dict().items()}, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("regrow, block", [("random", None), ("gradient", None), ("gradient", (2, 3))])
def test_prune_and_regrow_keeps_distributed_replicas_identical(regrow, block):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{os.path.join(tmp, 'store')}", os.path.join(tmp, "state")
        torch.multiprocessing.spawn(_regrow_worker, args=(init, regrow, block, out), nprocs=2, join=True)
        first, second = (torch.load(f"{out}.{r}") for r in (0, 1))
    for name in ("indptr", "indices", "weight_values"):
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sparse_linear_holds_half_precision_values(dtype):
    layer = _layer(dtype=dtype)
    assert layer.weight_values.dtype == dtype and _layer().to(dtype).weight_values.dtype == dtype
    x = torch.randn(3, 12, dtype=dtype, requires_grad=True)
    y = layer(x)
    assert y.dtype == dtype
    reference = x.double() @ layer.weight.double().T + layer.bias.double()
    torch.testing.assert_close(y.double(), reference, rtol=2e-2, atol=2e-2)
    y.sum().backward()
    assert layer.weight_values.grad.dtype == dtype and x.grad.dtype == dtype


@pytest.mark.parametrize("method", ["magnitude", "random"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_linear_converts_as_its_float32_copy(dtype, method):
    """from_dense and sparsify of a float16/bfloat16 nn.Linear (they raised TypeError on the CSR
    path): the structure of its exact float32 copy, the kept weights and the bias in its dtype."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(12, 7).to(dtype)
    wide = torch.nn.Linear(12, 7)
    with torch.no_grad():
        wide.weight.copy_(dense.weight.float())
        wide.bias.copy_(dense.bias.float())
    torch.manual_seed(1)
    low = st.SparseLinear.from_dense(dense, 0.6, method)
    torch.manual_seed(1)
    ref = st.SparseLinear.from_dense(wide, 0.6, method)
    assert low.weight_values.dtype == low.bias.dtype == dtype
    for name in ("indptr", "indices"):
        assert torch.equal(getattr(low, name), getattr(ref, name)), name
    assert torch.equal(low.weight_values.float(), ref.weight_values) and torch.equal(low.bias, dense.bias)
    model = torch.nn.Sequential(torch.nn.Linear(12, 7).to(dtype))
    st.sparsify(model, 0.5)
    assert isinstance(model[0], st.SparseLinear) and model[0].weight_values.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_layers_prune_and_regrow_as_their_float32_copies(dtype):
    from spchain.torch.pruning import prune_to

    torch.manual_seed(0)
    low = _layer(dtype=dtype)
    wide = _layer()
    wide.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in low.state_dict().items()})
    x = torch.randn(5, 12).to(dtype)
    for layer, inputs in ((low, x), (wide, x.float())):
        layer(inputs).sum().backward()
        layer.prune_and_regrow(0.3, regrow="gradient")
        prune_to(layer, layer.nnz - 4)
    assert low.weight_values.dtype == dtype and low.nnz == wide.nnz
    for name in ("indptr", "indices"):
        assert torch.equal(getattr(low, name), getattr(wide, name)), name
    torch.testing.assert_close(low.weight_values.float(), wide.weight_values)
