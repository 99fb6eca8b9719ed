"""spchain.torch's path functions (spchain/torch/paths.py): values as the array API, float64
gradchecks, and gradients against autograd through brute-force enumeration."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import reference  # noqa: E402
import spchain as sc  # noqa: E402
import spchain.torch as st  # noqa: E402


def problem(seed, batch, v, c, per_step, holes=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, v, c, dtype=torch.float64, generator=gen)
    trans = torch.randn(((1, v - 1) if per_step else ()) + (c, c), dtype=torch.float64, generator=gen)
    init = torch.randn(c, dtype=torch.float64, generator=gen)
    if holes:
        trans = trans.masked_fill(torch.rand(trans.shape, generator=gen) < 0.2, -torch.inf)
        x = x.masked_fill(torch.rand(x.shape, generator=gen) < 0.15, -torch.inf)
    lengths = torch.randint(1, v + 1, (batch,), generator=gen)
    return x, trans, init, lengths


@pytest.mark.parametrize("seed, v, c, per_step", [(0, 1, 3, False), (1, 3, 3, True), (2, 4, 2, False),
                                                  (3, 5, 3, True), (4, 6, 2, True), (5, 2, 1, False)])
def test_entropy_gradient_matches_autograd_through_enumeration(seed, v, c, per_step):
    x, trans, init, lengths = problem(seed, 3, v, c, per_step)
    inputs = [t.requires_grad_() for t in (x, trans, init)]
    weight = torch.randn(3, dtype=torch.float64)
    got = st.chain_entropy(x, trans, init, lengths=lengths)
    want = torch.stack([reference.chain_entropy_torch(x[b], trans[0] if per_step else trans, init, lengths[b])
                        for b in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad((weight * got).sum(), inputs)
    wants = torch.autograd.grad((weight * want).sum(), inputs, allow_unused=True)
    for g, w in zip(grads, wants):
        torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype, offset, quantum, tol", [
    (torch.float64, -1e12, 1 / 8, 1e-10), (torch.float64, -1e300, None, 1e-10),
    (torch.float32, -1e4, 1 / 8, 2e-5), (torch.float32, -1e6, 1 / 2, 2e-5)])
def test_entropy_and_its_gradient_ignore_a_constant_at_each_position(dtype, offset, quantum, tol):
    """A constant added to every state of a position adds to every path's score: the posterior,
    its entropy and the gradient stay those without it, even where the constant dwarfs the
    entropy (``H = log Z - E[score]`` would cancel to nothing). ``x`` is exact beside the
    constants: multiples of ``quantum``, or zeros (and the ``-inf`` holes)."""
    x, trans, init, lengths = problem(9, 3, 6, 3, False)
    x = torch.where(x.isfinite(), 0.0, x) if quantum is None else torch.round(x / quantum) * quantum
    constants = offset * torch.arange(1, 7, dtype=torch.float64)[:, None]  # exact in dtype
    results = []
    for shifted in (x, x + constants):
        inputs = [t.to(dtype).requires_grad_() for t in (shifted, trans, init)]
        h = st.chain_entropy(*inputs, lengths=lengths)
        results.append((h, *torch.autograd.grad(h.sum(), inputs)))
    want = torch.stack([reference.chain_entropy_torch(x[b], trans, init, lengths[b]) for b in range(3)])
    torch.testing.assert_close(results[1][0].double(), want, rtol=tol, atol=tol)
    for got, without in zip(results[1], results[0]):
        torch.testing.assert_close(got, without, rtol=tol, atol=tol)


@pytest.mark.parametrize("per_step", [False, True])
def test_a_float32_entropy_gradient_stays_exact_over_long_chains(per_step):
    # the gradient's Cov(φ, score) = fwd + bwd - E cancels sums of the whole score down to
    # one position's size: carried as they grow, float32 rounding left 0.8 % of the largest
    # entry at v = 2000 (2-6 % here), and the entropy 1e-5 off
    g = torch.Generator().manual_seed(3)
    v, c = 2000, 6
    x = torch.randn(2, v, c, generator=g, dtype=torch.float64) * 3 - 10
    x[0, 5:, 2] = -torch.inf  # a state closed for a while, and chains of two lengths
    trans = torch.log_softmax(torch.randn(*((1, v - 1) if per_step else ()), c, c, generator=g,
                                          dtype=torch.float64), -1)
    init = torch.log_softmax(torch.randn(c, generator=g, dtype=torch.float64), -1)
    lengths = torch.tensor([v, v - 777])
    results = []
    for dtype in (torch.float32, torch.float64):
        inputs = [t.to(dtype).requires_grad_() for t in (x, trans, init)]
        h = st.chain_entropy(*inputs, lengths=lengths)
        results.append([t.double() for t in (h, *torch.autograd.grad((h * torch.tensor([1.0, -0.5])).sum(), inputs))])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * float(want.abs().max()))


@pytest.mark.parametrize("per_step", [True, False])
def test_entropy_gradcheck(per_step):
    x, trans, init, lengths = problem(7, 2, 4, 3, per_step, holes=False)
    inputs = [t.requires_grad_() for t in (x, trans, init)]
    assert torch.autograd.gradcheck(lambda *a: st.chain_entropy(*a, lengths=lengths), inputs)


@pytest.mark.parametrize("per_step", [True, False])
def test_path_score_gradcheck_and_values(per_step):
    x, trans, init, lengths = problem(8, 3, 5, 3, per_step, holes=False)
    path = torch.randint(3, (2, 3, 5), generator=torch.Generator().manual_seed(1))
    inputs = [t.requires_grad_() for t in (x, trans, init)]
    assert torch.autograd.gradcheck(lambda *a: st.chain_path_score(*a, path, lengths=lengths), inputs)
    got = st.chain_path_score(x, trans, init, path, lengths=lengths)
    want = sc.chain_path_score(x.detach().numpy(), trans.detach().numpy(), init.detach().numpy(), path.numpy(),
                               lengths=lengths.numpy())
    np.testing.assert_array_equal(got.detach().numpy(), want)


def test_path_score_without_init_and_bad_paths():
    x = torch.zeros(3, 2, requires_grad=True)
    score = st.chain_path_score(x, torch.zeros(2, 2), None, torch.tensor([0, 1, 1]))
    score.backward()
    torch.testing.assert_close(x.grad, torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="path states must lie in 0..c-1"):
        st.chain_path_score(x, torch.zeros(2, 2), None, torch.tensor([0, 2, 1]))


def test_kbest_and_sample_match_the_array_api():
    x, trans, init, lengths = problem(9, 4, 5, 3, True)
    arrays = [t.numpy() for t in (x, trans, init)]
    scores, paths = st.chain_kbest(x, trans, init, k=4, lengths=lengths)
    want_scores, want_paths = sc.chain_kbest(*arrays, k=4, lengths=lengths.numpy())
    np.testing.assert_array_equal(scores.numpy(), want_scores)
    np.testing.assert_array_equal(paths.numpy(), want_paths)
    samples = st.chain_sample(x.requires_grad_(), trans, init, lengths=lengths.tolist(), num_samples=5, seed=3)
    np.testing.assert_array_equal(samples.numpy(), sc.chain_sample(*arrays, lengths=lengths.numpy(),
                                                                   num_samples=5, seed=3))
    assert samples.dtype == torch.int64 and not samples.requires_grad
