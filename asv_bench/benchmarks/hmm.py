"""asv: the hmm-fit workload (spchain.bench.hmm): ``spchain.hmm``'s EM beside hmmlearn's ``fit``
(hmmlearn's full-size fit takes minutes: ``python -m spchain bench`` times it once)."""

from spchain.bench import hmm

from . import common


class HmmFit(common.WorkloadBenchmark):
    workload = "hmm-fit"
    params = [hmm.CASES, ["spchain", "hmmlearn"]]
