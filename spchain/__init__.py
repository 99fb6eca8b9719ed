"""spchain: sparse, log-space chain and block-diagonal matrix products.

The array API takes NumPy/SciPy or CuPy/cupyx inputs and returns results on the same backend
and device; ``spchain.torch`` offers the same functions for torch tensors, with autograd.

>>> import numpy as np, spchain as sc
>>> sc.block_diag_matmul(np.ones((2, 3, 4)), np.ones((3, 4, 5))).shape
(2, 3, 5)

Names are loaded on first use, so ``import spchain`` compiles nothing and imports neither
Numba, torch nor CuPy; so is the submodule ``spchain.hmm`` (hmmlearn-style estimators).
"""

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # the names' real types, for type checkers; at run time they load on first use
    from . import hmm as hmm
    from .blockdiag import block_diag_matmul as block_diag_matmul
    from .blockdiag import grouped_matmul as grouped_matmul
    from .chain import chain_logsumexp as chain_logsumexp
    from .chain import chain_marginals as chain_marginals
    from .chain import chain_sweep as chain_sweep
    from .chain import viterbi as viterbi
    from .paths import chain_entropy as chain_entropy
    from .paths import chain_kbest as chain_kbest
    from .paths import chain_path_score as chain_path_score
    from .paths import chain_sample as chain_sample
    from .semiring import log_chain_product as log_chain_product
    from .semiring import logmatmul as logmatmul
    from .semiring import maxmatmul as maxmatmul
    from .sparse import prune as prune
    from .sparse import sddmm as sddmm
    from .sparse import spmm as spmm

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

_SUBMODULES = ("hmm",)
"""Submodules that attribute access imports (``spchain.hmm``); ``spchain.torch`` is imported by name."""

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name not in _API:
        raise AttributeError(f"module 'spchain' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API) | set(_SUBMODULES))
