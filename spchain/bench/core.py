"""Measuring one benchmark case: spchain beside its baselines, in one process.

A :class:`Case` holds its inputs already built (so memory is counted above them) and a
callable per method. :func:`measure` warms every method up (compiling kernels), then times
the methods in alternating rounds, measures each one's peak memory in a run of its own, and
compares each result with a float64 reference.
"""

import ctypes
import gc
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from numpy.typing import NDArray

MiB = 2.0**20


@dataclass
class Case:
    """One workload at one size: ``methods`` maps a name to a callable that runs it once.

    The first method is spchain's, the others are baselines. Each callable returns its
    result (an array, a tensor, or a tuple of them), which is compared with ``reference()``,
    a float64 result computed once; a method whose result is ``None`` gets no error figure.
    ``device`` is ``"cpu"`` or ``"cuda"``: on CUDA every callable synchronises before it returns.
    """

    workload: str
    name: str
    methods: dict[str, Callable[[], object]]
    reference: Callable[[], object] | None = None
    device: str = "cpu"
    slow: set[str] = field(default_factory=set)
    """Methods so slow that one timed run, without a warm-up, is enough (they compile nothing):
    the chain workload's pairwise broadcast tree, say."""
    scale: dict[str, float] = field(default_factory=dict)
    """Baselines run at a smaller size than spchain: the factor that scales their time to
    spchain's size (ratios use the scaled time)."""
    spchain_methods: set[str] = field(default_factory=set)
    """Methods besides those named ``spchain...`` that run spchain's kernels (spchain's other
    functions as the baselines of one, say): the first run's compiling step runs them too."""
    calls: int = 1
    """Calls that make one timed run, whose time is their mean: a call of microseconds timed
    alone measures the caches that the other method left cold, and the timer."""


@dataclass
class Result:
    """What :func:`measure` found for one method of one case."""

    workload: str
    case: str
    method: str
    times: list[float]
    peak_bytes: float
    max_rel_error: float
    scale: float = 1.0
    """The factor that scales the time to spchain's size (see :attr:`Case.scale`)."""

    @property
    def median(self) -> float:
        return float(np.median(self.times))


def to_numpy(value: object) -> NDArray[np.float64]:
    """``value`` (an array, tensor or scalar) as a float64 NumPy array."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().double().numpy()
    elif hasattr(value, "get"):
        value = value.get()
    return np.asarray(value, dtype=np.float64)


def max_rel_error(result: object, reference: object) -> float:
    """Largest ``|result - reference|`` over the largest ``|reference|``, over every part.

    Entries that are equal (equal infinities included) count as exact; an infinity or NaN
    where the reference has none makes the error infinite.
    """
    if not isinstance(reference, tuple):
        result, reference = (result,), (reference,)
    worst = 0.0
    # A method's result has its reference's structure: a tuple where the reference is one.
    for part, ref_part in zip(cast(Iterable[object], result), reference):
        r, ref = to_numpy(part), to_numpy(ref_part)
        if r.shape != ref.shape:
            return math.inf
        same = (r == ref) | (np.isnan(r) & np.isnan(ref))
        if not np.all(same | (np.isfinite(r) & np.isfinite(ref))):
            return math.inf
        finite_ref = ref[np.isfinite(ref)]
        scale = float(np.max(np.abs(finite_ref))) if finite_ref.size else 0.0
        with np.errstate(invalid="ignore"):
            diff = np.where(same, 0.0, np.abs(r - ref))
        if diff.size and diff.max() > 0:
            worst = max(worst, float(diff.max()) / (scale if scale > 0 else 1.0))
    return worst


def _rss_and_hwm() -> tuple[int, int]:
    rss = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm


def _release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``), so that a
    run reusing memory an earlier run freed is seen to use it; a no-op elsewhere."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_host_bytes(fn: Callable[[], object]) -> float:
    """Resident memory that ``fn()`` added at its peak (Linux high-water mark, reset first).

    torch's CPU allocations are invisible to ``tracemalloc``, so resident memory is the
    honest measure. Freed heap memory that the C allocator keeps resident is handed back
    first (``malloc_trim``): otherwise a method that reuses what an earlier run freed would
    seem to allocate nothing. Returns NaN where the high-water mark cannot be reset.
    """
    gc.collect()
    _release_free_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return math.nan
    before, _ = _rss_and_hwm()
    result = fn()
    _, peak = _rss_and_hwm()
    del result
    return float(max(peak - before, 0))


def peak_device_bytes(fn: Callable[[], object]) -> float:
    """Device memory that ``fn()`` added at its peak: torch's allocator plus CuPy's pool."""
    import torch

    from .. import _backend

    cp = _backend.cupy()
    pool = cp.get_default_memory_pool()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch_before = torch.cuda.memory_allocated()
    hook = _CupyPeakHook(pool.used_bytes())
    with hook:
        result = fn()
        torch.cuda.synchronize()
    del result
    return float(torch.cuda.max_memory_allocated() - torch_before + hook.peak - hook.start)


class _CupyPeakHook:
    """A CuPy memory hook that records the pool's high-water mark."""

    def __init__(self, start: int) -> None:
        from cupy.cuda import memory_hook

        class Hook(memory_hook.MemoryHook):  # type: ignore[misc]  # CuPy ships no type information
            name = "spchain_peak"

            def __init__(hook) -> None:
                hook.used = hook.peak = start

            def malloc_postprocess(hook, device_id: int, size: int, mem_size: int, mem_ptr: int, pmem_id: int) -> None:
                hook.used += mem_size
                hook.peak = max(hook.peak, hook.used)

            def free_postprocess(hook, device_id: int, mem_size: int, mem_ptr: int, pmem_id: int) -> None:
                hook.used -= mem_size

        self.start = start
        self._hook = Hook()

    @property
    def peak(self) -> int:
        return self._hook.peak

    def __enter__(self) -> "_CupyPeakHook":
        self._hook.__enter__()
        return self

    def __exit__(self, *exc: object) -> bool | None:
        suppress: bool | None = self._hook.__exit__(*exc)
        return suppress


def timed(fn: Callable[[], object], device: str, calls: int = 1) -> tuple[object, float]:
    """``(fn(), seconds)``, the seconds a call's mean over ``calls`` calls: wall-clock time on
    the CPU; on CUDA the time between two CUDA events recorded on torch's current stream
    around the calls (each synchronises before it returns)."""
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        return out, (time.perf_counter() - start) / calls
    import torch

    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))  # type: ignore[no-untyped-call]
    begin.record()
    for _ in range(calls):
        out = fn()
    end.record()
    end.synchronize()
    return out, begin.elapsed_time(end) / 1e3 / calls


def measure(case: Case, repeat: int, budget_s: float, tick: Callable[[], None] = lambda: None) -> list[Result]:
    """Warm up, then time ``case``'s methods in ``repeat`` alternating rounds.

    A baseline stops being repeated once its runs have taken ``budget_s`` seconds (at least
    one timed run each); the first method (spchain's, every ratio's base) runs every round.
    A method in ``case.slow`` is run once: that run is its timing and
    its memory measurement (it compiles nothing, so it needs no warm-up). ``tick`` is called
    after every run, for a progress bar.
    """
    peak = peak_device_bytes if case.device == "cuda" else peak_host_bytes
    reference = case.reference() if case.reference is not None else None
    times: dict[str, list[float]] = {name: [] for name in case.methods}
    first = next(iter(case.methods))
    peaks: dict[str, float] = {}
    errors: dict[str, float] = {}

    def run(name: str) -> object:
        out, seconds = timed(case.methods[name], case.device, case.calls)
        times[name].append(seconds)
        if name not in errors:
            errors[name] = math.nan if reference is None or out is None else max_rel_error(out, reference)
        return out

    for name, fn in case.methods.items():
        if name in case.slow:
            peaks[name] = peak(lambda: run(name))
        else:
            for _ in range(case.calls):
                fn()  # warm-up: compiles kernels, fills caches
        tick()
    for _ in range(repeat):
        for name in case.methods:
            if name not in case.slow and (name == first or sum(times[name]) <= budget_s):
                run(name)
            tick()
    for name, fn in case.methods.items():
        if name not in peaks:
            peaks[name] = peak(fn)
        tick()
    return [Result(case.workload, case.name, name, times[name], peaks[name], errors[name], case.scale.get(name, 1.0))
            for name in case.methods]
