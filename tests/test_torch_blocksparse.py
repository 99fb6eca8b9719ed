"""block_sparse_linear: a differentiable block-sparse (BSR) layer (spchain/torch/blocksparse.py)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import reference  # noqa: E402
import spchain as sc  # noqa: E402
import spchain.torch as st  # noqa: E402


def random_weight(rng, grid, blocksize, density, dtype=torch.float64, duplicates=0):
    """``(values, indptr, indices, shape, dense)``: empty block rows, unsorted and duplicate blocks."""
    indptr, indices = reference.messy_csr(rng, *grid, density, duplicates)
    values = rng.standard_normal((indices.size, *blocksize))
    shape = (grid[0] * blocksize[0], grid[1] * blocksize[1])
    dense = reference.bsr_dense(values, indices, indptr, shape)
    return (torch.tensor(values, dtype=dtype), torch.tensor(indptr), torch.tensor(indices), shape,
            torch.tensor(dense, dtype=torch.float64))


@pytest.mark.parametrize("blocksize", [(2, 3), (4, 4), (1, 5)])
def test_gradcheck_float64_for_x_values_and_bias(rng, blocksize):
    values, indptr, indices, shape, _ = random_weight(rng, (5, 3), blocksize, 0.4, duplicates=2)
    values.requires_grad_()
    x = torch.randn(4, shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.randn(shape[0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, v, b: st.block_sparse_linear(x, v, indptr, indices, shape, b),
                                    (x, values, bias), eps=1e-6, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("blocksize", [(3, 2), (5, 6)])  # (5, 6): 4 x 4 register tiles and leftovers, both ways
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_gradients_match_the_dense_masked_layer(rng, dtype, blocksize):
    values, indptr, indices, shape, dense = random_weight(rng, (7, 4), blocksize, 0.4, dtype)
    values.requires_grad_()
    x = torch.randn(3, 5, shape[1], dtype=dtype)[:, ::2].requires_grad_()  # non-contiguous, 3-D
    bias = torch.randn(shape[0], dtype=dtype, requires_grad=True)
    y = st.block_sparse_linear(x, values, indptr, indices, shape, bias)
    assert y.shape == (3, 3, shape[0]) and y.dtype == dtype
    grad_y = torch.randn(y.shape, dtype=dtype)
    y.backward(grad_y)
    x64, g64 = x.detach().double(), grad_y.double()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(y.detach().double(), x64 @ dense.T + bias.detach().double(), **tol)
    torch.testing.assert_close(x.grad.double(), g64 @ dense, **tol)
    torch.testing.assert_close(bias.grad.double(), g64.sum((0, 1)), **tol)
    full = (g64.reshape(-1, shape[0]).T @ x64.reshape(-1, shape[1])).numpy()
    r, c = values.shape[1:]
    rows = np.repeat(np.arange(7), np.diff(indptr.numpy()))
    want = np.stack([full[i * r:(i + 1) * r, j * c:(j + 1) * c] for i, j in zip(rows, indices.numpy())])
    torch.testing.assert_close(values.grad.double(), torch.tensor(want), **tol)


def test_no_blocks_and_empty_batch_give_zero_results_and_gradients():
    values = torch.zeros(0, 2, 2, dtype=torch.float64, requires_grad=True)
    indptr, indices = torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    y = st.block_sparse_linear(x, values, indptr, indices, (4, 6))
    y.sum().backward()
    assert not y.any() and not x.grad.any() and values.grad.shape == (0, 2, 2)
    values, indptr, indices = torch.ones(1, 2, 2, requires_grad=True), torch.tensor([0, 1, 1]), torch.tensor([2])
    y = st.block_sparse_linear(torch.zeros(0, 6), values, indptr, indices, (4, 6))
    y.sum().backward()
    assert y.shape == (0, 4) and not values.grad.any()


def test_inference_without_grad_matches(rng):
    values, indptr, indices, shape, dense = random_weight(rng, (4, 4), (4, 4), 0.5, torch.float32)
    x = torch.randn(6, shape[1])
    with torch.no_grad():
        y = st.block_sparse_linear(x, values.requires_grad_(), indptr, indices, shape)
    assert y.grad_fn is None
    torch.testing.assert_close(y.double(), x.double() @ dense.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args, error, message", [
    ((torch.ones(2, 5), torch.ones(1, 2, 2), torch.tensor([0, 1, 1]), torch.tensor([0]), (4, 4)),
     ValueError, "x's last axis must be 4"),
    ((torch.ones(2, 4), torch.ones(1, 4), torch.tensor([0, 1, 1]), torch.tensor([0]), (4, 4)),
     ValueError, "values must be 3-D"),
    ((torch.ones(2, 4), torch.ones(1, 2, 2), torch.tensor([0, 1]), torch.tensor([0]), (4, 4)),
     ValueError, "indptr has length 2; expected 3"),
    ((torch.ones(2, 4), torch.ones(1, 2, 2), torch.tensor([0, 1, 1]), torch.tensor([5]), (4, 4)),
     ValueError, "indices holds 5"),
    ((torch.ones(2, 6), torch.ones(1, 4, 4), torch.tensor([0, 1]), torch.tensor([0]), (4, 6)),
     ValueError, "not a whole number of"),
    ((torch.ones(2, 4), torch.ones(1, 2, 2, dtype=torch.int64), torch.tensor([0, 1, 1]), torch.tensor([0]), (4, 4)),
     TypeError, "dtype int64"),
])
def test_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        st.block_sparse_linear(*args)
    with pytest.raises(ValueError, match=r"bias has shape \(3,\)"):
        st.block_sparse_linear(torch.ones(2, 4), torch.ones(1, 2, 2), torch.tensor([0, 1, 1]), torch.tensor([0]),
                               (4, 4), torch.ones(3))


def test_trains_the_blocks_of_a_pruned_weight():
    w = torch.randn(8, 12, dtype=torch.float64)
    a = sc.prune(w.numpy(), 0.5, block=(4, 4))
    values = torch.tensor(a.data, requires_grad=True)
    optimizer = torch.optim.SGD([values], lr=0.1)
    x = torch.randn(5, 12, dtype=torch.float64)
    loss = st.block_sparse_linear(x, values, torch.tensor(a.indptr), torch.tensor(a.indices), (8, 12)).square().sum()
    loss.backward()
    optimizer.step()
    assert values.shape == (3, 4, 4) and not torch.equal(values.detach(), torch.tensor(a.data))


def test_torch_func_grad_vmap_and_compile(rng):
    """Two missing gradients (x and bias) at once: the backward operator's returns must not alias."""
    values, indptr, indices, shape, dense = random_weight(rng, (2, 3), (4, 4), 0.5)
    x = torch.randn(3, shape[1], dtype=torch.float64)

    def loss(v):
        return st.block_sparse_linear(x, v, indptr, indices, shape).square().sum()

    leaf = values.clone().requires_grad_()
    loss(leaf).backward()
    torch.testing.assert_close(torch.func.grad(loss)(values), leaf.grad, rtol=1e-12, atol=1e-12)
    xs = torch.randn(5, 3, shape[1], dtype=torch.float64)
    ys = torch.func.vmap(lambda x: st.block_sparse_linear(x, values, indptr, indices, shape))(xs)
    torch.testing.assert_close(ys, xs @ dense.T, rtol=1e-12, atol=1e-12)
    compiled = torch.compile(lambda x: st.block_sparse_linear(x, values, indptr, indices, shape), fullgraph=True)
    torch.testing.assert_close(compiled(x), x @ dense.T, rtol=1e-12, atol=1e-12)
