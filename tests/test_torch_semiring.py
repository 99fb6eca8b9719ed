"""spchain.torch logmatmul / maxmatmul / log_chain_product: autograd and gradcheck."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as hyp
from hypothesis.extra import numpy as hnp

torch = pytest.importorskip("torch")

import reference  # noqa: E402
import spchain.torch as st  # noqa: E402
from spchain import semiring  # noqa: E402


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("a_shape, b_shape", [((3, 4), (4, 5)), ((2, 3, 4), (4, 2)), ((2, 1, 3, 2), (3, 2, 4))])
def test_logmatmul_gradcheck(a_shape, b_shape):
    a, b = randn(*a_shape).requires_grad_(), randn(*b_shape, seed=1).requires_grad_()
    assert torch.autograd.gradcheck(st.logmatmul, (a, b), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_logmatmul_gradients_match_broadcasting_autograd():
    a, b = randn(4, 6, 5) * 3, randn(5, 7, seed=1) * 3
    a[1, :, 2] = -math.inf  # structural zeros: zero gradient there
    ours = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    theirs = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    g = randn(4, 6, 7, seed=2)
    (st.logmatmul(*ours) * g).sum().backward()
    (torch.logsumexp(theirs[0][..., :, :, None] + theirs[1][..., None, :, :], dim=-2) * g).sum().backward()
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)
    assert (ours[0].grad[1, :, 2] == 0).all()


def test_logmatmul_all_minus_inf_row_gives_minus_inf_and_zero_gradient():
    a = randn(3, 4)
    a[1] = -math.inf
    a.requires_grad_()
    out = st.logmatmul(a, randn(4, 2, seed=1))
    assert torch.isneginf(out[1]).all()
    out.sum().backward()
    assert (a.grad[1] == 0).all() and torch.isfinite(a.grad).all()


def test_logmatmul_gradient_of_underflowed_entries_is_exact():
    a = torch.tensor([[0.0, -300.0]], requires_grad=True)
    b = torch.tensor([[-math.inf], [0.0]], requires_grad=True)
    st.logmatmul(a, b).sum().backward()
    torch.testing.assert_close(a.grad, torch.tensor([[0.0, 1.0]]))
    torch.testing.assert_close(b.grad, torch.tensor([[0.0], [1.0]]))


def test_logmatmul_backward_twice_and_float32():
    a, b = randn(3, 4).float().requires_grad_(), randn(4, 2, seed=1).float().requires_grad_()
    out = st.logmatmul(a, b).sum()
    out.backward(retain_graph=True)
    first = a.grad.clone()
    out.backward()
    torch.testing.assert_close(a.grad, 2 * first)


def test_maxmatmul_values_gradcheck_and_argmax_is_not_differentiable():
    a, b = randn(2, 3, 4).requires_grad_(), randn(4, 5, seed=1).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: st.maxmatmul(a, b)[0], (a, b), eps=1e-6, atol=1e-8)
    values, argmax = st.maxmatmul(a, b)
    assert values.requires_grad and not argmax.requires_grad and argmax.dtype == torch.int64


@pytest.mark.parametrize("length", [1, 2, 3, 5])
def test_log_chain_product_gradcheck(length):
    m = randn(2, length, 3, 3).requires_grad_()
    assert torch.autograd.gradcheck(st.log_chain_product, (m,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_log_chain_product_gradient_in_chunks_with_minus_inf(monkeypatch):
    monkeypatch.setattr(semiring, "CHAIN_CHUNK_BYTES", 1)
    m = randn(3, 4, 3, 3)
    m[:, :, 0, 2] = -math.inf
    m = m.requires_grad_()
    assert torch.autograd.gradcheck(st.log_chain_product, (m,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_log_chain_product_value_matches_reference():
    m = randn(2, 7, 4, 4)
    np.testing.assert_allclose(st.log_chain_product(m).numpy(), reference.log_chain_product(m.numpy()), rtol=1e-12)


def test_devices_must_match():
    with pytest.raises(ValueError, match="a is on cpu but b is on meta"):
        st.logmatmul(randn(2, 2), randn(2, 2).to("meta"))


@pytest.mark.gpu
def test_cuda_tensors_match_cpu():
    a, b = randn(3, 5, 4), randn(4, 6, seed=1)
    for fn in (st.logmatmul, lambda a, b: st.maxmatmul(a, b)[0]):
        cpu = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        gpu = [a.cuda().requires_grad_(), b.cuda().requires_grad_()]
        fn(*cpu).sum().backward()
        fn(*gpu).sum().backward()
        for x, y in zip(gpu, cpu):
            torch.testing.assert_close(x.grad.cpu(), y.grad)
    m = randn(2, 5, 3, 3)
    torch.testing.assert_close(st.log_chain_product(m.cuda()).cpu(), st.log_chain_product(m))


SEMIRING_OPS = {
    "logmatmul": lambda a, b: st.logmatmul(a, b),
    "maxmatmul": lambda a, b: st.maxmatmul(a, b)[0],
    "log_chain_product": lambda a, b: st.log_chain_product(torch.stack([a, b])),
}


@pytest.mark.parametrize("name", SEMIRING_OPS)
def test_double_backward_raises_instead_of_a_silent_first_order_gradient(name):
    fn = SEMIRING_OPS[name]
    a, b = randn(3, 3).requires_grad_(), randn(3, 3, seed=1).requires_grad_()
    match = rf"spchain.torch.{name}: double backward \(create_graph=True.*is not implemented"
    with pytest.raises(RuntimeError, match=match):
        torch.autograd.grad(fn(a, b).sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match=match):
        torch.autograd.functional.hessian(lambda a: fn(a, b).sum(), a)
    (grad,) = torch.autograd.grad(fn(a, b).sum(), a)  # first order is fine
    assert grad.shape == a.shape


RTOL = {torch.float64: 1e-12, torch.float32: 3e-5}  # float32: a few roundings of the scales, summed
SCALES = {torch.float64: (1e-200, 1e200), torch.float32: (1e-25, 1e25)}


def grad_with_scales(fn, inputs, out_shape, dtype, axis):
    """Gradients of ``fn`` with incoming gradients of ``scales`` along ``axis``, and the same
    computed with incoming gradients of 1 (each scaled afterwards: the gradient is linear)."""
    tiny, huge = SCALES[dtype]
    scales = torch.tensor([tiny, huge], dtype=dtype).reshape((2,) + (1,) * (len(out_shape) - 1 - axis))
    g = randn(*out_shape, seed=3).to(dtype) * scales
    ones = [x.detach().clone().requires_grad_() for x in inputs]
    fn(*inputs).backward(g)
    fn(*ones).backward(g / scales)
    return [(x.grad, y.grad) for x, y in zip(inputs, ones)], scales


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_logmatmul_gradient_is_scaled_per_batch_element(dtype):
    a, b = (randn(2, 3, 4) * 3).to(dtype).requires_grad_(), (randn(4, 5, seed=1) * 3).to(dtype).requires_grad_()
    [(got_a, want_a), _], scales = grad_with_scales(st.logmatmul, (a, b), (2, 3, 5), dtype, 0)
    torch.testing.assert_close(got_a, want_a * scales, rtol=RTOL[dtype], atol=0)  # the tiny element was 0
    assert (got_a[0] != 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_log_chain_product_gradient_is_scaled_per_batch_element(dtype):
    m = randn(2, 4, 3, 3).to(dtype).requires_grad_()
    [(got, want)], scales = grad_with_scales(st.log_chain_product, (m,), (2, 3, 3), dtype, 0)
    torch.testing.assert_close(got, want * scales[..., None], rtol=RTOL[dtype], atol=0)
    assert (got[0] != 0).all()


def test_chain_gemm_sweep_transition_gradient_is_scaled_per_group():
    import spchain

    with spchain.chain_sweep("gemm"):
        x = randn(2, 5, 3).requires_grad_()
        trans = randn(2, 4, 3, 3, seed=1).requires_grad_()  # one set of transitions per chain
        [(got_x, want_x), (got_t, want_t)], scales = grad_with_scales(st.chain_logsumexp, (x, trans), (2,), torch.float64, 0)
        torch.testing.assert_close(got_t, want_t * scales[:, None, None, None], rtol=1e-12, atol=0)
        assert (got_t[0] != 0).all()
        torch.testing.assert_close(got_x, want_x * scales[:, None, None], rtol=1e-12, atol=0)


# +inf and -inf (docs/design.rst, "Numerical rules") ------------------------------------

with_infinities = hyp.one_of(hyp.just(-math.inf), hyp.just(math.inf), hyp.floats(-20, 20))


@given(data=hyp.data(), m=hyp.integers(0, 3), k=hyp.integers(0, 3), n=hyp.integers(0, 3), batch=hyp.integers(1, 2))
def test_logmatmul_gradients_with_plus_and_minus_inf_follow_the_rule(data, m, k, n, batch):
    a = data.draw(hnp.arrays(np.float64, (batch, m, k), elements=with_infinities))
    b = data.draw(hnp.arrays(np.float64, (k, n), elements=with_infinities))
    grad = data.draw(hnp.arrays(np.float64, (batch, m, n), elements=hyp.floats(-2, 2)))
    want_out, want_a, want_b = reference.log_matmul_and_grads(a, b, grad)
    at, bt = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    out = st.logmatmul(at, bt)
    out.backward(torch.tensor(grad))
    np.testing.assert_allclose(out.detach().numpy(), want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(at.grad.numpy(), want_a, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(bt.grad.numpy(), want_b, rtol=1e-10, atol=1e-12)


def test_plus_inf_output_shares_its_gradient_equally():
    a = torch.tensor([[math.inf, 0.0]], requires_grad=True)
    b = torch.tensor([[-math.inf, 1.0], [0.0, math.inf]], requires_grad=True)
    for fn in (st.logmatmul, lambda a, b: st.maxmatmul(a, b)[0]):
        a.grad = b.grad = None
        out = fn(a, b)
        torch.testing.assert_close(out.detach(), torch.tensor([[0.0, math.inf]]))
        out.sum().backward()
        # column 0 is its finite term (k = 1); column 1 has two +inf terms, 1/2 each
        torch.testing.assert_close(a.grad, torch.tensor([[0.5, 1.5]]))
        torch.testing.assert_close(b.grad, torch.tensor([[0.0, 0.5], [1.0, 0.5]]))


@pytest.mark.parametrize("length", [1, 2, 3, 5])
def test_log_chain_product_gradient_with_plus_and_minus_inf(length):
    rng = np.random.default_rng(length)
    m = rng.normal(size=(2, length, 3, 3))
    m[rng.random(m.shape) < 0.15] = math.inf
    m[rng.random(m.shape) < 0.3] = -math.inf
    grad = rng.normal(size=(2, 3, 3))
    mt = torch.tensor(m, requires_grad=True)
    st.log_chain_product(mt).backward(torch.tensor(grad))
    want_out, want_grad = reference.log_chain_product_and_grad(m, grad)
    assert not torch.isnan(mt.grad).any()
    np.testing.assert_allclose(mt.grad.numpy(), want_grad, rtol=1e-10, atol=1e-12)


def test_maxmatmul_all_minus_inf_terms_give_minus_inf_and_zero_gradient():
    a = torch.tensor([[-math.inf, -math.inf], [0.0, 1.0]], requires_grad=True)
    b = torch.tensor([[0.0, -math.inf], [0.0, -math.inf]], requires_grad=True)
    values, argmax = st.maxmatmul(a, b)
    assert torch.isneginf(values[0]).all() and torch.isneginf(values[:, 1]).all()
    assert (argmax[0] == 0).all()  # documented: argmax 0 where every term is -inf
    values.sum().backward()
    torch.testing.assert_close(a.grad, torch.tensor([[0.0, 0.0], [0.0, 1.0]]))
    torch.testing.assert_close(b.grad, torch.tensor([[0.0, 0.0], [1.0, 0.0]]))


@pytest.mark.parametrize("a_shape, b_shape", [((2, 0), (0, 3)), ((0, 2), (2, 3)), ((2, 2), (2, 0)), ((0, 2, 2), (2, 2))])
def test_empty_shapes_give_correct_results_and_zero_gradients(a_shape, b_shape):
    for fn in (st.logmatmul, lambda a, b: st.maxmatmul(a, b)[0]):
        a, b = torch.zeros(a_shape, requires_grad=True), torch.zeros(b_shape, requires_grad=True)
        out = fn(a, b)
        assert torch.isneginf(out).all()
        out.sum().backward()
        assert a.grad.shape == a_shape and b.grad.shape == b_shape
        assert (a.grad == 0).all() and (b.grad == 0).all()
    m = torch.zeros(0, 3, 2, 2, requires_grad=True)
    st.log_chain_product(m).sum().backward()
    assert m.grad.shape == m.shape


@pytest.mark.parametrize("to_sparse", [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr], ids=["coo", "csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_are_type_errors_naming_the_layout(to_sparse):
    dense = randn(3, 3)
    sparse = to_sparse(dense)
    with pytest.raises(TypeError, match=r"spchain.torch.logmatmul: b must be a dense tensor, not one of layout torch.sparse_(coo|csr)"):
        st.logmatmul(dense, sparse)
    with pytest.raises(TypeError, match=r"spchain.torch.maxmatmul: a must be a dense tensor, not one of layout torch.sparse_(coo|csr)"):
        st.maxmatmul(sparse, dense)
    with pytest.raises(TypeError, match=r"spchain.torch.log_chain_product: m must be a dense tensor, not one of layout torch.sparse_coo"):
        st.log_chain_product(dense[None].to_sparse())


@pytest.mark.parametrize("a, match", [(0.0, "a must be a torch.Tensor, not float"), (None, "a must be a torch.Tensor, not NoneType"),
                                      ([[0.0]], "a must be a torch.Tensor, not list")])
def test_scalars_none_and_lists_are_type_errors_naming_the_argument(a, match):
    for fn in (st.logmatmul, st.maxmatmul):
        with pytest.raises(TypeError, match=match):
            fn(a, randn(1, 1))


# bad input (docs/design.rst) ---------------------------------------------------------------------

TORCH_OPS = {
    "logmatmul": lambda a, b: st.logmatmul(a, b),
    "maxmatmul": lambda a, b: st.maxmatmul(a, b)[0],
    "log_chain_product": lambda a, b: st.log_chain_product(torch.stack([a, b.expand_as(a)])),
}


@pytest.mark.parametrize("name", TORCH_OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_computes_in_float32_and_returns_the_input_dtype(name, dtype):
    a, b = randn(3, 3).to(dtype).requires_grad_(), randn(3, 3, seed=1).to(dtype).requires_grad_()
    out = TORCH_OPS[name](a, b)
    assert out.dtype == dtype
    want = TORCH_OPS[name](a.detach().float(), b.detach().float())
    torch.testing.assert_close(out.float(), want.to(dtype).float())
    out.float().sum().backward()
    assert a.grad.dtype == dtype and b.grad.dtype == dtype


@pytest.mark.parametrize("name", TORCH_OPS)
def test_mixed_float32_and_float64_compute_in_float64_with_gradients_in_each_dtype(name):
    a, b = randn(3, 3).float().requires_grad_(), randn(3, 3, seed=1).requires_grad_()
    out = TORCH_OPS[name](a, b)
    assert out.dtype == torch.float64
    want = TORCH_OPS[name](a.detach().double(), b.detach())
    torch.testing.assert_close(out.detach(), want)
    out.sum().backward()
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float64


@pytest.mark.parametrize("name", TORCH_OPS)
def test_backward_twice_with_retain_graph_and_no_grad(name):
    a, b = randn(3, 3).requires_grad_(), randn(3, 3, seed=1).requires_grad_()
    out = TORCH_OPS[name](a, b).sum()
    out.backward(retain_graph=True)
    first = a.grad.clone()
    out.backward()
    torch.testing.assert_close(a.grad, 2 * first)
    with torch.no_grad():
        out = TORCH_OPS[name](a, b)
    assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize("name", TORCH_OPS)
def test_non_contiguous_and_zero_stride_tensors(name):
    base = randn(3, 6)
    a = base[:, ::2].requires_grad_()  # non-contiguous leaf: a strided view
    b = torch.zeros(1, 3, dtype=torch.float64).expand(3, 3).requires_grad_()  # 0-stride
    out = TORCH_OPS[name](a, b)
    want = TORCH_OPS[name](a.detach().contiguous(), b.detach().contiguous())
    torch.testing.assert_close(out.detach(), want)
    out.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape


def test_log_chain_product_nan_reaches_only_its_batch_element():
    m = randn(2, 3, 2, 2)
    m[0, 1, 0, 0] = math.nan
    m.requires_grad_()
    out = st.log_chain_product(m)
    assert torch.isnan(out[0]).any() and not torch.isnan(out[1]).any()
    out.sum().backward()
    assert not torch.isnan(m.grad[1]).any()


@pytest.mark.parametrize("name", ["logmatmul", "maxmatmul"])
def test_vmap_over_operands_with_different_batch_ranks_equals_a_loop(name):
    fn = TORCH_OPS[name]
    a, b = randn(2, 2, 3, 4), randn(2, 4, 5, seed=1)  # vmapped: a (2, 3, 4) with b (4, 5)
    out = torch.vmap(fn)(a, b)
    for k in range(2):
        torch.testing.assert_close(out[k], fn(a[k], b[k]))
    grads = torch.vmap(torch.func.grad(lambda a, b: fn(a, b).sum(), argnums=(0, 1)))(a, b)
    for k in range(2):
        leaves = [a[k].clone().requires_grad_(), b[k].clone().requires_grad_()]
        for g, e in zip(grads, torch.autograd.grad(fn(*leaves).sum(), leaves)):
            torch.testing.assert_close(g[k], e)
