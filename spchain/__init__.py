"""spchain: sparse, log-space chain and block-diagonal matrix products.

The array API takes NumPy/SciPy or CuPy/cupyx inputs and returns results on the same backend
and device; ``spchain.torch`` offers the same functions for torch tensors, with autograd.

>>> import numpy as np, spchain as sc
>>> sc.block_diag_matmul(np.ones((2, 3, 4)), np.ones((3, 4, 5))).shape
(2, 3, 5)

Names are loaded on first use, so ``import spchain`` compiles nothing and imports neither
Numba, torch nor CuPy.
"""

import importlib

__version__ = "0.1.0"

_API = {
    "spmm": "sparse",
    "sddmm": "sparse",
    "prune": "sparse",
    "logmatmul": "semiring",
    "maxmatmul": "semiring",
    "log_chain_product": "semiring",
    "chain_logsumexp": "chain",
    "chain_marginals": "chain",
    "viterbi": "chain",
    "chain_sweep": "chain",
    "chain_sample": "paths",
    "chain_entropy": "paths",
    "chain_kbest": "paths",
    "chain_path_score": "paths",
    "block_diag_matmul": "blockdiag",
    "grouped_matmul": "blockdiag",
}

__all__ = sorted(_API)


def __getattr__(name):
    if name not in _API:
        raise AttributeError(f"module 'spchain' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_API))
