"""The torch modules of spchain's block-diagonal and grouped products: ``BlockDiagonalLinear``
and ``GroupedLinear``, built on the operators of ``spchain.torch.blockdiag`` (so they compile,
export and run under ``torch.func``, in float16/bfloat16 too).
"""

import math
import numbers

import torch
from torch import nn

from .blockdiag import block_diag_matmul, group_sizes_tensor, grouped_matmul

__all__ = ["BlockDiagonalLinear", "GroupedLinear"]


class _PerGroupLinear(nn.Module):
    """A (G, d_in, d_out) weight and an optional bias, initialised like ``nn.Linear`` per group.

    Every entry is drawn from U(-1/√d_in, 1/√d_in), d_in being one group's fan-in: what
    ``nn.Linear(d_in, d_out)`` does for each group's weight and bias.
    """

    def __init__(self, groups, d_in, d_out, bias_shape, bias, device, dtype):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(groups, d_in, d_out, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(bias_shape, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        fan_in = self.weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)


def _check_sizes(name: str, **sizes) -> None:
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
                 device=None, dtype=None):
        _check_sizes("BlockDiagonalLinear", in_features=in_features, out_features=out_features, groups=groups)
        if in_features % groups or out_features % groups:
            raise ValueError(f"BlockDiagonalLinear: in_features ({in_features}) and out_features "
                             f"({out_features}) must be divisible by groups ({groups})")
        super().__init__(groups, in_features // groups, out_features // groups, (out_features,), bias, device, dtype)
        self.in_features, self.out_features, self.groups = in_features, out_features, groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"BlockDiagonalLinear: input must be (..., {self.in_features}), got {tuple(x.shape)}")
        y = block_diag_matmul(x.unflatten(-1, self.weight.shape[:2]), self.weight).flatten(-2)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"groups={self.groups}, bias={self.bias is not None}")


class GroupedLinear(_PerGroupLinear):
    """G linear layers, one per contiguous group of rows (the experts of a mixture of experts).

    ``forward(x, group_sizes)`` maps the rows of group g by ``x_g @ weight[g] + bias[g]``,
    through :func:`grouped_matmul`: one BLAS/cuBLAS product per group, nothing of size G × N.

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
                 device=None, dtype=None):
        _check_sizes("GroupedLinear", groups=groups, in_features=in_features, out_features=out_features)
        super().__init__(groups, in_features, out_features, (groups, out_features), bias, device, dtype)
        self.groups, self.in_features, self.out_features = groups, in_features, out_features

    def forward(self, x: torch.Tensor, group_sizes) -> torch.Tensor:
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
