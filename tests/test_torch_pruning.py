"""Whole-model tools: sparsify, erk_densities, GradualPruning, CosineDropFraction (spchain/torch/pruning.py)."""

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import spchain.torch as st  # noqa: E402
from spchain.torch import pruning  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float64):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 40, dtype=dtype), torch.nn.ReLU(),
                                        torch.nn.Linear(40, 30, dtype=dtype))
        self.head = torch.nn.Linear(30, 3, bias=False, dtype=dtype)
        self.norm = torch.nn.LayerNorm(30, dtype=dtype)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


def test_sparsify_at_sparsity_0_keeps_the_models_outputs():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(7, 12, dtype=torch.float64)
    want = model(x)
    assert st.sparsify(model, 0.0) == ["body.0", "body.2", "head"]
    assert all(type(m) is st.SparseLinear for m in (model.body[0], model.body[2], model.head))
    assert model.head.bias is None
    torch.testing.assert_close(model(x), want, rtol=1e-12, atol=1e-12)


def test_sparsify_uniform_keeps_the_largest_weights_of_each_layer():
    torch.manual_seed(1)
    model = Net(torch.float32)
    weights = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    biases = model.body[0].bias.detach().clone()
    names = st.sparsify(model, 0.75, skip=["head"])
    assert names == ["body.0", "body.2"] and type(model.head) is torch.nn.Linear
    for name in names:
        layer = model.get_submodule(name)
        w = weights[name]
        assert layer.nnz == w.numel() - round(0.75 * w.numel()) and layer.weight_values.dtype == torch.float32
        dense = layer.to_dense().weight.detach()
        kept = dense != 0
        assert torch.equal(dense[kept], w[kept])
        assert w[kept].abs().min() >= w[~kept].abs().max()
    assert torch.equal(model.body[0].bias.detach(), biases)


def test_sparsify_skip_predicate_and_erk():
    model = Net()
    names = st.sparsify(model, 0.9, distribution="erk", skip=lambda name, m: m.out_features < 10)
    assert names == ["body.0", "body.2"]
    layers = [model.body[0], model.body[2]]
    want = st.erk_densities([(40, 12), (30, 40)], 0.1)
    for layer, density in zip(layers, want):
        total = layer.in_features * layer.out_features
        assert layer.nnz == total - round((1 - density) * total)
    assert abs(sum(m.nnz for m in layers) - 0.1 * (480 + 1200)) <= 1


@pytest.mark.parametrize("density", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_erk_densities_hold_the_global_density_and_are_capped_at_1(density):
    shapes = [(784, 300), (300, 100), (100, 10), (10, 10)]
    got = st.erk_densities(shapes, density)
    sizes = [a * b for a, b in shapes]
    assert all(0.0 <= d <= 1.0 for d in got)
    assert math.isclose(sum(d * s for d, s in zip(got, sizes)), density * sum(sizes), rel_tol=1e-12, abs_tol=1e-9)
    free = [k for k, d in enumerate(got) if d < 1.0]
    ratios = {got[k] / ((a + b) / (a * b)) for k, (a, b) in enumerate(shapes) if k in free}
    assert len({round(r, 9) for r in ratios}) <= 1  # density proportional to (n_in + n_out) / (n_in n_out)
    if 0.05 <= density < 1.0:
        assert got[0] < got[1] <= got[2] <= got[3] == 1.0


@pytest.mark.parametrize("kwargs, error, message", [
    ({"sparsity": 1.5}, ValueError, r"sparsity must be in \[0, 1\]"),
    ({"sparsity": 0.5, "distribution": "normal"}, ValueError, "distribution must be"),
    ({"sparsity": 0.5, "skip": ["body.1"]}, ValueError, r"skip names \['body.1'\]"),
    ({"sparsity": 0.5, "skip": 3}, TypeError, "skip must be layer names or a predicate"),
])
def test_sparsify_bad_input(kwargs, error, message):
    with pytest.raises(error, match=message):
        st.sparsify(Net(), **kwargs)
    with pytest.raises(ValueError, match="for one layer use SparseLinear.from_dense"):
        st.sparsify(torch.nn.Linear(3, 3), 0.5)
    weight = torch.nn.Parameter(torch.ones(3, 3))
    for call in (lambda: st.sparsify(weight, 0.5), lambda: st.GradualPruning(weight, 0.5, steps=2)):
        with pytest.raises(TypeError, match="model must be a torch.nn.Module, not Parameter"):
            call()


def cubic(t, s_i, s_f, start, steps, every):
    done = min((t - start) // every, steps)
    return s_f + (s_i - s_f) * (1 - done / steps) ** 3


def test_gradual_pruning_follows_the_cubic_schedule_and_reaches_the_final_density_exactly():
    torch.manual_seed(2)
    model = Net()
    st.sparsify(model, 0.2)
    schedule = st.GradualPruning(model, {"body.0": 0.9, "body.2": 0.95, "head": 0.5}, start=3, steps=4, every=2)
    initial = {name: m.sparsity for name, m in schedule.layers.items()}
    for t in range(20):
        before = {name: m.nnz for name, m in schedule.layers.items()}
        schedule.step()
        for name, layer in schedule.layers.items():
            total = layer.in_features * layer.out_features
            if t < 3 or (t - 3) % 2:
                assert layer.nnz == before[name]
            else:
                s = cubic(t, initial[name], schedule.final[name], 3, 4, 2)
                assert layer.nnz == total - round(s * total)
    assert [m.nnz for m in schedule.layers.values()] == [480 - round(0.9 * 480), 1200 - round(0.95 * 1200), 45]


def test_gradual_pruning_keeps_the_largest_weights_and_optimizer_state_follows_them():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8, dtype=torch.float64))
    st.sparsify(model, 0.25)
    layer = model[0]
    parameter = layer.weight_values
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 16, dtype=torch.float64)).square().sum().backward()
        optimizer.step()
    state = optimizer.state[parameter]
    before = {k: v.clone() for k, v in state.items()}
    dense_before = layer.to_dense().weight.detach()
    grad_before = layer.to_dense().weight.new_zeros(8, 16)
    rows = torch.repeat_interleave(torch.arange(8), layer.indptr.diff())
    positions_before = rows * 16 + layer.indices
    grad_before.view(-1)[positions_before] = parameter.grad
    schedule = st.GradualPruning(model, 0.75, start=0, steps=1, optimizer=optimizer)
    schedule.step()
    schedule.step()
    assert layer.weight_values is parameter and layer.nnz == 32
    rows = torch.repeat_interleave(torch.arange(8), layer.indptr.diff())
    positions = rows * 16 + layer.indices
    assert torch.all(positions[1:] > positions[:-1])  # canonical CSR
    kept = torch.isin(positions_before, positions)
    assert layer.weight_values.detach().abs().min() >= (dense_before.view(-1)[positions_before][~kept]).abs().max()
    for key in ("exp_avg", "exp_avg_sq"):
        assert state[key].shape == (32,)
        assert torch.equal(state[key], before[key][kept])
    assert torch.equal(state["step"], before["step"])
    assert torch.equal(parameter.grad, grad_before.view(-1)[positions])
    optimizer.zero_grad()
    model(torch.randn(5, 16, dtype=torch.float64)).sum().backward()
    optimizer.step()  # Adam runs on the shrunk state
    assert layer.weight_values.shape == (32,)


def test_gradual_pruning_bad_input():
    with pytest.raises(ValueError, match="no SparseLinear layers"):
        st.GradualPruning(Net(), 0.9, steps=3)
    model = Net()
    st.sparsify(model, 0.5)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        st.GradualPruning(model, 0.9, steps=0)
    with pytest.raises(ValueError, match="final_sparsity names"):
        st.GradualPruning(model, {"head": 0.9}, steps=2)
    with pytest.raises(ValueError, match=r"final_sparsity must be in \[0, 1\]"):
        st.GradualPruning(model, 1.2, steps=2)


def test_prune_to_never_grows_a_layer():
    layer = st.SparseLinear(6, 4, sparsity=0.5)
    before = layer.weight_values.detach().clone()
    pruning.prune_to(layer, 100)
    assert torch.equal(layer.weight_values.detach(), before)


def test_cosine_drop_fraction():
    fraction = st.CosineDropFraction(0.4, end_step=10)
    values = [fraction(t) for t in range(12)]
    np.testing.assert_allclose(values[:10], 0.2 * (1 + np.cos(np.pi * np.arange(10) / 10)), rtol=1e-15)
    assert values[10] == values[11] == 0.0 and fraction(0) == 0.4
    assert all(a >= b for a, b in zip(values, values[1:]))
    with pytest.raises(ValueError, match="end_step must be an int >= 1"):
        st.CosineDropFraction(0.3, end_step=0)
    with pytest.raises(ValueError, match=r"initial must be in \[0, 1\]"):
        st.CosineDropFraction(1.3, end_step=5)


def _prune_step(kind, model, optimizer, schedule):
    """One structure change of ``kind`` on every SparseLinear layer of ``model``."""
    layers = [m for m in model.modules() if isinstance(m, st.SparseLinear)]
    if kind == "GradualPruning":
        schedule.step()
    for layer in layers:
        if kind == "prune_to":
            r, c = layer.block or (1, 1)
            pruning.prune_to(layer, max(layer.nnz - r * c, r * c), optimizer)
        elif kind.startswith("prune_and_regrow"):
            layer.prune_and_regrow(0.3, regrow=kind.split("-")[1], optimizer=optimizer)


@pytest.mark.parametrize("block", [None, (2, 2)])
@pytest.mark.parametrize("kind", ["prune_to", "GradualPruning", "prune_and_regrow-random", "prune_and_regrow-gradient"])
def test_the_plain_training_loop_runs_through_every_pruning_entry_point(kind, block):
    # issue 22 item 5: the previous step's loss (its graph) is alive during the next backward
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    st.sparsify(model, 0.0 if kind == "GradualPruning" else 0.5, block=block)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    schedule = st.GradualPruning(model, 0.9, start=1, steps=4, every=2, optimizer=optimizer)
    x = torch.randn(8, 16)
    for _ in range(12):
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        _prune_step(kind, model, optimizer, schedule)
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    for layer in (model[0], model[2]):
        want = torch.autograd.grad(model(x).square().mean(), layer.weight_values)[0]
        torch.testing.assert_close(layer.weight_values.grad, want)


def test_a_graph_from_before_prune_to_raises_autograds_error_on_backward():
    layer = st.SparseLinear(8, 4, sparsity=0.5)
    old = layer(torch.randn(3, 8)).sum()
    pruning.prune_to(layer, 8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        old.backward()


@pytest.mark.parametrize("block", [None, (2, 4)])
def test_sparsify_with_the_optimizer_swaps_parameters_and_gathers_their_state(block):
    # issue 26 item 1: an optimizer built before sparsify never updated the new weight_values
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    optimizer = torch.optim.Adam([{"params": [model[0].weight, model[0].bias]},
                                  {"params": [model[2].weight, model[2].bias], "lr": 0.1}])
    x = torch.randn(5, 16)
    for _ in range(2):
        optimizer.zero_grad()
        model(x).square().sum().backward()
        optimizer.step()
    weights = [model[0].weight, model[2].weight]
    dense_state = [{k: v.clone() for k, v in optimizer.state[w].items()} for w in weights]
    biases = [model[0].bias, model[2].bias]
    st.sparsify(model, 0.5, block=block, optimizer=optimizer)
    layers = [model[0], model[2]]
    held = [p for g in optimizer.param_groups for p in g["params"]]
    want = [layers[0].weight_values, biases[0], layers[1].weight_values, biases[1]]
    assert [id(p) for p in held] == [id(p) for p in want]
    assert all(layer.bias is bias for layer, bias in zip(layers, biases))
    assert set(optimizer.state) == {*(layer.weight_values for layer in layers), *biases}
    for layer, state in zip(layers, dense_state):
        probe = copy.deepcopy(layer)  # the layer's structure, to read a state tensor as a dense matrix
        with torch.no_grad():
            probe.weight_values.fill_(1)
            stored = probe.weight == 1
            for key in ("exp_avg", "exp_avg_sq"):
                probe.weight_values.copy_(optimizer.state[layer.weight_values][key])
                assert torch.equal(probe.weight[stored], state[key][stored])
        assert torch.equal(optimizer.state[layer.weight_values]["step"], state["step"])
    before = [layer.weight_values.detach().clone() for layer in layers]
    optimizer.zero_grad()
    model(x).square().sum().backward()
    optimizer.step()
    assert all(not torch.equal(layer.weight_values, b) for layer, b in zip(layers, before))


@pytest.mark.parametrize("block", [None, (2, 2)])
def test_a_compiled_model_prunes_on_one_dynamic_graph_where_module_shapes_are_not_static(block):
    # torch gives module parameters and buffers static shapes, so each new nnz recompiles
    # (fullgraph=True fails after 8); with them dynamic one graph serves every nnz
    def train(compiled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(st.SparseLinear(16, 16, sparsity=0.0, block=block, dtype=torch.float64),
                                    torch.nn.ReLU(), torch.nn.Linear(16, 2, dtype=torch.float64))
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        schedule = st.GradualPruning(model, 0.9, start=0, steps=10, optimizer=optimizer)
        x, losses = torch.randn(8, 16, dtype=torch.float64), []
        for _ in range(12):
            loss = run(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.detach())
        return torch.stack(losses), model[0].nnz

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(force_parameter_static_shapes=False,
                                    force_nn_module_property_static_shapes=False):
        losses, nnz = train(compiled=True)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    expected, expected_nnz = train(compiled=False)
    assert nnz == expected_nnz < 30 and graphs <= 2  # 256 weights pruned to 90 %
    torch.testing.assert_close(losses, expected, rtol=1e-12, atol=1e-12)
