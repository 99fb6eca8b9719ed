"""The block (BSR) and N:M parts of :class:`spchain.torch.SparseLinear`: block-size checks, the
random block structure, the dense view, block and N:M pruning of a dense weight, and the
drop-and-grow step of dynamic sparsity at block granularity."""

import warnings
from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import NDArray

from .. import _backend, _csr, _selection
from .. import blocksparse as _blocksparse
from .._typing import Shape
from ._bridge import on_device, to_array, to_tensor

def check_block(caller: str, block: object, shape: Sequence[int]) -> tuple[int, int]:
    """``block`` as ``(R, C)``; ``ValueError`` unless ``shape`` (out, in) is a whole number of blocks."""
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in block)):
        raise TypeError(f"{caller}: block must be a pair of ints (R, C), got {block!r}")
    r, c = int(block[0]), int(block[1])
    if r < 1 or c < 1 or shape[0] % r or shape[1] % c:
        raise ValueError(f"{caller}: block={(r, c)} needs out_features ({shape[0]}) a multiple of R and "
                         f"in_features ({shape[1]}) a multiple of C, both >= 1")
    return r, c


def random_structure(shape: Shape, block: Sequence[int], count: int,
                     seed: int) -> tuple[NDArray[np.integer], NDArray[np.integer]]:
    """``(indptr, indices)`` numpy arrays: ``count`` uniformly random blocks on the block grid."""
    grid = (shape[0] // block[0], shape[1] // block[1])
    positions = _selection.random_positions(_backend.NUMPY, grid[0] * grid[1], count, seed=seed)
    return _selection.positions_to_csr(_backend.NUMPY, positions, grid)


def dense_weight(values: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, shape: Shape) -> torch.Tensor:
    """The dense ``shape`` matrix of the BSR weight (differentiable in ``values``)."""
    r, c = values.shape[1:]
    gm, gn = shape[0] // r, shape[1] // c
    rows = torch.repeat_interleave(torch.arange(gm, device=indptr.device), indptr.diff().long())
    grid = values.new_zeros(gm * gn, r, c).index_add(0, rows * gn + indices.long(), values)
    return grid.view(gm, gn, r, c).transpose(1, 2).reshape(shape)


def bsr_tensor(indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, shape: Shape) -> torch.Tensor:
    """A torch sparse BSR tensor of validated parts, without torch's (once a process) beta warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse BSR tensor support is in beta")
        return torch.sparse_bsr_tensor(indptr, indices, values, size=shape, check_invariants=False)


def prune_dense(weight: torch.Tensor, sparsity: float | None, method: str, seed: int | None,
                block: tuple[int, int] | None, pattern: str | None,
                caller: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indptr, indices, values)`` tensors of ``weight`` pruned by :func:`spchain.prune`: to
    blocks (``block``, BSR values (nnzb, R, C)) or to an ``"n:m"`` ``pattern`` (CSR)."""
    low = weight.dtype == torch.bfloat16  # no NumPy dtype: select on an exact float32 copy
    with on_device(weight.device):
        array = to_array(weight.float() if low else weight)
        backend = _backend.backend_of(array, caller=caller)
        if pattern is None:
            data, indices, indptr = _blocksparse.block_parts(backend, array, sparsity, method, seed, block, caller)
        else:
            n, m = parse_pattern(caller, pattern)
            indptr, indices, data = _blocksparse.n_m_parts(backend, array, sparsity, n, m, caller)
        values = to_tensor(data).to(weight.dtype, copy=True)  # never a view of the caller's weight
        return to_tensor(indptr), to_tensor(indices), values


def parse_pattern(caller: str, pattern: object) -> tuple[int, int]:
    """``(n, m)`` of an ``"n:m"`` string."""
    parts = pattern.split(":") if isinstance(pattern, str) else ()
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{caller}: pattern must be a string 'n:m' such as '2:4', got {pattern!r}")
    return int(parts[0]), int(parts[1])


def norms(values: torch.Tensor) -> torch.Tensor:
    """The Frobenius norm of each block, in float64."""
    out: torch.Tensor = torch.linalg.vector_norm(values.double().flatten(1), dim=1)
    return out


def _gradient_norms(grad_y: torch.Tensor, x: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """Flat (row-major) block-grid norms of the dense gradient ``grad_y.T @ x``, in row blocks."""
    r, c = block
    m, n = grad_y.shape[1], x.shape[1]
    step = max(1, _selection._SCORE_BLOCK // max(r * n, 1))  # bounds the dense gradient held
    parts = [grad_y.new_zeros(0, dtype=torch.float64)]
    for b0 in range(0, m // r, step):
        b1 = min(m // r, b0 + step)
        g = grad_y[:, b0 * r:b1 * r].double().T @ x.double()
        parts.append(g.reshape(b1 - b0, r, n // c, c).square().sum((1, 3)).sqrt().reshape(-1))
    return torch.cat(parts)


def drop_and_grow(values: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, shape: Shape, n_move: int, *,
                  gradient: tuple[torch.Tensor, torch.Tensor] | None, seed: int,
                  caller: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`spchain._selection.drop_and_grow` at block granularity, on tensors.

    Drops the ``n_move`` blocks of smallest Frobenius norm (ties drop the later block) and grows
    as many blocks not stored after the drop: where the block norms of the dense gradient
    ``grad_y.T @ x`` (``gradient = (grad_y, x)``) are largest, or uniformly at random
    (``seed``) if ``gradient`` is None. Returns ``(indptr, indices, old_slots, new_slots)``.
    """
    block = tuple(values.shape[1:])
    grid = (shape[0] // block[0], shape[1] // block[1])
    with on_device(values.device):
        magnitudes = to_array(norms(values))
        scores = None if gradient is None else to_array(_gradient_norms(*gradient, block))
        backend = _backend.backend_of(magnitudes, caller=caller)
        xp = backend.xp
        structure = _csr.to_csr(backend, "csr", grid, None, to_array(indptr), to_array(indices), caller)
        positions = _csr.row_of_entries(backend, structure).astype(np.int64) * grid[1] + structure.indices
        if positions.shape[0] > 1 and bool((positions[1:] <= positions[:-1]).any()):
            raise ValueError(f"{caller} needs a canonical structure: blocks sorted within block rows, no duplicates")
        old_slots = _selection.largest(backend, magnitudes, structure.nnz - n_move)
        kept = positions[old_slots]
        if scores is None:
            grown = _selection.random_positions(backend, grid[0] * grid[1], n_move, taken=kept, seed=seed)
        else:
            scores[kept] = -np.inf  # n_move <= the free blocks, so no stored block is chosen
            grown = _selection.largest(backend, scores, n_move)
        new_positions = xp.sort(xp.concatenate([kept, grown]))
        new_indptr, new_indices = _selection.positions_to_csr(backend, new_positions, grid)
        new_slots = xp.searchsorted(new_positions, kept)
        return to_tensor(new_indptr), to_tensor(new_indices), to_tensor(old_slots), to_tensor(new_slots)
