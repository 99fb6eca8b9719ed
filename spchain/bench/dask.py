"""The chains-at-scale workload: many chains (v 40, c 16, per-step transitions, float32) on a
two-worker Dask ``LocalCluster`` (one thread and one process each), forward.

spchain's ``chain_logsumexp`` on a Dask array beside the hand-written version a user writes
today (``dask.array.map_blocks`` over the batch axis, the in-memory function in each task)
and one in-memory call on the same chains. The emissions of the Dask methods are made chunk by
chunk inside the tasks (seeded per chunk, so the in-memory copy is the same data), so their
times include making the chunks and a worker only ever holds the chunks in flight; the
in-memory call gets them made beforehand. Besides the table, the workload prints the workers'
peak resident memory (the Linux high-water mark, reset before each run) for each Dask method.

Full size: 2·10⁶ chains in chunks of 50,000 rows (x: 5.1 GB in float32; the in-memory call
holds it and its forward messages, another 5.1 GB: about 11 GiB at its peak, which fits a
24 GiB machine); quick: 8,000 chains in chunks of 2,000, on Dask's threaded scheduler (two
threads in the benchmark's process, no cluster to start; the case's name says so), so that the
table's peak memory is the Dask methods' own and no worker peak is printed. The float64
reference is the scaled forward recursion in NumPy (:mod:`spchain.bench.reference`).
"""

import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import numpy as np
from numpy.typing import NDArray

from .. import chain_logsumexp
from . import reference
from .core import Case

if TYPE_CHECKING:
    import dask.array
    import distributed

CASES = ["forward"]
SIZES = {False: {"chains": 2_000_000, "rows per chunk": 50_000}, True: {"chains": 8_000, "rows per chunk": 2_000}}
V, C = 40, 16
SLAB = 100_000
"""Rows of the float64 reference computed at a time."""
Runner: TypeAlias = Callable[[str, Callable[[], "dask.array.Array"]], Callable[[], object]]
"""``run(method, build)``: a timed callable computing the Dask array that ``build()`` makes."""


def emissions(block_id: int, rows: int) -> NDArray[np.float32]:
    """The emission logs of one chunk, (rows, v, c) float32, seeded by the chunk's number."""
    return np.random.default_rng((0, block_id)).standard_normal((rows, V, C), dtype=np.float32)


def _chunk(block_info: dict[Any, dict[str, Any]] | None = None) -> NDArray[np.float32]:
    assert block_info is not None  # map_blocks passes it
    info = block_info[None]
    return emissions(info["chunk-location"][0], info["chunk-shape"][0])


def transitions() -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """Per-step log transitions (1, v-1, c, c) and the log initial weights (c,), float32."""
    rng = np.random.default_rng(1)
    log_trans = np.log(rng.dirichlet(np.ones(C), size=(1, V - 1, C))).astype(np.float32)
    return log_trans, np.log(rng.dirichlet(np.ones(C))).astype(np.float32)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    import dask.array as da

    if device != "cpu":
        raise ValueError("chains-at-scale runs on the CPU (a Dask LocalCluster)")
    chains, rows = SIZES[quick].values()
    log_trans, log_init = transitions()
    x = da.map_blocks(_chunk, chunks=((rows,) * (chains // rows), (V,), (C,)), dtype=np.float32,
                      meta=np.empty((0, 0, 0), np.float32))
    memory_x = np.concatenate([emissions(k, rows) for k in range(chains // rows)])

    def hand_written() -> da.Array:
        out: da.Array = x.map_blocks(chain_logsumexp, log_trans, log_init, drop_axis=(1, 2), dtype=np.float32,
                                     meta=np.empty((0,), np.float32))
        return out

    def exact() -> NDArray[np.float64]:
        steps, i64 = np.exp(log_trans[0].astype(np.float64)), log_init.astype(np.float64)
        return np.concatenate([reference.chain_log_partition(memory_x[s:s + SLAB].astype(np.float64),
                                                             lambda a, t: a @ steps[t - 1], i64)
                               for s in range(0, chains, SLAB)])

    run, closing = _in_process() if quick else _on_cluster()
    methods = {
        # a Dask array in, a Dask array out (@scales_out; its annotation names the in-memory result)
        "spchain": run("spchain", lambda: cast(da.Array, chain_logsumexp(x, log_trans, log_init))),
        "hand-written map_blocks": run("hand-written map_blocks", hand_written),
        "in-memory call": lambda: chain_logsumexp(memory_x, log_trans, log_init),
    }
    case = Case("chains-at-scale", f"{name}, threaded scheduler" if quick else name, methods, exact)
    if closing:
        weakref.finalize(case, _close, *closing)
    return case


def _in_process() -> tuple[Runner, None]:
    """Quick sizes: Dask's threaded scheduler, two threads in this process (no cluster to start;
    the table's peak memory is then the Dask methods' own)."""
    def run(method: str, build: Callable[[], "dask.array.Array"]) -> Callable[[], object]:
        return lambda: build().compute(scheduler="threads", num_workers=2)
    return run, None


def _on_cluster() -> tuple[Runner, tuple["distributed.Client", "distributed.LocalCluster"]]:
    """Two single-threaded worker processes; each run prints the workers' peak memory when it grew."""
    import distributed

    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    client = distributed.Client(cluster)
    peaks: dict[str, int] = {}

    def run(method: str, build: Callable[[], "dask.array.Array"]) -> Callable[[], object]:
        def timed() -> object:
            client.run(_reset_peak)
            out = build().compute()
            worst = max(client.run(_peak_bytes).values())
            if worst > peaks.get(method, 0) + 2**20:  # report growth past 1 MiB only
                peaks[method] = worst
                print(f"chains-at-scale: {method}: workers' peak RSS {worst / 2**20:,.0f} MiB", file=sys.stderr)
            return out
        return timed
    return run, (client, cluster)


def _close(client: "distributed.Client", cluster: "distributed.LocalCluster") -> None:
    client.close()
    cluster.close()
