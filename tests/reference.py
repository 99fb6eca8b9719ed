"""Slow, obvious float64 references that spchain's results are checked against."""

import math

import numpy as np
import scipy.linalg
import scipy.sparse
from scipy.special import logsumexp


def log_add_exp(a, b):
    """``log(exp(a) + exp(b))`` elementwise, in float64."""
    with np.errstate(invalid="ignore"):
        return np.logaddexp(np.asarray(a, np.float64), np.asarray(b, np.float64))


def log_sum_exp(values, axis=None):
    """``log(sum(exp(values)))`` in float64; ``-inf`` for an empty or all ``-inf`` input."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return np.full(np.sum(values, axis=axis).shape, -np.inf) if axis is not None else -np.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        return logsumexp(values, axis=axis)


def _chain_inputs(x, log_trans, log_init, lengths):
    """Float64 copies broadcast to one batch shape: x (..., v, c), trans (..., S, c, c), init, lengths."""
    x = np.asarray(x, np.float64)
    log_trans = np.asarray(log_trans, np.float64)
    v, c = x.shape[-2:]
    if log_trans.ndim != x.ndim + 1:  # shared by all steps
        log_trans = log_trans[..., None, :, :]
    log_init = np.zeros(c) if log_init is None else np.asarray(log_init, np.float64)
    lengths = np.full((), v) if lengths is None else np.asarray(lengths)
    batch = np.broadcast_shapes(x.shape[:-2], log_trans.shape[:-3], log_init.shape[:-1], lengths.shape)
    return (np.broadcast_to(x, batch + (v, c)), np.broadcast_to(log_trans, batch + log_trans.shape[-3:]),
            np.broadcast_to(log_init, batch + (c,)), np.broadcast_to(lengths, batch))


def chain_logsumexp(x, log_trans, log_init=None, lengths=None):
    """The forward algorithm in float64, one chain and one step at a time."""
    x, trans, init, lengths = _chain_inputs(x, log_trans, log_init, lengths)
    out = np.empty(x.shape[:-2])
    for index in np.ndindex(out.shape):
        alpha = init[index] + x[index][0]
        for t in range(1, int(lengths[index])):
            step = trans[index][min(t - 1, trans.shape[-3] - 1)]
            alpha = log_sum_exp(alpha[:, None] + step, axis=0) + x[index][t]
        out[index] = log_sum_exp(alpha)
    return out


def chain_paths(x, log_trans, log_init=None, length=None):
    """Brute force for one chain: ``(scores, paths)`` of every state sequence, in float64."""
    x, trans, init, length = _chain_inputs(x, log_trans, log_init, length)
    assert x.ndim == 2, "one chain at a time"
    v, c = x.shape
    paths = np.array(list(np.ndindex(*(c,) * int(length))), dtype=np.int64).reshape(-1, int(length))
    scores = init[paths[:, 0]] + x[0, paths[:, 0]]
    for t in range(1, int(length)):
        step = trans[min(t - 1, trans.shape[0] - 1)]
        scores = scores + step[paths[:, t - 1], paths[:, t]] + x[t, paths[:, t]]
    return scores, paths


def chain_marginals_by_paths(x, log_trans, log_init=None, length=None):
    """Posterior marginals of one chain by enumerating its paths (zero past ``length``)."""
    scores, paths = chain_paths(x, log_trans, log_init, length)
    v, c = np.shape(x)
    out = np.zeros((v, c))
    total = log_sum_exp(scores)
    if total == -np.inf:
        return out
    weights = np.exp(scores - total)
    for t in range(paths.shape[1]):
        np.add.at(out[t], paths[:, t], weights)
    return out


def chain_logsumexp_torch(x, log_trans, log_init=None, lengths=None):
    """The forward algorithm as a differentiable torch recursion (float64 autograd reference)."""
    import torch

    v, c = x.shape[-2:]
    if log_trans.ndim != x.ndim + 1:
        log_trans = log_trans[..., None, :, :]
    if log_init is None:
        log_init = torch.zeros(c, dtype=x.dtype)
    alpha = log_init + x[..., 0, :]
    outs = [torch.logsumexp(alpha, -1)]
    for t in range(1, v):
        step = log_trans[..., min(t - 1, log_trans.shape[-3] - 1), :, :]
        alpha = torch.logsumexp(alpha[..., :, None] + step, dim=-2) + x[..., t, :]
        outs.append(torch.logsumexp(alpha, -1))
    outs = torch.stack(torch.broadcast_tensors(*outs), -1)
    if lengths is None:
        return outs[..., -1]
    index = torch.as_tensor(lengths).expand(outs.shape[:-1])[..., None] - 1
    return outs.gather(-1, index)[..., 0]


def log_matmul(a, b):
    """``log(exp(a) @ exp(b))`` by broadcasting, in float64 (builds the (..., m, k, n) tensor)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return log_sum_exp(a[..., :, :, None] + b[..., None, :, :], axis=-2)


def max_matmul(a, b):
    """Max-plus product by broadcasting: ``(values, argmax)`` (first maximum, NaN wins)."""
    terms = np.asarray(a, np.float64)[..., :, :, None] + np.asarray(b, np.float64)[..., None, :, :]
    if terms.shape[-2] == 0:
        shape = terms.shape[:-2] + terms.shape[-1:]
        return np.full(shape, -np.inf), np.zeros(shape, np.int64)
    argmax = np.argmax(terms, axis=-2)
    return np.take_along_axis(terms, argmax[..., None, :], axis=-2)[..., 0, :], argmax


def log_chain_product(m):
    """``log(exp(m_1) @ ... @ exp(m_L))`` left to right, in float64."""
    m = np.asarray(m, np.float64)
    out = m[..., 0, :, :]
    for step in range(1, m.shape[-3]):
        out = log_matmul(out, m[..., step, :, :])
    return out


def viterbi_by_paths(x, log_trans, log_init=None, length=None):
    """Brute force for one chain: ``(score, path)``, the path padded with -1 past ``length``.

    Among paths of equal best score, the one that is smallest read from the last position
    backwards (spchain's documented tie rule).
    """
    scores, paths = chain_paths(x, log_trans, log_init, length)
    best = np.max(scores)
    candidates = [tuple(p) for p, s in zip(paths, scores) if s == best or (np.isnan(best) and np.isnan(s))]
    path = min(candidates, key=lambda p: p[::-1])
    v = np.shape(x)[0]
    return best, np.array(list(path) + [-1] * (v - len(path)), dtype=np.int64)


def block_diag_matmul(x, w):
    """``x`` (..., G, d_in) times the block-diagonal matrix of ``w`` (G, d_in, d_out), in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    groups, d_in, d_out = w.shape
    dense = scipy.linalg.block_diag(*w) if groups else np.zeros((0, 0))
    return (x.reshape(math.prod(x.shape[:-2]), groups * d_in) @ dense).reshape(x.shape[:-1] + (d_out,))


def grouped_matmul(x, w, group_sizes):
    """Rows of ``x`` (N, d_in) in contiguous groups, group g times ``w[g]``: a per-group loop in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(group_sizes):
        out[start:start + size] = x[start:start + size] @ w[g]
        start += size
    return out


def grouped_weight_grad(x, grad, group_sizes):
    """The gradient of ``sum(grad * grouped_matmul(x, w, group_sizes))`` in ``w``: ``x_gᵀ grad_g`` per group."""
    x, grad = np.asarray(x, np.float64), np.asarray(grad, np.float64)
    out = np.zeros((len(group_sizes), x.shape[1], grad.shape[1]))
    start = 0
    for g, size in enumerate(group_sizes):
        out[g] = x[start:start + size].T @ grad[start:start + size]
        start += size
    return out


def block_diag_weight_grad(x, grad):
    """The gradient of ``sum(grad * block_diag_matmul(x, w))`` in ``w``: the diagonal blocks of the dense one."""
    x, grad = np.asarray(x, np.float64), np.asarray(grad, np.float64)
    groups, d_in, d_out = x.shape[-2], x.shape[-1], grad.shape[-1]
    rows = math.prod(x.shape[:-2])
    dense = x.reshape(rows, groups * d_in).T @ grad.reshape(rows, groups * d_out)
    out = np.zeros((groups, d_in, d_out))
    for g in range(groups):
        out[g] = dense[g * d_in:(g + 1) * d_in, g * d_out:(g + 1) * d_out]
    return out


def dense(matrix):
    """A SciPy sparse matrix (or cupyx, or torch sparse tensor) as a float64 NumPy array;
    duplicate entries add up."""
    if hasattr(matrix, "get"):
        matrix = matrix.get()
    if hasattr(matrix, "to_dense"):
        return matrix.detach().cpu().to_dense().double().numpy()
    return np.asarray(matrix.toarray(), np.float64)


def messy_csr(rng, m, n, density, duplicates):
    """``(indptr, indices)`` (int64) of a random m x n CSR structure whose first ``duplicates``
    entries are stored twice and whose columns are shuffled within each row."""
    matrix = scipy.sparse.random(m, n, density=density, format="csr", random_state=rng)
    rows, cols = entries(matrix.indptr, matrix.indices)
    rows, cols = np.concatenate([rows, rows[:duplicates]]), np.concatenate([cols, cols[:duplicates]])
    order = np.lexsort((rng.random(rows.size), rows))  # rows sorted, columns shuffled within
    return np.searchsorted(rows[order], np.arange(m + 1)), cols[order]


def entries(indptr, indices):
    """``(rows, cols)`` of every stored entry of a CSR structure, in storage order."""
    indptr, indices = np.asarray(indptr), np.asarray(indices)
    return np.repeat(np.arange(indptr.shape[0] - 1), np.diff(indptr)), indices.astype(np.int64)


def sampled_product(rows, cols, a, b):
    """The dense product ``a @ b.T`` in float64, read at ``(rows[p], cols[p])`` for every entry."""
    return (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T)[rows, cols]


def largest_positions(w, keep):
    """Sorted flat positions of the ``keep`` largest ``|w|``: NaN first, then by magnitude, ties to
    the earlier position (a plain Python sort)."""
    return largest_values(np.abs(np.asarray(w, np.float64)), keep)


def largest_values(scores, keep):
    """Sorted flat positions of the ``keep`` largest ``scores`` by value: NaN first, ties to the
    earlier position (a plain Python sort)."""
    flat = np.asarray(scores, np.float64).ravel()
    order = sorted(range(flat.size), key=lambda p: (0 if np.isnan(flat[p]) else 1, -flat[p], p))
    return np.sort(np.array(order[:keep], dtype=np.int64))


def bsr_dense(data, indices, indptr, shape):
    """A BSR structure as a dense float64 NumPy array, block by block (duplicates add up)."""
    data, indices, indptr = (np.asarray(a.get() if hasattr(a, "get") else a) for a in (data, indices, indptr))
    r, c = data.shape[1:]
    out = np.zeros(shape)
    for i in range(indptr.shape[0] - 1):
        for p in range(indptr[i], indptr[i + 1]):
            out[i * r:(i + 1) * r, indices[p] * c:(indices[p] + 1) * c] += data[p]
    return out


def n_m_mask(w, n, m):
    """The N:M mask of ``w`` by a plain Python sort of each group: NaN first, then by ``|w|``, ties
    to the earlier entry."""
    w = np.abs(np.asarray(w, np.float64))
    mask = np.zeros(w.shape, bool)
    for i in range(w.shape[0]):
        for g in range(0, w.shape[1], m):
            order = sorted(range(g, g + m), key=lambda j: (0 if np.isnan(w[i, j]) else 1, -w[i, j], j))
            mask[i, order[:n]] = True
    return mask


def semiring_terms(a, b):
    """The (..., m, k, n) terms ``a_ik + b_kj`` of a log-space or max-plus product, in float64,
    by the +inf rule: ``+inf + -inf`` is ``-inf`` (log-space zero, a structural zero, wins);
    NaN stays NaN."""
    a, b = np.asarray(a, np.float64)[..., :, :, None], np.asarray(b, np.float64)[..., None, :, :]
    with np.errstate(invalid="ignore"):
        terms = a + b
    return np.where(np.isnan(terms) & ~np.isnan(a) & ~np.isnan(b), -np.inf, terms)


def sum_to(grad, shape):
    """``grad`` summed over the axes along which an operand of ``shape`` was broadcast."""
    grad = grad.sum(axis=tuple(range(grad.ndim - len(shape))))
    return grad.sum(axis=tuple(i for i, s in enumerate(shape) if s == 1), keepdims=True).reshape(shape)


def log_matmul_and_grads(a, b, grad):
    """``(out, d a, d b)`` of ``sum(grad * log(exp(a) @ exp(b)))`` term by term, in float64: each
    output's gradient goes to its terms by their softmax weights, in equal shares to its +inf
    terms if it has any, and nowhere if it is ``-inf``."""
    terms = semiring_terms(a, b)
    out = log_sum_exp(terms, axis=-2)
    at_inf = np.isposinf(terms)
    count = at_inf.sum(axis=-2, keepdims=True)
    with np.errstate(invalid="ignore"):
        soft = np.exp(terms - out[..., None, :])
        weights = np.where(count > 0, at_inf / np.maximum(count, 1), soft)
    weights = np.where(np.isneginf(out)[..., None, :], 0, weights) * np.asarray(grad, np.float64)[..., None, :]
    return out, sum_to(weights.sum(axis=-1), np.shape(a)), sum_to(weights.sum(axis=-3), np.shape(b))


def log_chain_product_and_grad(m, grad):
    """``(out, d m)`` of ``sum(grad * log_chain_product(m))``: folded left to right with
    :func:`log_matmul_and_grads` and unwound step by step (the rule at every reduction)."""
    m = np.asarray(m, np.float64)
    prefix = [m[..., 0, :, :]]
    for step in range(1, m.shape[-3]):
        prefix.append(log_matmul_and_grads(prefix[-1], m[..., step, :, :], np.zeros(prefix[-1].shape))[0])
    grad_m = np.zeros(m.shape)
    g = np.asarray(grad, np.float64)
    for step in range(m.shape[-3] - 1, 0, -1):
        _, g, grad_m[..., step, :, :] = log_matmul_and_grads(prefix[step - 1], m[..., step, :, :], g)
    grad_m[..., 0, :, :] = g
    return prefix[-1], grad_m


def chain_entropy_by_paths(x, log_trans, log_init=None, length=None):
    """The entropy of one chain's posterior over paths by enumeration (0 if it has none)."""
    scores, _ = chain_paths(x, log_trans, log_init, length)
    total = log_sum_exp(scores)
    if total == -np.inf:
        return 0.0
    p = np.exp(scores - total)
    with np.errstate(invalid="ignore"):
        return float(-np.sum(np.where(p > 0, p * (scores - total), 0)))


def chain_kbest_by_paths(x, log_trans, log_init=None, length=None, k=1):
    """Brute force for one chain: the ``k`` best ``(scores, paths)``, best first, paths of
    score ``-inf`` left out (padded with ``-inf`` / -1), ties to the lexicographically
    smallest path read from the last position backwards."""
    scores, paths = chain_paths(x, log_trans, log_init, length)
    v = np.shape(x)[0]
    order = np.lexsort(tuple(paths.T) + (-scores,))  # last key first: score, then s_{L-1}, ...
    out_scores = np.full(k, -np.inf)
    out_paths = np.full((k, v), -1, np.int64)
    kept = [i for i in order if scores[i] > -np.inf][:k]
    out_scores[:len(kept)] = scores[kept]
    out_paths[:len(kept), :paths.shape[1]] = paths[kept]
    return out_scores, out_paths


def chain_entropy_torch(x, log_trans, log_init, length):
    """The entropy of one chain's posterior by enumeration, in torch (differentiable; float64)."""
    import torch

    v, c = x.shape
    paths = torch.tensor(list(np.ndindex(*(c,) * int(length))), dtype=torch.int64).reshape(-1, int(length))
    scores = log_init[paths[:, 0]] + x[0, paths[:, 0]]
    for t in range(1, int(length)):
        step = log_trans[t - 1] if log_trans.ndim == 3 else log_trans
        scores = scores + step[paths[:, t - 1], paths[:, t]] + x[t, paths[:, t]]
    scores = scores[scores > -np.inf]  # paths of weight 0 add nothing (and no 0 * inf gradient)
    if not len(scores):
        return scores.sum()  # no path: 0, with a zero gradient
    log_p = scores - torch.logsumexp(scores, 0)
    return -(log_p.exp() * log_p).sum()
