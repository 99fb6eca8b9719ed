"""Block-diagonal and grouped matmul for torch tensors, with autograd.

``spchain::block_diag_matmul`` and ``spchain::grouped_matmul`` are torch operators (see
:class:`~spchain.torch._operator.Operator`) over the array-level pairs of ``spchain.blockdiag``,
run on zero-copy NumPy/CuPy views of the tensors: they work under ``torch.compile``,
``torch.export`` and ``torch.func``, and take float16/bfloat16 inputs (computed in float32).
The backward reuses ``x`` and ``w``: the input gradient is the same product with ``w``
transposed (a view, never a copy) and the weight gradient ``x_gᵀ @ grad_g`` per group.
"""

from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import NDArray

from .. import blockdiag
from ._bridge import check_same_device
from ._operator import Operator, plain_eager

__all__ = ["block_diag_matmul", "grouped_matmul"]


def _block_diag_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    shape = blockdiag.block_diag_matmul_shape("spchain.torch.block_diag_matmul", x.shape, w.shape)
    return x.new_empty(shape, dtype=torch.promote_types(x.dtype, w.dtype))


def _grouped_fake(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[2]), dtype=torch.promote_types(x.dtype, w.dtype))


_BLOCK_DIAG = Operator(
    "block_diag_matmul", "(Tensor x, Tensor w) -> Tensor",
    blockdiag.block_diag_matmul_forward, _block_diag_fake,
    backward=blockdiag.block_diag_matmul_backward, differentiable=(0, 1))
# No leading_batch: vmap over x alone must give a weight gradient per slice, which one call with
# the batch folded into x's rows would sum; so vmap makes one call a slice.

# group_sizes crosses as an int64 CPU tensor (checked by the forward, read by the backward).
_GROUPED = Operator(
    "grouped_matmul", "(Tensor x, Tensor w, Tensor group_sizes) -> Tensor",
    blockdiag.grouped_matmul_forward, _grouped_fake,
    backward=blockdiag.grouped_matmul_backward, differentiable=(0, 1))


def block_diag_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Multiply each block of features by its own matrix: ``y[..., g, :] = x[..., g, :] @ w[g]``.

    The tensor version of :func:`spchain.block_diag_matmul`, differentiable in ``x`` and ``w``.
    Unlike ``torch.matmul(x.unsqueeze(-2), w)``, it never broadcasts ``w`` to one copy per
    row, in forward or backward; backward keeps only ``x`` and ``w``.

    Parameters
    ----------
    x : Tensor, shape (..., G, d_in)
        float32 or float64 (float16 and bfloat16 computed in float32), CPU or CUDA.
    w : Tensor, shape (G, d_in, d_out)
        On ``x``'s device.

    Returns
    -------
    Tensor, shape (..., G, d_out)
        In the promoted dtype of ``x`` and ``w``.

    Raises
    ------
    ValueError
        If the shapes do not match or the tensors are on different devices.
    TypeError
        For a non-tensor or an unsupported dtype (integers, complex).

    Examples
    --------
    >>> import torch, spchain.torch as sct
    >>> x = torch.ones(5, 4, 8, requires_grad=True)   # 5 rows, 4 blocks of 8 features
    >>> w = torch.ones(4, 8, 2, requires_grad=True)
    >>> y = sct.block_diag_matmul(x, w)
    >>> y.shape, y[0, 0].tolist()
    (torch.Size([5, 4, 2]), [8.0, 8.0])
    >>> y.sum().backward()
    >>> w.grad.shape
    torch.Size([4, 8, 2])
    """
    _dense_on_one_device("spchain.torch.block_diag_matmul", x=x, w=w)
    out: torch.Tensor = _BLOCK_DIAG(x, w)
    return out


def grouped_matmul(x: torch.Tensor, w: torch.Tensor,
                   group_sizes: Sequence[int] | NDArray[np.integer] | torch.Tensor) -> torch.Tensor:
    """Multiply each contiguous group of rows of ``x`` by its own matrix ``w[g]``.

    The tensor version of :func:`spchain.grouped_matmul`, differentiable in ``x`` and ``w``:
    one BLAS/cuBLAS product per group on views, nothing of size G × N allocated, empty
    groups allowed.

    Parameters
    ----------
    x : Tensor, shape (N, d_in)
        float32 or float64 (float16 and bfloat16 computed in float32), CPU or CUDA; rows
        sorted by group.
    w : Tensor, shape (G, d_in, d_out)
        On ``x``'s device.
    group_sizes : sequence of int or integer Tensor, shape (G,)
        Rows per group, non-negative, summing to N; a tensor may be on any device (a CUDA
        one is read back to the host once).

    Returns
    -------
    Tensor, shape (N, d_out)

    Raises
    ------
    ValueError
        If the shapes do not match, ``group_sizes`` is not G non-negative sizes summing to N,
        or the tensors are on different devices.
    TypeError
        For a non-tensor ``x`` or ``w``, non-integer ``group_sizes``, or an unsupported dtype.

    Examples
    --------
    >>> import torch, spchain.torch as sct
    >>> x = torch.ones(3, 2, requires_grad=True)
    >>> w = torch.stack([torch.eye(2), 3 * torch.eye(2)]).requires_grad_()
    >>> sct.grouped_matmul(x, w, [1, 2]).tolist()    # row 0 by w[0], rows 1-2 by w[1]
    [[1.0, 1.0], [3.0, 3.0], [3.0, 3.0]]
    """
    caller = "spchain.torch.grouped_matmul"
    _dense_on_one_device(caller, x=x, w=w)
    out: torch.Tensor = _GROUPED(x, w, group_sizes_tensor(caller, group_sizes, w, x))
    return out


def _dense_on_one_device(caller: str, **tensors: torch.Tensor) -> None:
    """``TypeError`` for a non-tensor or a sparse one (naming its layout), ``ValueError`` for
    tensors on different devices: the checks that ``torch.compile`` can trace."""
    check_same_device(caller, **tensors)
    for name, t in tensors.items():
        if t.layout != torch.strided:
            raise TypeError(f"{caller}: {name} is a {t.layout} tensor; it must be a dense (torch.strided) one")


def group_sizes_tensor(caller: str, group_sizes: Sequence[int] | NDArray[np.integer] | torch.Tensor, w: torch.Tensor,
                       x: torch.Tensor) -> torch.Tensor:
    """``group_sizes`` (a sequence, an array, or an integer tensor of any dtype on any device) as
    the int64 CPU tensor the operator takes: a copy, so the caller changing its sizes later
    cannot reach backward.

    Eager calls check the sizes here, on Python ints (so no size wraps around in the cast to
    int64) and with ``caller``'s name; a tensor met while compiling, tracing or under a
    ``torch.func`` transform is cast as it is and the operator's forward checks it (a
    data-dependent check cannot be traced).
    """
    if isinstance(group_sizes, torch.Tensor):
        if group_sizes.is_sparse or group_sizes.layout != torch.strided:
            raise TypeError(f"{caller}: group_sizes must be a dense tensor, not a {group_sizes.layout} one")
        if group_sizes.is_floating_point() or group_sizes.is_complex() or group_sizes.dtype == torch.bool:
            raise TypeError(f"{caller}: group_sizes must hold integers, not {str(group_sizes.dtype).removeprefix('torch.')}")
        if not plain_eager([group_sizes]):
            return group_sizes.to(device="cpu", dtype=torch.int64)
        group_sizes = group_sizes.detach().cpu().numpy()
    groups = w.shape[0] if w.ndim == 3 else -1
    rows = x.shape[0] if x.ndim == 2 else -1
    if groups < 0 or rows < 0:
        sizes = np.asarray(group_sizes)
        return torch.from_numpy(sizes.astype(np.int64)) if sizes.dtype.kind in "iu" else torch.zeros(0, dtype=torch.int64)
    return torch.from_numpy(blockdiag._check_group_sizes(caller, group_sizes, groups, rows))
