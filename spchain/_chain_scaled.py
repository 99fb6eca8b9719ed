"""The kernel sweep on the CPU where each transition matrix serves many row-steps: the
scaled kernels of ``spchain/kernels/cpu/chain_scaled.py`` (``c²`` multiply-adds and ``c``
exponentials a step instead of ``c²`` exponentials), exact as the log-space kernels.
"""

from __future__ import annotations

import numpy as np

from ._chain_layout import Chain
from ._typing import Array

REUSE = 4
"""Row-steps per transition matrix from which exponentiating the matrices once pays."""

PARTS = 8
"""Row chunks per transition matrix that the transition gradient sums in parallel, at most."""


def applies(chain: Chain) -> bool:
    """Whether the scaled kernels run: on the CPU, where each matrix serves ``REUSE`` row-steps."""
    rows, v, c = chain.x.shape
    groups, steps = chain.trans.shape[:2]
    return not chain.backend.on_gpu and c > 0 and rows * max(v - 1, 1) >= REUSE * groups * steps


def _scaled(chain: Chain) -> tuple[Array, Array]:
    """``(e, cmax)``: the transitions' exponentials shifted by their column maxima (float64)."""
    trans = chain.trans.astype(np.float64)
    cmax = trans.max(axis=-2) if trans.shape[-2] else np.full(trans.shape[:-2] + trans.shape[-1:], -np.inf)
    e = np.exp(trans - np.where(cmax == -np.inf, 0, cmax)[..., None, :])
    e[e < chain.backend.kernel("chain_scaled", "FLUSH")] = 0
    return e, cmax


def forward(chain: Chain, pre: Array, norm: Array) -> None:
    """Fills ``pre`` and ``norm`` as ``chain_forward`` does."""
    e, cmax = _scaled(chain)
    chain.backend.kernel("chain_scaled", "chain_forward_scaled")(
        chain.x, chain.trans, e, cmax, chain.group, chain.init, chain.lengths, pre, norm)


def backward(chain: Chain, pre: Array, norm: Array, weight: Array, grad_trans: Array | None) -> Array:
    """The posterior marginals (B, v, c); fills ``grad_trans`` (if not ``None``) with the
    ``weight``-ed expected transition counts."""
    e, cmax = _scaled(chain)
    marg = np.empty_like(chain.x)
    kernels = chain.backend.kernel
    kernels("chain_scaled", "chain_marginals_scaled")(chain.x, chain.trans, e, cmax, chain.group, chain.lengths,
                                                       pre, norm, marg)
    if grad_trans is not None:
        groups, steps = chain.trans.shape[:2]
        parts = max(1, min(PARTS // max(groups * steps, 1), chain.group))
        chunks = -(-chain.group // parts)
        acc = np.zeros(chain.trans.shape[:2] + (parts,) + chain.trans.shape[2:])
        ok = np.ones((groups, steps, parts), bool)
        kernels("chain_scaled", "chain_transition_grad_scaled")(chain.x, cmax, chain.group, chain.lengths, pre,
                                                                norm, marg, weight, chunks, acc, ok)
        if ok.all():
            grad_trans[...] = e * acc.sum(axis=2)
        else:  # a scale factor out of range: the exact log-space sums
            kernels("chain", "chain_transition_grad")(chain.x, chain.trans, chain.group, chain.lengths, pre, norm,
                                                      marg, weight, grad_trans)
    return marg
