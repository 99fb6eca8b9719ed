"""spchain.torch.LinearChainCRF (spchain/torch/crf.py) against pytorch-crf's CRF on the same parameters."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchcrf = pytest.importorskip("torchcrf")

import spchain.torch as st  # noqa: E402


def pair(num_tags, seed=0, dtype=torch.float64):
    """A pytorch-crf CRF with random parameters and a LinearChainCRF loaded with them."""
    torch.manual_seed(seed)
    ref = torchcrf.CRF(num_tags, batch_first=True).to(dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    crf = st.LinearChainCRF(num_tags).to(dtype)
    crf.load_state_dict(ref.state_dict())
    return crf, ref


def batch(num_tags, lengths, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    v = int(lengths.max())
    emissions = torch.randn(len(lengths), v, num_tags, dtype=dtype, generator=gen)
    tags = torch.randint(num_tags, (len(lengths), v), generator=gen)
    mask = torch.arange(v)[None, :] < lengths[:, None]
    return emissions, tags, lengths, mask


@pytest.mark.parametrize("num_tags, lengths", [(1, [3, 1]), (4, [7, 3, 1, 5, 7]), (6, [2, 2]), (3, [9])])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_and_gradients_match_pytorch_crf(num_tags, lengths, reduction):
    crf, ref = pair(num_tags)
    emissions, tags, lengths, mask = batch(num_tags, lengths)
    emissions.requires_grad_()
    got = crf.nll(emissions, tags, lengths, reduction=reduction)
    want = -ref(emissions, tags, mask, reduction=reduction)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got_grads = torch.autograd.grad(got.sum(), [emissions, *crf.parameters()])
    want_grads = torch.autograd.grad(want.sum(), [emissions, *ref.parameters()])
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_nll_float32_without_lengths():
    crf, ref = pair(5, dtype=torch.float32)
    emissions, tags, _, mask = batch(5, [6, 6, 6], dtype=torch.float32)
    torch.testing.assert_close(crf.nll(emissions, tags), -ref(emissions, tags, mask, reduction="mean"))


@pytest.mark.parametrize("num_tags, lengths", [(4, [7, 3, 1, 5, 7]), (2, [4, 4]), (5, [1])])
def test_decode_matches_pytorch_crf(num_tags, lengths):
    crf, ref = pair(num_tags, seed=2)
    emissions, _, lengths, mask = batch(num_tags, lengths, seed=3)
    got = crf.decode(emissions, lengths)
    want = ref.decode(emissions, mask)
    assert [row[:n].tolist() for row, n in zip(got, lengths)] == want
    assert all((row[n:] == -1).all() for row, n in zip(got, lengths))


def test_marginals_and_samples_are_the_posterior():
    crf, ref = pair(3, seed=4)
    emissions, _, lengths, mask = batch(3, [4, 2], seed=5)
    marginals = crf.marginals(emissions, lengths)
    # the brute-force posterior of pytorch-crf's scores
    for b, n in enumerate(lengths.tolist()):
        paths = torch.tensor(list(np.ndindex(*(3,) * n)))
        e = emissions[b:b + 1, :n].expand(len(paths), n, 3)
        logp = ref(e, paths, torch.ones(paths.shape, dtype=torch.bool), reduction="none").detach()
        p = logp.exp()
        want = torch.stack([torch.zeros(3, dtype=p.dtype).index_add(0, paths[:, t], p) for t in range(n)])
        torch.testing.assert_close(marginals[b, :n], want)
        assert (marginals[b, n:] == 0).all()
    samples = crf.sample(emissions, lengths, num_samples=4000, seed=0)
    assert samples.shape == (4000, 2, 4)
    frequencies = torch.stack([torch.bincount(samples[:, 0, t], minlength=3) for t in range(4)]).double() / 4000
    torch.testing.assert_close(frequencies, marginals[0], atol=0.03, rtol=0)


def test_state_dict_and_gradients_flow_to_parameters():
    crf = st.LinearChainCRF(4)
    assert set(crf.state_dict()) == {"start_transitions", "end_transitions", "transitions"}
    emissions, tags, lengths, _ = batch(4, [5, 3], dtype=torch.float32)
    crf.nll(emissions, tags, lengths).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in crf.parameters())


@pytest.mark.parametrize("call, error, match", [
    (lambda crf: crf.nll(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.int64)), ValueError, "emissions must have shape"),
    (lambda crf: crf.nll(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.int64)), ValueError, "tags must be"),
    (lambda crf: crf.nll(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.int64), reduction="avg"), ValueError,
     "reduction must be one of"),
    (lambda crf: crf.decode(torch.zeros(2, 3, 4), torch.tensor([3, 4])), ValueError, "lengths must lie in"),
    (lambda crf: crf.decode(torch.zeros(2, 3, 4), torch.tensor([3])), ValueError, "lengths must have shape"),
    (lambda crf: crf.nll(torch.zeros(1, 2, 4), torch.tensor([[0, 4]])), ValueError, "path states must lie"),
    # issue 22 item 7: IndexError before
    (lambda crf: crf.nll(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.int64), torch.tensor([3.0, 2.0])),
     TypeError, "lengths must hold integers"),
    (lambda crf: crf.decode(torch.zeros(2, 3, 4), [3.0, 1.5]), TypeError, "lengths must hold integers"),
    (lambda crf: crf.marginals(torch.zeros(2, 3, 4), torch.tensor([True, True])), TypeError, "lengths must hold int"),
    (lambda crf: crf.nll(torch.zeros(2, 0, 4), torch.zeros(2, 0, dtype=torch.int64)), ValueError, "at least one"),
    (lambda crf: crf.log_partition(torch.zeros(2, 0, 4), torch.tensor([0, 0])), ValueError, "at least one position"),
])
def test_bad_inputs_are_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(st.LinearChainCRF(4))


def sparse_pair(num_tags, allowed, seed=0):
    """A LinearChainCRF with sparse transitions and random parameters, and the dense one with
    the same scores (``-inf`` at the transitions not allowed)."""
    torch.manual_seed(seed)
    sparse = st.LinearChainCRF(num_tags, sparse_transitions=allowed).double()
    dense = st.LinearChainCRF(num_tags).double()
    with torch.no_grad():
        for p in sparse.parameters():
            p.normal_()
        full = torch.full((num_tags, num_tags), -torch.inf, dtype=torch.float64)
        full[torch.as_tensor(allowed)] = sparse.transitions
        dense.transitions.copy_(full)
        dense.start_transitions.copy_(sparse.start_transitions)
        dense.end_transitions.copy_(sparse.end_transitions)
    return sparse, dense


@pytest.mark.parametrize("num_tags, lengths", [(5, [7, 3, 1, 6]), (1, [2, 1]), (4, [1])])
def test_sparse_transitions_equal_the_dense_crf_with_minus_inf(num_tags, lengths):
    gen = torch.Generator().manual_seed(num_tags)
    allowed = torch.rand(num_tags, num_tags, generator=gen) < 0.5
    allowed[0, 0] = True
    sparse, dense = sparse_pair(num_tags, allowed)
    assert sparse.transitions.shape == (int(allowed.sum()),)
    emissions, _, lengths, _ = batch(num_tags, lengths, seed=2)
    tags = dense.decode(emissions, lengths).clamp(min=0)  # a possible path, with finite scores
    tags[-1, 0] = num_tags - 1  # and one that may take a transition not allowed (+inf NLL then)
    for reduction in ("none", "sum"):
        torch.testing.assert_close(sparse.nll(emissions, tags, lengths, reduction), dense.nll(emissions, tags, lengths, reduction))
    for crf in (sparse, dense):  # the gradients, of the possible paths
        crf.nll(emissions[:-1], tags[:-1], lengths[:-1], "sum").backward()
    torch.testing.assert_close(sparse.transitions.grad, dense.transitions.grad[allowed])
    torch.testing.assert_close(sparse.start_transitions.grad, dense.start_transitions.grad)
    torch.testing.assert_close(sparse.end_transitions.grad, dense.end_transitions.grad)
    assert torch.equal(sparse.decode(emissions, lengths), dense.decode(emissions, lengths))
    torch.testing.assert_close(sparse.marginals(emissions, lengths), dense.marginals(emissions, lengths))
    samples = sparse.sample(emissions, lengths, num_samples=50, seed=3)
    steps = torch.stack([samples[..., :-1], samples[..., 1:]], -1).reshape(-1, 2)
    steps = steps[(steps >= 0).all(-1)]
    assert allowed[steps[:, 0], steps[:, 1]].all()


def test_sparse_transitions_structures():
    allowed = torch.ones(4, 4, dtype=torch.bool).triu().tril(1)  # stay or move one tag on
    from_mask = st.LinearChainCRF(4, sparse_transitions=allowed)
    from_numpy = st.LinearChainCRF(4, sparse_transitions=allowed.numpy())
    from_sparse = st.LinearChainCRF(4, sparse_transitions=allowed.double().to_sparse_csr())
    for crf in (from_mask, from_numpy, from_sparse):
        assert crf.transition_indptr.tolist() == [0, 2, 4, 6, 7]
        assert crf.transition_indices.tolist() == [0, 1, 1, 2, 2, 3, 3]
        assert crf.transitions.shape == (7,)
    assert set(from_mask.state_dict()) == {"start_transitions", "end_transitions", "transitions",
                                           "transition_indptr", "transition_indices"}
    assert "allowed_transitions=7" in repr(from_mask)
    # a stored zero is an allowed transition
    stored_zero = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 3]]), torch.zeros(2), (4, 4), check_invariants=True)
    assert st.LinearChainCRF(4, sparse_transitions=stored_zero).transition_indices.tolist() == [1, 3]


@pytest.mark.parametrize("structure, error, match", [
    (torch.ones(4, 3, dtype=torch.bool), ValueError, r"must have shape \(4, 4\)"),
    (torch.ones(4, 4), TypeError, "must be a bool mask"),
    (torch.ones(3, 3).to_sparse_csr(), ValueError, r"must have shape \(4, 4\)"),
    (object(), TypeError, "must be a bool mask or a torch sparse tensor"),
])
def test_bad_sparse_transitions_are_errors(structure, error, match):
    with pytest.raises(error, match=match):
        st.LinearChainCRF(4, sparse_transitions=structure)
    with pytest.raises(ValueError, match="num_tags must be a positive int"):
        st.LinearChainCRF(0)


METHODS = {
    "log_partition": lambda crf, e, t, n: crf.log_partition(e, n),
    "nll": lambda crf, e, t, n: crf.nll(e, t, n, reduction="none"),
    "decode": lambda crf, e, t, n: crf.decode(e, n),
    "marginals": lambda crf, e, t, n: crf.marginals(e, n),
    "sample": lambda crf, e, t, n: crf.sample(e, n, num_samples=3, seed=0),
}


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("crf_dtype, emission_dtype", [(torch.float32, torch.bfloat16), (torch.float64, torch.float32),
                                                       (torch.float32, torch.float64), (torch.float32, torch.float16)])
def test_mixed_dtypes_follow_torchs_promotion_in_every_method(method, crf_dtype, emission_dtype, sparse):
    # issue 22 item 6: "Index put requires the source and destination dtypes match" before
    allowed = torch.ones(4, 4, dtype=torch.bool).triu() if sparse else None
    crf = st.LinearChainCRF(4, sparse_transitions=allowed).to(crf_dtype)
    emissions, tags, lengths, _ = batch(4, [5, 3], dtype=emission_dtype)
    tags = tags.sort(dim=1).values  # allowed by the upper-triangular structure
    dtype = torch.promote_types(crf_dtype, emission_dtype)
    got = METHODS[method](crf, emissions, tags, lengths)
    want = METHODS[method](crf.to(dtype), emissions.to(dtype), tags, lengths)
    assert got.dtype == want.dtype and (got.dtype == dtype or not got.is_floating_point())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_training_under_cpu_autocast_in_bfloat16():
    torch.manual_seed(0)
    head, crf = torch.nn.Linear(8, 4), st.LinearChainCRF(4)
    x, tags = torch.randn(3, 5, 8), torch.randint(4, (3, 5))
    with torch.autocast("cpu", torch.bfloat16):
        emissions = head(x)
        loss = crf.nll(emissions, tags)
    assert emissions.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    torch.testing.assert_close(loss, crf.nll(emissions.float(), tags))
    assert all(p.grad is not None for p in [*head.parameters(), *crf.parameters()])
