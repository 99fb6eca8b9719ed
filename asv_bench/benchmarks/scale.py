"""asv: the chains-at-scale workload (spchain.bench.dask): a Dask ``LocalCluster`` beside a
hand-written ``map_blocks`` and one in-memory call (at the quick sizes, ``SPCHAIN_BENCH_QUICK=1``,
Dask's threaded scheduler in the benchmark's process instead of a cluster).

``peakmem_run`` is the driving process's peak (the in-memory call holds the data there; the
Dask methods only their results); the workload prints the workers' peaks.
"""

from spchain.bench import dask

from . import common


class ChainsAtScale(common.WorkloadBenchmark):
    workload = "chains-at-scale"
    params = [dask.CASES, ["spchain", "hand-written map_blocks", "in-memory call"]]
    timeout = 3600

    def setup(self, case, method):
        try:
            import distributed  # noqa: F401
        except ImportError:
            raise NotImplementedError("needs dask[array] and distributed (the dask extra)") from None
        super().setup(case, method)
