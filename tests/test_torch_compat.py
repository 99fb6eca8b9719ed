"""The torch modules (SparseLinear and its block form, LinearChainCRF, BlockDiagonalLinear and
GroupedLinear) with torch's transforms and utilities: the module cells of the compatibility table
in docs/compatibility.rst that no other test file checks."""

import datetime
import os
import tempfile
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.nn.utils.prune  # noqa: E402

import spchain.torch as st  # noqa: E402


ALLOWED = torch.ones(4, 4, dtype=torch.bool).triu()  # made outside a meta-device context: it holds data


class Tagger(torch.nn.Module):
    """A linear emission head and a CRF in pytorch-crf's convention: the log-likelihood."""

    def __init__(self, sparse):
        super().__init__()
        self.head = torch.nn.Linear(6, 4, dtype=torch.float64)
        self.crf = st.LinearChainCRF(4, batch_first=True, sparse_transitions=ALLOWED if sparse else None).double()

    def forward(self, x, tags, mask):
        return self.crf(self.head(x), tags, mask, reduction="none")


def _tagger_inputs(batch=3):
    gen = torch.Generator().manual_seed(batch)
    lengths = torch.arange(batch) % 5 + 1
    tags = torch.randint(4, (batch, 5), generator=gen).sort(dim=1).values  # allowed by the triangle too
    return torch.randn(batch, 5, 6, dtype=torch.float64, generator=gen), tags, torch.arange(5) < lengths[:, None]


def _linear_inputs(batch=4):
    return (torch.randn(batch, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(batch)),)


CASES = {
    "SparseLinear": (lambda: st.SparseLinear(8, 6, sparsity=0.5, dtype=torch.float64), _linear_inputs),
    "SparseLinear block": (lambda: st.SparseLinear(8, 6, sparsity=0.5, block=(3, 2), dtype=torch.float64),
                           _linear_inputs),
    "LinearChainCRF": (lambda: Tagger(sparse=False), _tagger_inputs),
    "LinearChainCRF sparse": (lambda: Tagger(sparse=True), _tagger_inputs),
    "BlockDiagonalLinear": (lambda: st.BlockDiagonalLinear(8, 6, groups=2, dtype=torch.float64), _linear_inputs),
    "GroupedLinear": (lambda: st.GroupedLinear(3, 8, 2, dtype=torch.float64),
                      lambda batch=5: (_linear_inputs(batch)[0], torch.tensor([2, 0, batch - 2]))),
}


def _case(name, batch=None):
    torch.manual_seed(0)
    make, inputs = CASES[name]
    return make(), (inputs() if batch is None else inputs(batch))


def _loss_and_grads(module, inputs):
    out = module(*inputs)
    return out, torch.autograd.grad(out.sum(), list(module.parameters()))


class WithBreak(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *inputs):
        out = self.module(*inputs)
        torch._dynamo.graph_break()
        return out * 2


@pytest.mark.parametrize("name", CASES)
def test_compile_with_graph_breaks_trains_like_eager(name):
    module, inputs = _case(name)
    wrapped = WithBreak(module)
    torch._dynamo.reset()
    assert torch._dynamo.explain(wrapped)(*inputs).graph_break_count >= 1
    want, want_grads = _loss_and_grads(wrapped, inputs)
    got, got_grads = _loss_and_grads(torch.compile(wrapped), inputs)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("name", CASES)
def test_export_with_a_dynamic_batch_runs_other_batch_sizes(name):
    module, inputs = _case(name)
    batch = torch.export.Dim("batch", min=2, max=64)
    shapes = [{0: batch} if k == 0 or name.startswith("LinearChainCRF") else None for k in range(len(inputs))]
    if name == "GroupedLinear":  # the rows, split among the groups by the second input
        shapes = [{0: batch}, None]
    program = torch.export.export(module, inputs, dynamic_shapes=tuple(shapes))
    for size in (3, 7):
        module_, other = _case(name, size)
        torch.testing.assert_close(program.module()(*other), module(*other))


@pytest.mark.parametrize("name", CASES)
def test_torch_func_grad_of_functional_call_equals_autograd(name):
    module, inputs = _case(name)
    params = {k: v.detach() for k, v in module.named_parameters()}
    grads = torch.func.grad(lambda p: torch.func.functional_call(module, p, inputs).sum())(params)
    _, want = _loss_and_grads(module, inputs)
    for g, w in zip(grads.values(), want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("name", CASES)
def test_an_in_place_op_on_the_output_trains_as_on_nn_linear_s(name):
    """``nn.ReLU(inplace=True)`` after the module: the backward reads no output, so autograd
    allows it (as after ``nn.Linear``) and the gradients are those of ``relu(out)``."""
    module, inputs = _case(name)
    want = torch.autograd.grad(torch.relu(module(*inputs)).sum(), list(module.parameters()))
    out = module(*inputs)
    out.relu_()
    got = torch.autograd.grad(out.sum(), list(module.parameters()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("name", CASES)
def test_forward_ad_is_exact_or_not_implemented_never_zero(name):
    module, inputs = _case(name)
    x, rest = inputs[0], inputs[1:]
    tangent = torch.randn_like(x)

    def f(x):
        return module(x, *rest)

    step = 1e-6
    want = (f(x + step * tangent) - f(x - step * tangent)).detach() / (2 * step)
    try:
        _, got = torch.func.jvp(f, (x,), (tangent,))
    except NotImplementedError:
        return
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", CASES)
def test_autocast_runs_close_to_float32(name, dtype):
    module, inputs = _case(name)
    module = module.float()
    inputs = [t.float() if t.is_floating_point() else t for t in inputs]
    want = module(*inputs)
    with torch.autocast("cpu", dtype=dtype):
        got = module(*inputs)
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2 * float(want.abs().max()))
    got.float().sum().backward()
    assert all(p.grad is not None for p in module.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["LinearChainCRF", "LinearChainCRF sparse"])
def test_the_crf_in_half_precision(name, dtype):
    module, inputs = _case(name)
    want = module(*inputs)
    module = module.to(dtype)
    got = module(inputs[0].to(dtype), *inputs[1:])
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=5e-2, atol=5e-2 * float(want.abs().max()))
    got.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in module.parameters())


# the parameter of each module that torch's utilities take (SparseLinear: tests/test_torch_nn.py)
WEIGHTS = {"LinearChainCRF": ("crf", "transitions"), "BlockDiagonalLinear": ("", "weight"),
           "GroupedLinear": ("", "weight")}


def _utility_case(name):
    module, inputs = _case(name)
    owner, tensor = WEIGHTS[name]
    return module, inputs, module.get_submodule(owner), tensor


@pytest.mark.parametrize("name", WEIGHTS)
def test_parametrize_nn_utils_prune_and_weight_norm_act_on_the_weight(name):
    class Half(torch.nn.Module):
        def forward(self, w):
            return w / 2

    for attach in (lambda m, t: torch.nn.utils.parametrize.register_parametrization(m, t, Half()),
                   lambda m, t: torch.nn.utils.prune.random_unstructured(m, t, amount=0.5),
                   lambda m, t: torch.nn.utils.parametrizations.weight_norm(m, t, dim=0)):
        module, inputs, owner, tensor = _utility_case(name)
        reference, _ = _case(name)
        attach(owner, tensor)
        with torch.no_grad():  # the plain module with the weight the utility computes
            reference.get_submodule(WEIGHTS[name][0]).get_parameter(tensor).copy_(getattr(owner, tensor))
        got, grads = _loss_and_grads(module, inputs)
        torch.testing.assert_close(got, reference(*inputs))
        assert all(g is not None for g in grads)


@pytest.mark.parametrize("name", WEIGHTS)
def test_ao_pruning_sparsifies_the_weight(name):
    from torch.ao.pruning import BaseSparsifier

    class Half(BaseSparsifier):
        def update_mask(self, module, tensor_name, **kwargs):
            parametrization = getattr(module.parametrizations, tensor_name)
            order = parametrization.original.detach().flatten().abs().argsort()
            parametrization[0].mask.view(-1)[order[:order.numel() // 2]] = False

    module, inputs, owner, tensor = _utility_case(name)
    fqn = ".".join(filter(None, (WEIGHTS[name][0], tensor)))
    sparsifier = Half(defaults={})
    sparsifier.prepare(module, [{"tensor_fqn": fqn}])
    sparsifier.step()
    sparsifier.squash_mask()
    weight = getattr(owner, tensor)
    assert int((weight == 0).sum()) == weight.numel() // 2
    module(*inputs).sum().backward()


@pytest.mark.parametrize("name", CASES)
def test_meta_device_context_then_to_empty_and_reset_parameters(name):
    with torch.device("meta"):
        module, _ = _case(name)
    assert all(p.is_meta for p in module.parameters())
    module.to_empty(device="cpu")
    for m in module.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    _, inputs = _case(name)
    assert bool(module(*inputs).isfinite().all())


def _ddp_worker(rank, init, out):
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=120))
    try:
        results = {}
        for name in CASES:
            module, inputs = _case(name, 6)
            half = [t[3 * rank:3 * rank + 3] if name != "GroupedLinear" or k == 0 else t for k, t in enumerate(inputs)]
            if name == "GroupedLinear":  # rank 0 holds the first 3 rows (groups 0 and 1), rank 1 the rest
                half[1] = torch.tensor([2, 0, 1]) if rank == 0 else torch.tensor([0, 0, 3])
            ddp = torch.nn.parallel.DistributedDataParallel(module)
            ddp(*half).sum().backward()
            results[name] = [p.grad.clone() for p in module.parameters()]
            # wait, the GIL released, for gloo's thread to finish with the gradients' work: freed
            # later, the DDP reducer can deadlock against that thread (torch holds the GIL there)
            torch.distributed.barrier()
            del ddp
        torch.save(results, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_distributed_data_parallel_averages_the_gradients_of_the_whole_batch():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{os.path.join(tmp, 'init')}", os.path.join(tmp, "grads")
        torch.multiprocessing.spawn(_ddp_worker, args=(init, out), nprocs=2, join=True)
        ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for name in CASES:
        module, inputs = _case(name, 6)
        _, want = _loss_and_grads(module, inputs)
        for rank in ranks:
            for g, w in zip(rank[name], want):
                torch.testing.assert_close(g, w / 2)


class _Worked(torch.utils.data.Dataset):
    def __init__(self):
        self.modules = {name: _case(name) for name in CASES}

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {name: module(*inputs).detach() for name, (module, inputs) in self.modules.items()}


def test_dataloader_workers_run_the_modules():
    dataset = _Worked()
    want = dataset[0]
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=2, timeout=120)
    for batch in loader:
        for name, value in batch.items():
            torch.testing.assert_close(value, torch.stack([want[name]] * 2))


@pytest.mark.parametrize("name", CASES)
def test_jit_script_and_trace_raise(name):
    module, inputs = _case(name)
    for scripted in (module, torch.nn.Sequential(torch.nn.Identity(), module)):  # alone, and in a model
        with pytest.raises(RuntimeError, match=r"spchain\.torch\.\w+: torch.jit.script cannot compile spchain's "
                                               r"modules .*; use torch.compile or torch.export"):
            torch.jit.script(scripted)
    with warnings.catch_warnings(), pytest.raises((RuntimeError, torch.jit._trace.TracingCheckError)):
        warnings.simplefilter("ignore")
        torch.jit.trace(module, tuple(inputs))


@pytest.mark.parametrize("name", CASES)
def test_onnx_export_raises(name):
    module, inputs = _case(name)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), pytest.raises(RuntimeError):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, tuple(inputs), os.path.join(tmp, "model.onnx"), dynamo=False)


def test_the_compatibility_table_names_tests_that_exist():
    import pathlib
    import re

    tests = pathlib.Path(__file__).resolve().parent
    files = {"compat": "test_torch_compat.py", "transforms": "test_torch_transforms.py", "nn": "test_torch_nn.py",
             "crf": "test_crf.py", "pruning": "test_torch_pruning.py"}
    text = (tests.parent / "docs" / "compatibility.rst").read_text()
    references = re.findall(r"``([\w.]+)::(test_\w+)``", text)
    assert len(references) > 30
    for file, test in references:
        assert re.search(rf"^def {test}\(", (tests / files.get(file, file)).read_text(), re.MULTILINE), (file, test)
