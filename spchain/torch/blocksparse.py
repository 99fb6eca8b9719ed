"""Block-sparse linear layers for torch tensors: ``block_sparse_linear``.

The weight is BSR: dense (R, C) blocks on a block grid, given as ``values`` (nnzb, R, C) and the
block structure ``indptr``, ``indices``. It runs the one operator of sparse weights,
``spchain::sparse_linear`` (:func:`spchain.torch.sparse_linear` with block values: dense-tile
Numba kernels on the CPU, CUDA kernels on the GPU); its backward computes the input gradient
by the product with the transposed blocks and the value gradient by SDDMM at block granularity, so the weight, its
gradient and any optimizer state stay O(nnz).

>>> import torch, spchain.torch as st
>>> values = torch.ones(1, 2, 2, requires_grad=True)
>>> y = st.block_sparse_linear(torch.ones(3, 4), values, torch.tensor([0, 1, 1]), torch.tensor([1]), (4, 4))
>>> y[0].tolist()
[2.0, 2.0, 0.0, 0.0]
"""

import torch

from .linear import linear

__all__ = ["block_sparse_linear"]

_CALLER = "spchain.torch.block_sparse_linear"


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
    if isinstance(values, torch.Tensor) and values.dim() != 3:
        raise ValueError(f"{_CALLER}: values must be 3-D (nnzb, R, C), got shape {tuple(values.shape)}")
    return linear(_CALLER, x, values, indptr, indices, shape, bias)
