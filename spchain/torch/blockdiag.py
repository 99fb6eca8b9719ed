"""Block-diagonal and grouped matmul for torch tensors, with autograd, and their layers
:class:`BlockDiagonalLinear` and :class:`GroupedLinear`.

``spchain::block_diag_matmul`` and ``spchain::grouped_matmul`` are torch operators (see
:class:`~spchain.torch._operator.Operator`) over the array-level operations of ``spchain.blockdiag``,
run on zero-copy NumPy/CuPy views of the tensors: they work under ``torch.compile``,
``torch.export`` and ``torch.func``, and take float16/bfloat16 inputs (computed in float32).
The backward reuses ``x`` and ``w``: the input gradient is the same product with ``w``
transposed (a view, never a copy) and the weight gradient ``x_gᵀ @ grad_g`` per group.
"""

import math
import numbers
from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from .. import blockdiag
from ._bridge import check_dense
from ._operator import Operator, Unscriptable, multilinear_jvp, plain_eager

__all__ = ["block_diag_matmul", "grouped_matmul", "BlockDiagonalLinear", "GroupedLinear"]


def _block_diag_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    shape = blockdiag.block_diag_matmul_shape("spchain.torch.block_diag_matmul", x.shape, w.shape)
    return x.new_empty(shape, dtype=torch.promote_types(x.dtype, w.dtype))


def _grouped_fake(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[2]), dtype=torch.promote_types(x.dtype, w.dtype))


_BLOCK_DIAG = Operator(
    "block_diag_matmul", "(Tensor x, Tensor w) -> Tensor", blockdiag.BLOCK_DIAG, _block_diag_fake,
    differentiable=(0, 1), jvp=multilinear_jvp)
# No leading_batch: vmap over x alone must give a weight gradient per slice, which one call with
# the batch folded into x's rows would sum; so vmap makes one call a slice.

# group_sizes crosses as an int64 CPU tensor (checked by the forward, read by the backward).
_GROUPED = Operator(
    "grouped_matmul", "(Tensor x, Tensor w, Tensor group_sizes) -> Tensor", blockdiag.GROUPED, _grouped_fake,
    differentiable=(0, 1), jvp=multilinear_jvp)


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
    check_dense("spchain.torch.block_diag_matmul", x=x, w=w)
    out: torch.Tensor = _BLOCK_DIAG(x, w)
    return out


def grouped_matmul(x: torch.Tensor, w: torch.Tensor,
                   group_sizes: Sequence[int] | NDArray[np.integer] | torch.Tensor) -> torch.Tensor:
    """Multiply each contiguous group of rows of ``x`` by its own matrix ``w[g]``.

    The tensor version of :func:`spchain.grouped_matmul`, differentiable in ``x`` and ``w``:
    one BLAS product per group on views on the CPU, one batched cuBLAS GEMM on CUDA (ragged
    groups padded to at most 2 N + G rows), nothing of size G × N allocated, empty groups
    allowed.

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
    check_dense(caller, x=x, w=w)
    out: torch.Tensor = _GROUPED(x, w, group_sizes_tensor(caller, group_sizes, w, x))
    return out


def group_sizes_tensor(caller: str, group_sizes: Sequence[int] | NDArray[np.integer] | torch.Tensor, w: torch.Tensor,
                       x: torch.Tensor) -> torch.Tensor:
    """``group_sizes`` (a sequence, an array, or an integer tensor of any dtype on any device) as
    the int64 CPU tensor the operator takes: a copy, so the caller changing its sizes later
    cannot reach backward.

    Eager calls check the sizes here, on Python ints (so no size wraps around in the cast to
    int64) and with ``caller``'s name; a tensor met while compiling, tracing or under a
    ``torch.func`` transform, or a list or tuple met while compiling, is cast as it is and the
    operator's forward checks it (a data-dependent check cannot be traced).
    """
    if isinstance(group_sizes, (list, tuple)) and torch.compiler.is_compiling():  # Dynamo cannot trace NumPy's checks
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in group_sizes):
            raise TypeError(f"{caller}: group_sizes must hold integers, got {list(group_sizes)}")
        group_sizes = torch.tensor(list(group_sizes), dtype=torch.int64)
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


class _PerGroupLinear(Unscriptable, nn.Module):
    """A (G, d_in, d_out) weight and an optional bias, initialised like ``nn.Linear`` per group.

    Every entry is drawn from U(-1/√d_in, 1/√d_in), d_in being one group's fan-in: what
    ``nn.Linear(d_in, d_out)`` does for each group's weight and bias.
    """

    def __init__(self, groups: int, d_in: int, d_out: int, bias_shape: tuple[int, ...], bias: bool,
                 device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, d_in, d_out, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(bias_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        fan_in = self.weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)


def _check_sizes(name: str, **sizes: object) -> None:
    """``TypeError`` unless every size is an int; ``ValueError`` unless ``groups`` ≥ 1 and the others ≥ 0."""
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: {key} must be an int, got {value!r}")
        if value < (1 if key == "groups" else 0):
            raise ValueError(f"{name}: {key} must be {'positive' if key == 'groups' else 'non-negative'}, got {value}")


class BlockDiagonalLinear(_PerGroupLinear):
    """A linear layer whose weight is block-diagonal: G independent ``nn.Linear`` maps.

    The input's last axis (``in_features``) is cut into ``groups`` blocks of
    ``in_features // groups`` features; block g is mapped by ``weight[g]`` to
    ``out_features // groups`` outputs, and the blocks are concatenated (grouped
    convolution's 1×1 case). Runs :func:`block_diag_matmul`; memory stays O(input + output).

    Parameters
    ----------
    in_features, out_features : int
        Both divisible by ``groups`` (else ``ValueError``).
    groups : int
        Number of diagonal blocks.
    bias : bool
        Learn an additive bias of shape (out_features,).
    device, dtype : optional
        Where and how to create the parameters, as for ``nn.Linear``.

    Attributes
    ----------
    weight : Parameter, shape (groups, in_features // groups, out_features // groups)
    bias : Parameter, shape (out_features,), or None

    Examples
    --------
    >>> import torch, spchain.torch as sct
    >>> layer = sct.BlockDiagonalLinear(512, 256, groups=8)
    >>> layer
    BlockDiagonalLinear(in_features=512, out_features=256, groups=8, bias=True)
    >>> layer(torch.randn(32, 10, 512)).shape
    torch.Size([32, 10, 256])
    """

    def __init__(self, in_features: int, out_features: int, groups: int, bias: bool = True, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        _check_sizes("BlockDiagonalLinear", in_features=in_features, out_features=out_features, groups=groups)
        if in_features % groups or out_features % groups:
            raise ValueError(f"BlockDiagonalLinear: in_features ({in_features}) and out_features "
                             f"({out_features}) must be divisible by groups ({groups})")
        super().__init__(groups, in_features // groups, out_features // groups, (out_features,), bias, device, dtype)
        self.in_features, self.out_features, self.groups = in_features, out_features, groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"BlockDiagonalLinear: input must be (..., {self.in_features}), got {tuple(x.shape)}")
        y = block_diag_matmul(x.reshape(*x.shape[:-1], *self.weight.shape[:2]), self.weight).flatten(-2)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"groups={self.groups}, bias={self.bias is not None}")


class GroupedLinear(_PerGroupLinear):
    """G linear layers, one per contiguous group of rows (the experts of a mixture of experts).

    ``forward(x, group_sizes)`` maps the rows of group g by ``x_g @ weight[g] + bias[g]``,
    through :func:`grouped_matmul`: nothing of size G × N, no copy of the weight.

    Parameters
    ----------
    groups : int
        Number of groups (experts).
    in_features, out_features : int
        Sizes of each row's input and output.
    bias : bool
        Learn one bias per group, shape (groups, out_features).
    device, dtype : optional
        Where and how to create the parameters, as for ``nn.Linear``.

    Attributes
    ----------
    weight : Parameter, shape (groups, in_features, out_features)
    bias : Parameter, shape (groups, out_features), or None

    Examples
    --------
    >>> import torch, spchain.torch as sct
    >>> layer = sct.GroupedLinear(4, 16, 32)
    >>> layer
    GroupedLinear(groups=4, in_features=16, out_features=32, bias=True)
    >>> layer(torch.randn(10, 16), [3, 0, 5, 2]).shape
    torch.Size([10, 32])
    """

    def __init__(self, groups: int, in_features: int, out_features: int, bias: bool = True, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        _check_sizes("GroupedLinear", groups=groups, in_features=in_features, out_features=out_features)
        super().__init__(groups, in_features, out_features, (groups, out_features), bias, device, dtype)
        self.groups, self.in_features, self.out_features = groups, in_features, out_features

    def forward(self, x: torch.Tensor, group_sizes: Sequence[int] | NDArray[np.integer] | torch.Tensor) -> torch.Tensor:
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"GroupedLinear: input must be (N, {self.in_features}), got {tuple(x.shape)}")
        sizes = group_sizes_tensor("GroupedLinear", group_sizes, self.weight, x)
        y = grouped_matmul(x, self.weight, sizes)
        if self.bias is None:
            return y
        bias = torch.repeat_interleave(self.bias, sizes.to(self.bias.device), dim=0, output_size=y.shape[0])
        return y + bias

    def extra_repr(self) -> str:
        return (f"groups={self.groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")
