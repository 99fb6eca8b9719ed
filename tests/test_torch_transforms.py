"""Every spchain.torch function and module under torch's transforms: torch.compile with no graph
break, torch.export, torch.func (grad, vmap, jacrev), float16 / bfloat16, and a clear error (never
a silent first-order answer) for double backward.

One table of cases; each case is a function of dense tensors (sparse operands as their CSR
components: Dynamo cannot take torch sparse tensors) with small float64 inputs.
"""

from dataclasses import dataclass
from typing import Callable

import pytest

torch = pytest.importorskip("torch")

import spchain.torch as st  # noqa: E402

def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@dataclass
class Case:
    name: str
    fn: Callable
    inputs: Callable  # () -> tuple of float64 tensors, every one differentiable
    differentiable: bool = True
    low_precision_rtol: float = 2e-2  # bfloat16; float16 gets a tenth of it

    def __str__(self):
        return self.name


# A 5 x 4 CSR structure with an empty row, a duplicate and unsorted columns.
INDPTR, INDICES = torch.tensor([0, 2, 2, 5, 6, 7]), torch.tensor([3, 0, 1, 1, 2, 3, 0])


def _sparse_linear(x, values, bias):
    return st.sparse_linear(x, values, INDPTR, INDICES, (5, 4), bias)


def _chain_inputs():
    return randn(2, 5, 3), randn(2, 4, 3, 3, seed=1), randn(3, seed=2)


CASES = [
    Case("logmatmul", st.logmatmul, lambda: (randn(2, 3, 4), randn(2, 4, 5, seed=1))),
    Case("maxmatmul", lambda a, b: st.maxmatmul(a, b)[0], lambda: (randn(2, 3, 4), randn(4, 5, seed=1))),
    Case("log_chain_product", st.log_chain_product, lambda: (randn(2, 5, 3, 3),)),
    Case("chain_logsumexp", lambda x, t, i: st.chain_logsumexp(x, t, i, lengths=torch.tensor([5, 3])),
         _chain_inputs),
    Case("chain_marginals", lambda x, t, i: st.chain_marginals(x, t, i, lengths=torch.tensor([5, 3])),
         _chain_inputs, differentiable=False),
    Case("viterbi", lambda x, t, i: st.viterbi(x, t, i)[0], _chain_inputs),
    Case("chain_logsumexp_shared", lambda x, t: st.chain_logsumexp(x, t), lambda: (randn(2, 5, 3), randn(3, 3, seed=1))),
    Case("viterbi_lengths", lambda x, t, i: st.viterbi(x, t, i, lengths=torch.tensor([5, 2]))[0], _chain_inputs),
    Case("chain_entropy", lambda x, t, i: st.chain_entropy(x, t, i, lengths=torch.tensor([5, 3])), _chain_inputs),
    Case("chain_entropy_shared", lambda x, t: st.chain_entropy(x, t), lambda: (randn(2, 5, 3), randn(3, 3, seed=1))),
    Case("chain_path_score", lambda x, t, i: st.chain_path_score(x, t, i, torch.tensor([[0, 2, 1, 1, 0], [2, 2, 0, -1, -1]]),
                                                                 lengths=torch.tensor([5, 3])), _chain_inputs),
    Case("chain_kbest", lambda x, t, i: st.chain_kbest(x, t, i, k=3, lengths=torch.tensor([5, 3]))[0], _chain_inputs,
         differentiable=False),
    Case("block_diag_matmul", st.block_diag_matmul, lambda: (randn(5, 3, 4), randn(3, 4, 2, seed=1))),
    Case("grouped_matmul", lambda x, w: st.grouped_matmul(x, w, torch.tensor([2, 0, 3])),
         lambda: (randn(5, 4), randn(3, 4, 2, seed=1))),
    Case("sparse_linear", _sparse_linear, lambda: (randn(3, 4), randn(7, seed=1), randn(5, seed=2))),
    Case("sparse_linear_3d", lambda x, v: st.sparse_linear(x, v, INDPTR, INDICES, (5, 4)),
         lambda: (randn(2, 3, 4), randn(7, seed=1))),
]
# chain_sample draws integer paths, so it is not in the table: low precision does not apply (no
# float results, and rounded inputs may rightly change a draw) and vmap makes one call a slice, each
# at the same seed (so slices with equal inputs draw equal paths), checked below.
SAMPLE = Case("chain_sample", lambda x, t, i: st.chain_sample(x, t, i, lengths=torch.tensor([5, 3]), num_samples=4,
                                                               seed=7), _chain_inputs, differentiable=False)
DIFFERENTIABLE = [c for c in CASES if c.differentiable]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _leaves(case):
    return [t.requires_grad_() for t in case.inputs()]


def _eager(case):
    leaves = _leaves(case)
    out = case.fn(*leaves)
    grads = torch.autograd.grad(out.sum(), leaves) if case.differentiable else None
    return out.detach(), grads


@pytest.mark.slow  # a compile or export per function: minutes; the default set compiles a few below
@pytest.mark.parametrize("case", CASES, ids=str)
def test_compile_fullgraph_has_no_graph_break_and_matches_eager(case):
    inputs = case.inputs()
    assert torch._dynamo.explain(case.fn)(*inputs).graph_break_count == 0
    torch._dynamo.reset()
    expected, expected_grads = _eager(case)
    leaves = _leaves(case)
    out = torch.compile(case.fn, fullgraph=True)(*leaves)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    if case.differentiable:
        grads = torch.autograd.grad(out.sum(), leaves)
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


@pytest.mark.slow  # a compile or export per function: minutes; the default set compiles a few below
@pytest.mark.parametrize("case", CASES, ids=str)
def test_export_runs_as_eager(case):
    inputs = case.inputs()
    program = torch.export.export(_Wrap(case.fn), inputs)
    assert any("spchain" in str(node.target) for node in program.graph.nodes)
    torch.testing.assert_close(program.module()(*inputs), case.fn(*inputs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", DIFFERENTIABLE, ids=str)
def test_func_grad_and_jacrev_match_autograd(case):
    _, expected = _eager(case)
    inputs = case.inputs()
    argnums = tuple(range(len(inputs)))
    grads = torch.func.grad(lambda *a: case.fn(*a).sum(), argnums=argnums)(*inputs)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    jac = torch.func.jacrev(case.fn)(*inputs)
    torch.testing.assert_close(jac.sum(dim=tuple(range(case.fn(*inputs).dim()))), expected[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_vmap_equals_a_loop(case):
    stacked = [torch.stack([t, t * 0.5 - 0.25]) for t in case.inputs()]
    out = torch.vmap(case.fn)(*stacked)
    for k in range(2):
        torch.testing.assert_close(out[k], case.fn(*(t[k] for t in stacked)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", [c for c in CASES if not c.differentiable], ids=str)
def test_a_backward_through_an_operator_without_a_gradient_raises_never_a_zero(case):
    match = f"{case.name} has no gradient"
    leaves = _leaves(case)
    with pytest.raises(NotImplementedError, match=match):
        torch.autograd.grad(case.fn(*leaves).sum(), leaves)
    inputs = case.inputs()
    with pytest.raises(NotImplementedError, match=match):
        torch.func.grad(lambda x: case.fn(x, *inputs[1:]).sum())(inputs[0])
    torch.testing.assert_close(case.fn(*(t.detach() for t in leaves)), case.fn(*inputs))  # detached: constants


@pytest.mark.parametrize("case", DIFFERENTIABLE, ids=str)
def test_per_sample_gradients_equal_a_loop(case):
    stacked = [torch.stack([t, t * 0.5 - 0.25]) for t in case.inputs()]
    argnums = tuple(range(len(stacked)))
    grads = torch.vmap(torch.func.grad(lambda *a: case.fn(*a).sum(), argnums=argnums))(*stacked)
    for k in range(2):
        leaves = [t[k].clone().requires_grad_() for t in stacked]
        expected = torch.autograd.grad(case.fn(*leaves).sum(), leaves)
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g[k], e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", DIFFERENTIABLE, ids=str)
def test_double_backward_raises_instead_of_a_silent_first_order_answer(case):
    leaves = _leaves(case)
    with pytest.raises(RuntimeError, match="double backward"):
        grads = torch.autograd.grad(case.fn(*leaves).sum(), leaves, create_graph=True)
        sum(g.sum() for g in grads).backward()
    inputs = case.inputs()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.functional.hessian(lambda x: case.fn(x, *inputs[1:]).sum(), inputs[0])


@pytest.mark.parametrize("case", DIFFERENTIABLE, ids=str)
def test_forward_over_reverse_raises_not_implemented_naming_the_operator(case):
    inputs = case.inputs()
    loss = lambda x: case.fn(x, *inputs[1:]).sum()  # noqa: E731
    for second in (torch.func.hessian(loss), torch.func.jacfwd(torch.func.grad(loss))):
        with pytest.raises(NotImplementedError, match=r"spchain\.torch\.\w+: forward( over reverse|-mode AD)"):
            second(inputs[0])


# Forward-mode AD: the operators whose results have no gradient (chain_marginals, chain_kbest) and
# the sparse linear layers raise NotImplementedError; the others give the exact tangent.
NO_FORWARD_AD = {"chain_marginals", "chain_kbest", "sparse_linear", "sparse_linear_3d"}
FORWARD_AD = [c for c in CASES if c.name not in NO_FORWARD_AD]


def _tangents(inputs):
    return tuple(randn(*t.shape, seed=10 + k) for k, t in enumerate(inputs))


@pytest.mark.parametrize("case", FORWARD_AD, ids=str)
def test_forward_ad_tangent_is_the_jacobian_times_the_tangent(case):
    inputs, tangents = case.inputs(), _tangents(case.inputs())
    out, tangent = torch.func.jvp(case.fn, inputs, tangents)
    jacobians = torch.func.jacrev(case.fn, argnums=tuple(range(len(inputs))))(*inputs)
    expected = sum(torch.tensordot(j, t, dims=t.dim()) for j, t in zip(jacobians, tangents))
    torch.testing.assert_close(out, case.fn(*inputs), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tangent, expected, rtol=1e-10, atol=1e-12)
    with torch.autograd.forward_ad.dual_level():  # eager forward AD: the same tangent
        duals = [torch.autograd.forward_ad.make_dual(x, t) for x, t in zip(inputs, tangents)]
        eager = torch.autograd.forward_ad.unpack_dual(case.fn(*duals)).tangent
    torch.testing.assert_close(eager, expected, rtol=1e-10, atol=1e-12)
    jacobian = torch.func.jacfwd(case.fn)(*inputs)  # jacfwd: vmap over jvp
    torch.testing.assert_close(jacobian, jacobians[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in NO_FORWARD_AD], ids=str)
def test_forward_ad_raises_where_not_implemented_never_a_zero_tangent(case):
    inputs, tangents = case.inputs(), _tangents(case.inputs())
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(case.fn, inputs, tangents)
    with pytest.raises(NotImplementedError, match="forward-mode AD"), torch.autograd.forward_ad.dual_level():
        case.fn(*(torch.autograd.forward_ad.make_dual(x, t) for x, t in zip(inputs, tangents)))


def _reference_log_partition(x, log_trans, log_init):
    """The forward algorithm in torch operations (per-step transitions)."""
    alpha = x[..., 0, :] + log_init
    for t in range(1, x.shape[-2]):
        alpha = torch.logsumexp(alpha[..., :, None] + log_trans[..., t - 1, :, :], -2) + x[..., t, :]
    return torch.logsumexp(alpha, -1)


def _reference_chain_product(m):
    out = m[..., 0, :, :]
    for t in range(1, m.shape[-3]):
        out = torch.logsumexp(out[..., :, :, None] + m[..., t, None, :, :], -2)
    return out


@pytest.mark.parametrize("fn, reference, inputs", [
    (lambda x, t, i: st.chain_logsumexp(x, t, i), _reference_log_partition, _chain_inputs),
    (st.logmatmul, lambda a, b: torch.logsumexp(a[..., :, :, None] + b[..., None, :, :], -2),
     lambda: (randn(2, 3, 4), randn(4, 5, seed=1))),
    (st.log_chain_product, _reference_chain_product, lambda: (randn(2, 5, 3, 3),)),
], ids=["chain_logsumexp", "logmatmul", "log_chain_product"])
def test_forward_ad_equals_torch_on_a_float64_reference(fn, reference, inputs):
    inputs = inputs()
    tangents = _tangents(inputs)
    torch.testing.assert_close(torch.func.jvp(fn, inputs, tangents)[1], torch.func.jvp(reference, inputs, tangents)[1],
                               rtol=1e-10, atol=1e-12)


def _with_plus_inf(t, *positions):
    for position in positions:
        t[position] = float("inf")
    return t


@pytest.mark.parametrize("fn, inputs", [
    (st.logmatmul, lambda: (_with_plus_inf(randn(2, 3, 4), (0, 1, 2), (1, 0, 2)),
                            _with_plus_inf(randn(4, 5, seed=1), (2, 3)))),
    (st.logmatmul, lambda: (randn(2, 0), randn(0, 3))),
    (lambda a, b: st.maxmatmul(a, b)[0], lambda: (randn(2, 0), randn(0, 3))),
    (st.log_chain_product, lambda: (_with_plus_inf(randn(2, 4, 3, 3), (0, 1, 0, 1), (1, 2, 2, 0), (1, 3, 2, 0)),)),
    (st.log_chain_product, lambda: (_with_plus_inf(randn(1, 3, 3), (0, 0, 1)),)),
], ids=["logmatmul", "logmatmul_k0", "maxmatmul_k0", "log_chain_product", "log_chain_product_length_1"])
def test_forward_ad_at_plus_inf_and_empty_products_is_the_jacobian_times_the_tangent(fn, inputs):
    # a +inf output: reverse mode's equal shares to its +inf terms; no term (k = 0): a zero tangent
    inputs = inputs()
    for a in inputs:
        a[..., :1, -1:] = -float("inf")  # a log-space zero too
    tangents = _tangents(inputs)
    out, tangent = torch.func.jvp(fn, inputs, tangents)
    jacobians = torch.func.jacrev(fn, argnums=tuple(range(len(inputs))))(*inputs)
    expected = sum(torch.tensordot(j, t, dims=t.dim()) for j, t in zip(jacobians, tangents))
    assert torch.isfinite(expected).all() and (torch.isposinf(out).any() or torch.isneginf(out).all())
    torch.testing.assert_close(tangent, expected, rtol=1e-10, atol=1e-12)


def test_forward_ad_of_the_log_partition_is_the_sum_of_the_marginals():
    x, log_trans = randn(4, 3), randn(3, 3, seed=1)  # the example: 4 positions, tangent 4
    _, tangent = torch.func.jvp(lambda x: st.chain_logsumexp(x, log_trans), (x,), (torch.ones_like(x),))
    torch.testing.assert_close(tangent, torch.tensor(4.0, dtype=torch.float64))


def test_forward_ad_of_chain_sample_has_no_float_tangent_to_lose():
    inputs = SAMPLE.inputs()
    out, tangent = torch.func.jvp(SAMPLE.fn, inputs, _tangents(inputs))
    torch.testing.assert_close(out, SAMPLE.fn(*inputs), rtol=0, atol=0)
    assert not tangent.is_floating_point()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_low_precision_computes_in_float32_and_returns_the_input_dtype(case, dtype):
    inputs = [t.to(dtype) for t in case.inputs()]
    reference = case.fn(*(t.double() for t in inputs))
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = case.fn(*leaves)
    assert out.dtype == dtype
    rtol = case.low_precision_rtol / (10 if dtype == torch.float16 else 1)
    torch.testing.assert_close(out.double(), reference, rtol=rtol, atol=rtol)
    if case.differentiable:
        grads = torch.autograd.grad(out.float().sum(), leaves)
        assert all(g.dtype == dtype for g in grads)


def test_chain_sample_compiles_exports_and_vmaps_at_a_fixed_seed():
    inputs = SAMPLE.inputs()
    expected = SAMPLE.fn(*inputs)
    assert expected.dtype == torch.int64 and expected.shape == (4, 2, 5)
    assert torch._dynamo.explain(SAMPLE.fn)(*inputs).graph_break_count == 0
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(SAMPLE.fn, fullgraph=True)(*inputs), expected, rtol=0, atol=0)
    program = torch.export.export(_Wrap(SAMPLE.fn), inputs)
    assert any("spchain" in str(node.target) for node in program.graph.nodes)
    torch.testing.assert_close(program.module()(*inputs), expected, rtol=0, atol=0)
    out = torch.vmap(SAMPLE.fn)(*(torch.stack([t, t]) for t in inputs))
    for k in range(2):
        torch.testing.assert_close(out[k], expected, rtol=0, atol=0)


class _CRFNll(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.crf = st.LinearChainCRF(3).double()

    def forward(self, emissions, tags, lengths):
        return self.crf.nll(emissions, tags, lengths)


def _crf_inputs():
    return randn(2, 5, 3), torch.tensor([[0, 2, 1, 1, 0], [2, 2, 0, 0, 0]]), torch.tensor([5, 3])


def test_crf_nll_compiles_fullgraph_forward_and_backward_as_eager():
    module = _CRFNll()
    emissions, tags, lengths = _crf_inputs()
    leaves = [emissions.requires_grad_(), *module.parameters()]
    expected = module(emissions, tags, lengths)
    expected_grads = torch.autograd.grad(expected, leaves)
    assert torch._dynamo.explain(module)(emissions, tags, lengths).graph_break_count == 0
    torch._dynamo.reset()
    out = torch.compile(module, fullgraph=True)(emissions, tags, lengths)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(torch.autograd.grad(out, leaves), expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_crf_nll_exports():
    module = _CRFNll()
    inputs = _crf_inputs()
    program = torch.export.export(module, inputs)
    assert any("spchain" in str(node.target) for node in program.graph.nodes)
    torch.testing.assert_close(program.module()(*inputs), module(*inputs), rtol=1e-12, atol=1e-12)


MODULES = {
    "BlockDiagonalLinear": (lambda: st.BlockDiagonalLinear(8, 6, groups=2, dtype=torch.float64),
                            lambda: (randn(4, 8),)),
    "GroupedLinear": (lambda: st.GroupedLinear(3, 4, 2, dtype=torch.float64),
                      lambda: (randn(5, 4), torch.tensor([2, 0, 3]))),
    "SparseLinear": (lambda: st.SparseLinear(8, 6, sparsity=0.5, dtype=torch.float64), lambda: (randn(4, 8),)),
    "SparseLinear block": (lambda: st.SparseLinear(8, 6, sparsity=0.5, block=(3, 2), dtype=torch.float64),
                           lambda: (randn(4, 8),)),
}


def _module(name):
    torch.manual_seed(0)
    make, inputs = MODULES[name]
    return make(), inputs()


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_compiled_module_trains_like_eager(name):
    module, inputs = _module(name)
    assert torch._dynamo.explain(module)(*inputs).graph_break_count == 0
    torch._dynamo.reset()
    expected = module(*inputs)
    expected_grads = torch.autograd.grad(expected.sum(), list(module.parameters()))
    out = torch.compile(module, fullgraph=True)(*inputs)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(torch.autograd.grad(out.sum(), list(module.parameters())), expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_module_exports(name):
    module, inputs = _module(name)
    program = torch.export.export(module, inputs)
    torch.testing.assert_close(program.module()(*inputs), module(*inputs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", MODULES)
def test_module_in_low_precision(name, dtype):
    module, inputs = _module(name)
    reference = module(*inputs)
    module = module.to(dtype)
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    out = module(*inputs)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference, rtol=5e-2, atol=5e-2)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in module.parameters())


def test_autocast_bfloat16_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), st.SparseLinear(8, 6, sparsity=0.5),
                                st.BlockDiagonalLinear(6, 4, groups=2))
    x = torch.randn(4, 8)
    reference = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    torch.testing.assert_close(out.float(), reference, rtol=5e-2, atol=5e-2)
    out.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_sparse_linear_per_sample_gradients_by_functional_call():
    module, (x,) = _module("SparseLinear")
    params = {name: p.detach() for name, p in module.named_parameters()}
    buffers = dict(module.named_buffers())

    def loss(params, row):
        return torch.func.functional_call(module, (params, buffers), (row[None],)).square().sum()

    grads = torch.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for k in range(x.shape[0]):
        expected = torch.autograd.grad(module(x[k:k + 1]).square().sum(), list(module.parameters()))
        for name, e in zip(params, expected):
            torch.testing.assert_close(grads[name][k], e, rtol=1e-12, atol=1e-12)


def test_compiled_sparse_linear_model_matches_eager_and_exports():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), st.SparseLinear(8, 8, sparsity=0.75), torch.nn.ReLU(),
                                st.SparseLinear(8, 3, sparsity=0.5)).double()
    x = randn(5, 8)
    assert torch._dynamo.explain(model)(x).graph_break_count == 0
    torch._dynamo.reset()
    expected = model(x)
    expected_grads = torch.autograd.grad(expected.square().sum(), list(model.parameters()))
    out = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(torch.autograd.grad(out.square().sum(), list(model.parameters())), expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    program = torch.export.export(model, (x,))
    assert sum("sparse_linear" in str(node.target) for node in program.graph.nodes) == 2
    torch.testing.assert_close(program.module()(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_entry_points_run_under_torch_func_and_break_the_graph_under_compile():
    dense = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]], dtype=torch.float64)
    b = randn(4, 3, 2)
    for a in (dense.to_sparse(), dense.to_sparse_csr(), dense.to_sparse_csc()):
        torch.testing.assert_close(torch.vmap(lambda b: st.spmm(a, b))(b), dense @ b)
        grad = torch.func.grad(lambda b: st.spmm(a, b).square().sum())(b[0])
        torch.testing.assert_close(grad, 2 * dense.T @ (dense @ b[0]))
        # plain torch.compile: the sparse call runs eagerly between graphs (it crashed inside Dynamo)
        torch.testing.assert_close(torch.compile(lambda a, b: st.spmm(a, b) * 2 + 1)(a, b[0]), 2 * dense @ b[0] + 1)
        pattern = torch.compile(lambda a, x, y: st.sddmm(a, x, y))(a, randn(2, 5, seed=1), randn(3, 5, seed=2))
        torch.testing.assert_close(pattern.values(), (randn(2, 5, seed=1) @ randn(3, 5, seed=2).T)[dense != 0])
    log_trans = randn(3, 3).exp().to_sparse_csr()
    x = randn(2, 4, 3, seed=1)
    for fn in (st.chain_logsumexp, st.chain_marginals, st.chain_entropy, lambda x, t: st.viterbi(x, t)[0],
               lambda x, t: st.chain_kbest(x, t, k=2)[0], lambda x, t: st.chain_sample(x, t, seed=3),
               lambda x, t: st.chain_path_score(x, t, None, torch.tensor([0, 1, 2, 2]))):
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(fn)(x, log_trans), fn(x, log_trans), rtol=1e-12, atol=0)
    # fullgraph=True cannot break the graph: Dynamo's own clear refusal of sparse tensors (a torch limitation)
    with pytest.raises(Exception, match="sparse"):
        torch.compile(st.spmm, fullgraph=True)(dense.to_sparse_csr(), b[0])


# Under autocast the operators compute in float32 and return what torch's own operations would:
# autocast's dtype for the products (as torch.matmul), float32 for the log-space ones (as torch.logsumexp).
PRODUCTS = {"block_diag_matmul", "grouped_matmul", "sparse_linear", "sparse_linear_3d"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_autocast_computes_in_float32_and_returns_what_torch_would(case, dtype):
    inputs = [t.float() for t in case.inputs()]
    expected = case.fn(*inputs)
    leaves = [t.clone().requires_grad_() for t in inputs]
    with torch.autocast("cpu", dtype=dtype):
        out = case.fn(*leaves)
        low = case.fn(*(t.to(dtype) for t in inputs))  # low-precision inputs too
    assert out.dtype == low.dtype == (dtype if case.name in PRODUCTS else expected.dtype)
    rtol = case.low_precision_rtol / (10 if dtype == torch.float16 else 1)
    torch.testing.assert_close(out.to(expected.dtype), expected, rtol=rtol, atol=rtol)
    if case.differentiable:
        assert all(g.dtype == torch.float32 for g in torch.autograd.grad(out.float().sum(), leaves))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_the_gemm_sweep(dtype):
    # 64 tags and a batch of 1024 choose the GEMM sweep, whose torch matmul autocast would round
    x, log_trans, m = torch.randn(1024, 3, 64), torch.randn(64, 64), torch.randn(4, 64, 64)
    with torch.autocast("cpu", dtype=dtype):
        out = [st.chain_logsumexp(x, log_trans), st.viterbi(x, log_trans)[0], st.chain_marginals(x, log_trans),
               st.logmatmul(m, m), st.log_chain_product(m)]
        compiled = torch.compile(st.logmatmul, fullgraph=True)(m, m)
    expected = [st.chain_logsumexp(x, log_trans), st.viterbi(x, log_trans)[0], st.chain_marginals(x, log_trans),
                st.logmatmul(m, m), st.log_chain_product(m)]
    for o, e in zip(out + [compiled], expected + [expected[3]]):
        assert o.dtype == torch.float32
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)


def _dynamic_cases():
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    chain = ({0: batch, 1: length}, None)

    def inputs(b, v):
        return randn(b, v, 4), randn(4, 4, seed=1)

    return {
        "chain_logsumexp": (st.chain_logsumexp, inputs, chain),
        "chain_marginals": (st.chain_marginals, inputs, chain),
        "viterbi": (st.viterbi, inputs, chain),
        "chain_entropy": (st.chain_entropy, inputs, chain),
        "chain_kbest": (lambda x, t: st.chain_kbest(x, t, k=2), inputs, chain),
        "chain_sample": (lambda x, t: st.chain_sample(x, t, num_samples=2, seed=0), inputs, chain),
        "chain_lengths": (lambda x, t, n: st.chain_logsumexp(x, t, lengths=n),
                          lambda b, v: (*inputs(b, v), torch.arange(b) % v + 1), (*chain, {0: batch})),
        "chain_path_score": (lambda x, t, p: st.chain_path_score(x, t, None, p),
                             lambda b, v: (*inputs(b, v), torch.arange(b * v).reshape(b, v) % 4),
                             (*chain, {0: batch, 1: length})),
        "logmatmul": (st.logmatmul, lambda b, v: (randn(b, 3, v), randn(v, 5, seed=1)), ({0: batch, 2: length},
                                                                                       {0: length})),
        "maxmatmul": (st.maxmatmul, lambda b, v: (randn(b, 3, v), randn(v, 5, seed=1)), ({0: batch, 2: length},
                                                                                       {0: length})),
        "log_chain_product": (st.log_chain_product, lambda b, v: (randn(b, v, 3, 3),), ({0: batch, 1: length},)),
        "block_diag_matmul": (st.block_diag_matmul, lambda b, v: (randn(b, v, 3, 4), randn(3, 4, 2, seed=1)),
                              ({0: batch, 1: length}, None)),
    }


@pytest.mark.parametrize("name", list(_dynamic_cases()))
def test_export_with_a_dynamic_batch_and_length_runs_as_eager_at_other_sizes(name):
    fn, inputs, dynamic = _dynamic_cases()[name]
    program = torch.export.export(_Wrap(fn), inputs(3, 5), dynamic_shapes=(dynamic,))
    for b, v in ((2, 7), (6, 3)):
        torch.testing.assert_close(program.module()(*inputs(b, v)), fn(*inputs(b, v)), rtol=1e-12, atol=1e-12)


def test_compiled_chain_functions_do_not_recompile_for_each_batch_size():
    def fn(x, log_trans, lengths):
        return st.chain_logsumexp(x, log_trans, lengths=lengths) + st.viterbi(x, log_trans)[0] + st.logmatmul(
            x, log_trans).sum((-1, -2))

    compiled = torch.compile(fn, fullgraph=True)
    torch._dynamo.utils.counters.clear()
    for b in range(2, 8):
        x, log_trans, lengths = randn(b, 5, 4), randn(4, 4, seed=1), torch.arange(b) % 5 + 1
        torch.testing.assert_close(compiled(x, log_trans, lengths), fn(x, log_trans, lengths), rtol=1e-12, atol=1e-12)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # static, then dynamic: nn.Linear's count


def test_group_sizes_as_a_list_compiles_fullgraph():
    x, w = randn(5, 4), randn(3, 4, 2, seed=1)
    layer = st.GroupedLinear(3, 4, 2, dtype=torch.float64)
    for sizes in ([2, 0, 3], (2, 0, 3)):
        torch._dynamo.reset()
        out = torch.compile(lambda x, w: st.grouped_matmul(x, w, sizes), fullgraph=True)(x, w)
        torch.testing.assert_close(out, st.grouped_matmul(x, w, torch.tensor([2, 0, 3])), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x, sizes), layer(x, torch.tensor(sizes)))
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="sum to 6 but x has 5 rows"):
        torch.compile(lambda x, w: st.grouped_matmul(x, w, [2, 0, 4]), fullgraph=True)(x, w)
    with pytest.raises(Exception, match="group_sizes must hold integers"):  # under fullgraph, in Dynamo's error
        torch.compile(lambda x, w: st.grouped_matmul(x, w, [2, 0, 3.0]), fullgraph=True)(x, w)


def test_jit_trace_records_the_operators_and_jit_script_is_a_clear_error():
    a, b = randn(2, 3), randn(3, 4, seed=1)
    traced = torch.jit.trace(_Wrap(st.logmatmul), (a, b))
    assert "spchain::logmatmul" in str(traced.graph)
    torch.testing.assert_close(traced(randn(5, 3, seed=2), b), st.logmatmul(randn(5, 3, seed=2), b))
    with pytest.raises(torch.jit.frontend.NotSupportedError):  # torch.export is the supported route
        torch.jit.script(_Wrap(st.logmatmul))


def test_onnx_export_is_a_clear_error_naming_the_operator():
    io = pytest.importorskip("io")
    with pytest.raises(Exception, match="spchain::logmatmul"):
        torch.onnx.export(_Wrap(st.logmatmul), (randn(2, 3), randn(3, 4, seed=1)), io.BytesIO(), dynamo=False)


def test_crf_nll_exports_with_a_dynamic_batch_and_length_and_compiles_without_recompiling_per_batch():
    module = _CRFNll()

    def inputs(b, v):
        return randn(b, v, 3), torch.arange(b * v).reshape(b, v) % 3, torch.arange(b) % v + 1

    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    program = torch.export.export(module, inputs(3, 5),
                                  dynamic_shapes=({0: batch, 1: length}, {0: batch, 1: length}, {0: batch}))
    for b, v in ((2, 7), (6, 3)):
        torch.testing.assert_close(program.module()(*inputs(b, v)), module(*inputs(b, v)), rtol=1e-12, atol=1e-12)
    compiled = torch.compile(module)
    torch._dynamo.utils.counters.clear()
    for b in range(2, 8):
        torch.testing.assert_close(compiled(*inputs(b, 5)), module(*inputs(b, 5)), rtol=1e-12, atol=1e-12)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
