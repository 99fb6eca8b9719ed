"""spchain.torch's chain and path functions with a sparse CSR log_trans
(spchain/torch/_sparse_chain.py): equal to the dense chain, with a sparse CSR gradient."""

import warnings

import pytest
import torch

import spchain.torch as st

warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")


def sparse_trans(c, dtype=torch.float64, density=0.5):
    """A sparse CSR log_trans (a stored -inf included) and its dense twin (-inf where absent)."""
    mask = torch.rand(c, c) < density
    mask[0, 0] = True
    values = torch.randn(c, c, dtype=dtype)
    values[0, 0] = -torch.inf
    stored = torch.where(mask, values, 0.0)
    stored[0, 0] = 1.0  # to_sparse_csr keeps non-zeros: put the -inf back below
    csr = stored.to_sparse_csr()
    vals = csr.values().clone()
    vals[0] = -torch.inf
    matrix = torch.sparse_csr_tensor(csr.crow_indices(), csr.col_indices(), vals, size=(c, c))
    return matrix, torch.where(mask, values, -torch.inf)


@pytest.mark.parametrize("batch, v, c, lengths", [
    ((3,), 5, 6, None), ((4,), 6, 5, [6, 1, 3, 2]), ((0,), 3, 4, None), ((2,), 1, 3, None), ((), 4, 7, None),
])
def test_chain_functions_and_gradients_equal_the_dense_chain(batch, v, c, lengths):
    torch.manual_seed(v * 100 + c)
    matrix, dense = sparse_trans(c)
    matrix.requires_grad_()
    dense.requires_grad_()
    x = torch.randn(batch + (v, c), dtype=torch.float64, requires_grad=True)
    init = torch.randn(c, dtype=torch.float64)
    kw = {} if lengths is None else {"lengths": torch.tensor(lengths)}
    got, want = st.chain_logsumexp(x, matrix, init, **kw), st.chain_logsumexp(x, dense, init, **kw)
    torch.testing.assert_close(got, want)
    weight = torch.randn(batch, dtype=torch.float64)
    (grad_x, grad_m), (want_x, want_d) = (torch.autograd.grad((r * weight).sum(), (x, t))
                                          for r, t in ((got, matrix), (want, dense)))
    assert grad_m.layout == torch.sparse_csr
    torch.testing.assert_close(grad_m.crow_indices(), matrix.crow_indices())
    torch.testing.assert_close(grad_m.col_indices(), matrix.col_indices())
    torch.testing.assert_close(grad_m.to_dense(), torch.where(dense.isneginf() & ~stored(matrix), 0.0, want_d))
    torch.testing.assert_close(grad_x, want_x)
    torch.testing.assert_close(st.chain_marginals(x, matrix, init, **kw), st.chain_marginals(x, dense, init, **kw))
    for op in (st.viterbi, lambda *a, **k: st.chain_kbest(*a, k=2, **k),
               lambda *a, **k: st.chain_sample(*a, num_samples=2, seed=3, **k)):
        for g, w in zip(*(op(x, t, init, **kw) for t in (matrix, dense))):
            torch.testing.assert_close(g, w)
    torch.testing.assert_close(st.chain_entropy(x, matrix, init, **kw), st.chain_entropy(x, dense, init, **kw))
    path = st.viterbi(x, dense, init, **kw)[1].clamp(min=0)
    torch.testing.assert_close(st.chain_path_score(x, matrix, init, path, **kw),
                               st.chain_path_score(x, dense, init, path, **kw))


def stored(matrix):
    """The stored entries of a CSR tensor as a dense bool mask."""
    ones = torch.sparse_csr_tensor(matrix.crow_indices(), matrix.col_indices(),
                                   torch.ones_like(matrix.values()), size=matrix.shape)
    return ones.to_dense() > 0


@pytest.mark.parametrize("name", ["chain_logsumexp", "viterbi", "chain_entropy", "chain_path_score"])
def test_float64_gradcheck_including_the_sparse_values(name):
    torch.manual_seed(1)
    c = 5
    matrix, _ = sparse_trans(c, density=0.6)
    values = matrix.values().detach().clone()
    values[0] = -1.0  # gradcheck needs finite inputs
    values.requires_grad_()
    x = torch.randn(3, 4, c, dtype=torch.float64, requires_grad=True)
    init = torch.randn(c, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([4, 2, 1])

    def f(x, values, init):
        m = torch.sparse_csr_tensor(matrix.crow_indices(), matrix.col_indices(), values, size=(c, c))
        if name == "chain_path_score":
            path = st.viterbi(x.detach(), m.detach(), init.detach(), lengths=lengths)[1]  # through stored entries
            return st.chain_path_score(x, m, init, path.clamp(min=0), lengths=lengths)
        out = getattr(st, name)(x, m, init, lengths=lengths)
        return out[0] if name == "viterbi" else out

    assert torch.autograd.gradcheck(f, (x, values, init))


@pytest.mark.parametrize("trans, error, match", [
    (torch.eye(4).to_sparse_csr(), ValueError, r"log_trans must end in \(c, c\) = \(3, 3\)"),
    (torch.eye(3).expand(2, 3, 3).to_sparse_csr(), ValueError, "must be one .c, c. matrix"),
    # row 1 stores columns 2 then 0: torch's backward would permute the gradient of its values
    (torch.sparse_csr_tensor(torch.tensor([0, 1, 3, 3]), torch.tensor([1, 2, 0]), torch.zeros(3), size=(3, 3)),
     ValueError, "sorted column indices in each row, row 1"),
])
def test_bad_sparse_transitions(trans, error, match):
    with pytest.raises(error, match=match):
        st.chain_logsumexp(torch.zeros(2, 4, 3), trans)


def test_unsorted_columns_are_rejected_not_given_a_permuted_gradient():
    crow, col = torch.tensor([0, 2, 3]), torch.tensor([1, 0, 1])
    values = torch.tensor([0.5, -1.0, 0.3], dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 2, dtype=torch.float64)
    for fn in (st.chain_logsumexp, st.chain_marginals, st.chain_entropy, lambda x, t: st.viterbi(x, t)[0],
               lambda x, t: st.chain_sample(x, t), lambda x, t: st.chain_kbest(x, t, k=2)[0],
               lambda x, t: st.chain_path_score(x, t, None, torch.tensor([0, 1, 1]))):
        with pytest.raises(ValueError, match="sorted column indices"):
            fn(x, torch.sparse_csr_tensor(crow, col, values, size=(2, 2)))
    order = torch.tensor([1, 0, 2])  # the same matrix with sorted columns: the gradient of the dense twin
    st.chain_logsumexp(x, torch.sparse_csr_tensor(crow, col[order], values[order], size=(2, 2))).backward()
    dense = torch.tensor([[-1.0, 0.5], [-torch.inf, 0.3]], dtype=torch.float64, requires_grad=True)
    st.chain_logsumexp(x, dense).backward()
    torch.testing.assert_close(values.grad, dense.grad[[0, 0, 1], [1, 0, 1]])
