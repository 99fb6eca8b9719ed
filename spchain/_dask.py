"""The hook that lets every array-level function take Dask arrays.

Each public function of the array API carries ``@scales_out``. A call with no
``dask.array.Array`` argument goes straight to the function; a call with one goes to the
function of the same name in ``_dask_array`` (products) or ``_dask_chain`` (chains), which
build a lazy Dask graph whose tasks call the ordinary in-memory function on NumPy or CuPy
chunks. Dask itself is imported only then, so ``import spchain`` never imports it.
"""

import functools
import importlib
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

from . import _backend

P = ParamSpec("P")
R = TypeVar("R")

_CHAIN_FUNCTIONS = {"chain_logsumexp", "chain_marginals", "viterbi"}


def scales_out(fn: Callable[P, R]) -> Callable[P, R]:
    """Route calls of ``fn`` with a Dask array argument to its Dask version."""

    @functools.wraps(fn)
    def dispatch(*args: P.args, **kwargs: P.kwargs) -> R:
        if any(_backend.is_dask(a) for a in (*args, *kwargs.values())):
            module = "_dask_chain" if fn.__name__ in _CHAIN_FUNCTIONS else "_dask_array"
            dask_fn = getattr(importlib.import_module(f".{module}", __package__), fn.__name__)
            return cast(R, dask_fn(*args, **kwargs))
        return fn(*args, **kwargs)

    return dispatch
