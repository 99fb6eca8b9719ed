"""asv benchmarks of the block-diag and grouped workloads (``spchain/bench/blockdiag.py``, ``grouped.py``).

Each method (spchain's and the baselines it must beat) is timed (``time_run``) and its whole
process's resident peak measured (``peakmem_run``) on forward + backward.
"""

from spchain.bench import blockdiag, grouped

from . import common


class BlockDiag(common.WorkloadBenchmark):
    workload = "block-diag"
    params = [blockdiag.CASES, list(blockdiag.METHODS)]


class Grouped(common.WorkloadBenchmark):
    workload = "grouped"
    params = [grouped.CASES, list(grouped.METHODS)]
