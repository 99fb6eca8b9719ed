"""The two exact sweeps of a chain: scaled GEMMs, or the log-space Numba kernels.

- where many rows share one transition matrix, each step is one GEMM in scaled (exp) space
  (BLAS / cuBLAS) whose underflowed entries are recomputed in log space: on the CPU one Numba
  pass over the rows does a step's elementwise work (:func:`fused_steps`), on the GPU array
  code (:func:`spchain._logspace.log_product`);
- otherwise the Numba kernels of ``spchain/kernels/*/chain.py`` run the whole log-space sweep, an
  online log-sum-exp over chunks of states, one row of the batch per thread (CPU) or block (GPU).

:func:`use_gemm` chooses between them by a cost model, unless :func:`chain_sweep` forces one.
The functions here assume finite or ``-inf`` inputs (``spchain._chain_limits`` handles ``+inf``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from types import ModuleType

import numpy as np

from . import _backend, _chain_scaled, _logspace, _structures
from ._backend import read_only
from ._chain_layout import Chain
from .kernels import cpu, cuda
from ._logspace import normalised, renormalise, weighted
from ._typing import Array

SWEEPS = ("auto", "gemm", "kernel")
_SWEEP = contextvars.ContextVar("spchain.chain_sweep", default="auto")


@contextlib.contextmanager
def chain_sweep(sweep: str) -> Iterator[None]:
    """Force the sweep of the chain functions inside a ``with`` block (of this thread or task).

    Both sweeps are exact; ``"gemm"`` (scaled GEMMs) is fast where many chains share a
    transition matrix, ``"kernel"`` (the log-space Numba kernels) otherwise, and ``"auto"``
    (the default) chooses by a cost model. Applies to :func:`spchain.chain_logsumexp`,
    :func:`spchain.chain_marginals`, their gradients in ``spchain.torch`` (computed inside the
    block) and the ``+inf`` limits; Viterbi has one sweep.

    Parameters
    ----------
    sweep : {"auto", "gemm", "kernel"}

    Examples
    --------
    >>> import numpy as np, spchain as sc
    >>> x, trans = np.zeros((2, 3, 4)), np.full((4, 4), -np.log(4))
    >>> with sc.chain_sweep("kernel"):
    ...     np.exp(sc.chain_logsumexp(x, trans)).round(6)
    array([4., 4.])
    """
    if sweep not in SWEEPS:
        raise ValueError(f"spchain.chain_sweep: sweep must be one of {SWEEPS}, got {sweep!r}")
    token = _SWEEP.set(sweep)
    try:
        yield
    finally:
        _SWEEP.reset(token)


def use_gemm(chain: Chain) -> bool:
    """Whether the scaled-GEMM sweep is expected to beat the kernel sweep.

    On the CPU, where each transition matrix serves many row-steps (shared transitions), the
    kernel sweep runs the scaled kernels (:mod:`spchain._chain_scaled`). Both do
    ``group · c²`` multiply-adds per step and matrix (``group`` rows share it); BLAS does
    them faster, but each step of the GEMM sweep pays its kernel calls and O(c) elementwise
    work a row, which small states do not repay. Measured on a 2-core CPU (forward + backward,
    float32, v 40, c 64 to 256, 64 to 512 rows per matrix): the GEMM sweep wins from c 96
    (1.5x at 128 rows and c 96, per step; 0.8x to 0.9x at c 64 whatever the rows) and
    ``group · c²`` of about 10⁶ with one matrix per step (whose exponentials and gradients the
    kernels pay per step) or 2·10⁶ with one for all steps (about even there). With few rows
    a matrix the GEMM sweep wins at smaller products too, since a block of the scaled kernels
    takes fewer rows as ``c`` grows (4 at c 256, 1 from c 363), each block reading the whole
    matrix a step. Measured on a 2-core Intel Xeon (v 16, 1 to 64 rows a matrix, 2026-11-29):
    with a matrix per step the kernel sweep took 1.1-1.8x the GEMM sweep's time at c 128 and
    1.3-9.5x from c 192, whatever the rows; with one for all steps 1.1-4.3x from c 384 and
    1.2-1.35x at c 256 with 4 to 16 rows, while it stayed ahead at c 128 and below, and at c
    256 with one or two rows. At the chain workload's sizes (500 rows, c 200, per step) the
    GEMM sweep is 3.4x faster; at the CRF's (256 rows, c 50, shared) the scaled kernels are 2x
    faster. Otherwise (one matrix per row and step) the log-space kernels cost about
    ``rows * c²`` exponentials a step, the
    GEMM sweep a fixed overhead of array calls, ``G * c²`` exponentials and a call per
    transition matrix, and O(rows * c) elementwise work, the ``rows * c²`` multiply-adds going
    to BLAS; the constants are seconds fitted on a 2-core CPU. From c 256 a row's matrix
    leaves the core's cache and the kernels slow down 2-3x, which the model misses: with one
    matrix per row (v 16, 1 to 16 rows, 2026-11-29) the kernel sweep took 1.9-2x the GEMM
    sweep's time at c 256 with 1 to 4 rows (even at 16) and 1.3-2.6x at c 512, while it kept
    ahead up to c 64 and was within 10-30 % either way at c 128. The GPU has a model of its
    own (:func:`gpu_gemm_wins`).
    """
    rows, _, c = chain.x.shape
    if c == 0:  # nothing to multiply: the kernels' empty sums give -inf
        return False
    if _SWEEP.get() != "auto":
        return _SWEEP.get() == "gemm"
    groups = chain.trans.shape[0]
    if chain.backend.on_gpu:
        return gpu_gemm_wins(rows, c, groups)
    if _chain_scaled.applies(chain):
        if c < 96:
            return False
        if chain.trans.shape[1] > 1:  # a matrix per step
            return bool(c >= 128 or chain.group * c * c >= 1e6)
        return bool(chain.group * c * c >= 2e6 or c >= 384 or (c >= 256 and chain.group >= 4))
    if c >= 256:
        return True
    kernel = rows * (1.0e-9 * c * c + 5e-7)
    gemm = 3e-5 + groups * (1.5e-9 * c * c + 1.5e-6) + 1.5e-8 * rows * c
    return bool(gemm < kernel)


GPU_ROWS_AT_ONCE = 1024
"""Rows the kernel sweep runs at once on a GPU (a block each: about 8 blocks on each of an
H100's 132 multiprocessors)."""


def gpu_gemm_wins(rows: int, c: int, groups: int) -> bool:
    """Whether, on a GPU, the GEMM sweep is expected to beat the kernel sweep (per step; both
    take every step, so the number of steps drops out).

    The kernel sweep runs its rows in waves of :data:`GPU_ROWS_AT_ONCE` blocks; a block
    spends about 1.2 µs per state on each of its ``c`` states (one ``exp`` a term, threads over
    the states in tiles of 256): 9.3 ms for the chain workload's forward (500 rows, 40 steps,
    c 200) on an H100. The GEMM sweep, free of synchronisations, is bound by its twenty-odd
    array calls a step (about 250 µs of host time) plus the exponentials of the ``groups``
    transition matrices (memory bound). So at the workload's size the two are even, and the
    GEMM sweep wins from larger ``c`` or more rows. The constants are estimates from one H100
    run and CuPy's per-call overhead; ``scripts/gpu-check.sh`` measures the chain workloads
    to refit them.
    """
    waves = -(-rows // GPU_ROWS_AT_ONCE)
    kernel = waves * c * -(-c // 256) * 1.2e-6
    gemm = 2.5e-4 + groups * c * c * 1.5e-11
    return gemm < kernel


def normalise(xp: ModuleType, q: Array) -> tuple[tuple[Array, Array, Array], Array]:
    """The normalised message ``â = q - lse(q)`` (``q`` itself where the lse is not finite),
    as the scaled operand of the next step's product (:func:`_logspace.scaled` of ``â``,
    taken from the exponentials of the lse itself), and ``lse(q)`` over the last axis."""
    e, shift, top = _logspace.scaled(xp, q, -1)
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = xp.where(top == -np.inf, -np.inf, xp.log(total) + shift)
    offset = _logspace.finite_or_zero(xp, lse)
    return (e, shift - offset, top - offset), lse[..., 0]


def forward_finite(chain: Chain) -> tuple[Array, Array, Array]:
    """Forward sweep: ``(log_partition (B,), pre (B, v, c), norm (B, v))``."""
    if chain.sparse is not None:
        from . import _sparse_chain
        return _sparse_chain.forward(chain)
    xp = chain.xp
    rows, v, c = chain.x.shape
    pre = xp.empty((rows, v, c), chain.x.dtype)
    norm = xp.empty((rows, v), chain.x.dtype)
    if rows and use_gemm(chain):
        (_forward_gemm_fused if fused_steps(chain) else _forward_gemm)(chain, pre, norm)
    elif rows and _chain_scaled.applies(chain):
        _chain_scaled.forward(chain, pre, norm)
    elif rows:
        args = (chain.x, chain.trans, chain.group, chain.init, chain.lengths, pre, norm)
        if chain.backend.on_gpu:
            chain.backend.launcher(cuda.chain.launch_chain_forward)(*args)
        else:
            cpu.team.run(cpu.chain.chain_forward, *args)
    inside = xp.arange(v)[None, :] < chain.lengths[:, None]
    log_partition = xp.where(inside, norm, 0).sum(axis=1, dtype=np.float64).astype(chain.x.dtype)
    return log_partition, pre, norm


def log_partition_finite(chain: Chain) -> Array:
    """:func:`forward_finite`'s log-partition alone: without its messages where the scaled
    kernels apply (the rows they cannot do exactly go through :func:`forward_finite`)."""
    if chain.sparse is None and chain.x.shape[0] and not use_gemm(chain) and _chain_scaled.applies(chain):
        out, lost = _chain_scaled.log_partition(chain)
        log_partition = out.astype(chain.x.dtype)
        return log_partition if not lost.any() else np.where(lost, forward_finite(chain)[0], log_partition)
    return forward_finite(chain)[0]


def fused_steps(chain: Chain) -> bool:
    """Whether the GEMM sweep runs each step's elementwise work in one Numba kernel (the CPU:
    ``_forward_gemm_fused``, ``_backward_gemm_fused``) rather than as array code (the GPU,
    whose array calls do not synchronise; the CPU tests run it on NumPy arrays)."""
    return not chain.backend.on_gpu


def _forward_gemm(chain: Chain, pre: Array, norm: Array) -> None:
    """The GEMM sweep's forward as array code (:func:`fused_steps`)."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    groups = chain.trans.shape[0]
    x = chain.x.reshape(groups, chain.group, v, c)
    pre4 = pre.reshape(groups, chain.group, v, c)
    norm3 = norm.reshape(groups, chain.group, v)
    pre4[:, :, 0] = chain.init.reshape(groups, chain.group, c)
    u, norm3[:, :, 0] = normalise(xp, pre4[:, :, 0] + x[:, :, 0])
    for t in range(chain.max_length - 1):
        trans = chain.step_matrices(t)

        def before(t: int = t) -> Array:
            return normalised(xp, pre4[:, :, t], x[:, :, t], norm3[:, :, t])

        _logspace.log_product(xp, u, _logspace.scaled(xp, trans, -2), before, trans, out=pre4[:, :, t + 1])
        u, norm3[:, :, t + 1] = normalise(xp, pre4[:, :, t + 1] + x[:, :, t + 1])
    outside = xp.arange(v)[None, :] >= chain.lengths[:, None]  # as the kernels leave them (no mask indexing: no sync)
    xp.copyto(pre, -np.inf, where=outside[..., None])
    xp.copyto(norm, 0, where=outside)


def _scaled_transitions(chain: Chain) -> tuple[Array, Array]:
    """``(e, cmax)`` of the fused GEMM sweep: ``e = exp(trans - cmax)`` in the chain's dtype and
    the column maxima ``cmax`` (G, S, c) (a subnormal entry of ``e`` makes products below the
    smallest normal number, which ``_logspace.underflow_threshold`` counts as dropped). Made
    once a prepared chain: the forward's serve its backward (3.7 ms of the chain workload's
    forward + backward of 120 ms, where each made its own)."""
    def build() -> tuple[Array, Array]:
        cmax = chain.trans.max(axis=-2)
        e = chain.trans - _logspace.finite_or_zero(np, cmax)[..., None, :]
        np.exp(e, out=e)
        return e, cmax

    return _structures.kept(chain, "scaled_transitions", build)


def _forward_gemm_fused(chain: Chain, pre: Array, norm: Array) -> None:
    """The GEMM sweep's forward on the CPU: a step is one GEMM (torch's BLAS) and one pass of
    a Numba kernel over each row (``kernels/cpu/chain_scaled.py``: ``gemm_forward_step``), where
    the array code takes a dozen passes."""
    rows, v, c = chain.x.shape
    groups = chain.trans.shape[0]
    e, cmax = _scaled_transitions(chain)
    log_threshold = np.log(_logspace.underflow_threshold(chain.x.dtype, c))
    tiny = float(np.finfo(chain.x.dtype).tiny)
    product, u = np.empty((2, rows, c), chain.x.dtype)
    top = np.empty(rows)
    kernels = cpu.chain_scaled
    for t in range(chain.max_length):
        cpu.team.run(kernels.gemm_forward_step, t, chain.x, chain.trans, cmax,
                     chain.group, chain.init, chain.lengths, log_threshold, tiny, product, top, u, pre, norm)
        if t + 1 < chain.max_length:
            s = t if chain.per_step else 0
            _backend.matmul(np, u.reshape(groups, chain.group, c), e[:, s],
                            out=product.reshape(groups, chain.group, c), log=True)
    pre[:, chain.max_length:] = -np.inf
    norm[:, chain.max_length:] = 0


def backward_finite(chain: Chain, pre: Array, norm: Array, weight: Array,
                    trans_grad: bool = True) -> tuple[Array, Array | None]:
    """Gradients of ``sum(weight * log_partition)``: ``(d x (B, v, c), d trans (G, S, c, c))``.

    ``d x`` holds ``weight`` times the posterior marginals; ``d init`` is ``d x[:, 0]``.
    ``d trans`` is ``None`` unless ``trans_grad``.
    """
    pre, norm, weight = (read_only(a) for a in (pre, norm, weight))  # one kernel signature, as the inputs
    if chain.sparse is not None:
        from . import _sparse_chain
        return _sparse_chain.backward(chain, pre, norm, weight, trans_grad)
    xp = chain.xp
    rows, v, c = chain.x.shape
    grad_trans = xp.zeros(chain.trans.shape, chain.x.dtype) if trans_grad else None
    if not rows:
        return xp.zeros_like(chain.x), grad_trans
    if use_gemm(chain):
        sweep = _backward_gemm_fused if fused_steps(chain) else _backward_gemm
        grad_x = sweep(chain, pre, norm, weight, grad_trans)
    elif _chain_scaled.applies(chain):
        grad_x = weighted(xp, _chain_scaled.backward(chain, pre, norm, weight, grad_trans), weight)
    else:
        beta = xp.empty_like(chain.x)
        args = (chain.x, chain.trans, chain.group, chain.lengths, norm, beta)
        if chain.backend.on_gpu:
            chain.backend.launcher(cuda.chain.launch_chain_backward)(*args)
        else:
            cpu.team.run(cpu.chain.chain_backward, *args)
        inside = (xp.arange(v)[None, :] < chain.lengths[:, None])[..., None]
        marginals, _ = renormalise(xp, xp.where(inside, xp.exp(normalised(xp, pre, chain.x, norm) + beta), 0))
        if grad_trans is not None and batched_counts(chain):
            _chain_scaled.transition_grad_gemm(chain, pre, norm, marginals, weight, grad_trans)
        elif grad_trans is not None:
            counts = (chain.x, chain.trans, chain.group, chain.lengths, pre, norm, marginals, weight, grad_trans)
            if chain.backend.on_gpu:
                chain.backend.launcher(cuda.chain.launch_chain_transition_grad)(*counts)
            else:
                cpu.team.run(cpu.chain.chain_transition_grad, *counts)
        grad_x = weighted(xp, marginals, weight)
    return grad_x, grad_trans


def batched_counts(chain: Chain) -> bool:
    """Whether the kernel sweep's transition gradient is one batched GEMM after the backward
    sweep (:func:`_chain_scaled.transition_grad_gemm`): on the GPU, where the alternative is a
    kernel that walks each matrix's rows serially. The CPU keeps its kernel."""
    return chain.backend.on_gpu


def _backward_gemm(chain: Chain, pre: Array, norm: Array, weight: Array, grad_trans: Array | None) -> Array:
    """The backward sweep by scaled GEMMs, one step at a time, as array code (:func:`fused_steps`);
    fills ``grad_trans`` if given, by one batched GEMM after the sweep."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    groups = chain.trans.shape[0]
    shape = (groups, chain.group)
    x = chain.x.reshape(shape + (v, c))
    pre4 = pre.reshape(shape + (v, c))
    norm3 = norm.reshape(shape + (v,))
    last = (chain.lengths - 1).reshape(shape)[..., None]
    w = weight.reshape(shape)[..., None]
    grad_x = xp.zeros(shape + (v, c), chain.x.dtype)  # the marginals, weighted at the end
    beta = xp.full(shape + (c,), -np.inf, chain.x.dtype)

    def message(t: int) -> Array:
        return normalised(xp, pre4[:, :, t], x[:, :, t], norm3[:, :, t])

    forward = message(chain.max_length - 1)
    for t in range(chain.max_length - 1, -1, -1):
        active = t <= last
        beta = xp.where(last == t, 0, beta)
        grad_x[:, :, t], log_total = renormalise(xp, xp.where(active, xp.exp(forward + beta), 0))
        beta = beta - log_total
        if t == 0:
            break
        trans = chain.step_matrices(t - 1)
        forward = message(t - 1)
        y = xp.where(active, x[:, :, t] + beta, -np.inf)
        d = norm3[:, :, t, None]
        beta = xp.where(d == -np.inf, -np.inf, _logspace.log_matmul(xp, y, trans.swapaxes(-1, -2), posinf=False) - d)
    if grad_trans is not None:  # the counts: one batched GEMM (a chunk of rows at a time)
        _chain_scaled.transition_grad_gemm(chain, pre, norm, grad_x.reshape(rows, v, c), weight, grad_trans)
    grad_x *= w[..., None]
    return grad_x.reshape(rows, v, c)


def _backward_gemm_fused(chain: Chain, pre: Array, norm: Array, weight: Array, grad_trans: Array | None) -> Array:
    """The GEMM sweep's backward on the CPU: a step is one pass of a Numba kernel over each
    row (``gemm_backward_step``) and two GEMMs (torch's BLAS), the backward messages' and the
    transition counts'; fills ``grad_trans`` if given. Matrices whose scaled counts could lose
    their answer get the exact log-space kernel's (``_chain_scaled._exact_where_not``)."""
    rows, v, c = chain.x.shape
    groups, steps = chain.trans.shape[:2]
    dtype = chain.x.dtype
    e, cmax = _scaled_transitions(chain)
    log_threshold, tiny = np.log(_logspace.underflow_threshold(dtype, c)), float(np.finfo(dtype).tiny)
    # each group's weights scaled to at most 1, so that its factors stay in range and a group of
    # tiny weights is not lost beside one of huge ones (NaN flows through)
    scale = np.where(np.isfinite(weight), np.abs(weight), 0).reshape(groups, chain.group).max(axis=1)
    scale = np.where(scale > 0, scale, 1)
    grad_x = np.empty_like(chain.x)  # the kernel writes every position the sweep takes
    grad_x[:, chain.max_length:] = 0
    last = chain.lengths - 1
    forward = np.ascontiguousarray(normalised(np, pre[:, chain.max_length - 1], chain.x[:, chain.max_length - 1],
                                              norm[:, chain.max_length - 1]))
    beta, y, z, product, p, w = np.empty((6, rows, c), dtype)
    top = np.empty(rows)
    counts = grad_trans is not None  # summed in place (the caller's zeros), then scaled
    ok, reached = np.ones((groups, steps), bool), np.zeros((groups, steps), bool)
    kernels = cpu.chain_scaled
    shape = (groups, chain.group, c)
    for t in range(chain.max_length - 1, -1, -1):
        cpu.team.run(kernels.gemm_backward_step, t, last, weight, 1 / scale,
                     chain.x, chain.trans, cmax, chain.group, pre, norm, log_threshold, tiny, counts,
                     forward, beta, y, top, z, product, grad_x, p, w, ok, reached)
        if t == 0:
            break
        s = t - 1 if chain.per_step else 0
        _backend.matmul(np, z.reshape(shape), e[:, s].swapaxes(-1, -2), out=product.reshape(shape), log=True)
        if grad_trans is not None and chain.per_step:  # each matrix's counts in one GEMM
            _backend.matmul(np, p.reshape(shape).swapaxes(-1, -2), w.reshape(shape), out=grad_trans[:, s])
        elif grad_trans is not None:
            grad_trans[:, 0] += _backend.matmul(np, p.reshape(shape).swapaxes(-1, -2), w.reshape(shape))
    if grad_trans is not None:
        grad_trans *= e
        grad_trans *= scale[:, None, None, None]
        grad_trans[~reached] = 0  # a matrix no row uses gets 0, even a NaN one
        _chain_scaled._exact_where_not(chain, pre, norm, grad_x, np.ones_like(weight), ok, grad_trans)
    return grad_x


def viterbi_finite(chain: Chain) -> tuple[Array, Array]:
    """Best paths: ``(score (B,), path (B, v) int64, -1 past each length)``."""
    if chain.sparse is not None:
        from . import _sparse_chain
        return _sparse_chain.viterbi(chain)
    xp = chain.xp
    rows, v, c = chain.x.shape
    score = xp.empty(rows, chain.x.dtype)
    path = xp.empty((rows, v), np.int64)
    if rows:
        work = xp.empty((rows, 2, c), chain.x.dtype)
        backptr = xp.empty((rows, v, c), np.int32)
        args = (chain.x, chain.trans, chain.group, chain.init, chain.lengths, work, backptr, score, path)
        if chain.backend.on_gpu:
            chain.backend.launcher(cuda.chain.launch_chain_viterbi)(*args)
        else:
            cpu.team.run(cpu.chain.chain_viterbi, *args)
        path = xp.where((score == -np.inf)[:, None], -1, path)  # no path: nothing to follow, no gradient
    return score, path
