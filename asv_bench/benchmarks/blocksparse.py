"""The block-sparse workload (``spchain.bench.blocksparse``): ``block_sparse_linear`` with 16 x 16
and 32 x 32 blocks, and a 2:4 weight through ``SparseLinear``, beside the dense ``nn.Linear`` and
the unstructured ``SparseLinear``; ``time_run`` and ``peakmem_run`` come from the base class."""

from spchain.bench import blocksparse

from . import common


class BlockSparseLinear(common.WorkloadBenchmark):
    workload = "block-sparse"
    params = [blocksparse.CASES, blocksparse.METHODS]
