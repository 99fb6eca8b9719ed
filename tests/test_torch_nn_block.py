"""SparseLinear with a block-sparse (BSR) weight and N:M pruning (spchain/torch/nn.py,
spchain/torch/_block_layer.py): against dense masked and SciPy BSR references in float64,
block regrowth with the optimizer state, block sparsify and GradualPruning (issue 15)."""

import numpy as np
import pytest
import scipy.sparse

torch = pytest.importorskip("torch")

import spchain as sc  # noqa: E402
import spchain.torch as st  # noqa: E402
from spchain.torch import pruning  # noqa: E402

import reference  # noqa: E402


def _layer(seed=0, shape=(12, 8), block=(3, 2), sparsity=0.5, **kwargs):
    torch.manual_seed(seed)
    return st.SparseLinear(shape[1], shape[0], sparsity=sparsity, block=block, dtype=torch.float64, **kwargs)


def _blocks(layer):
    """The flat block-grid positions of the stored blocks, row-major."""
    rows = torch.repeat_interleave(torch.arange(layer.indptr.shape[0] - 1), layer.indptr.diff().long())
    return (rows * (layer.in_features // layer.block[1]) + layer.indices.long()).numpy()


def _scipy(layer):
    return scipy.sparse.bsr_array((layer.weight_values.detach().numpy(), layer.indices.numpy(), layer.indptr.numpy()),
                                  shape=(layer.out_features, layer.in_features))


def _block_norms(w, block):
    r, c = block
    return np.sqrt(np.square(w).reshape(w.shape[0] // r, r, w.shape[1] // c, c).sum(axis=(1, 3))).ravel()


@pytest.mark.parametrize("shape, block, sparsity", [((12, 8), (3, 2), 0.5), ((8, 8), (4, 4), 0.75),
                                                    ((6, 9), (1, 3), 0.0), ((4, 4), (2, 2), 1.0),
                                                    ((5, 7), (1, 1), 0.6)])
@pytest.mark.parametrize("batch", [(4,), (2, 3), (0,)])
def test_block_layer_matches_scipy_bsr_and_the_dense_masked_reference(shape, block, sparsity, batch):
    layer = _layer(shape=shape, block=block, sparsity=sparsity)
    nblocks = shape[0] * shape[1] // (block[0] * block[1])
    assert layer.weight_values.shape == (nblocks - round(sparsity * nblocks), *block)
    assert layer.nnz == layer.weight_values.numel() and layer.sparsity == 1 - layer.nnz / (shape[0] * shape[1])
    positions = _blocks(layer)
    assert np.all(np.diff(positions) > 0)  # canonical: sorted, no duplicates
    dense = _scipy(layer).toarray()
    mask = np.kron(np.isin(np.arange(nblocks), positions).reshape(shape[0] // block[0], -1), np.ones(block))
    assert np.all(dense[mask == 0] == 0)
    np.testing.assert_array_equal(layer.weight.detach().numpy(), dense)
    torch.testing.assert_close(layer.weight_csr().to_dense(), layer.weight.detach(), rtol=0, atol=0)
    x = torch.randn(*batch, shape[1], dtype=torch.float64, requires_grad=True)
    y = layer(x)
    want = (_scipy(layer) @ x.detach().reshape(-1, shape[1]).numpy().T).T + layer.bias.detach().numpy()
    np.testing.assert_allclose(y.detach().reshape(-1, shape[0]).numpy(), want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    y.backward(g)
    w = layer.weight.detach().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    (x2 @ w.T).backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)
    rows = torch.repeat_interleave(torch.arange(shape[0] // block[0]), layer.indptr.diff().long())
    tiles = w.grad.reshape(shape[0] // block[0], block[0], -1, block[1]).transpose(1, 2)
    torch.testing.assert_close(layer.weight_values.grad, tiles[rows, layer.indices.long()], rtol=1e-12, atol=1e-12)


def test_block_layer_gradcheck_in_values_x_and_bias():
    layer = _layer(sparsity=0.5)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    values, bias = layer.weight_values.detach().requires_grad_(), layer.bias.detach().requires_grad_()
    shape = (layer.out_features, layer.in_features)

    def f(x, values, bias):
        return st.block_sparse_linear(x, values, layer.indptr, layer.indices, shape, bias)

    assert torch.autograd.gradcheck(f, (x, values, bias))

    def through_layer(x, values, bias):
        return torch.func.functional_call(layer, {"weight_values": values, "bias": bias}, (x,))

    assert torch.autograd.gradcheck(through_layer, (x, values, bias))


# an optimizer and the keys of its per-block state: Adam's moments are shaped like the blocks,
# Adafactor's second moment is factored over each block's axes ((nnzb, R, 1) and (nnzb, 1, C))
OPTIMIZERS = {"Adam": (torch.optim.Adam, ("exp_avg", "exp_avg_sq")),
              "Adafactor": (torch.optim.Adafactor, ("row_var", "col_var"))}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_block_prune_and_regrow_keeps_nnzb_and_moves_optimizer_state_per_block(name):
    make, keys = OPTIMIZERS[name]
    torch.manual_seed(2)
    layer = st.SparseLinear(16, 12, sparsity=0.6, block=(2, 4))
    optimizer = make(layer.parameters(), lr=1e-2)
    x = torch.randn(32, 16)
    for _ in range(3):
        optimizer.zero_grad()
        layer(x).square().mean().backward()
        optimizer.step()
    before_pos, before_values = _blocks(layer), layer.weight_values.detach().clone()
    state = optimizer.state[layer.weight_values]
    before_state = {k: v.clone() for k, v in state.items()}
    before_grad = layer.weight_values.grad.clone()
    nnzb = layer.weight_values.shape[0]
    n_move = round(0.5 * nnzb)
    layer.prune_and_regrow(0.5, optimizer=optimizer)
    after_pos = _blocks(layer)
    assert layer.weight_values.shape == (nnzb, 2, 4) and np.all(np.diff(after_pos) > 0)
    survivors = reference.largest_positions(_block_norms_of(before_values), nnzb - n_move)
    slot = {p: s for s, p in enumerate(after_pos)}
    new_slots = np.array([slot[p] for p in before_pos[survivors]])
    fresh = np.setdiff1d(np.arange(nnzb), new_slots)
    assert fresh.size == n_move
    for after, before in [(layer.weight_values.detach(), before_values), (layer.weight_values.grad, before_grad),
                          *((state[k], before_state[k]) for k in keys)]:
        torch.testing.assert_close(after[new_slots], before[survivors], rtol=0, atol=0)
        assert bool((after[fresh] == 0).all())
    assert state["step"] == before_state["step"]
    optimizer.step()
    layer(x).sum().backward()  # the layer and optimizer work unchanged afterwards


@pytest.mark.parametrize("regrow", ["random", "gradient"])
def test_block_layers_without_blocks_prune_regrow_and_train_as_the_csr_layer_does(regrow):
    # issue 22 item 8: no stored block, a reshape error before
    layer = st.SparseLinear(8, 4, sparsity=1.0, block=(2, 2))
    assert layer.weight_values.shape == (0, 2, 2)
    x = torch.randn(3, 8)
    layer(x).sum().backward()
    layer.prune_and_regrow(0.5, regrow=regrow)
    assert layer.weight_values.shape == (0, 2, 2) and layer.indptr.tolist() == [0, 0, 0]
    pruning.prune_to(layer, 0)
    kept = st.SparseLinear(8, 4, sparsity=0.5, block=(2, 2))
    pruning.prune_to(kept, 0)
    assert kept.weight_values.shape == (0, 2, 2)
    torch.testing.assert_close(kept(x), kept.bias.expand(3, 4))


def _block_norms_of(values):
    return values.double().flatten(1).norm(dim=1).numpy()


@pytest.mark.parametrize("inplace", [False, True], ids=["", "in-place ReLU after"])
def test_block_regrow_by_gradient_picks_the_largest_dense_gradient_block_norms(inplace):
    torch.manual_seed(3)
    layer = st.SparseLinear(12, 8, sparsity=0.7, block=(2, 3), dtype=torch.float64)
    x = torch.randn(16, 12, dtype=torch.float64)
    dense = layer.to_dense()
    for model in (layer, dense):
        torch.nn.functional.relu(model(x), inplace=inplace).pow(3).mean().backward()
    before = _blocks(layer)
    nnzb = layer.weight_values.shape[0]
    n_move = round(0.5 * nnzb)
    kept = before[reference.largest_positions(_block_norms_of(layer.weight_values.detach()), nnzb - n_move)]
    scores = _block_norms(dense.weight.grad.numpy(), (2, 3))
    free = np.setdiff1d(np.arange(scores.size), kept)
    want = np.sort(np.concatenate([kept, free[reference.largest_positions(scores[free], n_move)]]))
    layer.prune_and_regrow(0.5, regrow="gradient")
    np.testing.assert_array_equal(_blocks(layer), want)


@pytest.mark.parametrize("method", ["magnitude", "random"])
def test_from_dense_with_block_keeps_the_blocks_of_spchain_prune(method):
    torch.manual_seed(4)
    linear = torch.nn.Linear(8, 6, dtype=torch.float64)
    layer = st.SparseLinear.from_dense(linear, 0.5, method=method, block=(3, 2))
    assert layer.block == (3, 2) and layer.weight_values.shape == (4, 3, 2)
    dense = layer.weight.detach().numpy()
    w = linear.weight.detach().numpy()
    if method == "magnitude":
        np.testing.assert_array_equal(dense, sc.prune(w, 0.5, block=(3, 2)).toarray())
    else:
        assert np.all((dense == 0) | (dense == w))
    x = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ torch.from_numpy(dense).T + linear.bias, rtol=1e-12, atol=1e-12)
    layer.weight_values.data.zero_()
    assert bool((linear.weight != 0).all())  # a copy: never a view of the dense weight


@pytest.mark.parametrize("pattern, dtype", [("2:4", torch.float64), ("1:4", torch.float32), ("3:8", torch.float64),
                                            ("2:4", torch.bfloat16)])
def test_from_dense_n_m_pattern_is_exact(pattern, dtype):
    n, m = (int(k) for k in pattern.split(":"))
    torch.manual_seed(5)
    linear = torch.nn.Linear(16, 6, dtype=dtype)
    with torch.no_grad():
        linear.weight[0, :m] = 0.0  # a group of zeros keeps n stored zeros
    layer = st.SparseLinear.from_dense(linear, pattern=pattern)
    assert layer.block is None and layer.nnz == 6 * 16 * n // m and layer.weight_values.dtype == dtype
    w = linear.weight.detach().double().numpy()
    rows = np.repeat(np.arange(6), np.diff(layer.indptr.numpy()))
    cols = layer.indices.numpy()
    groups = np.zeros((6, 16 // m), int)
    np.add.at(groups, (rows, cols // m), 1)
    assert np.all(groups == n)  # exactly n stored in every group of m consecutive inputs
    kept = np.zeros(w.shape, bool)
    kept[rows, cols] = True
    for i in range(6):
        for g in range(16 // m):
            a = np.abs(w[i, g * m:(g + 1) * m])
            k = kept[i, g * m:(g + 1) * m]
            assert a[k].min() >= a[~k].max()
    np.testing.assert_array_equal(layer.weight.detach().double().numpy(), np.where(kept, w, 0.0))
    np.testing.assert_array_equal(layer.weight.detach().double().numpy(),
                                  sc.prune(w, method="n:m", n=n, m=m).toarray())


def test_meta_construction_then_to_empty_and_reset_parameters_is_a_valid_block_layer():
    layer = _layer(device="meta")
    assert layer.weight_values.is_meta and layer.weight_values.shape == (8, 3, 2)
    layer.to_empty(device="cpu")
    torch.manual_seed(0)
    layer.reset_parameters()
    reference_layer = _layer()  # the same draws
    for name in ("indptr", "indices", "weight_values", "bias"):
        torch.testing.assert_close(getattr(layer, name), getattr(reference_layer, name))


def test_block_layer_state_dict_round_trip():
    source, target = _layer(seed=0), _layer(seed=1)
    target.load_state_dict(source.state_dict())
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)
    assert "block=(3, 2)" in repr(target)


@pytest.mark.parametrize("block, error, message", [
    ((5, 2), ValueError, r"block=\(5, 2\) needs out_features \(12\) a multiple of R"),
    ((3, 3), ValueError, r"in_features \(8\) a multiple of C"),
    ((0, 2), ValueError, "needs out_features"),
    (3, TypeError, "block must be a pair of ints"),
    ((2.0, 2), TypeError, "block must be a pair of ints"),
])
def test_bad_block_sizes_raise(block, error, message):
    with pytest.raises(error, match=message):
        st.SparseLinear(8, 12, block=block)
    with pytest.raises(error, match=message):
        st.SparseLinear.from_dense(torch.nn.Linear(8, 12), 0.5, block=block)


def test_from_dense_bad_pattern():
    linear = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match="pattern must be a string 'n:m'"):
        st.SparseLinear.from_dense(linear, pattern="2/4")
    with pytest.raises(ValueError, match="do not split into groups of m = 3"):
        st.SparseLinear.from_dense(linear, pattern="2:3")
    with pytest.raises(ValueError, match="has sparsity 0.5, not 0.9"):
        st.SparseLinear.from_dense(linear, 0.9, pattern="2:4")
    with pytest.raises(ValueError, match="block or pattern, not both"):
        st.SparseLinear.from_dense(linear, block=(2, 2), pattern="2:4")
    for method in ("n:m", "random"):
        with pytest.raises(ValueError, match="for N:M pruning pass pattern='n:m'"):
            st.SparseLinear.from_dense(linear, 0.5 if method == "n:m" else None, method=method,
                                       pattern=None if method == "n:m" else "2:4")
    for block in (None, (2, 2)):
        with pytest.raises(ValueError, match="needs a sparsity"):
            st.SparseLinear.from_dense(linear, block=block)


def test_sparsify_with_blocks_round_trips_at_sparsity_0_and_checks_every_layer_first():
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).double()
    x = torch.randn(5, 12, dtype=torch.float64)
    want = model(x)
    assert st.sparsify(model, 0.0, block=(4, 4)) == ["0", "2"]
    assert model[0].block == (4, 4) and model[0].sparsity == 0.0
    torch.testing.assert_close(model(x), want, rtol=1e-12, atol=1e-12)
    other = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Linear(8, 6))
    with pytest.raises(ValueError, match="layer '1'.*multiple of R"):
        st.sparsify(other, 0.5, block=(4, 4))
    assert type(other[0]) is torch.nn.Linear  # nothing replaced


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_gradual_pruning_of_block_layers_reaches_the_final_density_and_state_follows_blocks(name):
    make, keys = OPTIMIZERS[name]
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8, dtype=torch.float64))
    st.sparsify(model, 0.0, block=(2, 2))
    layer = model[0]
    parameter = layer.weight_values
    optimizer = make(model.parameters(), lr=1e-2)
    optimizer.zero_grad()
    model(torch.randn(5, 16, dtype=torch.float64)).square().sum().backward()
    optimizer.step()
    before_pos, before_values = _blocks(layer), parameter.detach().clone()
    before = {k: v.clone() for k, v in optimizer.state[parameter].items()}
    schedule = st.GradualPruning(model, 0.75, start=0, steps=2, optimizer=optimizer)
    for _ in range(3):
        schedule.step()
    assert layer.weight_values is parameter and parameter.shape == (8, 2, 2)
    assert layer.sparsity == 0.75  # the final density exactly
    kept = np.isin(before_pos, _blocks(layer))
    norms = _block_norms_of(before_values)
    assert norms[kept].min() >= norms[~kept].max()
    for key in keys:
        assert torch.equal(optimizer.state[parameter][key], before[key][torch.from_numpy(kept)])
    model(torch.randn(5, 16, dtype=torch.float64)).sum().backward()
    optimizer.step()
