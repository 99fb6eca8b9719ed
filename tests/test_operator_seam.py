"""One prepared problem per call (issue 21): a forward and backward through ``spchain.torch``
prepares its chain once and validates a sparse ``log_trans`` once."""

import collections

import pytest
import torch

import spchain._chain_layout
import spchain._csr
import spchain._structures
import spchain.chain
import spchain.torch as st
from spchain.torch.chain import SPARSE_CHAIN_LOGSUMEXP


@pytest.fixture
def calls(monkeypatch):
    """Counts of the chain preparations (``prepare``) and sparse structure validations
    (``to_csr``) made, with an empty structure cache."""
    counts = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    prepare = counted("prepare", spchain._chain_layout.prepare)
    monkeypatch.setattr(spchain._chain_layout, "prepare", prepare)
    monkeypatch.setattr(spchain.chain, "prepare", prepare)
    monkeypatch.setattr(spchain._csr, "to_csr", counted("structure", spchain._csr.to_csr))
    monkeypatch.setattr(spchain._structures, "STRUCTURES", spchain._structures.StructureCache())
    return counts


def _inputs(sparse):
    torch.manual_seed(0)
    x = torch.randn(4, 8, 4, dtype=torch.float64, requires_grad=True)
    trans = torch.randn(4, 4, dtype=torch.float64)
    trans = trans.masked_fill(torch.eye(4, dtype=torch.bool).roll(1, 1), 0.0)
    log_trans = trans.to_sparse_csr() if sparse else trans
    return x, log_trans.requires_grad_(), torch.randn(4, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("sparse", [False, True])
def test_chain_logsumexp_prepares_once(calls, sparse):
    x, log_trans, log_init = _inputs(sparse)
    st.chain_logsumexp(x, log_trans, log_init, lengths=torch.tensor([8, 3, 5, 1])).sum().backward()
    assert calls["prepare"] == 1
    assert calls["structure"] == (1 if sparse else 0)
    assert x.grad is not None and log_trans.grad is not None and log_init.grad is not None


def test_the_registered_operators_validate_a_sparse_structure_once(calls):
    x, log_trans, _ = _inputs(True)
    parts = log_trans.crow_indices(), log_trans.col_indices(), log_trans.values().detach()

    def total(values):
        return SPARSE_CHAIN_LOGSUMEXP(x.detach(), parts[0], parts[1], values, None, None)[0].sum()

    got = torch.func.grad(total)(parts[2])  # a transform: the registered forward and backward operators
    assert calls["structure"] == 1  # the backward operator prepares again, its structure from the cache
    leaf = parts[2].clone().requires_grad_()
    want, = torch.autograd.grad(total(leaf), leaf)
    torch.testing.assert_close(got, want)


def test_crf_training_step_prepares_each_operator_once(calls):
    torch.manual_seed(0)
    allowed = torch.ones(5, 5, dtype=torch.bool).triu().tril(1)
    crf = st.LinearChainCRF(5, sparse_transitions=allowed).double()
    emissions = torch.randn(3, 6, 5, dtype=torch.float64, requires_grad=True)
    tags = torch.tensor([[0, 1, 1, 2, 3, 4], [0, 0, 1, 2, 2, 2], [1, 1, 1, 2, 3, 3]])
    crf.nll(emissions, tags, torch.tensor([6, 4, 5])).backward()
    assert calls["prepare"] == 2  # chain_logsumexp's and chain_path_score's
    assert calls["structure"] == 1  # shared by both, forward and backward
    assert crf.transitions.grad is not None
    crf.nll(emissions, tags, torch.tensor([6, 4, 5])).backward()
    assert calls["structure"] == 1  # and by the next step


@pytest.mark.parametrize("name", ["logmatmul", "maxmatmul", "log_chain_product", "block_diag_matmul",
                                  "grouped_matmul"])
def test_the_products_validate_once_per_forward_and_backward(monkeypatch, name):
    """The products are ``Op``s: their operands are checked by one ``prepare`` a call."""
    import spchain._checks
    import spchain.blockdiag

    checks = []

    def counted(real):
        return lambda *args, **kwargs: (checks.append(1), real(*args, **kwargs))[1]

    monkeypatch.setattr(spchain._checks, "dense", counted(spchain._checks.dense))
    monkeypatch.setattr(spchain.blockdiag, "dense", counted(spchain.blockdiag.dense))
    torch.manual_seed(0)
    a = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    call = {"logmatmul": lambda: st.logmatmul(a, b), "maxmatmul": lambda: st.maxmatmul(a, b)[0],
            "log_chain_product": lambda: st.log_chain_product(a),
            "block_diag_matmul": lambda: st.block_diag_matmul(a.transpose(0, 1), a),
            "grouped_matmul": lambda: st.grouped_matmul(b.T, a[:, :, :2], torch.tensor([1, 4, 0]))}[name]
    call().square().sum().backward()
    assert len(checks) == 1
    assert a.grad is not None


@pytest.mark.parametrize("layout", [torch.Tensor.to_sparse_csr, torch.Tensor.to_sparse_coo])
def test_spmm_converts_its_sparse_operand_once_per_forward_and_backward(monkeypatch, layout):
    """``spmm`` is an ``Op``: its backward multiplies by the CSR form its forward built."""
    import spchain.sparse

    conversions = []
    real = spchain.sparse.to_csr
    monkeypatch.setattr(spchain.sparse, "to_csr", lambda *args, **kwargs: (conversions.append(1), real(*args, **kwargs))[1])
    a = layout(torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 3.0]], dtype=torch.float64))
    b = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    st.spmm(a, b).square().sum().backward()
    assert len(conversions) == 1
    torch.testing.assert_close(b.grad, 2 * a.to_dense().T @ (a.to_dense() @ b.detach()))
