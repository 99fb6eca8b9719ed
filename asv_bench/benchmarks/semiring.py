"""asv: the logmatmul workload (spchain.bench.logmatmul) beside broadcasting PyTorch."""

from spchain.bench import logmatmul

from . import common


class LogMatmul(common.WorkloadBenchmark):
    workload = "logmatmul"
    params = [logmatmul.CASES, ["spchain", "torch broadcasting logsumexp"]]
