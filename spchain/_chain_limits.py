"""``+inf`` inputs of a chain: ``+inf`` out, never NaN, with limit gradients.

:func:`forward`, :func:`backward` and :func:`viterbi` are the sweeps of
``spchain._chain_sweep`` for any input: rows whose log-partition is ``+inf`` (a possible path
goes through a ``+inf`` term) are found by a max-plus sweep over ``+inf`` marks and set apart;
their gradient is the limit as the ``+inf`` terms grow together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ._chain_layout import Chain
from ._chain_sweep import backward_finite, forward_finite, log_partition_finite, viterbi_finite
from ._typing import Array

LIMIT = 2.0**20
"""What ``+inf`` becomes, in float64, for the gradient of a chain whose log-partition is ``+inf``:
paths through fewer ``+inf`` terms then weigh ``exp(-2**20) = 0`` relative to the others, as
in the limit, and ``2**20 * k`` stays exact to 1e-10 in float64."""


def _with(chain: Chain, f: Callable[[Array], Array]) -> Chain:
    """``chain`` with ``f`` applied to its x, transitions and init."""
    return dataclasses.replace(chain, x=f(chain.x), trans=f(chain.trans), init=f(chain.init))


def limited(chain: Chain) -> Chain:
    """``chain`` in float64 with ``+inf`` as :data:`LIMIT`: its posterior is the limit one as
    the ``+inf`` terms grow together (the paths through the most ``+inf`` terms)."""
    return _with(chain, lambda a: chain.xp.where(chain.xp.isposinf(a), LIMIT, a).astype(np.float64))


def _plus_inf_rows(chain: Chain) -> tuple[Array, Array] | tuple[None, None]:
    """``(None, None)`` where no input holds ``+inf``; else ``(infinite (B,) bool, path (B, v))``:
    the rows whose log-partition is ``+inf`` (a path with no ``-inf`` or NaN term goes through
    a ``+inf`` one) and, for those, such a path (the most ``+inf`` terms; Viterbi's ties)."""
    xp = chain.xp
    if not chain.has_plus_inf:
        return None, None
    marks = _with(chain, lambda a: xp.where(xp.isposinf(a), 1, xp.where(xp.isfinite(a), 0, a)).astype(a.dtype))
    score, path = viterbi_finite(marks)
    return score >= 1, path


def _without_plus_inf(chain: Chain) -> Chain:
    """``+inf`` replaced by ``-inf``: exact for the rows whose ``+inf`` terms all lie on
    impossible paths, and harmless for the others, whose outputs are set apart."""
    return _with(chain, lambda a: chain.xp.where(chain.xp.isposinf(a), -np.inf, a))


def forward(chain: Chain) -> tuple[Array, Array, Array]:
    """:func:`forward_finite`, with ``+inf`` where a possible path goes through a ``+inf`` and
    NaN where a row reads a NaN (:func:`_nan_where_read`)."""
    infinite, _ = _plus_inf_rows(chain)
    if infinite is None:
        log_partition, pre, norm = forward_finite(chain)
        return _nan_where_read(chain, log_partition), pre, norm
    log_partition, pre, norm = forward_finite(_without_plus_inf(chain))
    return _nan_where_read(chain, chain.xp.where(infinite, np.inf, log_partition).astype(chain.x.dtype)), pre, norm


def log_partition(chain: Chain) -> Array:
    """:func:`forward`'s log-partition alone (no messages: nothing for a gradient)."""
    infinite, _ = _plus_inf_rows(chain)
    if infinite is None:
        return _nan_where_read(chain, log_partition_finite(chain))
    finite = log_partition_finite(_without_plus_inf(chain))
    return _nan_where_read(chain, chain.xp.where(infinite, np.inf, finite).astype(chain.x.dtype))


def _nan_where_read(chain: Chain, log_partition: Array) -> Array:
    """``log_partition`` with NaN for the rows that read a NaN (:attr:`Chain.nan_rows`), also
    one on no possible path, whichever sweep ran: the kernel sweeps pass over the transitions
    out of a state of weight 0, the GEMM sweep's ``0 · NaN`` is NaN."""
    if not chain.has_nan:
        return log_partition
    return chain.xp.where(chain.nan_rows, np.nan, log_partition).astype(log_partition.dtype, copy=False)


def backward(chain: Chain, pre: Array, norm: Array, weight: Array,
             trans_grad: bool = True) -> tuple[Array, Array | None]:
    """:func:`backward_finite` for the outputs of :func:`forward`. A row with a ``+inf``
    log-partition gets the limit of its gradient as its ``+inf`` terms grow together: the
    posterior of the paths with the most ``+inf`` terms."""
    xp = chain.xp
    infinite, _ = _plus_inf_rows(chain)
    if infinite is None:
        grad_x, grad_trans = backward_finite(chain, pre, norm, weight, trans_grad)
        return nan_gradients(chain, weight, grad_x), grad_trans
    grad_x, grad_trans = backward_finite(_without_plus_inf(chain), pre, norm, xp.where(infinite, 0, weight),
                                         trans_grad)
    limit = limited(chain)
    _, limit_pre, limit_norm = forward_finite(limit)
    limit_x, limit_trans = backward_finite(limit, limit_pre, limit_norm,
                                           xp.where(infinite, weight, 0).astype(np.float64), trans_grad)
    grad_x = xp.where(infinite[:, None, None], limit_x.astype(chain.x.dtype), grad_x)
    if grad_trans is not None and limit_trans is not None:
        grad_trans = grad_trans + limit_trans.astype(chain.x.dtype)
    return nan_gradients(chain, weight, grad_x), grad_trans


def nan_gradients(chain: Chain, weight: Array, grad_x: Array) -> Array:
    """``grad_x`` NaN in the rows that read a NaN and have a gradient: a NaN output's, whichever
    sweep ran or path it took (in place; nothing to do, and no copy, without a NaN input)."""
    if chain.has_nan:
        grad_x[chain.nan_rows & (weight != 0)] = np.nan
    return grad_x


def viterbi(chain: Chain) -> tuple[Array, Array]:
    """:func:`viterbi_finite`, with score ``+inf`` and a path through ``+inf`` terms where a
    possible path goes through one, and score NaN and path -1 where a row reads a NaN."""
    infinite, marked_path = _plus_inf_rows(chain)
    if infinite is None:
        score, path = viterbi_finite(chain)
    else:
        score, path = viterbi_finite(_without_plus_inf(chain))
        xp = chain.xp
        score = xp.where(infinite, np.inf, score).astype(chain.x.dtype)
        path = xp.where(infinite[:, None], marked_path, path)
    return nan_paths(chain, score, path)


def nan_paths(chain: Chain, scores: Array, paths: Array) -> tuple[Array, Array]:
    """``scores`` NaN and ``paths`` -1 in the rows that read a NaN (:attr:`Chain.nan_rows`;
    ``scores`` (..., B), ``paths`` (..., B, v)): no path of such a chain is meaningful (in
    place; nothing to do without a NaN input)."""
    if chain.has_nan:
        scores[..., chain.nan_rows] = np.nan
        paths[..., chain.nan_rows, :] = -1
    return scores, paths
