"""torch.library.opcheck over every registered ``spchain::`` operator: its schema, its fake
implementation (also with dynamic shapes, through AOT dispatch) and its autograd registration,
on tiny inputs of each dtype the operators take (float32 and float64; float16 and bfloat16 reach
them as float32, cast by the public functions).

The operators are enumerated from torch's dispatcher, so a new one without sample inputs here
fails :func:`test_every_operator_has_samples`. Each backward operator
(``spchain::<name>_backward``) is checked on the results of its forward operator.
"""

import warnings

import pytest

torch = pytest.importorskip("torch")

import spchain.torch  # noqa: E402,F401  (registers every operator)
from spchain.torch._operator import OPERATORS  # noqa: E402

DTYPES = [torch.float32, torch.float64]
# test_aot_dispatch_dynamic traces forward and backward with symbolic sizes, the slow part (about a
# second an operator), once, in float64: the fake implementations and the graphs do not depend on
# the dtype. test_aot_dispatch_static adds nothing that the dynamic one misses.
UTILS = {torch.float64: ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
         torch.float32: ("test_schema", "test_autograd_registration", "test_faketensor")}


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _chain(dtype):
    return randn(2, 4, 3, dtype=dtype), randn(3, 3, dtype=dtype, seed=1), randn(3, dtype=dtype, seed=2)


def _csr(dtype):
    """The parts of a 3 x 3 CSR log_trans with sorted columns and an empty row."""
    return torch.tensor([0, 2, 2, 4]), torch.tensor([0, 2, 1, 2]), randn(4, dtype=dtype, seed=3)


LENGTHS = torch.tensor([4, 2])
PATH = torch.tensor([[0, 2, 1, 1], [2, 0, -1, -1]])
# the parts of the 2 x 3 sparse matrix [[1, 0, 2], [0, 0, 3]] (CSR) and of a 4 x 4 BSR weight of 2 x 2 blocks
SPARSE = (torch.tensor([0, 2, 3]), torch.tensor([0, 2, 2]), "csr", [2, 3])
BLOCKS = (torch.tensor([0, 1, 2]), torch.tensor([1, 0]), [4, 4])

# each operator's arguments at a dtype; the differentiable ones require grad (see _requires_grad)
SAMPLES = {
    "logmatmul": lambda d: (randn(2, 3, 4, dtype=d), randn(4, 5, dtype=d, seed=1)),
    "maxmatmul": lambda d: (randn(2, 3, 4, dtype=d), randn(4, 5, dtype=d, seed=1)),
    "log_chain_product": lambda d: (randn(2, 4, 3, 3, dtype=d),),
    "chain_logsumexp": lambda d: (*_chain(d), LENGTHS),
    "chain_marginals": lambda d: (*_chain(d), LENGTHS),
    "viterbi": lambda d: (*_chain(d), LENGTHS),
    "chain_entropy": lambda d: (*_chain(d), LENGTHS),
    "chain_sample": lambda d: (*_chain(d), LENGTHS, 3, 7),
    "chain_kbest": lambda d: (*_chain(d), LENGTHS, 2),
    "chain_path_score": lambda d: (*_chain(d), PATH, LENGTHS),
    "sparse_chain_logsumexp": lambda d: (_chain(d)[0], *_csr(d), _chain(d)[2], LENGTHS),
    "sparse_chain_marginals": lambda d: (_chain(d)[0], *_csr(d), _chain(d)[2], LENGTHS),
    "sparse_viterbi": lambda d: (_chain(d)[0], *_csr(d), _chain(d)[2], LENGTHS),
    "sparse_chain_entropy": lambda d: (_chain(d)[0], *_csr(d), _chain(d)[2], LENGTHS),
    "sparse_chain_sample": lambda d: (_chain(d)[0], *_csr(d), _chain(d)[2], LENGTHS, 3, 7),
    "sparse_chain_kbest": lambda d: (_chain(d)[0], *_csr(d), _chain(d)[2], LENGTHS, 2),
    "sparse_chain_path_score": lambda d: (_chain(d)[0], *_csr(d), _chain(d)[2], PATH.clamp(min=0), LENGTHS),
    "block_diag_matmul": lambda d: (randn(5, 3, 4, dtype=d), randn(3, 4, 2, dtype=d, seed=1)),
    "grouped_matmul": lambda d: (randn(5, 4, dtype=d), randn(3, 4, 2, dtype=d, seed=1), torch.tensor([2, 0, 3])),
    "spmm": lambda d: (randn(3, 2, dtype=d), randn(3, dtype=d, seed=1), *SPARSE),
    "sddmm": lambda d: (*SPARSE[:2], randn(2, 4, dtype=d), randn(3, 4, dtype=d, seed=1), *SPARSE[2:]),
    "sparse_linear": lambda d: (randn(5, 3, dtype=d), randn(3, dtype=d, seed=1), *SPARSE[:2], [2, 3],
                                randn(2, dtype=d, seed=2)),
}
# spchain::sparse_linear with a block-sparse (BSR) weight: values (nnzb, R, C)
BLOCK_SAMPLE = lambda d: (randn(5, 4, dtype=d), randn(2, 2, 2, dtype=d, seed=1), *BLOCKS,  # noqa: E731
                          randn(4, dtype=d, seed=2))
# made only by the doctest of Operator, when the doctests run in the same process
DOCTEST_ONLY = {"doc_double"}


def _registered():
    names = {name.split("::", 1)[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
             if name.startswith("spchain::")}
    return sorted(n for n in names if n not in DOCTEST_ONLY)


def _operator(name):
    return OPERATORS[f"spchain::{name.removesuffix('_backward')}"]


def _requires_grad(operator, args):
    """The arguments, the differentiable float ones requiring grad where the operator has a backward."""
    if operator.backward is None:  # no autograd registration: its public function detaches the arguments
        return args
    return tuple(a.detach().requires_grad_() if k in operator.differentiable and isinstance(a, torch.Tensor)
                 and a.is_floating_point() else a for k, a in enumerate(args))


def _backward_args(operator, args):
    """The arguments of ``spchain::<name>_backward``: the forward's, its results, unit incoming
    gradients of the public results, and every gradient needed."""
    with torch.no_grad():
        results = operator.op(*args)
    results = list(results) if isinstance(results, tuple) else [results]
    grads = [torch.ones_like(r) for r in results[:operator.outputs]]
    return (*args, results, grads, [True] * len(operator.differentiable))


def test_every_operator_has_samples():
    forward = [n for n in _registered() if not n.endswith("_backward")]
    assert set(forward) == set(SAMPLES)
    for name in _registered():  # each backward operator belongs to a forward one with a backward
        assert _operator(name).backward is not None or not name.endswith("_backward")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", _registered())
def test_opcheck(name, dtype):
    _opcheck(name, SAMPLES[name.removesuffix("_backward")](dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["sparse_linear", "sparse_linear_backward"])
def test_opcheck_sparse_linear_with_block_values(name, dtype):
    _opcheck(name, BLOCK_SAMPLE(dtype), dtype)


def _opcheck(name, args, dtype):
    operator = _operator(name)
    if name.endswith("_backward"):
        overload = getattr(torch.ops.spchain, name).default
        args = _backward_args(operator, args)
    else:
        overload = operator.op
        args = _requires_grad(operator, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's beta and deprecation notes on the way
        torch.library.opcheck(overload, args, test_utils=UTILS[dtype])


# the operators whose backward reads their outputs (a log-sum-exp's or a max's result, a best path)
READ_OUTPUTS = {"chain_logsumexp", "sparse_chain_logsumexp", "chain_entropy", "sparse_chain_entropy", "viterbi",
                "sparse_viterbi", "logmatmul", "maxmatmul"}


@pytest.mark.parametrize("name", sorted(n for n in SAMPLES if _operator(n).backward is not None))
def test_an_output_changed_in_place_is_allowed_where_the_backward_does_not_read_it(name):
    """As torch's own ops: where the backward reads the arguments alone (a product, as
    ``nn.Linear``'s), the output may change in place before it (``nn.ReLU(inplace=True)``) and the
    gradients are the out-of-place op's; where it reads the output (as ``torch.logsumexp``'s),
    autograd's in-place error."""
    operator = _operator(name)
    assert operator.array.reads_outputs == (name in READ_OUTPUTS)
    args = _requires_grad(operator, SAMPLES[name](torch.float64))
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def first_output():
        out = operator(*args)
        return out[0] if isinstance(out, tuple) else out

    want = torch.autograd.grad((first_output() * 2).sum(), leaves)
    out = first_output()
    out.mul_(2)
    if operator.array.reads_outputs:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
        return
    for got, w in zip(torch.autograd.grad(out.sum(), leaves), want, strict=True):
        torch.testing.assert_close(got, w)


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_low_precision_arguments_promote_as_torch_does(name, low):
    """float16 and bfloat16 arguments are computed in float32, and the float results come in the
    promoted dtype of the float arguments (``torch.promote_types``): the low one where every
    float argument has it, float32 beside a float32 one (never a silent downcast)."""
    operator = _operator(name)
    args = SAMPLES[name](torch.float32)
    floats = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    cases = [(floats, low)] + ([(floats[:1], torch.float32)] if len(floats) > 1 else [])
    for lowered, dtype in cases:
        results = operator(*(a.to(low) if k in lowered else a for k, a in enumerate(args)))
        for r in results if isinstance(results, tuple) else (results,):
            assert r.dtype == dtype or not r.is_floating_point()
