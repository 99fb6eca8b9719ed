"""spchain for torch tensors (CPU and CUDA), with autograd.

The functions have the names and signatures of the array API; tensors cross to NumPy/CuPy and
back through a zero-copy DLPack bridge, on torch's current CUDA stream. Import this subpackage
explicitly (``import spchain.torch``); ``import spchain`` never imports torch.
"""

from .blockdiag import BlockDiagonalLinear, GroupedLinear, block_diag_matmul, grouped_matmul
from .blocksparse import block_sparse_linear
from .chain import chain_logsumexp, chain_marginals, viterbi
from .crf import LinearChainCRF
from .linear import sparse_linear
from .nn import SparseLinear
from .paths import chain_entropy, chain_kbest, chain_path_score, chain_sample
from .pruning import CosineDropFraction, GradualPruning, erk_densities, sparsify
from .semiring import log_chain_product, logmatmul, maxmatmul
from .sparse import prune, sddmm, spmm

__all__ = [
    "BlockDiagonalLinear",
    "CosineDropFraction",
    "GradualPruning",
    "GroupedLinear",
    "LinearChainCRF",
    "SparseLinear",
    "block_diag_matmul",
    "block_sparse_linear",
    "chain_entropy",
    "chain_kbest",
    "chain_logsumexp",
    "chain_marginals",
    "chain_path_score",
    "chain_sample",
    "erk_densities",
    "grouped_matmul",
    "log_chain_product",
    "logmatmul",
    "maxmatmul",
    "prune",
    "sddmm",
    "sparse_linear",
    "sparsify",
    "spmm",
    "viterbi",
]
