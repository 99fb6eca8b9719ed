"""Markers, options, Hypothesis profiles and the shared fixtures of spchain's tests.

- ``slow`` tests (Hypothesis at its full budget, DDP, Dask clusters, the docstring examples,
  subprocesses, large sizes) are deselected by plain ``pytest``; ``pytest --all`` runs everything
  (as CI does), ``pytest -m slow`` only them. Without ``--all`` or ``slow`` in ``-m``, a Hypothesis
  test tries ``QUICK_EXAMPLES`` inputs and belongs to the default set; with them, ``FULL_EXAMPLES``
  and it counts as slow (``HYPOTHESIS_PROFILE=quick|full`` or ``--hypothesis-profile`` overrides).
- Plain ``pytest`` (the default set, no paths, ``-k`` or ``-m``) runs on ``DEFAULT_WORKERS`` worker
  processes when pytest-xdist is installed and the machine has that many cores: Numba compiles
  one kernel at a time in a process, so two workers cut a first run by about 40 % on 2 cores; they
  share Numba's on-disk cache, and take whole files (``loadfile``), so that a file's kernels are
  mostly compiled once. ``-n 0`` runs in this process, ``-n N`` on N workers.
- ``--max-default-seconds=S`` fails the run if a test of the default set (not ``slow``) takes
  longer than ``S`` seconds, setup and teardown included (wall time); CI passes 30.
- ``gpu`` tests need CuPy and a real CUDA device; they are skipped without one.
- ``cuda_kernel`` tests run Numba CUDA kernels; without a GPU they need the simulator:
  ``NUMBA_ENABLE_CUDASIM=1 pytest -m cuda_kernel`` (set before Numba is imported).
"""

import collections
import gc
import os
import zlib

import numpy as np
import pytest
from _pytest.mark.expression import Expression
from hypothesis import is_hypothesis_test, settings

QUICK_EXAMPLES, FULL_EXAMPLES = 10, 100
settings.register_profile("quick", max_examples=QUICK_EXAMPLES, deadline=None, print_blob=True)
settings.register_profile("full", max_examples=FULL_EXAMPLES, deadline=None, print_blob=True)

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


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true",
                     help="run the slow tests too, as CI does (plain pytest deselects them; -m slow runs only them)")
    parser.addoption("--max-default-seconds", type=float, metavar="S",
                     help="fail the run if a test not marked slow takes longer than S seconds (CI: 30)")


DEFAULT_WORKERS = 2


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads -n
def pytest_cmdline_main(config):
    option = config.option
    plain = not (config.args_source == pytest.Config.ArgsSource.ARGS or option.keyword or option.markexpr or option.all)
    worker = hasattr(config, "workerinput")  # a worker's command line is the plain one too
    if (plain and not worker and config.pluginmanager.hasplugin("xdist") and option.numprocesses is None
            and not option.usepdb and not option.collectonly and _cores() >= DEFAULT_WORKERS):
        option.numprocesses, option.dist = DEFAULT_WORKERS, "loadfile"


def _slow_selected(config) -> bool:
    """Whether this run takes slow tests: ``--all``, or an ``-m`` expression that a ``slow`` test matches."""
    markexpr = config.option.markexpr
    return config.option.all or bool(markexpr) and Expression.compile(markexpr).evaluate(lambda name, **_: name == "slow")


def pytest_configure(config):
    if not config.getoption("hypothesis_profile", None):
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("full" if _slow_selected(config) else "quick"))
    if config.option.max_default_seconds is not None:
        config.pluginmanager.register(DefaultSetTimer(config.option.max_default_seconds))


class DefaultSetTimer:
    """``--max-default-seconds``: each default-set test's setup, call and teardown, summed (wall time)."""

    def __init__(self, limit: float):
        self.limit = limit
        self.seconds = collections.Counter()

    def pytest_runtest_logreport(self, report):
        if "slow" not in report.keywords:
            self.seconds[report.nodeid] += report.duration

    def over(self):
        return sorted(((s, n) for n, s in self.seconds.items() if s > self.limit), reverse=True)

    def pytest_sessionfinish(self, session):
        if self.over() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.over():
            terminalreporter.section(f"over {self.limit:g} s in the default set (--max-default-seconds)", red=True)
            for seconds, nodeid in self.over():
                terminalreporter.write_line(f"{seconds:8.2f}s {nodeid}")


def pytest_report_header(config):
    if not (config.option.all or config.option.markexpr):
        return "slow tests deselected: pytest --all runs everything, pytest -m slow only them"
    return None


@pytest.hookimpl(tryfirst=True)  # before -m selects by markers
def pytest_collection_modifyitems(config, items):
    if _slow_selected(config):
        for item in items:
            if is_hypothesis_test(getattr(item, "obj", None)):
                item.add_marker(pytest.mark.slow)
    elif not config.option.markexpr:
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
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
