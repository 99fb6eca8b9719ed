"""Markers, Hypothesis profiles and the shared fixtures of spchain's tests.

- ``gpu`` tests need CuPy and a real CUDA device; they are skipped without one.
- ``cuda_kernel`` tests run Numba CUDA kernels; without a GPU they need the simulator:
  ``NUMBA_ENABLE_CUDASIM=1 pytest -m cuda_kernel`` (set before Numba is imported).
"""

import gc
import os
import zlib

import numpy as np
import pytest
from hypothesis import settings

settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile("ci", max_examples=40, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

# the simulator replaces Numba's CUDA compiler, which test_kernels_ptx.py exercises
collect_ignore = ["test_kernels_ptx.py"] if SIMULATOR else []


def _gpu_available() -> bool:
    if SIMULATOR:
        return False
    from spchain import _backend

    try:
        _backend.cupy()
    except _backend.CudaUnavailableError:
        return False
    return True


GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs CuPy and a CUDA device")
    no_cuda = pytest.mark.skip(reason="needs a CUDA device, or NUMBA_ENABLE_CUDASIM=1 for the simulator")
    for item in items:
        # markers, not keywords: a keyword is also any parent's name (a checkout in a folder "gpu")
        if item.get_closest_marker("gpu") and not GPU:
            item.add_marker(no_gpu)
        if item.get_closest_marker("cuda_kernel") and not (GPU or SIMULATOR):
            item.add_marker(no_cuda)


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """The array module of one backend: every array-level test body runs on both."""
    if request.param == "numpy":
        return np
    from spchain import _backend

    return _backend.cupy()


@pytest.fixture
def small_launch(monkeypatch):
    """Tiny CUDA launch sizes, so that kernels run several blocks and grid-stride loops."""
    from spchain.kernels.cuda import config

    monkeypatch.setattr(config, "THREADS_PER_BLOCK", 4)
    monkeypatch.setattr(config, "MAX_BLOCKS", 3)
    monkeypatch.setattr(config, "STATE_CHUNK", 4)
    return config


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: fresh inputs per test, reproducible per run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture
def rss_growth():
    """``growth(step, repeats)``: resident memory added by ``repeats`` calls of ``step`` after
    a warm-up (torch's CPU allocations are invisible to tracemalloc): a leak check."""

    def growth(step, repeats: int = 200) -> int:
        for _ in range(20):
            step()
        gc.collect()
        start = _rss()
        for _ in range(repeats):
            step()
        gc.collect()
        return _rss() - start

    return growth
