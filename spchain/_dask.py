"""The hook that lets the array-level functions take Dask arrays.

Each public function of the array API but ``prune`` (which needs the whole weight, and says so
for a Dask array) carries ``@scales_out``. A call with no
``dask.array.Array`` argument goes straight to the function; a call with one goes to the
function of the same name in ``_dask_array`` (products), ``_dask_chain`` (chains) or
``_dask_paths`` (paths), which build a lazy Dask graph whose tasks call the ordinary in-memory
function on NumPy or CuPy chunks. Dask itself is imported only then, so ``import spchain`` never imports it.
"""

import functools
import importlib
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

from . import _backend

P = ParamSpec("P")
R = TypeVar("R")

_MODULES = {"chain_logsumexp": "_dask_chain", "chain_marginals": "_dask_chain", "viterbi": "_dask_chain",
            "chain_sample": "_dask_paths", "chain_entropy": "_dask_paths", "chain_kbest": "_dask_paths",
            "chain_path_score": "_dask_paths"}
"""The module of each function's Dask version, other than ``_dask_array`` (the products)."""


def scales_out(fn: Callable[P, R]) -> Callable[P, R]:
    """Route calls of ``fn`` with a Dask array argument to its Dask version."""

    @functools.wraps(fn)
    def dispatch(*args: P.args, **kwargs: P.kwargs) -> R:
        if any(_backend.is_dask(a) for a in (*args, *kwargs.values())):
            module = _MODULES.get(fn.__name__, "_dask_array")
            dask_fn = getattr(importlib.import_module(f".{module}", __package__), fn.__name__)
            return cast(R, dask_fn(*args, **kwargs))
        return fn(*args, **kwargs)

    return dispatch
