"""The sparse-linear workload (``spchain.bench.sparse``): ``SparseLinear`` beside the dense
``nn.Linear`` and the COO ``torch.sparse.mm`` layer, at 90 % and 99 % sparsity, forward and
forward + backward; ``time_run`` and ``peakmem_run`` come from the base class."""

from spchain.bench import sparse

from . import common


class SparseLinear(common.WorkloadBenchmark):
    workload = "sparse-linear"
    params = [sparse.CASES, sparse.METHODS]
