"""Block-diagonal and grouped matmul for torch tensors and their modules (spchain/torch/blockdiag.py)."""

import doctest
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import reference  # noqa: E402
import spchain.torch as sct  # noqa: E402
from spchain import blockdiag  # noqa: E402
from spchain.torch import blockdiag as torch_blockdiag  # noqa: E402
from spchain.torch import nn as torch_nn  # noqa: E402

GROUP_SIZES = [3, 0, 4, 1]


def einsum_block_diag(x, w):
    return torch.einsum("...gi,gio->...go", x, w)


def loop_grouped(x, w, group_sizes):
    parts = x.split(list(group_sizes))
    return torch.cat([part @ w[g] for g, part in enumerate(parts)]) if parts else x.new_zeros(0, w.shape[2])


def make(shape, dtype=torch.float64, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


def test_docstring_examples():
    assert doctest.testmod(torch_blockdiag, raise_on_error=True).attempted >= 4
    assert doctest.testmod(torch_nn, raise_on_error=True).attempted >= 4


# The functions -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lead", [(6,), (), (2, 3)], ids=["rows", "no-leading-axes", "two-leading-axes"])
def test_block_diag_matmul_values_and_gradients_match_einsum(dtype, lead):
    x, w = make(lead + (3, 4), dtype, 1), make((3, 4, 5), dtype, 2)
    grad = make(lead + (3, 5), dtype, 3, requires_grad=False)
    y = sct.block_diag_matmul(x, w)
    assert y.dtype == dtype and y.shape == lead + (3, 5)
    want = einsum_block_diag(x, w)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(y, want, **tol)
    for got, expected in zip(torch.autograd.grad(y, (x, w), grad), torch.autograd.grad(want, (x, w), grad)):
        torch.testing.assert_close(got, expected, **tol)
    np.testing.assert_allclose(y.detach().numpy(), reference.block_diag_matmul(x.detach(), w.detach()),
                               rtol=tol["rtol"], atol=tol["atol"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_matmul_values_and_gradients_match_a_per_group_loop(dtype):
    x, w = make((8, 4), dtype, 1), make((4, 4, 3), dtype, 2)
    grad = make((8, 3), dtype, 3, requires_grad=False)
    y = sct.grouped_matmul(x, w, GROUP_SIZES)
    want = loop_grouped(x, w, GROUP_SIZES)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(y, want, **tol)
    for got, expected in zip(torch.autograd.grad(y, (x, w), grad), torch.autograd.grad(want, (x, w), grad)):
        torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize(
    "x_shape, w_shape",
    [((5, 3, 2), (3, 2, 4)), ((2, 1, 3), (1, 3, 2)), ((3, 2), (3, 2, 3)), ((4, 2, 3, 2), (3, 2, 2))],
    ids=["rows", "one-group", "no-leading-axes", "two-leading-axes"],
)
def test_block_diag_matmul_gradcheck(x_shape, w_shape):
    assert torch.autograd.gradcheck(sct.block_diag_matmul, (make(x_shape, seed=1), make(w_shape, seed=2)),
                                    eps=1e-6, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("group_sizes", [GROUP_SIZES, [5], [0, 2, 0], [1, 1, 1]],
                         ids=["uneven-with-empty", "one-group", "mostly-empty", "one-row-each"])
def test_grouped_matmul_gradcheck(group_sizes):
    x, w = make((sum(group_sizes), 3), seed=1), make((len(group_sizes), 3, 2), seed=2)
    assert torch.autograd.gradcheck(lambda x, w: sct.grouped_matmul(x, w, group_sizes), (x, w),
                                    eps=1e-6, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize(
    "run",
    [
        lambda x, w: sct.block_diag_matmul(x.reshape(0, 2, 3), w),
        lambda x, w: sct.block_diag_matmul(x.reshape(0, 2, 3).transpose(0, 1), w[:0]),
        lambda x, w: sct.grouped_matmul(x.reshape(0, 3), w, [0, 0]),
        lambda x, w: sct.grouped_matmul(x.reshape(0, 3), w[:0], []),
    ],
    ids=["block-no-rows", "block-no-groups", "grouped-no-rows", "grouped-no-groups"],
)
def test_empty_shapes_give_empty_results_and_zero_gradients(run):
    x, w = make((0,), seed=1), make((2, 3, 4), seed=2)
    y = run(x, w)
    assert y.numel() == 0
    (y.sum() + 0 * w.sum()).backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


LAYOUTS = {
    "transposed": lambda t: t.detach().transpose(-1, -2).contiguous().transpose(-1, -2),
    "sliced": lambda t: t.detach().repeat_interleave(2, dim=-1)[..., ::2],
    "zero-stride": lambda t: t.detach()[:1].expand(t.shape),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_contiguous_tensors_get_correct_values_and_gradients(layout):
    x = LAYOUTS[layout](make((5, 2, 3), seed=1)).requires_grad_()
    w = LAYOUTS[layout](make((2, 3, 3), seed=2)).requires_grad_()
    assert not x.is_contiguous()
    for ours, theirs, args in [
        (sct.block_diag_matmul, einsum_block_diag, (x, w)),
        (lambda x2, w2: sct.grouped_matmul(x2, w2, [2, 3]), lambda x2, w2: loop_grouped(x2, w2, [2, 3]), (x[:, 0], w)),
    ]:
        y, want = ours(*args), theirs(*args)
        torch.testing.assert_close(y, want)
        grad = torch.ones_like(y)
        for got, expected in zip(torch.autograd.grad(y, (x, w), grad), torch.autograd.grad(want, (x, w), grad)):
            torch.testing.assert_close(got, expected)


def test_backward_saves_only_x_w_and_the_sizes():
    x, w = make((5, 2, 3)), make((2, 3, 4))
    for y in (sct.block_diag_matmul(x, w), sct.grouped_matmul(x[:, 0], w, [1, 4])):
        saved = y.grad_fn.saved_tensors
        assert saved[0].data_ptr() == x.data_ptr() and saved[1] is w  # never a per-row copy of w
        assert all(t.data_ptr() != y.data_ptr() for t in saved)  # not the output, which may change in place
        assert sum(t.numel() for t in saved[2:]) <= 2  # grouped_matmul's int64 sizes


def test_only_the_needed_gradients_are_computed(monkeypatch):
    def fail(*args):
        raise AssertionError("weight gradient computed although w does not require grad")

    monkeypatch.setattr(blockdiag, "_block_diag_weight_grad", fail)
    monkeypatch.setattr(blockdiag, "_grouped_weight_grad", fail)
    x, w = make((4, 2, 3)), make((2, 3, 2), requires_grad=False)
    sct.block_diag_matmul(x, w).sum().backward()
    sct.grouped_matmul(x[:, 0], w, [1, 3]).sum().backward()
    assert x.grad is not None and w.grad is None
    x, w = make((4, 2, 3), requires_grad=False), make((2, 3, 2))
    monkeypatch.undo()
    sct.block_diag_matmul(x, w).sum().backward()
    assert w.grad is not None and x.grad is None


def test_backward_twice_with_retain_graph_accumulates():
    x, w = make((4, 2, 3)), make((2, 3, 2))
    for y in (sct.block_diag_matmul(x, w), sct.grouped_matmul(x[:, 0], w, [2, 2])):
        x.grad = w.grad = None
        loss = (y * y).sum()
        loss.backward(retain_graph=True)
        first = (x.grad.clone(), w.grad.clone())
        loss.backward()
        torch.testing.assert_close(x.grad, 2 * first[0])
        torch.testing.assert_close(w.grad, 2 * first[1])


def test_partly_used_outputs_and_no_grad():
    x, w = make((4, 2, 3)), make((2, 3, 2))
    y = sct.block_diag_matmul(x, w)
    y[:, 0].sum().backward()  # no gradient reaches group 1: its entries get zero gradients
    assert torch.equal(w.grad[1], torch.zeros_like(w[1])) and torch.equal(x.grad[:, 1], torch.zeros_like(x[:, 1]))
    with torch.no_grad():
        assert sct.block_diag_matmul(x, w).grad_fn is None
        assert not sct.grouped_matmul(x[:, 0], w, [2, 2]).requires_grad


def test_inf_and_nan_propagate_without_numpy_warnings():
    x, w = torch.ones(2, 2, 2), torch.ones(2, 2, 2)
    x[0, 1, 0], x[1, 0, 1] = math.nan, math.inf
    y = sct.block_diag_matmul(x, w)  # a RuntimeWarning would fail this test (setup.cfg)
    assert y[0, 1].isnan().all() and y[1, 0].isinf().all() and y[0, 0].isfinite().all()
    z = sct.grouped_matmul(x[:, 1], w, [1, 1])
    assert z[0].isnan().all() and z[1].isfinite().all()


def test_mixed_float32_float64_computes_in_float64_and_returns_gradients_in_each_dtype():
    x, w = make((4, 2, 3), torch.float32), make((2, 3, 2), torch.float64)
    y = sct.block_diag_matmul(x, w)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, einsum_block_diag(x.double(), w))
    y.sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float64


@pytest.mark.parametrize(
    "dtype, message",
    [(torch.int64, "int64"), (torch.int32, "int32"), (torch.complex64, "complex64")],
)
def test_unsupported_dtypes_are_type_errors(dtype, message):
    x, w = torch.ones(2, 2, 2, dtype=dtype), torch.ones(2, 2, 2)
    with pytest.raises(TypeError, match=message):
        sct.block_diag_matmul(x, w)
    with pytest.raises(TypeError, match=message):
        sct.grouped_matmul(w[0], x, [1, 1])


def test_shape_device_type_and_group_size_errors():
    x, w = torch.ones(4, 2, 3), torch.ones(2, 3, 2)
    with pytest.raises(ValueError, match=r"x has shape \(4, 2, 3\), w has shape \(3, 3, 2\)"):
        sct.block_diag_matmul(x, torch.ones(3, 3, 2))
    with pytest.raises(ValueError, match=r"x is on cpu but w is on meta"):
        sct.block_diag_matmul(x, torch.ones(2, 3, 2, device="meta"))
    with pytest.raises(ValueError, match=r"x is on cpu but w is on meta"):
        sct.grouped_matmul(x[:, 0], torch.ones(2, 3, 2, device="meta"), [2, 2])
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, not ndarray"):
        sct.block_diag_matmul(np.ones((4, 2, 3)), w)
    with pytest.raises(ValueError, match=r"group_sizes sum to 3 but x has 4 rows"):
        sct.grouped_matmul(x[:, 0], w, [1, 2])
    with pytest.raises(ValueError, match=r"group_sizes must be non-negative"):
        sct.grouped_matmul(x[:, 0], w, torch.tensor([5, -1]))
    with pytest.raises(TypeError, match=r"group_sizes must hold integers, not float32"):
        sct.grouped_matmul(x[:, 0], w, torch.tensor([2.0, 2.0]))


WRAPPING_SIZES = [2**62, 2**62, 2**62, 2**62 + 6]
"""Their int64 sum wraps around to 6."""


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_group_sizes_tensor_of_any_integer_dtype(dtype):
    x, w = make((8, 4), seed=1), make((4, 4, 3), seed=2)
    torch.testing.assert_close(sct.grouped_matmul(x, w, torch.tensor(GROUP_SIZES, dtype=dtype)),
                               loop_grouped(x, w, GROUP_SIZES))


@pytest.mark.parametrize(
    "sizes",
    [WRAPPING_SIZES, np.array(WRAPPING_SIZES), torch.tensor(WRAPPING_SIZES), torch.tensor([2**63 - 1, 0, 0, 6], dtype=torch.uint64)],
    ids=["list", "ndarray", "tensor", "uint64-tensor"],
)
def test_group_sizes_past_n_are_rejected_before_anything_runs(sizes):
    x = torch.ones(6, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"spchain.torch.grouped_matmul: group_sizes must each be at most the 6 rows"):
        sct.grouped_matmul(x, torch.ones(4, 4, 2), sizes)
    with pytest.raises(ValueError, match=r"GroupedLinear: group_sizes must each be at most the 6 rows"):
        sct.GroupedLinear(4, 4, 2)(x, sizes)  # segfaulted in the bias's repeat_interleave


@pytest.mark.parametrize("sizes, dtype", [(torch.tensor([2.0, 2.0]), "float32"), (torch.tensor([True, True]), "bool"),
                                          ([2.0, 2.0], "float64")])
def test_group_sizes_of_floats_or_bools_are_type_errors(sizes, dtype):
    for layer in (lambda x, s: sct.grouped_matmul(x, torch.ones(2, 3, 2), s), sct.GroupedLinear(2, 3, 2)):
        with pytest.raises(TypeError, match=rf"group_sizes must hold integers, not {dtype}"):
            layer(torch.ones(4, 3), sizes)


@pytest.mark.parametrize("as_sizes", [list, tuple, torch.tensor, np.array], ids=["list", "tuple", "tensor", "ndarray"])
def test_group_sizes_may_be_a_sequence_tensor_or_array(as_sizes):
    x, w = make((8, 4), seed=1), make((4, 4, 3), seed=2)
    torch.testing.assert_close(sct.grouped_matmul(x, w, as_sizes(GROUP_SIZES)), loop_grouped(x, w, GROUP_SIZES))


def test_group_sizes_list_changed_after_forward_does_not_change_backward():
    x, w = make((4, 3)), make((2, 3, 2))
    sizes = [1, 3]
    y = sct.grouped_matmul(x, w, sizes)
    sizes[:] = [4, 0]
    y.sum().backward()
    want_x, want_w = torch.autograd.grad(loop_grouped(x, w, [1, 3]).sum(), (x, w))
    torch.testing.assert_close(x.grad, want_x)
    torch.testing.assert_close(w.grad, want_w)


def test_many_forward_backward_calls_do_not_leak(rss_growth):
    x, w = make((256, 4, 16), torch.float32), make((4, 16, 16), torch.float32)
    layer = sct.GroupedLinear(4, 64, 32)

    def step():
        x.grad = w.grad = None
        sct.block_diag_matmul(x, w).sum().backward()
        layer(x.detach().reshape(1024, 16).repeat(1, 4), [400, 0, 224, 400]).sum().backward()

    assert rss_growth(step) < 16 * 2**20  # one leaked step would hold over 256 KiB of activations


# The modules ---------------------------------------------------------------------------------


def test_block_diagonal_linear_matches_a_dense_block_diagonal_layer():
    layer = sct.BlockDiagonalLinear(6, 9, groups=3, dtype=torch.float64)
    assert layer.weight.shape == (3, 2, 3) and layer.bias.shape == (9,)
    x = make((4, 5, 6), seed=1)
    dense = torch.block_diag(*layer.weight)
    torch.testing.assert_close(layer(x), x @ dense + layer.bias)
    assert torch.autograd.gradcheck(layer, (x,), eps=1e-6, atol=1e-9, rtol=1e-7)


def test_grouped_linear_matches_a_per_group_loop():
    layer = sct.GroupedLinear(4, 3, 2, dtype=torch.float64)
    assert layer.weight.shape == (4, 3, 2) and layer.bias.shape == (4, 2)
    x = make((8, 3), seed=1)
    want = loop_grouped(x, layer.weight, GROUP_SIZES) + layer.bias.repeat_interleave(torch.tensor(GROUP_SIZES), 0)
    torch.testing.assert_close(layer(x, GROUP_SIZES), want)
    torch.testing.assert_close(layer(x, torch.tensor(GROUP_SIZES)), want)
    torch.testing.assert_close(layer(x, np.array(GROUP_SIZES, np.uint8)), want)
    assert torch.autograd.gradcheck(lambda x, w, b: layer(x, GROUP_SIZES), (x, layer.weight, layer.bias),
                                    eps=1e-6, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize(
    "make_layer, x, group_sizes",
    [(lambda: sct.BlockDiagonalLinear(8, 4, 2, bias=False), torch.ones(3, 8), None),
     (lambda: sct.GroupedLinear(2, 8, 4, bias=False), torch.ones(3, 8), [1, 2])],
    ids=["block-diagonal", "grouped"],
)
def test_modules_without_bias(make_layer, x, group_sizes):
    layer = make_layer()
    assert layer.bias is None and set(layer.state_dict()) == {"weight"}
    y = layer(x) if group_sizes is None else layer(x, group_sizes)
    assert y.shape == (3, 4)
    y.sum().backward()
    assert layer.weight.grad is not None


def test_initialisation_is_nn_linear_per_group():
    torch.manual_seed(0)
    for layer, fan_in in [(sct.BlockDiagonalLinear(512, 256, 8), 64), (sct.GroupedLinear(4, 100, 300), 100)]:
        bound = 1 / math.sqrt(fan_in)
        for p in (layer.weight, layer.bias):
            assert p.abs().max() <= bound
            assert abs(p.std().item() - bound / math.sqrt(3)) < 0.1 * bound  # the std of U(-b, b)
    layer.reset_parameters()
    assert layer.weight.abs().max() <= 1 / math.sqrt(100)


def test_extra_repr_and_state_dict_round_trip():
    block = sct.BlockDiagonalLinear(4, 6, 2, bias=False)
    grouped = sct.GroupedLinear(3, 4, 5)
    assert repr(block) == "BlockDiagonalLinear(in_features=4, out_features=6, groups=2, bias=False)"
    assert repr(grouped) == "GroupedLinear(groups=3, in_features=4, out_features=5, bias=True)"
    state = grouped.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == {"weight": (3, 4, 5), "bias": (3, 5)}
    other = sct.GroupedLinear(3, 4, 5)
    other.load_state_dict(state)
    x = torch.randn(6, 4)
    torch.testing.assert_close(other(x, [2, 2, 2]), grouped(x, [2, 2, 2]))


def test_module_factory_kwargs():
    layer = sct.GroupedLinear(2, 3, 4, device="meta", dtype=torch.float64)
    assert layer.weight.device.type == "meta" and layer.bias.dtype == torch.float64


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: sct.BlockDiagonalLinear(10, 8, 4), ValueError, r"in_features \(10\) and out_features \(8\) must be divisible by groups \(4\)"),
        (lambda: sct.BlockDiagonalLinear(8, 10, 4), ValueError, r"must be divisible by groups \(4\)"),
        (lambda: sct.BlockDiagonalLinear(8, 8, 0), ValueError, r"groups must be positive, got 0"),
        (lambda: sct.GroupedLinear(0, 8, 8), ValueError, r"groups must be positive, got 0"),
        (lambda: sct.GroupedLinear(2, -1, 8), ValueError, r"in_features must be non-negative, got -1"),
        (lambda: sct.GroupedLinear(2.0, 8, 8), TypeError, r"groups must be an int, got 2.0"),
        (lambda: sct.BlockDiagonalLinear(8, 8, True), TypeError, r"groups must be an int, got True"),
    ],
    ids=["in-not-divisible", "out-not-divisible", "zero-groups", "zero-experts", "negative", "float", "bool"],
)
def test_module_construction_errors(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_module_input_shape_errors():
    with pytest.raises(ValueError, match=r"input must be \(\.\.\., 8\), got \(3, 6\)"):
        sct.BlockDiagonalLinear(8, 4, 2)(torch.ones(3, 6))
    with pytest.raises(ValueError, match=r"input must be \(N, 8\), got \(2, 3, 8\)"):
        sct.GroupedLinear(2, 8, 4)(torch.ones(2, 3, 8), [3, 3])


# GPU: CUDA tensors through CuPy and cuBLAS -----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_tensors_match_the_cpu_on_torchs_current_stream(dtype):
    x, w = make((6, 3, 4), dtype, 1), make((3, 4, 5), dtype, 2)
    xs, ws = make((8, 4), dtype, 3), make((4, 4, 5), dtype, 4)
    stream = torch.cuda.Stream()
    results = {}
    for device in ("cpu", "cuda"):
        args = [t.detach().to(device).requires_grad_() for t in (x, w, xs, ws)]
        with torch.cuda.stream(stream):
            y = sct.block_diag_matmul(args[0], args[1])
            z = sct.grouped_matmul(args[2], args[3], torch.tensor(GROUP_SIZES, device=device))
            (y.square().sum() + z.square().sum()).backward()
        torch.cuda.synchronize()
        assert y.device.type == z.device.type == device
        results[device] = [t.detach().cpu() for t in (y, z, *(a.grad for a in args))]
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for cpu, cuda in zip(results["cpu"], results["cuda"]):
        torch.testing.assert_close(cuda, cpu, **tol)


@pytest.mark.gpu
def test_cuda_modules_and_gradcheck():
    block = sct.BlockDiagonalLinear(6, 4, 2, device="cuda", dtype=torch.float64)
    grouped = sct.GroupedLinear(3, 4, 2, device="cuda", dtype=torch.float64)
    x = make((5, 6), seed=1).detach().cuda().requires_grad_()
    assert torch.autograd.gradcheck(block, (x,), eps=1e-6, atol=1e-9, rtol=1e-7)
    xs = make((5, 4), seed=2).detach().cuda().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: grouped(t, [2, 0, 3]), (xs,), eps=1e-6, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("op", ["block_diag_matmul", "grouped_matmul"])
def test_double_backward_raises_instead_of_a_silent_zero_hessian(op):
    x, w = make((4, 2, 3)), make((2, 3, 2), seed=1)
    fn = (lambda x, w: sct.block_diag_matmul(x, w)) if op == "block_diag_matmul" else (
        lambda x, w: sct.grouped_matmul(x.reshape(8, 3), w, [3, 5]))
    match = r"double backward \(create_graph=True"
    with pytest.raises(RuntimeError, match=match):
        torch.autograd.grad((fn(x, w) ** 2).sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match=match):
        torch.autograd.functional.hessian(lambda w: (fn(x, w) ** 2).sum(), w)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_are_type_errors_naming_the_layout():
    x, w = make((4, 2, 3)), make((2, 3, 2), seed=1)
    with pytest.raises(TypeError, match=r"block_diag_matmul: w must be a dense tensor, not one of layout torch.sparse_coo"):
        sct.block_diag_matmul(x, w.detach().to_sparse())
    with pytest.raises(TypeError, match=r"grouped_matmul: x must be a dense tensor, not one of layout torch.sparse_csr"):
        sct.grouped_matmul(x.detach()[:, 0].to_sparse_csr(), w, [2, 2])
    with pytest.raises(TypeError, match=r"group_sizes must be a dense tensor, not a torch.sparse_coo one"):
        sct.grouped_matmul(x[:, 0], w, torch.tensor([2, 2]).to_sparse())


@pytest.mark.parametrize("x_shape, w_shape", [((0, 2, 3), (2, 3, 4)), ((5, 2, 0), (2, 0, 4)), ((5, 2, 3), (2, 3, 0))])
def test_block_diag_empty_shapes_give_zero_gradients(x_shape, w_shape):
    x, w = make(x_shape), make(w_shape, seed=1)
    y = sct.block_diag_matmul(x, w)
    assert y.shape == x_shape[:-1] + w_shape[-1:] and (y == 0).all()
    y.sum().backward()
    assert x.grad.shape == x_shape and w.grad.shape == w_shape
    assert (x.grad == 0).all() and (w.grad == 0).all()


# torch.func ----------------------------------------------------------------------------------
def _grouped_reference(x, w):
    return torch.cat([x[:2] @ w[0], x[2:] @ w[2]])


TORCH_FUNC_CASES = {
    "block_diag_matmul": (sct.block_diag_matmul, einsum_block_diag, (5, 3, 4)),
    "grouped_matmul": (lambda x, w: sct.grouped_matmul(x, w, torch.tensor([2, 0, 3])), _grouped_reference, (5, 4)),
}


@pytest.mark.parametrize("op", TORCH_FUNC_CASES)
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)], ids=["x", "w", "both"])
def test_jacrev_in_each_argument_matches_the_torch_reference(op, argnums):
    fn, reference, x_shape = TORCH_FUNC_CASES[op]
    x, w = make(x_shape, requires_grad=False), make((3, 4, 2), seed=1, requires_grad=False)
    got, want = (torch.func.jacrev(f, argnums=argnums)(x, w) for f in (fn, reference))
    for g, e in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("op", TORCH_FUNC_CASES)
def test_vmap_over_x_alone_gives_a_weight_gradient_per_sample(op):
    fn, reference, x_shape = TORCH_FUNC_CASES[op]
    xs, w = make((2, *x_shape), requires_grad=False), make((3, 4, 2), seed=1, requires_grad=False)
    grad_w = torch.vmap(torch.func.grad(lambda x, w: fn(x, w).pow(2).sum(), argnums=1), in_dims=(0, None))(xs, w)
    expected = torch.stack([torch.func.grad(lambda x, w: reference(x, w).pow(2).sum(), argnums=1)(x, w) for x in xs])
    torch.testing.assert_close(grad_w, expected)


def test_autocast_bfloat16_model_with_both_modules():
    torch.manual_seed(0)
    first, block, grouped = torch.nn.Linear(8, 8), sct.BlockDiagonalLinear(8, 6, groups=2), sct.GroupedLinear(2, 6, 3)
    x, sizes = torch.randn(4, 8), torch.tensor([1, 3])
    reference = grouped(block(first(x)), sizes)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped(block(first(x)), sizes)
    torch.testing.assert_close(out.float(), reference, rtol=5e-2, atol=5e-2)
    out.float().sum().backward()
    assert all(p.grad is not None for m in (first, block, grouped) for p in m.parameters())
