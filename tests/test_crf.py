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


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_tags_of_a_compact_integer_dtype_give_the_int64_nll(dtype):
    crf, _ = pair(5)
    emissions, tags, lengths, _ = batch(5, [6, 4, 1])
    torch.testing.assert_close(crf.nll(emissions, tags.to(dtype), lengths), crf.nll(emissions, tags, lengths),
                               rtol=0, atol=0)


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
    (lambda crf: crf.nll(np.zeros((2, 3, 4)), torch.zeros(2, 3, dtype=torch.int64)), TypeError,
     "emissions must be a torch.Tensor, not ndarray"),
    (lambda crf: crf.nll(torch.zeros(2, 3, 4), np.zeros((2, 3), np.int64)), TypeError, "tags must be a torch.Tensor"),
    (lambda crf: crf.decode(np.zeros((2, 3, 4))), TypeError, "emissions must be a torch.Tensor"),
    (lambda crf: crf.marginals([[[0.0] * 4]]), TypeError, "emissions must be a torch.Tensor, not list"),
    (lambda crf: crf.sample(np.zeros((2, 3, 4))), TypeError, "emissions must be a torch.Tensor"),
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


def _limits(n):
    """``lengths=n`` for 1-D ``n``, ``mask=n`` for 2-D."""
    return {"mask" if n is not None and n.ndim == 2 else "lengths": n}


METHODS = {
    "log_partition": lambda crf, e, t, n: crf.log_partition(e, **_limits(n)),
    "nll": lambda crf, e, t, n: crf.nll(e, t, reduction="none", **_limits(n)),
    "decode": lambda crf, e, t, n: crf.decode(e, **_limits(n)),
    "marginals": lambda crf, e, t, n: crf.marginals(e, **_limits(n)),
    "sample": lambda crf, e, t, n: crf.sample(e, num_samples=3, seed=0, **_limits(n)),
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


class Tagger(torch.nn.Module):
    def __init__(self, crf, vocab=20, num_tags=5):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 8, dtype=torch.float64)
        self.emit = torch.nn.Linear(8, num_tags, dtype=torch.float64)
        self.crf = crf.double()

    def forward(self, words):
        return self.emit(self.embed(words))


@pytest.mark.parametrize("batch_first", [False, True])
def test_the_same_tagger_training_as_pytorch_crf_gives_the_same_losses_and_paths(batch_first):
    # issue 26: pytorch-crf's calling convention, code unchanged but the class
    torch.manual_seed(0)
    theirs = Tagger(torchcrf.CRF(5, batch_first=batch_first))
    ours = Tagger(st.LinearChainCRF(5, batch_first=batch_first))
    ours.load_state_dict(theirs.state_dict())
    gen = torch.Generator().manual_seed(1)
    words, tags = torch.randint(20, (12, 9), generator=gen), torch.randint(5, (12, 9), generator=gen)
    mask = torch.arange(9) < torch.randint(1, 10, (12, 1), generator=gen)
    if not batch_first:
        words, tags, mask = words.T, tags.T, mask.T
    losses = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        losses[name] = []
        for step in range(15):
            reduction = ("sum", "mean", "token_mean")[step % 3]
            loss = -model.crf(model(words), tags, mask, reduction=reduction)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    np.testing.assert_allclose(losses["ours"], losses["theirs"], rtol=1e-10)
    with torch.no_grad():
        emissions = ours(words)
        assert ours.crf.decode(emissions, mask) == theirs.crf.decode(emissions, mask)
        assert ours.crf.decode(emissions) == theirs.crf.decode(emissions)
        llh = ours.crf(emissions, tags, mask, reduction="none")
        torch.testing.assert_close(llh, theirs.crf(emissions, tags, mask, reduction="none"))
        torch.testing.assert_close(ours.crf.nll(emissions, tags, mask=mask, reduction="none"), -llh)


def test_spchains_own_convention_keeps_its_meaning_and_refuses_pytorch_crfs_call():
    # issue 26 item 5: a time-major tensor is never read as batch-major without batch_first
    crf = st.LinearChainCRF(4)
    emissions, tags, lengths, mask = batch(4, [5, 3, 5])
    assert isinstance(crf.decode(emissions, lengths), torch.Tensor)
    with pytest.raises(ValueError, match="batch_first=True or batch_first=False"):
        crf(emissions.transpose(0, 1), tags.T)
    time_major = st.LinearChainCRF(4, batch_first=False)
    time_major.load_state_dict(crf.state_dict())
    for method in ("nll", "log_partition", "marginals", "sample"):
        got = METHODS[method](time_major, emissions.transpose(0, 1), tags.T, lengths)
        want = METHODS[method](crf, emissions, tags, lengths)
        torch.testing.assert_close(got, want.transpose(-2, -1) if method == "sample" else
                                   want.transpose(0, 1) if method == "marginals" else want)
    assert time_major.decode(emissions.transpose(0, 1), lengths) == \
        [row[:n].tolist() for row, n in zip(crf.decode(emissions, lengths), lengths)]
    assert crf.decode(emissions, mask).tolist() == crf.decode(emissions, lengths).tolist()  # a 2-D second argument


@pytest.mark.parametrize("method", METHODS)
def test_a_mask_may_be_any_contiguous_window_per_sequence(method):
    # left padding and a masked leading [CLS] position are the right-padded chains, moved
    crf, _ = pair(4, seed=6)
    emissions, tags, lengths, mask = batch(4, [5, 2, 4, 1], seed=7)
    starts = torch.tensor([0, 3, 1, 2])
    moved_e, moved_t = torch.randn(4, 6, 4, dtype=torch.float64), torch.randint(4, (4, 6))
    window = torch.zeros(4, 6, dtype=torch.bool)
    for b, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        moved_e[b, s:s + n], moved_t[b, s:s + n], window[b, s:s + n] = emissions[b, :n], tags[b, :n], True
    got = METHODS[method](crf, moved_e, moved_t, window)  # a 2-D mask in the place of lengths
    want = METHODS[method](crf, emissions, tags, lengths)
    if method in ("decode", "marginals", "sample"):
        fill = 0 if method == "marginals" else -1
        assert bool(((got[~window] if method == "marginals" else got[..., ~window]) == fill).all())
        for b, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
            if method == "marginals":
                torch.testing.assert_close(got[b, s:s + n], want[b, :n])
            elif method == "decode":
                assert torch.equal(got[b, s:s + n], want[b, :n])
            else:
                assert got[:, b, s:s + n].shape == (3, n) and bool((got[:, b, s:s + n] >= 0).all())
    else:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mask, error, match", [
    (torch.tensor([[True, False, True], [True, True, True]]), ValueError, "one contiguous window"),
    (torch.tensor([[False, False, False], [True, True, True]]), ValueError, "at least one unmasked"),
    (torch.ones(2, 3), TypeError, "mask must be a bool"),
    (torch.ones(3, 2, dtype=torch.bool), ValueError, "mask must have the shape of tags"),
])
def test_bad_masks_are_errors(mask, error, match):
    crf = st.LinearChainCRF(4, batch_first=True)
    with pytest.raises(error, match=match):
        crf(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.int64), mask)
    with pytest.raises(error, match=match):
        crf.decode(torch.zeros(2, 3, 4), mask)
    with pytest.raises(ValueError, match="lengths or a mask, not both"):
        crf.nll(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.int64), torch.tensor([3, 3]),
                mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="batch_first must be"):
        st.LinearChainCRF(4, batch_first=1)


@pytest.mark.slow  # three torch.compile calls: the default set's slowest test; test_torch_transforms compiles the CRF
def test_sparse_transitions_compile_with_fullgraph():
    # issue 26 item 7: the structure stays index buffers, no sparse tensor is traced
    torch._dynamo.reset()
    allowed = torch.ones(5, 5, dtype=torch.bool).triu()
    crf = st.LinearChainCRF(5, sparse_transitions=allowed)
    emissions, tags, lengths, _ = batch(5, [6, 3], dtype=torch.float32)
    tags = tags.sort(dim=1).values
    nll = torch.compile(lambda e: crf.nll(e, tags, lengths), fullgraph=True)
    decode = torch.compile(lambda e: crf.decode(e, lengths), fullgraph=True)
    emissions.requires_grad_()
    got = nll(emissions)
    got.backward()
    grad = emissions.grad.clone()
    emissions.grad = None
    want = crf.nll(emissions, tags, lengths)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, emissions.grad)
    assert torch.equal(decode(emissions.detach()), crf.decode(emissions.detach(), lengths))
    log_z = torch.compile(crf.log_partition)(emissions, lengths)
    torch.testing.assert_close(log_z, crf.log_partition(emissions, lengths))


def test_meta_init_then_to_empty_and_reset_parameters_restores_the_structure():
    # issue 26 item 11
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    with torch.device("meta"):
        crf = st.LinearChainCRF(5, sparse_transitions=allowed)
    assert crf.transitions.is_meta and crf.transition_indices.is_meta
    crf.to_empty(device="cpu")
    crf.reset_parameters()
    want = st.LinearChainCRF(5, sparse_transitions=allowed)
    assert torch.equal(crf.transition_indptr, want.transition_indptr)
    assert torch.equal(crf.transition_indices, want.transition_indices)
    assert bool((crf.decode(torch.randn(2, 4, 5)).diff() <= 0).all())
    with torch.device("meta"), pytest.raises(ValueError, match="meta device, which holds no data"):
        st.LinearChainCRF(5, sparse_transitions=torch.ones(5, 5, dtype=torch.bool))
