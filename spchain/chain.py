"""Log-space chain products: the HMM forward algorithm, its marginals and Viterbi decoding.

``chain_logsumexp`` computes ``log(init^T D(e^x0) T_1 D(e^x1) ... T_{v-1} e^x{v-1})`` for
batches of chains, exactly, in O(batch · v · c) memory. Two sweeps compute it, both exact:

- where many rows share one transition matrix, each step is one GEMM in scaled (exp) space
  (BLAS / cuBLAS) whose underflowed entries are recomputed in log space
  (:func:`spchain._logspace.log_product`);
- otherwise the Numba kernels of ``kernels/*/chain.py`` run the whole log-space sweep, an
  online log-sum-exp over chunks of states, one row of the batch per thread (CPU) or block (GPU).

``_use_gemm`` chooses between them by a cost model.

The gradient is the forward-backward algorithm: the backward sweep reuses the saved forward
messages (O(batch · v · c)), never a (batch, v, c, c) tensor.
"""

import dataclasses
from dataclasses import dataclass

import numpy as np
import scipy.sparse

from . import _backend, _checks, _logspace
from ._dask import scales_out

ALGORITHM = "auto"
"""``"auto"``, or ``"gemm"`` / ``"kernel"`` to force a sweep (both are exact; tests use this)."""


@dataclass
class _Chain:
    """A chain problem in the layout the sweeps use.

    The broadcast batch axes are reordered so that the axes along which the transitions vary
    come first: rows ``g * group ... (g + 1) * group - 1`` then share ``trans[g]``.
    """

    backend: _backend.Backend
    x: object  # (B, v, c), contiguous
    trans: object  # (G, S, c, c): S = v - 1 per-step matrices, or S = 1 shared by all steps
    init: object  # (B, c)
    lengths: object  # (B,) int64, in 1..v
    group: int
    max_length: int
    batch_shape: tuple
    order: tuple
    x_shape: tuple

    @property
    def xp(self):
        return self.backend.xp

    @property
    def per_step(self) -> bool:
        """Whether step t uses its own matrix ``trans[:, t]`` (else all use ``trans[:, 0]``)."""
        return self.trans.shape[1] > 1

    def step_matrices(self, t: int):
        """The (G, c, c) transition matrices of step ``t -> t + 1``."""
        return self.trans[:, t if self.per_step else 0]

    def rows(self, a, tail: tuple = ()):
        """A batch-shaped array (``batch_shape + tail``, broadcastable) in row order, (B, *tail)."""
        nd = len(self.batch_shape)
        a = self.xp.broadcast_to(a, self.batch_shape + tail)
        a = a.transpose(self.order + tuple(range(nd, nd + len(tail))))
        return self.xp.ascontiguousarray(a).reshape((int(np.prod(self.batch_shape)),) + tail)

    def unrows(self, a):
        """The inverse of :meth:`rows`: (B, *tail) back to ``batch_shape + tail`` (contiguous)."""
        nd = len(self.batch_shape)
        tail = a.shape[1:]
        a = a.reshape(tuple(self.batch_shape[k] for k in self.order) + tail)
        if self.order == tuple(range(nd)):
            return a
        return a.transpose(tuple(np.argsort(self.order)) + tuple(range(nd, nd + len(tail)))).copy()


def _check_dense(caller: str, name: str, a, required: bool) -> None:
    """``TypeError`` naming ``name`` unless ``a`` is a dense array, a list / tuple or a Python
    scalar (or ``None``, where the argument is optional)."""
    if a is None:
        if required:
            raise TypeError(f"{caller}: {name} is required (an array), got None")
        return
    if scipy.sparse.issparse(a) or hasattr(a, "tocsr"):
        raise TypeError(f"{caller}: {name} must be a dense array, not a sparse {type(a).__name__} "
                        "(sparse transitions are not supported yet)")
    if not (hasattr(a, "dtype") and hasattr(a, "shape") or isinstance(a, (list, tuple, int, float, np.generic))):
        raise TypeError(f"{caller}: {name} must be an array (or a list or a number), not {type(a).__name__}")


def _prepare(x, log_trans, log_init, lengths, caller: str) -> _Chain:
    """Validate the inputs of a chain function and bring them to the sweeps' layout.

    Lists and Python numbers are converted to arrays; a number broadcasts like a 0-d array
    (a scalar ``log_trans`` is a (c, c) matrix filled with it, a scalar ``log_init`` a
    (c,) vector), so only ``x`` needs its full (..., v, c) shape.
    """
    for name, a, required in (("x", x, True), ("log_trans", log_trans, True), ("log_init", log_init, False),
                              ("lengths", lengths, False)):
        _check_dense(caller, name, a, required)
    backend = _backend.backend_of(*(a for a in (x, log_trans, log_init, lengths) if hasattr(a, "dtype")),
                                  caller=caller)
    xp = backend.xp
    named = {"x": x, "log_trans": log_trans, "log_init": log_init}
    dtype = _checks.float_dtype(caller, **{k: a for k, a in named.items() if hasattr(a, "dtype")})
    x, log_trans, log_init = (a if a is None or hasattr(a, "dtype") else xp.asarray(a, dtype)
                              for a in named.values())
    if x.ndim < 2:
        raise ValueError(f"{caller}: x must have shape (..., v, c), got {x.shape}")
    v, c = x.shape[-2:]
    if v < 1:
        raise ValueError(f"{caller}: x has shape {x.shape}: a chain needs at least one position (v >= 1)")
    if log_trans.ndim == 0:
        log_trans = xp.broadcast_to(log_trans, (c, c))
    if log_init is not None and log_init.ndim == 0:
        log_init = xp.broadcast_to(log_init, (c,))
    if log_trans.ndim < 2 or log_trans.shape[-2:] != (c, c):
        raise ValueError(f"{caller}: log_trans must end in (c, c) = ({c}, {c}) to match x {x.shape}, "
                         f"got {log_trans.shape}")
    per_step = log_trans.ndim == x.ndim + 1
    if per_step and log_trans.shape[-3] != v - 1:
        raise ValueError(f"{caller}: log_trans {log_trans.shape} has one more axis than x {x.shape}, so it "
                         f"holds one matrix per step and its axis -3 must be v - 1 = {v - 1}")
    trans_batch = log_trans.shape[:-3] if per_step else log_trans.shape[:-2]
    if log_init is None:
        log_init = xp.zeros((c,), dtype)
    elif log_init.ndim < 1 or log_init.shape[-1] != c:
        raise ValueError(f"{caller}: log_init must have shape (..., c) with c = {c}, got {log_init.shape}")
    if lengths is not None:
        lengths = xp.asarray(lengths)
        if not np.issubdtype(np.dtype(lengths.dtype), np.integer):
            raise TypeError(f"{caller}: lengths must hold integers, got dtype {lengths.dtype}")
    length_shape = () if lengths is None else lengths.shape
    try:
        batch_shape = np.broadcast_shapes(x.shape[:-2], trans_batch, log_init.shape[:-1], length_shape)
    except ValueError:
        kind = "one matrix per step" if per_step else "shared by all steps (per-step transitions have one more axis than x)"
        raise ValueError(f"{caller}: batch shapes do not broadcast: x {x.shape[:-2]}, log_trans {trans_batch} "
                         f"(log_trans {log_trans.shape} is {kind}), log_init {log_init.shape[:-1]}, "
                         f"lengths {length_shape}") from None
    nd = len(batch_shape)
    trans_batch = (1,) * (nd - len(trans_batch)) + tuple(trans_batch)
    varying = tuple(k for k in range(nd) if trans_batch[k] != 1)  # an empty axis varies too: 0 groups
    order = varying + tuple(k for k in range(nd) if trans_batch[k] == 1)
    groups = int(np.prod([batch_shape[k] for k in varying], dtype=np.int64))
    rows = int(np.prod(batch_shape, dtype=np.int64))
    group = rows // groups if groups else 0
    steps = v - 1 if per_step else 1
    chain = _Chain(backend, None, xp.ascontiguousarray(log_trans, dtype=dtype).reshape(groups, steps, c, c),
                   None, None, group, v, batch_shape, order, x.shape)
    chain.x = chain.rows(x.astype(dtype, copy=False), (v, c))
    chain.init = chain.rows(log_init.astype(dtype, copy=False), (c,))
    if lengths is None:
        chain.lengths = xp.full((rows,), v, dtype=np.int64)
    else:
        chain.lengths = chain.rows(lengths.astype(np.int64, copy=False))
        if rows:
            low, high = int(chain.lengths.min()), int(chain.lengths.max())
            if low < 1 or high > v:
                raise ValueError(f"{caller}: lengths must lie in 1..v = 1..{v}, got values from {low} to {high}")
            chain.max_length = high
    return chain


def _use_gemm(chain: _Chain) -> bool:
    """Whether the scaled-GEMM sweep is expected to beat the log-space kernel sweep.

    Per step, the kernel sweep costs about ``rows * c²`` (vectorised) exponentials plus a
    little per row; the GEMM sweep a fixed overhead of array calls, ``G * c²`` exponentials and
    a call per transition matrix, and O(rows * c) elementwise work, the ``rows * c²``
    multiply-adds going to BLAS. The constants are seconds fitted to measurements on a 2-core
    CPU (both sweeps, float32, c from 4 to 200, 4 to 500 rows, shared and per-row transitions).
    On the GPU the GEMM sweep pays kernel launches and host synchronisations every step: on an
    H100 the kernel sweep was 3.5x (forward) and 5.4x (forward + backward) faster at batch 500,
    v 40, c 200, so the GPU always takes it.
    """
    rows, _, c = chain.x.shape
    if c == 0:  # nothing to multiply: the kernels' empty sums give -inf
        return False
    if ALGORITHM != "auto":
        return ALGORITHM == "gemm"
    groups = chain.trans.shape[0]
    if chain.backend.on_gpu:
        return False
    kernel = rows * (1.0e-9 * c * c + 5e-7)
    gemm = 3e-5 + groups * (1.5e-9 * c * c + 1.5e-6) + 1.5e-8 * rows * c
    return gemm < kernel


def _normalise(xp, q):
    """The normalised message ``â = q - lse(q)`` (``q`` itself where the lse is not finite),
    as the scaled operand of the next step's product (:func:`_logspace.scaled` of ``â``,
    taken from the exponentials of the lse itself), and ``lse(q)`` over the last axis."""
    e, shift, top = _logspace.scaled(xp, q, -1)
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = xp.where(top == -np.inf, -np.inf, xp.log(total) + shift)
    offset = _logspace.finite_or_zero(xp, lse)
    return (e, shift - offset, top - offset), lse[..., 0]


def _normalised(xp, pre, x, norm):
    """The normalised forward message ``â_t`` from what the forward sweep saved."""
    return (pre + x) - _logspace.finite_or_zero(xp, norm)[..., None]


def _forward_finite(chain: _Chain):
    """Forward sweep: ``(log_partition (B,), pre (B, v, c), norm (B, v))``."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    pre = xp.empty((rows, v, c), chain.x.dtype)
    norm = xp.empty((rows, v), chain.x.dtype)
    if rows and _use_gemm(chain):
        _forward_gemm(chain, pre, norm)
    elif rows:
        kernel = chain.backend.kernel("chain", "chain_forward")
        kernel(chain.x, chain.trans, chain.group, chain.init, chain.lengths, pre, norm)
    inside = xp.arange(v)[None, :] < chain.lengths[:, None]
    log_partition = xp.where(inside, norm, 0).sum(axis=1, dtype=np.float64).astype(chain.x.dtype)
    return log_partition, pre, norm


def _forward_gemm(chain: _Chain, pre, norm):
    xp = chain.xp
    rows, v, c = chain.x.shape
    groups = chain.trans.shape[0]
    x = chain.x.reshape(groups, chain.group, v, c)
    pre4 = pre.reshape(groups, chain.group, v, c)
    norm3 = norm.reshape(groups, chain.group, v)
    pre4[:, :, 0] = chain.init.reshape(groups, chain.group, c)
    u, norm3[:, :, 0] = _normalise(xp, pre4[:, :, 0] + x[:, :, 0])
    for t in range(chain.max_length - 1):
        trans = chain.step_matrices(t)

        def before(t=t):
            return _normalised(xp, pre4[:, :, t], x[:, :, t], norm3[:, :, t])

        _logspace.log_product(xp, u, _logspace.scaled(xp, trans, -2), before, trans, out=pre4[:, :, t + 1])
        u, norm3[:, :, t + 1] = _normalise(xp, pre4[:, :, t + 1] + x[:, :, t + 1])
    pre4[:, :, chain.max_length:] = -np.inf
    norm3[:, :, chain.max_length:] = 0


def _backward_finite(chain: _Chain, pre, norm, weight, trans_grad: bool = True):
    """Gradients of ``sum(weight * log_partition)``: ``(d x (B, v, c), d trans (G, S, c, c))``.

    ``d x`` holds ``weight`` times the posterior marginals; ``d init`` is ``d x[:, 0]``.
    ``d trans`` is ``None`` unless ``trans_grad``.
    """
    xp = chain.xp
    rows, v, c = chain.x.shape
    grad_trans = xp.zeros(chain.trans.shape, chain.x.dtype) if trans_grad else None
    if not rows:
        return xp.zeros_like(chain.x), grad_trans
    if _use_gemm(chain):
        grad_x = _backward_gemm(chain, pre, norm, weight, grad_trans)
    else:
        beta = xp.empty_like(chain.x)
        chain.backend.kernel("chain", "chain_backward")(chain.x, chain.trans, chain.group, chain.lengths, norm, beta)
        inside = (xp.arange(v)[None, :] < chain.lengths[:, None])[..., None]
        marginals, _ = _renormalise(xp, xp.where(inside, xp.exp(_normalised(xp, pre, chain.x, norm) + beta), 0))
        if trans_grad:
            kernel = chain.backend.kernel("chain", "chain_transition_grad")
            kernel(chain.x, chain.trans, chain.group, chain.lengths, pre, norm, marginals, weight, grad_trans)
        grad_x = marginals * weight[:, None, None]
    return grad_x, grad_trans


def _renormalise(xp, marginals):
    """``marginals`` divided by their sum over the last axis, and the log of that sum (0 where
    the sum is 0 or not finite, which stays as it is).

    In exact arithmetic each position's marginals sum to 1; in float32 the backward messages,
    scaled by the forward normalisers only, drift by a factor linear in the position (5e-4 at
    v = 10⁴). Renormalising every position removes that drift and changes nothing exact.
    """
    total = marginals.sum(axis=-1, keepdims=True)
    usable = (total > 0) & xp.isfinite(total)
    total = xp.where(usable, total, 1)
    return marginals / total, xp.log(total)


def _backward_gemm(chain: _Chain, pre, norm, weight, grad_trans):
    """The backward sweep by scaled GEMMs, one step at a time; fills ``grad_trans`` if given."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    groups = chain.trans.shape[0]
    shape = (groups, chain.group)
    x = chain.x.reshape(shape + (v, c))
    pre4 = pre.reshape(shape + (v, c))
    norm3 = norm.reshape(shape + (v,))
    last = (chain.lengths - 1).reshape(shape)[..., None]
    w = weight.reshape(shape)[..., None]
    grad_x = xp.zeros(shape + (v, c), chain.x.dtype)
    beta = xp.full(shape + (c,), -np.inf, chain.x.dtype)

    def message(t):
        return _normalised(xp, pre4[:, :, t], x[:, :, t], norm3[:, :, t])

    forward = message(chain.max_length - 1)
    for t in range(chain.max_length - 1, -1, -1):
        active = t <= last
        beta = xp.where(last == t, 0, beta)
        marginals, log_total = _renormalise(xp, xp.where(active, xp.exp(forward + beta), 0))
        beta = beta - log_total
        grad_x[:, :, t] = marginals * w
        if t == 0:
            break
        trans = chain.step_matrices(t - 1)
        forward = message(t - 1)
        if grad_trans is not None:
            before = xp.where(active, forward, -np.inf)
            step = t - 1 if chain.per_step else 0
            _, counts = _logspace.log_matmul_grads(xp, before, trans, pre4[:, :, t], grad_x[:, :, t], need_a=False)
            reached = active.any(axis=1)[..., None]  # (G, 1, 1): a group no chain of which takes this step
            grad_trans[:, step] += xp.where(reached, counts, 0)  # gets 0, even for a NaN matrix
        y = xp.where(active, x[:, :, t] + beta, -np.inf)
        d = norm3[:, :, t, None]
        beta = xp.where(d == -np.inf, -np.inf, _logspace.log_matmul(xp, y, trans.swapaxes(-1, -2)) - d)
    return grad_x.reshape(rows, v, c)


def _viterbi_finite(chain: _Chain):
    """Best paths: ``(score (B,), path (B, v) int64, -1 past each length)``."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    score = xp.empty(rows, chain.x.dtype)
    path = xp.empty((rows, v), np.int64)
    if rows:
        work = xp.empty((rows, 2, c), chain.x.dtype)
        backptr = xp.empty((rows, v, c), np.int32)
        kernel = chain.backend.kernel("chain", "viterbi")
        kernel(chain.x, chain.trans, chain.group, chain.init, chain.lengths, work, backptr, score, path)
        path = xp.where((score == -np.inf)[:, None], -1, path)  # no path: nothing to follow, no gradient
    return score, path


_LIMIT = 2.0**20
"""What ``+inf`` becomes, in float64, for the gradient of a chain whose log-partition is ``+inf``:
paths through fewer ``+inf`` terms then weigh ``exp(-2**20) = 0`` relative to the others, as
in the limit, and ``2**20 * k`` stays exact to 1e-10 in float64."""


def _with(chain: _Chain, f) -> _Chain:
    """``chain`` with ``f`` applied to its x, transitions and init."""
    return dataclasses.replace(chain, x=f(chain.x), trans=f(chain.trans), init=f(chain.init))


def _plus_inf_rows(chain: _Chain):
    """``(None, None)`` where no input holds ``+inf``; else ``(infinite (B,) bool, path (B, v))``:
    the rows whose log-partition is ``+inf`` (a path with no ``-inf`` or NaN term goes through
    a ``+inf`` one) and, for those, such a path (the most ``+inf`` terms; Viterbi's ties)."""
    xp = chain.xp
    if not any(bool(xp.isposinf(a).any()) for a in (chain.x, chain.trans, chain.init)):
        return None, None
    marks = _with(chain, lambda a: xp.where(xp.isposinf(a), 1, xp.where(xp.isfinite(a), 0, a)).astype(a.dtype))
    score, path = _viterbi_finite(marks)
    return score >= 1, path


def _without_plus_inf(chain: _Chain) -> _Chain:
    """``+inf`` replaced by ``-inf``: exact for the rows whose ``+inf`` terms all lie on
    impossible paths, and harmless for the others, whose outputs are set apart."""
    return _with(chain, lambda a: chain.xp.where(chain.xp.isposinf(a), -np.inf, a))


def _forward(chain: _Chain):
    """:func:`_forward_finite`, with ``+inf`` where a possible path goes through a ``+inf``."""
    infinite, _ = _plus_inf_rows(chain)
    if infinite is None:
        return _forward_finite(chain)
    log_partition, pre, norm = _forward_finite(_without_plus_inf(chain))
    return chain.xp.where(infinite, np.inf, log_partition).astype(chain.x.dtype), pre, norm


def _backward(chain: _Chain, pre, norm, weight, trans_grad: bool = True):
    """:func:`_backward_finite` for the outputs of :func:`_forward`. A row with a ``+inf``
    log-partition gets the limit of its gradient as its ``+inf`` terms grow together: the
    posterior of the paths with the most ``+inf`` terms."""
    xp = chain.xp
    infinite, _ = _plus_inf_rows(chain)
    if infinite is None:
        return _backward_finite(chain, pre, norm, weight, trans_grad)
    grad_x, grad_trans = _backward_finite(_without_plus_inf(chain), pre, norm, xp.where(infinite, 0, weight),
                                          trans_grad)
    limit = _with(chain, lambda a: xp.where(xp.isposinf(a), _LIMIT, a).astype(np.float64))
    _, limit_pre, limit_norm = _forward_finite(limit)
    limit_x, limit_trans = _backward_finite(limit, limit_pre, limit_norm,
                                            xp.where(infinite, weight, 0).astype(np.float64), trans_grad)
    grad_x = xp.where(infinite[:, None, None], limit_x.astype(chain.x.dtype), grad_x)
    if trans_grad:
        grad_trans = grad_trans + limit_trans.astype(chain.x.dtype)
    return grad_x, grad_trans


def _viterbi(chain: _Chain):
    """:func:`_viterbi_finite`, with score ``+inf`` and a path through ``+inf`` terms where a
    possible path goes through one."""
    infinite, marked_path = _plus_inf_rows(chain)
    if infinite is None:
        return _viterbi_finite(chain)
    score, path = _viterbi_finite(_without_plus_inf(chain))
    xp = chain.xp
    return xp.where(infinite, np.inf, score).astype(chain.x.dtype), xp.where(infinite[:, None], marked_path, path)


def _viterbi_grads(chain: _Chain, path, weight, trans_grad: bool = True):
    """Sub-gradients of ``sum(weight * score)``: ``weight`` on every step of the best path.

    Returns ``(d x (B, v, c), d trans (G, S, c, c) or None)``; ``d init`` is ``d x[:, 0]``.
    """
    xp = chain.xp
    rows, v, c = chain.x.shape
    grad_x = xp.zeros((rows, v, c), chain.x.dtype)
    grad_trans = xp.zeros(chain.trans.shape, chain.x.dtype) if trans_grad else None
    if not rows or not c:
        return grad_x, grad_trans
    inside = path >= 0
    state = xp.where(inside, path, 0)
    w = xp.where(inside, weight[:, None], 0).astype(chain.x.dtype)
    _backend.scatter_add(xp, grad_x, (xp.arange(rows)[:, None], xp.arange(v)[None, :], state), w)
    if trans_grad and v > 1:
        groups = (xp.arange(rows) // chain.group)[:, None]
        steps = xp.arange(v - 1)[None, :] if chain.per_step else xp.zeros((1, v - 1), np.int64)
        _backend.scatter_add(xp, grad_trans, (groups, steps, state[:, :-1], state[:, 1:]), w[:, 1:])
    return grad_x, grad_trans


@scales_out
def chain_logsumexp(x, log_trans, log_init=None, *, lengths=None):
    """Log-partition of batched chains: ``log(init^T D(e^x0) T_1 D(e^x1) ... T_{v-1} e^x{v-1})``.

    The HMM forward algorithm, exact for every ``v >= 1``, in O(batch · v · c) memory.

    Parameters
    ----------
    x : array (..., v, c)
        Log of the diagonals (the emission scores) at each of ``v`` positions over ``c`` states.
    log_trans : array (..., v-1, c, c) or (..., c, c)
        Log transition matrices: with one more axis than ``x``, one matrix per step
        (``log_trans[..., t, i, j]`` scores state i at t → state j at t + 1); with as many
        axes as ``x`` or fewer, one matrix shared by all steps. Leading axes broadcast.
    log_init : array (..., c), optional
        Log initial weights (default: zeros).
    lengths : int array, optional
        The number of positions, in 1..v, of each chain of the (broadcast) batch.

    Returns
    -------
    array
        The log-partition, of the broadcast batch shape. ``-inf`` where no path has weight;
        ``+inf`` where a path with no ``-inf`` term goes through a ``+inf`` one (a ``+inf``
        on impossible paths only changes nothing), never NaN for ``+inf`` inputs; NaN where a
        NaN lies on a possible path. The gradient of a ``+inf`` output goes in equal shares to
        the ``+inf`` terms of each reduction (the limit as they grow together: the posterior
        of the paths with the most ``+inf`` terms), 0 elsewhere.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> x = np.log(np.full((2, 3, 4), 0.5))        # 2 chains, 3 positions, 4 states
    >>> trans = np.log(np.full((4, 4), 0.25))      # shared by every step
    >>> np.round(np.exp(sc.chain_logsumexp(x, trans)), 4)   # 4 * 0.5**3
    array([0.5, 0.5])
    """
    caller = "spchain.chain_logsumexp"
    chain = _prepare(x, log_trans, log_init, lengths, caller)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), chain.backend.use():
        log_partition, _, _ = _forward(chain)
        return chain.unrows(log_partition)


@scales_out
def chain_marginals(x, log_trans, log_init=None, *, lengths=None):
    """Posterior marginals of each state at each position: the gradient of
    ``chain_logsumexp(...).sum()`` with respect to ``x``.

    Takes the arguments of :func:`chain_logsumexp` and returns an array of ``x``'s shape
    (summed over the batch axes along which ``x`` was broadcast). Each position's marginals
    sum to 1 (0 where the chain has no path of positive weight, and past its length). Where
    ``+inf`` inputs make the log-partition ``+inf``, they are its limit as the ``+inf`` terms
    grow together (see :func:`chain_logsumexp`).

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> x = np.log(np.array([[0.9, 0.1], [0.5, 0.5]]))
    >>> stay = np.array([[0.0, -np.inf], [-np.inf, 0.0]])   # the state never changes
    >>> sc.chain_marginals(x, stay).round(2)
    array([[0.9, 0.1],
           [0.9, 0.1]])
    """
    chain = _prepare(x, log_trans, log_init, lengths, "spchain.chain_marginals")
    xp = chain.xp
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), chain.backend.use():
        _, pre, norm = _forward(chain)
        grad_x, _ = _backward(chain, pre, norm, xp.ones(chain.x.shape[0], chain.x.dtype), trans_grad=False)
        return _logspace.reduce_to(chain.unrows(grad_x), chain.x_shape)


@scales_out
def viterbi(x, log_trans, log_init=None, *, lengths=None):
    """The best state sequence of each chain and its score (the max-product forward algorithm).

    Takes the arguments of :func:`chain_logsumexp`.

    Returns
    -------
    score : array
        ``max over paths of init[s0] + x[0, s0] + sum_t (log_trans[s_{t-1}, s_t] + x[t, s_t])``,
        of the broadcast batch shape (``-inf`` where no path has weight; ``+inf``, with a
        path through ``+inf`` terms, where a path with no ``-inf`` term has one).
    path : int64 array (..., v)
        The best path; -1 past each chain's length, and -1 everywhere for an impossible chain
        (score ``-inf``), whose score then has zero gradients in ``spchain.torch``. Ties go to the lowest state index, from
        the last position backwards: the last state is the lowest best one, each earlier state
        the lowest best predecessor of the next.

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> x = np.log(np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]]))
    >>> score, path = sc.viterbi(x, np.log(np.array([[0.7, 0.3], [0.3, 0.7]])))
    >>> path
    array([0, 1, 1])
    """
    chain = _prepare(x, log_trans, log_init, lengths, "spchain.viterbi")
    with chain.backend.use():
        score, path = _viterbi(chain)
        return chain.unrows(score), chain.unrows(path)
