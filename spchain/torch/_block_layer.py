"""The structure parts of :class:`spchain.torch.SparseLinear`: block-size checks, the random
(block) structure, the dense view of blocks, block and N:M pruning of a dense weight, and the
drop-and-grow step of dynamic sparsity, for CSR and block layers alike."""

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from .. import _backend, _csr, _selection
from .. import blocksparse as _blocksparse
from .._typing import Shape
from ._bridge import bridge, to_array, to_tensor
from .sparse import as_array

def check_block(caller: str, block: object, shape: Sequence[int]) -> tuple[int, int]:
    """``block`` as ``(R, C)``; ``ValueError`` unless ``shape`` (out, in) is a whole number of blocks."""
    r, c = _csr.check_block(caller, block)
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
    with bridge(weight.device):
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


def drop_and_grow(values: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, shape: Shape, n_move: int, *,
                  gradient: tuple[torch.Tensor, torch.Tensor] | None, seed: int,
                  caller: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`spchain._selection.drop_and_grow` on tensors, for CSR values (nnz,) and BSR
    blocks (nnzb, R, C) alike: ``gradient = (grad_y, x)`` of the last batch, or None for a
    random regrowth (``seed``). Returns ``(indptr, indices, old_slots, new_slots)``."""
    r, c = (1, 1) if values.dim() == 1 else values.shape[1:]
    with bridge(values.device):
        weights = to_array(selectable(values))
        backend = _backend.backend_of(weights, caller=caller)
        grid = _csr.to_csr(backend, "csr", (shape[0] // r, shape[1] // c), None, to_array(indptr), to_array(indices),
                           caller)
        grad_y, x = (None, None) if gradient is None else (as_array(selectable(t)) for t in gradient)
        new_indptr, new_indices, old_slots, new_slots = _selection.drop_and_grow(
            backend, grid, weights, n_move, grad_y=grad_y, x=x, seed=seed, caller=caller)
        return to_tensor(new_indptr), to_tensor(new_indices), to_tensor(old_slots), to_tensor(new_slots)


def selectable(t: torch.Tensor) -> torch.Tensor:
    """``t`` for choosing entries by magnitude on the array level: bfloat16 (which NumPy and
    CuPy lack) widened to float32, exactly."""
    return t.float() if t.dtype == torch.bfloat16 else t


def following(state: Mapping[str, Any], weights: torch.Tensor) -> list[str]:
    """The keys of the optimizer ``state`` that follow each stored weight (or block): its
    tensors of one entry per stored weight along the first axis, shaped like ``weights`` (Adam's
    moments) or factored over a block's axes (Adafactor's ``row_var`` (nnzb, R, 1) and
    ``col_var`` (nnzb, 1, C)); not scalar state such as ``step``."""
    def per_weight(v: Any) -> bool:
        return (torch.is_tensor(v) and v.dim() == weights.dim() and v.dim() > 0 and v.shape[0] == weights.shape[0]
                and all(n in (1, m) for n, m in zip(v.shape[1:], weights.shape[1:])))
    return [k for k, v in state.items() if per_weight(v)]


def carry(weights: torch.Tensor, optimizer: torch.optim.Optimizer | None,
          move: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make the stored ``weights`` (a parameter, kept the same object, which optimizers hold),
    its gradient and ``optimizer``'s state that :func:`following` names follow a change of
    structure: each becomes ``move(t)``, in place where the number of stored weights stays."""
    state = {} if optimizer is None else optimizer.state.get(weights, {})
    keys = following(state, weights)
    grad = weights.grad
    data = move(weights.data)
    if data.shape == weights.shape:
        weights.data.copy_(data)
        for t in ([] if grad is None else [grad]) + [state[k] for k in keys]:
            t.copy_(move(t))
        return
    _resize(weights, data)
    if grad is not None:
        weights.grad = move(grad)
    for k in keys:
        state[k] = move(state[k])


def _resize(parameter: torch.Tensor, data: torch.Tensor) -> None:
    """Give ``parameter`` (the same object, which optimizers hold) ``data`` of another shape.

    Autograd keeps one gradient accumulator per leaf for as long as a graph holds it, with the
    shape the leaf had when it was made; assigning ``.data`` renews it only on a change of dtype or
    device. Passing through another dtype renews it, so that the next backward accumulates into
    the new shape even while a graph of an earlier step (the previous ``loss``) is alive; the
    version bump makes a backward through such an old graph raise autograd's error.
    """
    parameter.data = data.new_empty(0, dtype=torch.float64 if data.dtype != torch.float64 else torch.float32)
    parameter.data = data
    torch.autograd.graph.increment_version(parameter)
