"""``@njit(cache=True)`` CPU kernels: raw arrays in, preallocated outputs filled.

A dispatcher imports this package (``from .kernels import cpu``) and names a kernel by its module
attribute, ``cpu.team.run(cpu.chain.chain_forward, ...)`` (a parallel kernel, on a team of
threads: ``team.py``): go-to-definition and ``grep`` lead from the call to the kernel. A kernel
module is imported on first access, after :func:`threading_layer` chose Numba's threading
layer, so ``import spchain`` imports no Numba.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the modules that attribute access loads, for type checkers and editors
    from . import blocksparse as blocksparse
    from . import chain as chain
    from . import chain_scaled as chain_scaled
    from . import exp as exp
    from . import paths as paths
    from . import semiring as semiring
    from . import sparse as sparse
    from . import sparse_chain as sparse_chain
    from . import sparse_chain_scaled as sparse_chain_scaled
    from . import team as team

MODULES = ("blocksparse", "chain", "chain_scaled", "exp", "paths", "semiring", "sparse", "sparse_chain",
           "sparse_chain_scaled", "team")
"""The kernel modules, each imported on first access (``cpu.chain``)."""


_FORKED = False


def _mark_forked() -> None:
    global _FORKED
    _FORKED = True


os.register_at_fork(after_in_child=_mark_forked)


def forked() -> bool:
    """Whether this process was forked after spchain's kernels were first imported (where torch's
    OpenMP threads of the parent are gone: ``team.parallel``)."""
    return _FORKED


CROWDED_EVERY = 0.1
"""Seconds for which :func:`crowded`'s answer stands (reading it costs about 0.1 ms)."""

_crowded = [-1.0, False]  # when last read, and what


def crowded() -> bool:
    """Whether threads of other processes are runnable now (``/proc/loadavg`` less this
    process's own running threads), so that a team of this process's threads would not find
    its cores free.

    A parallel region of GNU OpenMP ends when every thread of its team has run: on a machine
    that other work keeps busy, that waits for the scheduler to give an idle thread a time
    slice (CSR times dense, 0.14 ms on Numba's threads or the calling thread alone, took 12 ms
    on torch's team at a load of 4-5 on 2 cores)."""
    now = time.monotonic()
    if now - _crowded[0] > CROWDED_EVERY:
        _crowded[:] = [now, _others_running() > 0]
    return bool(_crowded[1])


@contextlib.contextmanager
def assume_idle() -> Iterator[None]:
    """Take the machine as not :func:`crowded` inside the block (the benchmark's compiling
    step, run beside its own workers: it compiles the entries that an idle run calls)."""
    _crowded[:] = [math.inf, False]
    try:
        yield
    finally:
        _crowded[:] = [-1.0, False]


def _others_running() -> int:
    """Runnable threads on the machine that are not this process's (0 where unknown)."""
    try:
        with open("/proc/loadavg") as loadavg:
            runnable = int(loadavg.read().split()[3].split("/")[0])
        own = 0
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat") as stat:
                    own += stat.read().rsplit(")", 1)[1].split()[0] == "R"
            except OSError:  # a thread that has just ended
                pass
    except (OSError, ValueError, IndexError):  # not Linux
        return 0
    return runnable - own


def __getattr__(name: str) -> ModuleType:
    if name not in MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    threading_layer()
    return importlib.import_module(f".{name}", __name__)


@functools.cache
def threading_layer() -> str:
    """Select Numba's threading layer for spchain's parallel CPU kernels, once, before the first
    one loads; returns the name asked for (``"tbb"``, or ``"default"`` without TBB).

    TBB is fork-safe and thread-safe: a process that forks after running a kernel (a torch
    ``DataLoader`` worker, ``multiprocessing`` with ``fork``) can run kernels in the child, and
    threads can call spchain at once. GNU OpenMP, Numba's usual layer, kills such a child, and
    ``workqueue`` aborts on concurrent calls. TBB is a dependency of spchain on x86-64 Linux and
    Windows (pip's ``tbb``); pip puts ``libtbb`` in ``sys.prefix/lib``, which a virtual
    environment's loader does not search, so it is loaded from there first. Without TBB, or
    where the user chose a layer (``NUMBA_THREADING_LAYER``, ``numba.config``), Numba's own
    choice stands: kernels work, but a forked child must not call them. If another library
    started Numba's threads first on another layer, that layer stays, with a warning: under
    contention, a parallel kernel on GNU OpenMP ran 40x slower than on TBB (a 4 MB transpose,
    0.5 ms against 20 ms, 2 cores at a load of 8).
    """
    import numba
    from numba.np.ufunc import parallel

    if os.environ.get("NUMBA_THREADING_LAYER") or numba.config.THREADING_LAYER != "default":
        return str(numba.config.THREADING_LAYER)
    if _tbb_loads():
        if parallel._is_initialized and numba.threading_layer() != "tbb":
            warnings.warn(
                f"Numba's threads were started on its {numba.threading_layer()!r} layer (by a library that ran "
                "Numba parallel code before spchain's first CPU kernel) and cannot change: spchain's kernels "
                "are not fork-safe there, and GNU OpenMP's spinning threads run them many times slower on "
                "a busy machine; import spchain's kernels first (call spchain.kernels.cpu.threading_layer()) "
                "or set NUMBA_THREADING_LAYER=tbb", stacklevel=2)
            return str(numba.threading_layer())
        numba.config.THREADING_LAYER = "tbb"
    return str(numba.config.THREADING_LAYER)


def _tbb_loads() -> bool:
    """Whether Numba's TBB layer can start here (a TBB of a version Numba accepts)."""
    library = os.path.join(sys.prefix, "lib", "libtbb.so.12")
    try:
        if sys.platform.startswith("linux") and os.path.exists(library):
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        importlib.import_module("numba.np.ufunc.tbbpool")
        importlib.import_module("numba.np.ufunc.parallel")._check_tbb_version_compatible()
    except (OSError, ImportError, AttributeError):
        return False
    return True
