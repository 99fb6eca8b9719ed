"""Float64 references of the chain workloads that run none of spchain's kernels: the scaled
forward(-backward) recursion in probability space (Rabiner's scaling), in NumPy and SciPy.

A benchmark's reference must not share the code it checks, and compiling spchain's float64
kernels for a reference alone took 14 s of the quick run's first, compiling step. The inputs
are finite log-weights, every chain with a path: each step's messages are normalised, so
nothing underflows that matters at float64's precision. ``step(a, t)`` is ``a @ P_t``, the
messages ``a`` (n, c) times the transition probabilities into position ``t``; ``back(b, t)``
is ``b @ P_t.T``.

    >>> import numpy as np
    >>> x, p = np.log(np.full((1, 2, 2), 0.5)), np.eye(2)
    >>> chain_marginals(x, lambda a, t: a @ p, lambda b, t: b @ p.T, np.log([0.25, 0.75]))
    array([[[0.25, 0.75],
            [0.25, 0.75]]])
"""

from collections.abc import Callable, Iterator

import numpy as np
from numpy.typing import NDArray

Step = Callable[[NDArray[np.float64], int], NDArray[np.float64]]


def _forward(x: NDArray[np.float64], step: Step, log_init: NDArray[np.float64]
             ) -> Iterator[tuple[NDArray[np.float64], NDArray[np.float64]]]:
    """Each position's normalised forward messages (n, c) and their normaliser (n,), in order;
    the log-partition is the sum of the normalisers' logarithms and ``x``'s row maxima."""
    message = np.exp(log_init + x[:, 0] - x[:, 0].max(axis=1, keepdims=True))
    for t in range(x.shape[1]):
        if t:
            message = step(message, t) * np.exp(x[:, t] - x[:, t].max(axis=1, keepdims=True))
        scale = message.sum(axis=1)
        message = message / scale[:, None]
        yield message, scale


def chain_log_partition(x: NDArray[np.float64], step: Step, log_init: NDArray[np.float64]) -> NDArray[np.float64]:
    """``log sum over paths exp(log_init[s_0] + x[:, 0, s_0] + sum_t log P_t[s_{t-1}, s_t] + x[:, t, s_t])``
    of ``x`` (n, v, c) float64: ``chain_logsumexp``'s result."""
    total: NDArray[np.float64] = x.max(axis=2).sum(axis=1)
    for _, scale in _forward(x, step, log_init):
        total += np.log(scale)
    return total


def chain_marginals(x: NDArray[np.float64], step: Step, back: Step, log_init: NDArray[np.float64]
                    ) -> NDArray[np.float64]:
    """The posterior marginals (n, v, c) of each state at each position: ``chain_marginals``' result."""
    alpha, scales = zip(*_forward(x, step, log_init))
    out = np.stack(alpha, axis=1)
    beta = np.ones(out.shape[::2])
    for t in range(x.shape[1] - 2, -1, -1):
        emitted = np.exp(x[:, t + 1] - x[:, t + 1].max(axis=1, keepdims=True))
        beta = back(emitted * beta, t + 1) / scales[t + 1][:, None]
        out[:, t] *= beta
    return out
