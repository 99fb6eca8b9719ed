"""``@cuda.jit`` kernels (``<op>_kernel``) and their host launchers (``launch_<op>``).

A dispatcher imports this package (``from .kernels import cuda``) and binds a launcher to CuPy's
stream by its module attribute, ``backend.launcher(cuda.chain.launch_chain_forward)``. A kernel
module is imported on first access, and with it ``numba.cuda``: spchain does so only on the CUDA
path. Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run, slowly, on NumPy arrays.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the modules that attribute access loads, for type checkers and editors
    from . import blocksparse as blocksparse
    from . import chain as chain
    from . import config as config
    from . import logspace as logspace
    from . import paths as paths
    from . import semiring as semiring
    from . import sparse as sparse
    from . import sparse_chain as sparse_chain

MODULES = ("blocksparse", "chain", "config", "logspace", "paths", "semiring", "sparse", "sparse_chain")
"""The kernel modules, each imported on first access (``cuda.chain``)."""


def __getattr__(name: str) -> ModuleType:
    if name not in MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f".{name}", __name__)
