"""Sparse products for torch tensors: ``spmm``, ``sddmm`` and ``prune``.

Their sparse operands are torch sparse tensors (COO, CSR, CSC). ``spmm`` and ``sddmm`` take
them apart into their component tensors and run the operators ``spchain::spmm`` and
``spchain::sddmm`` on those (operators take dense tensors only), which run the array-level
dispatchers of ``spchain.sparse`` on zero-copy NumPy/CuPy views. ``torch.compile`` cannot
trace torch sparse tensors (Dynamo refuses them), so ``spmm`` and ``sddmm`` break the graph and
run eagerly (``fullgraph=True`` refuses them); a compiled model's sparse layer is
:class:`spchain.torch.SparseLinear` (or :func:`spchain.torch.sparse_linear`), which takes its
structure as dense index tensors.

>>> import torch, spchain.torch as st
>>> a = torch.tensor([[0.0, 2.0], [1.0, 0.0]]).to_sparse_csr()
>>> st.spmm(a, torch.ones(2, 3))[:, 0]
tensor([2., 1.])
"""

import warnings
from collections.abc import Sequence
from typing import Literal

import torch

from .. import _backend, _csr
from .. import sparse as _sparse
from .._typing import Array, Seed, Shape
from ._bridge import bridge, check_dense, check_same_device, to_array, to_tensor
from ._operator import Operator, linear_jvp, run_eagerly

__all__ = ["spmm", "sddmm", "prune"]

_LOW = (torch.float16, torch.bfloat16)
_FORMATS = {torch.sparse_coo: "coo", torch.sparse_csr: "csr", torch.sparse_csc: "csc"}
_SMALL_INDEX = (torch.int8, torch.uint8, torch.int16, torch.int32)


def as_array(t: torch.Tensor) -> Array:
    """A NumPy/CuPy array of ``t``; a column-major (transposed) 2-D tensor crosses without a copy."""
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
        return to_array(t.t()).T
    return to_array(t)


def index_dtype(first: torch.Tensor, second: torch.Tensor, shape: Sequence[int]) -> torch.dtype:
    """The index dtype :func:`spchain._csr.to_csr` gives a structure of the index tensors
    ``first, second``: int32 where both are and every size fits, else int64."""
    small = _csr.fits_int32(*shape, first.shape[0], second.shape[0])
    return torch.int32 if small and first.dtype in _SMALL_INDEX and second.dtype in _SMALL_INDEX else torch.int64


def _sparse_tensor(t: object, caller: str) -> tuple[str, Shape, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(format, shape, data, first, second)`` tensors of a 2-D COO, CSR or CSC tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{caller} takes a torch sparse tensor (COO, CSR or CSC), not {type(t).__name__}")
    fmt = _FORMATS.get(t.layout)
    if fmt is None:
        raise TypeError(f"{caller} takes a sparse COO, CSR or CSC tensor, not one of layout {t.layout}")
    if t.dim() != 2:
        raise ValueError(f"{caller} takes 2-D sparse tensors (no batch or dense dimensions), got shape {tuple(t.shape)}")
    with torch._C._DisableFuncTorch():  # torch.func cannot wrap the parts of a CSR or CSC tensor; they need no wrapping
        if fmt == "coo":
            index = t._indices()  # uncoalesced entries are fine: duplicates add up
            return fmt, tuple(t.shape), t._values(), index[0], index[1]
        if fmt == "csr":
            return fmt, tuple(t.shape), t.values(), t.crow_indices(), t.col_indices()
        return fmt, tuple(t.shape), t.values(), t.ccol_indices(), t.row_indices()


def _no_low_precision(caller: str, **tensors: torch.Tensor) -> None:
    """``TypeError`` for a float16/bfloat16 tensor: these products take float32 and float64."""
    for name, t in tensors.items():
        if t.dtype in _LOW:
            raise TypeError(f"{caller}: {name} has dtype {str(t.dtype).removeprefix('torch.')}; "
                            "spchain supports float32 and float64")


def csr_tensor(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: Shape) -> torch.Tensor:
    """A torch sparse CSR tensor of validated parts, without torch's (once a process) beta warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, values, size=shape, check_invariants=False)


def _spmm_fake(b: torch.Tensor, data: torch.Tensor, first: torch.Tensor, second: torch.Tensor, fmt: str,
               shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    index = index_dtype(first, second, shape)
    dtype = torch.promote_types(b.dtype, data.dtype)
    return (b.new_empty((shape[0], *b.shape[1:]), dtype=dtype), first.new_empty(shape[0] + 1, dtype=index),
            first.new_empty(second.shape[0], dtype=index), torch.empty_like(data))


def _sddmm_fake(first: torch.Tensor, second: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fmt: str,
                shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    index = index_dtype(first, second, shape)
    return (first.new_empty(shape[0] + 1, dtype=index), first.new_empty(second.shape[0], dtype=index),
            a.new_empty(second.shape[0], dtype=torch.promote_types(a.dtype, b.dtype)))


# spmm returns the CSR form of a that its backward multiplies by (transposed); sddmm has no
# gradient (it is the value gradient of a sparse layer).
_SPMM = Operator("spmm", "(Tensor b, Tensor data, Tensor first, Tensor second, str fmt, int[] shape)"
                 " -> (Tensor, Tensor, Tensor, Tensor)",
                 _sparse.SPMM, _spmm_fake, outputs=1, differentiable=(0,), jvp=linear_jvp)
_SDDMM = Operator("sddmm", "(Tensor first, Tensor second, Tensor a, Tensor b, str fmt, int[] shape)"
                  " -> (Tensor, Tensor, Tensor)", _sparse.SDDMM, _sddmm_fake, outputs=3)


@run_eagerly
def spmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sparse times dense for tensors: ``a @ b``, differentiable with respect to ``b``.

    Parameters
    ----------
    a : torch sparse tensor, COO (coalesced or not), CSR or CSC, shape (m, k)
        Duplicates add up, as in :func:`spchain.spmm`. It must not require grad (for a
        trainable sparse weight use :func:`sparse_linear` or :class:`SparseLinear`).
    b : torch.Tensor, shape (k,) or (k, n), on ``a``'s device

    Returns
    -------
    torch.Tensor, shape (m,) or (m, n)
        float32 if both are float32, else float64.

    Raises
    ------
    TypeError, ValueError
        As :func:`spchain.spmm`; ``ValueError`` for tensors on different devices.

    Notes
    -----
    ``a`` crosses as its component tensors to the operator ``spchain::spmm``, so
    ``torch.func`` transforms it (``grad``, ``vmap`` and ``jvp`` with respect to ``b``).
    ``torch.compile`` cannot take torch sparse tensors, so this function and :func:`sddmm` break
    the graph and run eagerly (``fullgraph=True`` fails with Dynamo's "Attempted to wrap sparse
    Tensor"); for a compiled sparse layer use :func:`sparse_linear` with the structure as index
    tensors.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> a = torch.tensor([[0.0, 2.0], [1.0, 0.0]]).to_sparse_csr()
    >>> b = torch.ones(2, 3, requires_grad=True)
    >>> st.spmm(a, b).sum().backward()
    >>> b.grad[:, 0]
    tensor([1., 2.])
    """
    caller = "spchain.torch.spmm"
    fmt, shape, data, first, second = _sparse_tensor(a, caller)
    check_dense(caller, b=b)
    check_same_device(caller, a=data, b=b)
    _no_low_precision(caller, a=data, b=b)
    if a.requires_grad and torch.is_grad_enabled():
        raise TypeError(f"{caller} differentiates with respect to the dense operand only, and a requires grad; "
                        "for a trainable sparse weight use spchain.torch.sparse_linear or SparseLinear")
    out: torch.Tensor = _SPMM(b, data, first, second, fmt, list(shape))
    return out


@run_eagerly
def sddmm(pattern: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sampled dense-dense product for tensors: ``a @ b.T`` at ``pattern``'s stored entries.

    Parameters
    ----------
    pattern : torch sparse tensor, COO, CSR or CSC, shape (m, n)
        Only its structure is used.
    a : torch.Tensor, shape (m, k)
    b : torch.Tensor, shape (n, k)

    Returns
    -------
    torch sparse CSR tensor
        ``pattern``'s entries in CSR order (duplicates kept), each ``a[row] . b[col]``. It
        carries no autograd history (inside a layer, :func:`sparse_linear` uses this product
        for the weight gradient).

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> pattern = torch.eye(2).to_sparse_csr()
    >>> st.sddmm(pattern, torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.ones(2, 2)).values()
    tensor([3., 7.])
    """
    caller = "spchain.torch.sddmm"
    fmt, shape, _, first, second = _sparse_tensor(pattern, caller)
    check_dense(caller, a=a, b=b)
    check_same_device(caller, pattern=first, a=a)
    _no_low_precision(caller, a=a, b=b)
    indptr, indices, data = _SDDMM(first, second, a, b, fmt, list(shape))
    return csr_tensor(indptr, indices, data, shape)


def prune(w: torch.Tensor, sparsity: float, *, method: Literal["magnitude", "random"] = "magnitude",
          seed: Seed = None) -> torch.Tensor:
    """Keep ``w.numel() - round(sparsity * w.numel())`` entries of a dense matrix tensor.

    Parameters and selection as :func:`spchain.prune`: ``"magnitude"`` keeps the largest
    ``|w|`` (ties to the earlier position), ``"random"`` uniformly chosen positions (``seed``).

    Returns
    -------
    torch sparse CSR tensor
        On ``w``'s device, ``w``'s dtype, sorted indices, without autograd history.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> st.prune(torch.tensor([[0.5, -3.0], [2.0, 0.1]]), 0.5).to_dense()
    tensor([[ 0., -3.],
            [ 2.,  0.]])
    """
    caller = "spchain.torch.prune"
    check_dense(caller, w=w)
    with bridge(w.device):
        array = as_array(w) if w.dim() == 2 else to_array(w)
        backend = _backend.backend_of(array, caller=caller)
        indptr, indices, data = _sparse.prune_parts(backend, array, sparsity, method, seed, caller)
        return csr_tensor(to_tensor(indptr), to_tensor(indices), to_tensor(data), tuple(w.shape))
