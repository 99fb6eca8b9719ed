"""The sparse linear layer's product for torch tensors: ``sparse_linear`` (the product of
:class:`spchain.torch.SparseLinear`), the operator ``spchain::sparse_linear``, for CSR and BSR
weights alike.

The weight is ``values`` ((nnz,) for CSR, (nnzb, R, C) for BSR blocks) and the structure
``indptr``, ``indices`` as tensors. The operator runs the one array-level body of both formats
(:func:`spchain.sparse.linear`) on zero-copy NumPy/CuPy views, its structure from the
array-level cache (:data:`spchain._structures.STRUCTURES`); it works under ``torch.compile``
(no graph break), ``torch.export`` and ``torch.func``. The kernels compute feature-major
(``W @ x.T``): the operator takes ``x`` (batch, in) as it is and returns ``y.T`` (out, batch),
so the output is a transposed view, which the next sparse layer (and elementwise ops between)
consume without copying.

>>> import torch, spchain.torch as st
>>> indptr, indices = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
>>> st.sparse_linear(torch.ones(3, 2), torch.ones(2), indptr, indices, (2, 2)).shape
torch.Size([3, 2])
"""

import math
from collections.abc import Sequence
import torch

from .. import _backend, _csr, _structures
from .. import sparse as _sparse
from ..blocksparse import Bsr
from ._bridge import check_dense
from ._operator import _PLAIN, Operator, _forward_mode, _untraced
from .sparse import index_dtype

__all__ = ["sparse_linear"]

_CALLER = "spchain.torch.sparse_linear"
_FLOATS = (torch.float32, torch.float64)


def _fake(x: torch.Tensor, values: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, shape: Sequence[int],
          bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(x.dtype, values.dtype)
    dtype = dtype if bias is None else torch.promote_types(dtype, bias.dtype)
    r, c = _sparse.block_size(values) or (1, 1)
    index = index_dtype(indptr, indices, (shape[0] // r, shape[1] // c))
    return (x.new_empty((shape[0], x.shape[0]), dtype=dtype), indptr.new_empty(indptr.shape[0], dtype=index),
            indices.new_empty(indices.shape[0], dtype=index))


# The operator takes x (batch, in) as it is and returns y.T (out, batch), the layout the
# kernels write, so that neither x, the output nor its incoming gradient is copied on the way;
# the public function transposes. Its other results are the backward's: the structure the
# product ran on (the backward differentiates that one, whatever happened to the caller's
# index tensors since).
_OPERATOR = Operator(
    "sparse_linear",
    "(Tensor x, Tensor values, Tensor indptr, Tensor indices, int[] shape, Tensor? bias)"
    " -> (Tensor, Tensor, Tensor)",
    _sparse.LINEAR, _fake, outputs=1, differentiable=(0, 1, 5), backward_reads=(0, 1, 2, 3), strided=(0,))


def linear(caller: str, x: torch.Tensor, values: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
           shape: tuple[int, int], bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`sparse_linear` and :func:`spchain.torch.block_sparse_linear`: the checks of
    their arguments, in one place, and the operator."""
    check_dense(caller, ("bias",), x=x, values=values, indptr=indptr, indices=indices, bias=bias)
    shape = _csr.check_shape(caller, shape)
    error = _shape_error(x, values, indices, shape, bias)
    if error:
        raise ValueError(f"{caller}: {error}")
    if indices.is_cuda and not torch.compiler.is_compiling():
        _structures.STRUCTURES.note_versions((indptr.data_ptr(), indices.data_ptr()),
                                             (indptr._version, indices._version), (indptr, indices))
    rows = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), shape[1])
    y = _OPERATOR(rows, values, indptr, indices, list(shape), bias).t()
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], shape[0])


def _shape_error(x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, shape: tuple[int, int],
                 bias: torch.Tensor | None) -> str:
    """What is wrong with the shapes of :func:`linear`'s arguments ("" where nothing is)."""
    if x.dim() == 0 or x.shape[-1] != shape[1]:
        return f"x has shape {tuple(x.shape)} but the weight has shape {shape} (x's last axis must be {shape[1]})"
    if values.dim() not in (1, 3) or indices.dim() != 1 or values.shape[0] != indices.shape[0]:
        return (f"values {tuple(values.shape)} and indices {tuple(indices.shape)} must be 1-D and of one length "
                "(nnz), or (nnzb, R, C) blocks and (nnzb,)")
    if bias is not None and tuple(bias.shape) != (shape[0],):
        return f"bias has shape {tuple(bias.shape)}; expected ({shape[0]},)"
    return ""


class LinearPlan:
    """A layer's :func:`sparse_linear` on the CPU, past the operator's checks: the structure of
    its index tensors, validated and prepared by the structure cache, kept between calls, and
    each call's product by the same array-level body (:func:`spchain.sparse.linear`); a call
    that records a gradient hands the operator's eager ``autograd.Function`` that prepared
    problem (``Operator.record``), so its backward is the operator's. Every call compares the
    index tensors' contents with the kept structure's (as every lookup of the cache does) and
    looks the structure up again on any difference. A call that needs more (a GPU, a
    transform, tracer, compile, forward mode or autocast, mixed dtypes, an argument that is
    wrong) returns ``None`` and takes the operator, which raises the errors. A structure that
    stores every entry in row-major order (sparsity 0, as the dense start of
    :class:`~spchain.torch.GradualPruning`) runs ``nn.Linear``'s product on the values as the
    dense weight (:func:`spchain._csr.stores_every_entry`): torch's GEMM and autograd (figures
    in ``docs/design.rst``). The plan holds one structure (the layer's latest) for as long as
    the layer lives.

    >>> import torch
    >>> plan = LinearPlan()
    >>> indptr, indices, values = torch.tensor([0, 1, 2]), torch.tensor([1, 0]), torch.ones(2)
    >>> with torch.no_grad():
    ...     plan(torch.ones(3, 2), values, indptr, indices, (2, 2), None).shape
    torch.Size([3, 2])
    """

    __slots__ = ("_dense", "_structure")

    def __init__(self) -> None:
        self._structure: _csr.Csr | Bsr | None = None
        self._dense = False

    def __call__(self, x: torch.Tensor, values: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                 shape: tuple[int, int], bias: torch.Tensor | None) -> torch.Tensor | None:
        """``sparse_linear(x, values, indptr, indices, shape, bias)``, or ``None`` where the call
        takes the operator."""
        if _forward_mode() or torch._C._is_any_autocast_enabled() or not _untraced():
            return None
        dtype = values.dtype
        if not (type(x) in _PLAIN and x.is_cpu and x.layout == torch.strided and x.dtype == dtype):
            return None
        for t in (values, indptr, indices, bias):  # read as they are by the kernels: C-contiguous
            if t is not None and not (type(t) in _PLAIN and t.is_cpu and t.layout == torch.strided
                                      and t.is_contiguous()):
                return None
        if dtype not in _FLOATS or (bias is not None and bias.dtype != dtype) \
                or _shape_error(x, values, indices, shape, bias):
            return None
        arrays = indptr.numpy(), indices.numpy()
        block = _sparse.block_size(values)
        structure = self._structure
        if structure is None or structure.shape != shape or getattr(structure, "blocksize", None) != block \
                or not _structures.equal(structure, arrays):
            structure, _ = _structures.STRUCTURES.lookup(_backend.NUMPY, arrays, shape, _CALLER, blocksize=block)
            self._structure = structure
            r, c = block or (1, 1)
            self._dense = _csr.stores_every_entry(structure.indptr, structure.indices, (shape[0] // r, shape[1] // c))
        if self._dense:
            return torch.nn.functional.linear(x, _dense_weight(values, shape), bias)
        values_array = values.numpy(force=True)
        rows = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), shape[1])
        rows_array, bias_array = rows.numpy(force=True), None if bias is None else bias.numpy(force=True)
        if torch.is_grad_enabled() and (x.requires_grad or values.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            problem = _sparse.LinearProblem(_backend.NUMPY, values_array.dtype, rows_array, values_array,
                                            arrays[0], arrays[1], shape, bias_array, structure, None, _CALLER)
            yt = _OPERATOR.record(problem, rows, values, indptr, indices, list(shape), bias)[0]
        else:
            yt = torch.from_numpy(_sparse.linear(_backend.NUMPY, structure, values_array, rows_array, bias_array,
                                                 dtype=values_array.dtype))
        y = yt.t()
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], shape[0])


def _dense_weight(values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The dense weight of a structure that stores every entry in row-major order
    (:func:`spchain._csr.stores_every_entry`): a view of CSR ``values``; BSR blocks
    (nnzb, R, C) moved into their rows (a copy, the size of ``values``)."""
    if values.dim() == 1:
        return values.view(shape)
    r, c = values.shape[1:]
    return values.view(shape[0] // r, shape[1] // c, r, c).transpose(1, 2).reshape(shape)


def sparse_linear(x: torch.Tensor, values: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                  shape: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a sparse weight ``W`` given as CSR arrays; differentiable.

    Parameters
    ----------
    x : torch.Tensor, shape (..., in_features)
        Any leading dimensions and layout; on the CPU the kernels read a row-major ``x`` as it
        is (transposing each tile into their buffers), and a column-major one too.
    values : torch.Tensor, shape (nnz,), or (nnzb, R, C) for BSR
        The stored weights (or blocks); gradient by SDDMM at the stored entries only (O(nnz)).
    indptr : torch.Tensor, shape (out_features + 1,) (BSR: out_features / R + 1), int32 or int64
    indices : torch.Tensor, shape (nnz,) (BSR: (nnzb,)), int32 or int64
        Column (block column) of each stored weight (block). Duplicates add up; explicit
        zeros are trainable.
    shape : (out_features, in_features)
    bias : torch.Tensor, shape (out_features,), optional

    Returns
    -------
    torch.Tensor, shape (..., out_features)
        The promoted dtype of the float inputs (``torch.promote_types``): float64 if one is
        float64, float16 or bfloat16 where every one has that dtype (computed in float32 and
        rounded once, so within that dtype's rounding of the float32 result), else float32;
        gradients come back in each input's dtype. On the CPU a float32/float64 result is a
        transposed view of the kernel's feature-major output (call ``.contiguous()`` if you
        need rows).

    Raises
    ------
    TypeError
        Non-float values or inputs (ints, bools), non-integer indices.
    ValueError
        A malformed structure (see :func:`spchain.spmm`), shapes that do not match, tensors
        on different devices.

    Notes
    -----
    A torch operator (``spchain::sparse_linear``): it compiles with ``fullgraph=True``,
    exports, and runs under ``torch.func`` (``grad``, ``vmap``, per-sample gradients). The
    structure is validated once and cached with its transpose (the csr2csc order the input
    gradient needs), for the 64 most recently used structures (at most 256 MiB of them, so
    that structures left behind by ``prune_and_regrow`` do not pin memory); each call only
    compares the tensors with the cached copy (O(nnz), however they were changed: in place,
    through ``.data`` or a NumPy view) and validates and rebuilds on any difference. On CUDA
    the comparison stays on the device (no wait for it): an in-place torch write (which bumps
    the version counters) rebuilds as on the CPU, and a write that bumps none (``.data``, a
    CuPy view) makes the result NaN until the next rebuild, never the old structure's. The backward
    differentiates the structure its forward ran on; changing ``x``, ``values``, ``indptr`` or
    ``indices`` in place between them raises autograd's version-counter error, as
    ``nn.Linear`` does. Double backward (``create_graph=True``) raises a ``RuntimeError``.
    The backward computes the input gradient by the transposed product and the value
    gradient by SDDMM; no dense weight or dense weight gradient is ever formed.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> indptr, indices = torch.tensor([0, 1, 3]), torch.tensor([2, 0, 1])
    >>> values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    >>> y = st.sparse_linear(torch.ones(4, 3), values, indptr, indices, (2, 3))
    >>> y[0]
    tensor([1., 5.], grad_fn=<SelectBackward0>)
    >>> y.sum().backward()
    >>> values.grad
    tensor([4., 4., 4.])
    """
    return linear(_CALLER, x, values, indptr, indices, shape, bias)
