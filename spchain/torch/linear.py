"""The sparse linear layer's product for torch tensors: ``sparse_linear`` (the product of
:class:`spchain.torch.SparseLinear`), the operator ``spchain::sparse_linear``.

The weight is CSR: ``values`` (nnz) and the structure ``indptr``, ``indices`` as tensors. The
operator runs the array-level dispatchers of ``spchain.sparse`` on zero-copy NumPy/CuPy views;
it works under ``torch.compile`` (no graph break), ``torch.export`` and ``torch.func``. On the
CPU the kernel computes feature-major (``W @ x.T``): the operator takes ``x.T`` and returns
``y.T``, so a column-major ``x`` crosses without a copy and the output is a transposed view,
which the next sparse layer (and elementwise ops between) consume without copying.

>>> import torch, spchain.torch as st
>>> indptr, indices = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
>>> st.sparse_linear(torch.ones(3, 2), torch.ones(2), indptr, indices, (2, 2)).shape
torch.Size([3, 2])
"""

import collections
import math
from collections.abc import Hashable, Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

from .. import _backend, _checks, _csr
from .. import sparse as _sparse
from .._typing import Array, Shape
from ._bridge import check_dense
from ._operator import Operator
from .sparse import index_dtype

__all__ = ["sparse_linear"]

_CALLER = "spchain.torch.sparse_linear"

_Entry: TypeAlias = tuple[_csr.Csr, tuple[_csr.Csr, Array] | None]
"""A cached structure and, on the CPU, its transpose ``(csr_t, order)``."""


class _StructureCache:
    """Validated CSR structures of :func:`sparse_linear` and, on the CPU, their transposes.

    Keyed by the index arrays' data pointers, dtypes and lengths, the shape and the device (the
    operator sees array views, not the caller's tensor objects, also under ``torch.compile``);
    it holds the most recently used structures, at most ``size`` of them and at most ``budget``
    bytes of arrays in all (default 256 MiB; the most recent one is kept whatever its size), so
    that the structures that ``prune_and_regrow`` leaves behind do not pin memory. An entry holds private copies of the
    validated structure, and every lookup compares the arrays' contents with them (O(nnz),
    next to an O(nnz * batch) product): version counters are not trusted (writes through a
    NumPy view or ``.data`` do not bump them, and an unchecked index would reach a kernel), nor
    is an address that a new tensor may reuse. On the CPU a difference validates and rebuilds
    the entry. On the GPU the comparison stays on the device (reading it would wait for the
    device): :meth:`lookup` returns its flag with the entry, the product runs on the validated
    copies, and :func:`_forward` makes the result NaN where the flag says the caller's
    structure changed. An in-place torch write bumps the tensors' version counters, which
    :meth:`note_versions` reads on the host before each eager call: it drops their entries,
    so the next lookup validates and rebuilds; only a write that bumps no counter (``.data``,
    a CuPy view) meets the flag and gives NaN until the next such rebuild.
    """

    def __init__(self, size: int = 64, budget: int = 256 * 2**20) -> None:
        self._entries: collections.OrderedDict[tuple[Hashable, ...], _Entry] = collections.OrderedDict()
        self._size, self._budget, self._bytes = size, budget, 0
        self._versions: collections.OrderedDict[tuple[int, int], tuple[int, int]] = collections.OrderedDict()

    def note_versions(self, indptr: torch.Tensor, indices: torch.Tensor) -> None:
        """Drop the entries of ``(indptr, indices)``'s addresses if a torch write changed them
        (their version counters moved) since the last call: host integers, no synchronisation."""
        addresses, versions = (indptr.data_ptr(), indices.data_ptr()), (indptr._version, indices._version)
        if self._versions.pop(addresses, versions) != versions:
            for key in [key for key in self._entries if key[:2] == addresses]:
                self._forget(key)
        self._versions[addresses] = versions
        while len(self._versions) > self._size:
            self._versions.popitem(last=False)

    def lookup(self, backend: _backend.Backend, arrays: tuple[Array, Array], shape: Shape, caller: str,
            key_arrays: tuple[Array, Array] | None = None) -> tuple[_Entry, Array | None]:
        """``((csr, transpose), same)`` for the structure ``arrays = (indptr, indices)``: ``csr``
        on private validated copies, ``transpose`` its ``(csr_t, order)`` on the CPU (``None``
        on the GPU). The entry is the one of ``key_arrays`` (default ``arrays``): the backward
        looks up its forward's structure under the caller's tensors. ``same`` is ``None``
        where ``arrays`` were compared on the host (the CPU, a new entry, or ``arrays`` that
        are the entry's own), else the device's 0-d flag that they equal the entry's."""
        first, second = key_arrays or arrays
        key = (_address(first), _address(second), first.dtype, second.dtype, first.shape, second.shape, shape,
               backend.device)
        entry = self._entries.get(key)
        if entry is not None:
            csr, transpose = entry
            if csr.indices.shape == arrays[1].shape and csr.indptr.shape == arrays[0].shape:
                if backend.on_gpu:
                    self._entries.move_to_end(key)
                    return entry, _same_on_device(csr, arrays)
                if bool((csr.indices == arrays[1]).all()) and bool((csr.indptr == arrays[0]).all()):
                    self._entries.move_to_end(key)
                    return entry, None
        csr = _csr.to_csr(backend, "csr", shape, None, arrays[0].copy(), arrays[1].copy(), caller)
        entry = csr, (None if backend.on_gpu else _csr.transposed(backend, csr))
        self._forget(key)
        self._entries[key] = entry
        self._bytes += _nbytes(entry)
        while len(self._entries) > 1 and (len(self._entries) > self._size or self._bytes > self._budget):
            self._forget(next(iter(self._entries)))
        return entry, None

    def _forget(self, key: tuple[Hashable, ...]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= _nbytes(entry)

    @property
    def nbytes(self) -> int:
        """The bytes of the arrays that the cache holds."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)


def _same_on_device(csr: _csr.Csr, arrays: tuple[Array, Array]) -> Array | None:
    """``None`` where ``arrays`` are ``csr``'s own (the structure a forward returned, by
    address), else the 0-d device flag that their contents equal ``csr``'s: no synchronisation."""
    if _address(arrays[0]) == _address(csr.indptr) and _address(arrays[1]) == _address(csr.indices):
        return None
    same: Array = (csr.indices == arrays[1]).all() & (csr.indptr == arrays[0]).all()
    return same


def _nbytes(entry: _Entry) -> int:
    csr, transpose = entry
    arrays = [csr.indptr, csr.indices] + ([] if transpose is None else [transpose[0].indptr, transpose[0].indices,
                                                                       transpose[1]])
    return sum(a.nbytes for a in arrays)


def _address(a: Array) -> int:
    return int(a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr)


_STRUCTURES = _StructureCache()


def _forward(xt: Array, values: Array, indptr: Array, indices: Array, shape: Sequence[int],
             bias: Array | None) -> tuple[Array, Array, Array, Array]:
    """``(y.T, x.T, indptr, indices)``: the product, and what the backward reads (``x.T`` in
    the computation's dtype, the validated structure the product ran on)."""
    backend = _backend.backend_of(xt, values, bias, indptr, indices, caller=_CALLER)
    dtype = _checks.float_dtype(_CALLER, x=xt, values=values, bias=bias)
    (csr, _), same = _STRUCTURES.lookup(backend, (indptr, indices), tuple(shape), _CALLER)
    y, x_saved = _sparse.linear(backend, csr, values, xt.T, bias, dtype)
    if not backend.on_gpu:
        return y.T, x_saved.T, csr.indptr.copy(), csr.indices.copy()
    if same is not None:  # a structure changed since it was cached: NaN, never the old structure's product
        y = backend.xp.where(same, y, np.nan).astype(y.dtype, copy=False)
    return y.T, x_saved.T, csr.indptr, csr.indices  # the cache's copies are never written: no copy per call


def _fake(xt: torch.Tensor, values: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, shape: Sequence[int],
          bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(xt.dtype, values.dtype)
    dtype = dtype if bias is None else torch.promote_types(dtype, bias.dtype)
    index = index_dtype(indptr, indices, shape)
    return (xt.new_empty((shape[0], xt.shape[1]), dtype=dtype), xt.new_empty(xt.shape, dtype=dtype),
            indptr.new_empty(shape[0] + 1, dtype=index), indices.new_empty(indices.shape[0], dtype=index))


def _backward(args: Sequence[Any], results: Sequence[Array], grads: Sequence[Array],
              needs: Sequence[bool]) -> tuple[Array | None, Array | None, Array | None]:
    _, values, indptr, indices, shape, _ = args
    _, xt, ran_indptr, ran_indices = results
    grad_yt = grads[0]
    need_x, need_values, need_bias = needs
    backend = _backend.backend_of(grad_yt, xt, ran_indices, caller=_CALLER)
    if need_x:  # the transpose, cached with the structure the forward ran on
        (csr, transpose), _ = _STRUCTURES.lookup(backend, (ran_indptr, ran_indices), tuple(shape), _CALLER,
                                              (indptr, indices))
    else:
        csr, transpose = _csr.Csr(ran_indptr, ran_indices, None, tuple(shape)), None
    grad_x, grad_values = _sparse.linear_backward(backend, csr, transpose, values, grad_yt.T, xt.T, xt.dtype,
                                                  need_x, need_values)
    grad_bias = grad_yt.sum(axis=1) if need_bias else None
    return None if grad_x is None else grad_x.T, grad_values, grad_bias


# The operator takes x.T and returns y.T (the kernel's feature-major layouts), so that a
# column-major x, the output and its incoming gradient cross without copies; the public
# function transposes. Its other results are the backward's: x.T in the computation's dtype
# and the structure the product ran on (the backward differentiates that one, whatever
# happened to the caller's index tensors since).
_OPERATOR = Operator(
    "sparse_linear",
    "(Tensor xt, Tensor values, Tensor indptr, Tensor indices, int[] shape, Tensor? bias)"
    " -> (Tensor, Tensor, Tensor, Tensor)",
    _forward, _fake, outputs=1, backward=_backward, differentiable=(0, 1, 5), backward_reads=(1, 2, 3))


def sparse_linear(x: torch.Tensor, values: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                  shape: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a sparse weight ``W`` given as CSR arrays; differentiable.

    Parameters
    ----------
    x : torch.Tensor, shape (..., in_features)
        Any leading dimensions; any layout (a transposed view crosses without a copy).
    values : torch.Tensor, shape (nnz,)
        The stored weights; gradient by SDDMM at the stored entries only (O(nnz)).
    indptr : torch.Tensor, shape (out_features + 1,), int32 or int64
    indices : torch.Tensor, shape (nnz,), int32 or int64
        Column of each stored weight. Duplicates add up; explicit zeros are trainable.
    shape : (out_features, in_features)
    bias : torch.Tensor, shape (out_features,), optional

    Returns
    -------
    torch.Tensor, shape (..., out_features)
        float32 if every float input is float32, float64 if one is float64; float16 or
        bfloat16 if an input is (computed in float32 and rounded once, so within that dtype's
        rounding of the float32 result; gradients come back in each input's dtype). On the
        CPU a float32/float64 result is a transposed view of the kernel's feature-major
        output (call ``.contiguous()`` if you need rows).

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
    check_dense(_CALLER, ("bias",), x=x, values=values, indptr=indptr, indices=indices, bias=bias)
    shape = _csr.check_shape(_CALLER, shape)
    if x.dim() == 0 or x.shape[-1] != shape[1]:
        raise ValueError(f"{_CALLER}: x has shape {tuple(x.shape)} but the weight has shape {shape} "
                         f"(x's last axis must be {shape[1]})")
    if values.dim() != 1 or indices.dim() != 1 or values.shape[0] != indices.shape[0]:
        raise ValueError(f"{_CALLER}: values {tuple(values.shape)} and indices {tuple(indices.shape)} "
                         "must be 1-D and of one length (nnz)")
    if bias is not None and tuple(bias.shape) != (shape[0],):
        raise ValueError(f"{_CALLER}: bias has shape {tuple(bias.shape)}; expected ({shape[0]},)")
    if indices.is_cuda and not torch.compiler.is_compiling():
        _STRUCTURES.note_versions(indptr, indices)
    rows = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), shape[1])
    y = _OPERATOR(rows.t(), values, indptr, indices, list(shape), bias).t()
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], shape[0])
