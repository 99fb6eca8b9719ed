"""Block-sparse linear layers for torch tensors: ``block_sparse_linear``.

The weight is BSR: dense (R, C) blocks on a block grid, given as ``values`` (nnzb, R, C) and the
block structure ``indptr``, ``indices``. The operator ``spchain::block_sparse_linear`` runs the
array-level dispatchers of ``spchain.blocksparse`` (dense-tile Numba kernels on the CPU, CUDA
kernels on the GPU); its backward computes the input gradient by the product with the
transposed blocks and the value gradient by SDDMM at block granularity, so the weight, its
gradient and any optimizer state stay O(nnz).

>>> import torch, spchain.torch as st
>>> values = torch.ones(1, 2, 2, requires_grad=True)
>>> y = st.block_sparse_linear(torch.ones(3, 4), values, torch.tensor([0, 1, 1]), torch.tensor([1]), (4, 4))
>>> y[0].tolist()
[2.0, 2.0, 0.0, 0.0]
"""

import math
from collections.abc import Sequence
from typing import Any

import torch

from .. import _backend, _checks, _csr
from .. import blocksparse as _blocksparse
from .._typing import Array, Shape
from ._bridge import check_same_device
from ._operator import Operator

__all__ = ["block_sparse_linear"]

_CALLER = "spchain.torch.block_sparse_linear"


def _structure(backend: _backend.Backend, values: Array, indptr: Array, indices: Array,
               shape: Shape) -> _blocksparse.Bsr:
    return _blocksparse.to_bsr(backend, shape, values, indptr, indices, _CALLER)


def _forward(x: Array, values: Array, indptr: Array, indices: Array, shape: Sequence[int],
             bias: Array | None) -> tuple[Array, Array]:
    backend = _backend.backend_of(x, values, indptr, indices, bias, caller=_CALLER)
    dtype = _checks.float_dtype(_CALLER, x=x, values=values, bias=bias)
    bsr = _structure(backend, values, indptr, indices, tuple(shape))
    yt_xt: tuple[Array, Array] = _blocksparse.linear(backend, bsr, values, x, bias, dtype)
    return yt_xt


def _fake(x: torch.Tensor, values: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, shape: Sequence[int],
          bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(x.dtype, values.dtype) if bias is None else \
        torch.promote_types(torch.promote_types(x.dtype, values.dtype), bias.dtype)
    return x.new_empty((shape[0], x.shape[0]), dtype=dtype), x.new_empty((x.shape[1], x.shape[0]), dtype=dtype)


def _backward(args: Sequence[Any], results: Sequence[Array], grads: Sequence[Array],
              needs: Sequence[bool]) -> tuple[Array | None, Array | None, Array | None]:
    x, values, indptr, indices, shape, bias = args
    _, xt = results
    grad_yt = grads[0]
    need_x, need_values, need_bias = needs
    backend = _backend.backend_of(grad_yt, values, indptr, indices, caller=_CALLER)
    bsr = _structure(backend, values, indptr, indices, tuple(shape))
    transpose = _blocksparse.transposed(backend, bsr) if need_x else None
    grad_x, grad_values = _blocksparse.linear_backward(backend, bsr, transpose, values, grad_yt, xt, xt.dtype,
                                                       need_x, need_values)
    grad_bias = grad_yt.sum(axis=1) if need_bias else None
    return grad_x, grad_values, grad_bias


# The operator returns y.T (out, batch), the layout the kernel writes, so that neither the
# output nor its incoming gradient is copied on the way; the public function transposes.
_OPERATOR = Operator(
    "block_sparse_linear",
    "(Tensor x, Tensor values, Tensor indptr, Tensor indices, int[] shape, Tensor? bias) -> (Tensor, Tensor)",
    _forward, _fake, outputs=1, backward=_backward, differentiable=(0, 1, 5))


def block_sparse_linear(x: torch.Tensor, values: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                        shape: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a block-sparse (BSR) weight ``W``; differentiable.

    Parameters
    ----------
    x : torch.Tensor, shape (..., in_features)
        Any leading dimensions and layout.
    values : torch.Tensor, shape (nnzb, R, C)
        The stored blocks; gradient by block SDDMM at the stored blocks only (O(nnz)).
    indptr : torch.Tensor, shape (out_features / R + 1,), int32 or int64
    indices : torch.Tensor, shape (nnzb,), int32 or int64
        The block column of each stored block. Duplicates add up; blocks of zeros are trainable.
    shape : (out_features, in_features)
        A whole number of (R, C) blocks.
    bias : torch.Tensor, shape (out_features,), optional

    Returns
    -------
    torch.Tensor, shape (..., out_features)
        float32 if every float input is float32, else float64. For a 2-D ``x`` it is a
        transposed view of the kernel's feature-major output (``.contiguous()`` for rows).

    Raises
    ------
    TypeError
        Non-float values or inputs, non-integer indices.
    ValueError
        A malformed block structure (see :func:`spchain.blocksparse.to_bsr`), shapes that do not
        match, tensors on different devices.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> values = torch.arange(8.0).reshape(2, 2, 2).requires_grad_()
    >>> indptr, indices = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    >>> y = st.block_sparse_linear(torch.ones(5, 4), values, indptr, indices, (4, 4))
    >>> y[0].tolist()
    [1.0, 5.0, 9.0, 13.0]
    >>> y.sum().backward()
    >>> values.grad[0]
    tensor([[5., 5.],
            [5., 5.]])
    """
    check_same_device(_CALLER, x=x, values=values, indptr=indptr, indices=indices, bias=bias)
    shape = _csr.check_shape(_CALLER, shape)
    if x.dim() == 0 or x.shape[-1] != shape[1]:
        raise ValueError(f"{_CALLER}: x has shape {tuple(x.shape)} but the weight has shape {shape} "
                         f"(x's last axis must be {shape[1]})")
    if values.dim() != 3:
        raise ValueError(f"{_CALLER}: values must be 3-D (nnzb, R, C), got shape {tuple(values.shape)}")
    if bias is not None and tuple(bias.shape) != (shape[0],):
        raise ValueError(f"{_CALLER}: bias has shape {tuple(bias.shape)}; expected ({shape[0]},)")
    rows = x.reshape(math.prod(x.shape[:-1]), shape[1]) if x.dim() != 2 else x
    y = _OPERATOR(rows, values, indptr, indices, list(shape), bias).t()  # the operator gives y.T (no copy)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], shape[0])
