"""asv: the chain workload (spchain.bench.chain) beside the PyTorch baselines."""

from spchain.bench import chain, viterbi

from . import common


class Chain(common.WorkloadBenchmark):
    workload = "chain"
    params = [chain.CASES, ["spchain", "torch sequential logsumexp", "torch pairwise broadcast tree"]]


class Viterbi(common.WorkloadBenchmark):
    workload = "viterbi"
    params = [viterbi.CASES, ["spchain", "torch broadcasting max"]]
