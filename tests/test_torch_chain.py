"""spchain.torch.chain_logsumexp / chain_marginals: autograd, gradcheck, devices, leaks."""

import math

import pytest

torch = pytest.importorskip("torch")

import reference  # noqa: E402
import spchain as sc  # noqa: E402
import spchain.torch as st  # noqa: E402


@pytest.fixture(params=["gemm", "kernel"])
def algorithm(request):
    with sc.chain_sweep(request.param):
        yield request.param


def inputs(batch, v, c, *, per_step=True, trans_batch=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch + (v, c), generator=g, dtype=dtype)
    if trans_batch is None:
        trans_batch = (1,) * len(batch) if per_step else ()
    shape = trans_batch + ((v - 1,) if per_step else ()) + (c, c)
    trans = torch.log_softmax(torch.randn(shape, generator=g, dtype=dtype), -1)
    init = torch.log_softmax(torch.randn(c, generator=g, dtype=dtype), -1)
    return x, trans, init


@pytest.mark.parametrize(
    "batch, trans_batch, per_step",
    [((3,), None, True), ((3,), None, False), ((3,), (3,), True), ((2, 2), (1, 2), True), ((), None, True)],
    ids=["per-step", "shared", "per-row", "n-t-broadcast", "unbatched"],
)
def test_gradcheck_x_trans_init(algorithm, batch, trans_batch, per_step):
    x, trans, init = inputs(batch, 4, 3, per_step=per_step, trans_batch=trans_batch)
    args = [t.requires_grad_() for t in (x, trans, init)]
    assert torch.autograd.gradcheck(lambda *a: st.chain_logsumexp(*a), args, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_with_minus_inf_entries_and_lengths(algorithm):
    x, trans, init = inputs((3,), 5, 3)
    trans = trans.clone()
    trans[..., 0, 2] = -math.inf  # structural zeros
    trans[..., 2, 1] = -math.inf
    x = x.clone()
    x[1, 2, 0] = -math.inf
    lengths = torch.tensor([5, 2, 4])
    args = [t.requires_grad_() for t in (x, trans, init)]
    fn = lambda *a: st.chain_logsumexp(*a, lengths=lengths)  # noqa: E731
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-8, rtol=1e-6)
    fn(*args).sum().backward()
    assert (trans.grad[..., 0, 2] == 0).all() and (trans.grad[..., 2, 1] == 0).all()
    assert x.grad[1, 2, 0] == 0 and (x.grad[1, 2:] == 0).all()


def test_matches_autograd_through_a_torch_recursion(algorithm):
    x, trans, init = inputs((4,), 6, 5, per_step=True)
    ours = [t.clone().requires_grad_() for t in (x, trans, init)]
    theirs = [t.clone().requires_grad_() for t in (x, trans, init)]
    weights = torch.arange(1.0, 5.0, dtype=torch.float64)
    (st.chain_logsumexp(*ours) * weights).sum().backward()
    (reference.chain_logsumexp_torch(*theirs) * weights).sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-10)


def test_float32_gradients_are_close_to_float64(algorithm):
    x, trans, init = inputs((8,), 12, 6)
    grads = {}
    for dtype in (torch.float32, torch.float64):
        args = [t.to(dtype).requires_grad_() for t in (x, trans, init)]
        st.chain_logsumexp(*args).sum().backward()
        grads[dtype] = [a.grad.double() for a in args]
    for a, b in zip(grads[torch.float32], grads[torch.float64]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_underflowed_gemm_entries_get_exact_transition_gradients():
    # see test_chain.py::test_scaled_gemm_underflow_is_recomputed_exactly: the one path runs
    # through trans[1, 1] from a state 200 nats below the row's maximum
    with sc.chain_sweep("gemm"):
        trans = torch.tensor([[0.0, -math.inf], [-math.inf, 0.0]], requires_grad=True)
        x = torch.tensor([[[0.0, -200.0], [-math.inf, 0.0]]] * 4, requires_grad=True)
        st.chain_logsumexp(x, trans).sum().backward()
        torch.testing.assert_close(trans.grad, torch.tensor([[0.0, 0.0], [0.0, 4.0]]))


def test_marginals_equal_the_gradient_and_have_none(algorithm):
    x, trans, init = inputs((3,), 5, 4)
    x.requires_grad_()
    st.chain_logsumexp(x, trans, init).sum().backward()
    marg = st.chain_marginals(x, trans, init)
    torch.testing.assert_close(marg.detach(), x.grad)
    with pytest.raises(NotImplementedError, match="chain_marginals has no gradient"):  # never a silent zero
        (marg * x).sum().backward()


def test_backward_twice_with_retain_graph_and_no_grad():
    x, trans, init = inputs((3,), 5, 4)
    x.requires_grad_()
    out = st.chain_logsumexp(x, trans, init).sum()
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    torch.testing.assert_close(x.grad, 2 * first)
    with torch.no_grad():
        value = st.chain_logsumexp(x, trans, init)
    assert not value.requires_grad
    torch.testing.assert_close(value.sum(), out.detach())


def test_only_the_needed_gradients_are_computed():
    x, trans, init = inputs((3,), 5, 4)
    trans.requires_grad_()
    st.chain_logsumexp(x, trans, init).sum().backward()
    assert trans.grad is not None and x.grad is None and init.grad is None


def test_non_contiguous_tensors(algorithm):
    x, trans, init = inputs((4,), 5, 3)
    x_t = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert not x_t.is_contiguous()
    torch.testing.assert_close(st.chain_logsumexp(x_t, trans, init), st.chain_logsumexp(x, trans, init))


def test_array_api_rejects_tensors_that_require_grad():
    x, trans, _ = inputs((2,), 3, 2)
    with pytest.raises(TypeError, match=r"spchain\.torch\.chain_logsumexp.*detach"):
        sc.chain_logsumexp(x.requires_grad_(), trans)


def test_devices_must_match():
    x, trans, _ = inputs((2,), 3, 2)
    with pytest.raises(ValueError, match="x is on cpu but log_trans is on meta"):
        st.chain_logsumexp(x, trans.to("meta"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_computes_in_float32_and_returns_the_input_dtype(dtype):
    x, trans, init = (t.to(dtype) for t in inputs((2,), 3, 2))
    leaves = [t.clone().requires_grad_() for t in (x, trans, init)]
    out = st.chain_logsumexp(*leaves)
    assert out.dtype == dtype
    torch.testing.assert_close(out, st.chain_logsumexp(x.float(), trans.float(), init.float()).to(dtype))
    out.float().sum().backward()
    assert all(t.grad.dtype == dtype for t in leaves)
    score, path = st.viterbi(x, trans, init)
    assert score.dtype == dtype and path.dtype == torch.int64
    assert st.chain_marginals(x, trans, init).dtype == dtype


def test_lengths_as_a_list():
    x, trans, init = inputs((2,), 4, 3)
    got = st.chain_logsumexp(x, trans, init, lengths=[2, 4])
    torch.testing.assert_close(got, reference.chain_logsumexp_torch(x, trans, init, torch.tensor([2, 4])))


def test_repeated_forward_backward_does_not_leak(rss_growth):
    x, trans, init = inputs((64,), 20, 16, dtype=torch.float32)
    args = [t.requires_grad_() for t in (x, trans, init)]

    def step():
        for a in args:
            a.grad = None
        st.chain_logsumexp(*args).sum().backward()

    assert rss_growth(step) < 16 * 2**20  # one leaked step would hold its 80 KiB of messages


@pytest.mark.gpu
def test_cuda_tensors_match_cpu(algorithm):
    x, trans, init = inputs((5,), 6, 4)
    cpu = [t.clone().requires_grad_() for t in (x, trans, init)]
    gpu = [t.cuda().requires_grad_() for t in (x, trans, init)]
    lengths = torch.tensor([6, 3, 1, 6, 2])
    out_cpu = st.chain_logsumexp(*cpu, lengths=lengths)
    out_gpu = st.chain_logsumexp(*gpu, lengths=lengths.cuda())
    out_cpu.sum().backward()
    out_gpu.sum().backward()
    torch.testing.assert_close(out_gpu.cpu(), out_cpu)
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a.grad.cpu(), b.grad)


def test_viterbi_score_gradient_is_the_one_hot_best_path():
    x, trans, init = inputs((3,), 5, 4)
    lengths = torch.tensor([5, 2, 4])
    args = [t.clone().requires_grad_() for t in (x, trans, init)]
    score, path = st.viterbi(*args, lengths=lengths)
    assert not path.requires_grad
    (score * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
    want_x = torch.zeros_like(x)
    want_trans = torch.zeros_like(trans)
    want_init = torch.zeros_like(init)
    for b, w in enumerate((1.0, 2.0, 3.0)):
        _, best = reference.viterbi_by_paths(x[b].numpy(), trans[0].numpy(), init.numpy(), int(lengths[b]))
        length = int(lengths[b])
        want_init[best[0]] += w
        for t in range(length):
            want_x[b, t, best[t]] = w
            if t:
                want_trans[0, t - 1, best[t - 1], best[t]] += w
    torch.testing.assert_close(args[0].grad, want_x)
    torch.testing.assert_close(args[1].grad, want_trans)
    torch.testing.assert_close(args[2].grad, want_init)


def test_viterbi_gradcheck_with_shared_transitions():
    x, trans, init = inputs((2,), 4, 3, per_step=False)
    args = [t.requires_grad_() for t in (x, trans, init)]
    assert torch.autograd.gradcheck(lambda *a: st.viterbi(*a)[0], args, eps=1e-6, atol=1e-8)


def test_impossible_sequence_has_zero_gradients_not_nan(algorithm):
    x, trans, init = inputs((2,), 5, 3)
    x = x.clone()
    x[0, 3] = -math.inf  # no state is possible at position 3 of chain 0
    args = [t.requires_grad_() for t in (x, trans, init)]
    out = st.chain_logsumexp(*args)
    assert out[0] == -math.inf and torch.isfinite(out[1])
    out[1].backward()
    assert torch.isfinite(args[0].grad).all() and (args[0].grad[0] == 0).all()
    assert torch.isfinite(args[1].grad).all() and torch.isfinite(args[2].grad).all()
    out = st.chain_logsumexp(*args)
    args[0].grad = None
    out.sum().backward()  # -inf in the sum: the impossible chain still adds no NaN
    assert (args[0].grad[0] == 0).all() and torch.isfinite(args[0].grad).all()


@pytest.mark.parametrize("op", [st.chain_logsumexp, lambda x, t: st.viterbi(x, t)[0]])
def test_double_backward_raises_instead_of_dropping_the_graph(op):
    x = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    trans = torch.zeros(3, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(op(x, trans).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.functional.hessian(lambda x: op(x, trans).sum(), x)


def test_scalars_and_lists_become_tensors_of_x_dtype():
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    got = st.chain_logsumexp(x, -1.0, [0.5, 0.5, 0.5])
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, st.chain_logsumexp(x, torch.full((3, 3), -1.0, dtype=torch.float64),
                                                       torch.full((3,), 0.5, dtype=torch.float64)))
    got.sum().backward()
    assert x.grad.shape == x.shape
    score, path = st.viterbi([[0.0]], torch.zeros(1, 1))
    assert score.item() == 0.0 and path.tolist() == [0]
    torch.testing.assert_close(st.chain_marginals([[0.0, 0.0]], 0.0), torch.full((1, 2), 0.5))


@pytest.mark.parametrize("op", [st.chain_logsumexp, st.viterbi, st.chain_entropy])
def test_zero_dimensional_log_trans_and_log_init_get_the_sum_of_their_entries_gradients(op):
    """A 0-d ``log_trans`` or ``log_init`` stands for every entry (a backward crashed on both)."""
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    scalar_trans = torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)
    scalar_init = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    full_trans = torch.full((4, 4), -1.0, dtype=torch.float64, requires_grad=True)
    full_init = torch.full((4,), 0.5, dtype=torch.float64, requires_grad=True)
    for trans, init in ((scalar_trans, scalar_init), (full_trans, full_init)):
        out = op(x, trans, init)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert scalar_trans.grad.shape == () and scalar_init.grad.shape == ()
    torch.testing.assert_close(scalar_trans.grad, full_trans.grad.sum())
    torch.testing.assert_close(scalar_init.grad, full_init.grad.sum())


@pytest.mark.parametrize("op", [st.chain_logsumexp, st.viterbi, st.chain_entropy])
@pytest.mark.parametrize("x_shape, init_shape", [((4, 3), (3,)), ((2, 1, 3), (2, 3))])
def test_x_and_log_init_gradients_do_not_share_memory(op, x_shape, init_shape):
    """``log_init``'s gradient is ``x``'s at the first position: for one chain or chains of
    length one it came back as a view of ``x``'s, so that two backward passes accumulated it
    three times into ``log_init.grad`` (and ``x.grad.mul_`` changed it)."""
    torch.manual_seed(0)
    x = torch.randn(x_shape, dtype=torch.float64, requires_grad=True)
    init = torch.randn(init_shape, dtype=torch.float64, requires_grad=True)
    trans = torch.randn(3, 3, dtype=torch.float64)

    def loss():
        out = op(x, trans, init)
        return (out[0] if isinstance(out, tuple) else out).sum()

    want_x, want_init = torch.autograd.grad(loss(), (x, init))
    for _ in range(2):
        loss().backward()
    torch.testing.assert_close(init.grad, 2 * want_init)
    torch.testing.assert_close(x.grad, 2 * want_x)
    x.grad.zero_()
    torch.testing.assert_close(init.grad, 2 * want_init)


@pytest.mark.parametrize("op", [st.chain_logsumexp, st.chain_marginals, st.viterbi])
@pytest.mark.parametrize("args, match", [
    ((torch.eye(3).to_sparse(), torch.zeros(3, 3)), "x must be a dense tensor, not one of layout torch.sparse_coo"),
    ((torch.zeros(2, 3), torch.eye(3).to_sparse()), "log_trans must be a dense tensor.*sparse CSR.*sparse_coo"),
    ((torch.zeros(2, 3), None), "log_trans is required"),
    ((None, torch.zeros(3, 3)), "x is required"),
    ((torch.zeros(2, 3), "a"), "log_trans must be a tensor.*not str"),
])
def test_bad_argument_types_are_type_errors_naming_them(op, args, match):
    with pytest.raises(TypeError, match=match):
        op(*args)


@pytest.mark.parametrize("x_shape, trans_shape", [((0, 5, 4), (0, 4, 4)), ((0, 5, 4), (4, 4)),
                                                  ((2, 0, 5, 4), (2, 1, 4, 4)), ((3, 1, 2), (3, 0, 2, 2)),
                                                  ((3, 5, 0), (0, 0))])
def test_empty_shapes_run_forward_and_backward(algorithm, x_shape, trans_shape):
    x = torch.zeros(x_shape, dtype=torch.float64, requires_grad=True)
    trans = torch.zeros(trans_shape, dtype=torch.float64, requires_grad=True)
    out = st.chain_logsumexp(x, trans)
    (out[torch.isfinite(out)].sum() + st.viterbi(x, trans)[0].clamp(min=0).sum()).backward()
    assert x.grad.shape == x.shape and trans.grad.shape == trans.shape
    assert not x.grad.isnan().any() and not trans.grad.isnan().any()


def test_long_float32_chain_gradient_does_not_drift(algorithm):
    x, trans, init = inputs((2,), 10_000, 3, dtype=torch.float32)
    x.requires_grad_(True)
    trans.requires_grad_(True)
    st.chain_logsumexp(x, trans, init).sum().backward()
    want = torch.from_numpy(sc.chain_marginals(x.detach().double().numpy(), trans.detach().double().numpy(),
                                               init.double().numpy()))
    assert (x.grad.sum(-1) - 1).abs().max() < 1e-5
    torch.testing.assert_close(x.grad.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["x", "trans", "init"])
def test_viterbi_impossible_chain_has_minus_inf_score_zero_gradients_and_no_path(case):
    x, trans, init = inputs((2,), 4, 2)
    lengths = torch.tensor([4, 2])
    if case == "x":
        x[0] = -math.inf
    elif case == "trans":
        trans[0, 1] = -math.inf  # step 1 -> 2 impossible: only the first chain reaches it
    elif case == "init":
        init[:] = -math.inf
    args = [t.requires_grad_() for t in (x, trans, init)]
    score, path = st.viterbi(*args, lengths=lengths if case != "init" else None)
    score[0].backward()
    assert score[0] == -math.inf
    assert (path[0] == -1).all()
    for t in args:
        assert (t.grad == 0).all()


def test_nan_transition_of_a_step_no_chain_takes_gets_zero_gradient(algorithm):
    x, trans, _ = inputs((2,), 4, 2, trans_batch=(2,))
    trans[0, 1:] = math.nan  # row 0 (length 2) uses only step 0 of its matrices
    x.requires_grad_(True)
    trans.requires_grad_(True)
    out = st.chain_logsumexp(x, trans, lengths=torch.tensor([2, 4]))
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert (trans.grad[0, 1:] == 0).all() and torch.isfinite(trans.grad).all() and torch.isfinite(x.grad).all()


def test_plus_inf_gradients_go_to_the_plus_inf_terms(algorithm):
    x = torch.tensor([[[math.inf, 0.0], [0.0, 0.0]], [[0.0, 1.0], [2.0, 0.0]]], dtype=torch.float64,
                     requires_grad=True)
    trans = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    out = st.chain_logsumexp(x, trans)
    out.sum().backward()
    assert out[0] == math.inf and torch.isfinite(out[1])
    torch.testing.assert_close(x.grad[0], torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64))
    assert torch.isfinite(trans.grad).all() and torch.isfinite(x.grad).all()
    x.grad = None
    score, path = st.viterbi(x, trans)
    score.sum().backward()
    assert score[0] == math.inf and path[0, 0] == 0 and torch.isfinite(x.grad).all()


def test_kernel_sweep_scales_each_rows_gradient_on_its_own():
    """Incoming gradients 1e-200 and 1e200 in one batch: neither underflows nor overflows."""
    with sc.chain_sweep("kernel"):
        x, trans, init = inputs((2,), 5, 3, trans_batch=(2,))
        args = [t.requires_grad_() for t in (x, trans, init)]
        weight = torch.tensor([1e-200, 1e200], dtype=torch.float64)
        (st.chain_logsumexp(*args) * weight).sum().backward()
        grads = [t.grad.clone() for t in args]
        for t in args:
            t.grad = None
        st.chain_logsumexp(*args).sum().backward()
        for got, ones, scaled in zip(grads, [t.grad for t in args], [True, True, False]):
            if scaled:  # x and the per-row transitions: row b's gradient is weight[b] times the unit one
                torch.testing.assert_close(got, ones * weight.reshape((2,) + (1,) * (ones.dim() - 1)), rtol=1e-12, atol=0)
