"""Launch sizes of every CUDA kernel, in one place that tests patch to force multi-block runs.

Kernels use grid-stride loops, so their results never depend on these values. Launchers read
them at launch time; a kernel reads ``STATE_CHUNK`` when it is compiled (on a real GPU) or on
every call (under the simulator).
"""

THREADS_PER_BLOCK = 256
"""Threads per block of one-dimensional launches."""

MAX_BLOCKS = 4096
"""Upper bound on the blocks of one launch; grid-stride loops cover the rest."""

STATE_CHUNK = 256
"""States per shared-memory chunk in the log-space chain and semiring kernels."""


def blocks_for(n_items: int, per_block: int = 0) -> int:
    """Blocks for ``n_items`` work items at ``per_block`` items a block (default: a thread each)."""
    per_block = per_block or THREADS_PER_BLOCK
    return max(1, min(MAX_BLOCKS, -(-n_items // per_block)))
