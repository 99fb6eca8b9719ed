"""Sparse products for torch tensors: ``spmm``, ``sddmm``, ``prune`` and ``sparse_linear`` (the
product of :class:`spchain.torch.nn.SparseLinear`).

Tensors cross to NumPy/CuPy through the zero-copy bridge and the array-level dispatchers of
``spchain.sparse`` do the work. A row- or column-major 2-D tensor crosses without a copy in
either direction: on the CPU the layer computes feature-major (``W @ x.T``), so its output is a
transposed view, which the next sparse layer (and elementwise ops between) consume without
copying.

>>> import torch, spchain.torch as st
>>> indptr, indices = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
>>> st.sparse_linear(torch.ones(3, 2), torch.ones(2), indptr, indices, (2, 2)).shape
torch.Size([3, 2])
"""

import math
import warnings
import weakref

import torch

from .. import _backend, _checks
from .. import sparse as _sparse
from ._bridge import check_same_device, first_order, on_device, to_array, to_tensor

__all__ = ["spmm", "sddmm", "prune", "sparse_linear"]

_LOW = (torch.float16, torch.bfloat16)
_FORMATS = {torch.sparse_coo: "coo", torch.sparse_csr: "csr", torch.sparse_csc: "csc"}


def _as_array(t: torch.Tensor):
    """A NumPy/CuPy array of ``t``; a column-major (transposed) 2-D tensor crosses without a copy."""
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
        return to_array(t.t()).T
    return to_array(t)


def _as_tensor(a) -> torch.Tensor:
    """A tensor sharing ``a``'s memory; a column-major 2-D array crosses without a copy."""
    if a.ndim == 2 and not a.flags.c_contiguous and a.flags.f_contiguous:
        return to_tensor(a.T).t()
    return to_tensor(a)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., features) as a matrix (batch, features), zero-size axes included."""
    if t.dim() == 2:
        return t
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _check_dense_tensors(caller: str, optional=(), **tensors) -> None:
    """``TypeError`` naming the first of ``tensors`` that is not a dense (strided) tensor;
    ``None`` is allowed for the names in ``optional``."""
    for name, t in tensors.items():
        if t is None and name in optional:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{caller}: {name} must be a torch.Tensor, not {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{caller}: {name} must be a dense tensor, not one of layout {t.layout}")


def _sparse_tensor(t, caller: str):
    """``(format, shape, data, first, second)`` tensors of a 2-D COO, CSR or CSC tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{caller} takes a torch sparse tensor (COO, CSR or CSC), not {type(t).__name__}")
    fmt = _FORMATS.get(t.layout)
    if fmt is None:
        raise TypeError(f"{caller} takes a sparse COO, CSR or CSC tensor, not one of layout {t.layout}")
    if t.dim() != 2:
        raise ValueError(f"{caller} takes 2-D sparse tensors (no batch or dense dimensions), got shape {tuple(t.shape)}")
    if fmt == "coo":
        index = t._indices()  # uncoalesced entries are fine: duplicates add up
        return fmt, tuple(t.shape), t._values(), index[0], index[1]
    if fmt == "csr":
        return fmt, tuple(t.shape), t.values(), t.crow_indices(), t.col_indices()
    return fmt, tuple(t.shape), t.values(), t.ccol_indices(), t.row_indices()


def _csr_tensor(crow, col, values, shape) -> torch.Tensor:
    """A torch sparse CSR tensor of validated parts, without torch's (once a process) beta warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, values, size=shape, check_invariants=False)


def _csr_of(csr: _sparse.Csr, data, copy: bool) -> torch.Tensor:
    """``csr``'s structure (copied if it may be the caller's) with ``data``, as a CSR tensor."""
    indptr, indices = (csr.indptr.copy(), csr.indices.copy()) if copy else (csr.indptr, csr.indices)
    return _csr_tensor(to_tensor(indptr), to_tensor(indices), to_tensor(data), csr.shape)


class _Spmm(torch.autograd.Function):
    """``a @ b`` for a sparse ``a``, differentiable with respect to the dense ``b``.

    The backward reads ``a``'s tensors through ``ctx.saved_tensors`` (autograd raises if they
    changed in place since the forward) together with the CSR form the forward built of them.
    """

    @staticmethod
    def forward(ctx, b, fmt, shape, data, first, second):
        caller = "spchain.torch.spmm"
        with on_device(b.device):
            arrays = [to_array(t) for t in (data, first, second)]
            b_array = _as_array(b)
            backend = _backend.backend_of(*arrays, b_array, caller=caller)
            csr, out = _sparse.spmm_parts(backend, fmt, shape, arrays[0], arrays[1:], b_array, caller)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(data, first, second, *(to_tensor(a) for a in (csr.indptr, csr.indices, csr.data)))
            ctx.shape, ctx.b_dtype = csr.shape, b.dtype
        return _as_tensor(out)

    @staticmethod
    @first_order("spchain.torch.spmm")
    def backward(ctx, grad_out):
        indptr, indices, data = ctx.saved_tensors[3:]
        with on_device(grad_out.device):
            csr = _sparse.Csr(to_array(indptr), to_array(indices), to_array(data), ctx.shape)
            grad = _as_array(grad_out) if grad_out.dim() == 2 else to_array(grad_out)[:, None]
            backend = _backend.backend_of(grad, csr.indices)
            t_csr = _sparse.transposed(backend, csr)[0]
            grad_b = _sparse.matmul(backend, t_csr, grad, grad.dtype)
        grad_b = _as_tensor(grad_b if grad_out.dim() == 2 else grad_b[:, 0]).to(ctx.b_dtype)
        return grad_b, None, None, None, None, None


def spmm(a, b):
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
    _check_dense_tensors(caller, b=b)
    check_same_device(caller, a=data, b=b)
    if a.requires_grad and torch.is_grad_enabled():
        raise TypeError(f"{caller} differentiates with respect to the dense operand only, and a requires grad; "
                        "for a trainable sparse weight use spchain.torch.sparse_linear or SparseLinear")
    return _Spmm.apply(b, fmt, shape, data, first, second)


def sddmm(pattern, a, b):
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
    _check_dense_tensors(caller, a=a, b=b)
    device = check_same_device(caller, pattern=first, a=a, b=b)
    with on_device(device):
        index = [to_array(t) for t in (first, second)]
        dense = [_as_array(t) for t in (a, b)]
        backend = _backend.backend_of(*index, *dense, caller=caller)
        csr, data = _sparse.sddmm_parts(backend, fmt, shape, index, *dense, caller)
        return _csr_of(csr, data, copy=True)


def prune(w, sparsity, *, method="magnitude", seed=None):
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
    _check_dense_tensors(caller, w=w)
    with on_device(w.device):
        array = _as_array(w) if w.dim() == 2 else to_array(w)
        backend = _backend.backend_of(array, caller=caller)
        indptr, indices, data = _sparse.prune_parts(backend, array, sparsity, method, seed, caller)
        return _csr_of(_sparse.Csr(indptr, indices, None, tuple(w.shape)), data, copy=False)


# --- sparse_linear ---------------------------------------------------------------------------


class _StructureCache:
    """Validated CSR structures of :func:`sparse_linear` and, on the CPU, their transposes.

    One entry per live ``(indptr, indices)`` tensor pair, keyed by identity and held through
    weak references, so it goes when the tensors go. An entry holds private copies of the
    validated structure, and the products run on those copies: every call compares the
    tensors' contents with them (O(nnz), next to an O(nnz * batch) product) and validates and
    rebuilds the entry when they differ. Version counters are not trusted: writes through a
    NumPy view or ``.data`` do not bump them, and an unchecked index would reach a kernel.
    """

    def __init__(self):
        self._entries = {}

    def get(self, backend, indptr, indices, arrays, shape, caller):
        """``(csr, transpose)`` for the structure in the tensors ``indptr, indices`` (their
        ``arrays``): ``csr`` on private validated copies, ``transpose`` its
        ``(csr_t, order)`` on the CPU (``None`` on the GPU)."""
        key = (id(indptr), id(indices))
        stamp = (shape, backend.device)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is indptr and entry[1]() is indices and entry[2] == stamp:
            csr, transpose = entry[3]
            xp = backend.xp
            if bool(xp.array_equal(csr.indices, arrays[1])) and bool(xp.array_equal(csr.indptr, arrays[0])):
                return csr, transpose
        csr = _sparse.to_csr(backend, "csr", shape, None, *(a.copy() for a in arrays), caller)
        transpose = None if backend.on_gpu else _sparse.transposed(backend, csr)

        def forget(_, entries=self._entries):
            entries.pop(key, None)

        self._entries[key] = (weakref.ref(indptr, forget), weakref.ref(indices, forget), stamp, (csr, transpose))
        return csr, transpose

    def __len__(self) -> int:
        return len(self._entries)


_STRUCTURES = _StructureCache()


def _linear(x, values, bias, indptr, indices, shape):
    """``(y, x_saved, dtype, x_row_major, structure)``: the forward of :func:`sparse_linear` on
    validated tensors, with ``x_saved`` the array :func:`spchain.sparse.linear_backward` reads
    x from, ``x_row_major`` whether x (as a matrix) came row-major and ``structure`` the
    ``(csr, transpose)`` the product ran on."""
    caller = "spchain.torch.sparse_linear"
    x2 = _rows(x)
    with on_device(x.device):
        xa, va, ia, ja = _as_array(x2), to_array(values), to_array(indptr), to_array(indices)
        ba = None if bias is None else to_array(bias)
        backend = _backend.backend_of(xa, va, ba, ia, ja, caller=caller)
        dtype = _checks.float_dtype(caller, x=xa, values=va, bias=ba)
        structure = _STRUCTURES.get(backend, indptr, indices, (ia, ja), shape, caller)
        y, x_saved = _sparse.linear(backend, structure[0], va, xa, ba, dtype)
    y = _as_tensor(y)
    y = y if x.dim() == 2 else y.reshape(*x.shape[:-1], shape[0])
    return y, x_saved, dtype, x2.is_contiguous(), structure


class _SparseLinear(torch.autograd.Function):
    """``x @ W.T + bias`` for a CSR weight; gradients for ``x``, ``values`` and ``bias``.

    The caller's tensors the backward depends on (``x``, ``values``, ``indptr``, ``indices``)
    go through ``ctx.save_for_backward``, so autograd raises if one changed in place since
    the forward. ``ctx.structure`` is the cache's ``(csr, transpose)`` the forward ran on:
    private arrays that nothing writes to (the cache replaces an entry, never updates it), so
    the backward differentiates exactly the product the forward computed, without converting
    them to tensors and back on every call.
    """

    @staticmethod
    def forward(ctx, x, values, bias, indptr, indices, shape):
        y, x_saved, dtype, x_row_major, structure = _linear(x, values, bias, indptr, indices, shape)
        need_x, need_values = ctx.needs_input_grad[:2]
        x_saved = _as_tensor(x_saved) if need_values else None
        ctx.save_for_backward(x if need_values else None, x_saved, values if need_x else None, indptr, indices)
        ctx.structure = structure
        ctx.shape, ctx.x_shape, ctx.x_row_major, ctx.dtype = shape, x.shape, x_row_major, dtype
        ctx.dtypes = (x.dtype, values.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    @first_order("spchain.torch.sparse_linear")
    def backward(ctx, grad_y):
        caller = "spchain.torch.sparse_linear"
        _, x_saved, values, _, _ = ctx.saved_tensors
        need_x, need_values, need_bias = ctx.needs_input_grad[:3]
        grad_y2 = _rows(grad_y)
        csr, transpose = ctx.structure
        with on_device(grad_y.device):
            ga = _as_array(grad_y2)
            va = None if values is None else to_array(values)
            xa = None if x_saved is None else _as_array(x_saved)
            backend = _backend.backend_of(ga, csr.indices, caller=caller)
            grad_x, grad_values = _sparse.linear_backward(backend, csr, transpose, va, ga, xa, ctx.dtype,
                                                          need_x, need_values)
            if grad_x is not None and ctx.x_row_major:  # x's layout, as autograd prefers for a leaf
                grad_x = _sparse.contiguous(backend, grad_x)
        x_dtype, values_dtype, bias_dtype = ctx.dtypes
        if grad_x is not None:
            grad_x = _as_tensor(grad_x).reshape(ctx.x_shape).to(x_dtype)
        if grad_values is not None:
            grad_values = to_tensor(grad_values).to(values_dtype)
        grad_bias = grad_y2.sum(0).to(bias_dtype) if need_bias else None
        return grad_x, grad_values, grad_bias, None, None, None


def sparse_linear(x, values, indptr, indices, shape, bias=None):
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
    The structure is validated once and cached with its transpose (the csr2csc order the input
    gradient needs), per live ``(indptr, indices)`` pair; each call only compares the tensors
    with the cached copy (O(nnz), however they were changed: in place, through ``.data`` or
    a NumPy view) and validates and rebuilds on any difference. The backward differentiates
    the structure its forward ran on; changing ``x``, ``values``, ``indptr`` or ``indices`` in
    place between them raises autograd's version-counter error, as ``nn.Linear`` does.
    ``create_graph=True`` raises (no double backward). The backward computes the input
    gradient by the transposed product and the value gradient by SDDMM; no dense weight or
    dense weight gradient is ever formed.

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
    caller = "spchain.torch.sparse_linear"
    _check_dense_tensors(caller, ("bias",), x=x, values=values, indptr=indptr, indices=indices, bias=bias)
    check_same_device(caller, x=x, values=values, indptr=indptr, indices=indices, bias=bias)
    shape = _sparse.check_shape(caller, shape)
    if x.dim() == 0 or x.shape[-1] != shape[1]:
        raise ValueError(f"{caller}: x has shape {tuple(x.shape)} but the weight has shape {shape} "
                         f"(x's last axis must be {shape[1]})")
    if values.dim() != 1 or indices.dim() != 1 or values.shape[0] != indices.shape[0]:
        raise ValueError(f"{caller}: values {tuple(values.shape)} and indices {tuple(indices.shape)} "
                         "must be 1-D and of one length (nnz)")
    if bias is not None and tuple(bias.shape) != (shape[0],):
        raise ValueError(f"{caller}: bias has shape {tuple(bias.shape)}; expected ({shape[0]},)")
    low = next((t.dtype for t in (x, values, bias) if t is not None and t.dtype in _LOW), None)
    if low is not None:  # computed in float32, returned in the low precision (autograd casts the gradients)
        x, values, bias = (t if t is None or t.dtype not in _LOW else t.float() for t in (x, values, bias))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, values, bias)):
        y = _SparseLinear.apply(x, values, bias, indptr, indices, shape)
    else:
        y = _linear(x, values, bias, indptr, indices, shape)[0]  # inference: no autograd node
    return y if low is None else y.to(low)
