"""Sparse transitions of a chain: one (c, c) matrix of log-values shared by all steps, stored
as SciPy or cupyx CSR, CSC or COO (converted once); absent entries are ``-inf``.

:func:`split` validates such a ``log_trans`` (no repeated entry) and splits it into its
structure (:class:`Structure`) and its stored values, which a :class:`~._chain_layout.Chain`
holds as ``trans`` of shape (1, 1, nnz), so that ``spchain._chain_limits`` treats them like
dense transitions. :func:`forward`, :func:`backward` and :func:`viterbi` are the sweeps of
``spchain._chain_sweep`` for such a chain: per step, an SpMV over the stored entries,
O(batch · v · (c + nnz)) time, O(batch · v · c) memory, and the gradient of the stored values
at the stored entries only. On the CPU the forward and backward sweeps exponentiate the stored
values once and run scaled SpMVs (``spchain/kernels/cpu/sparse_chain_scaled.py``: ``c``
exponentials and logarithms and ``nnz`` multiply-adds a step and row, log space only where a
scaled sum underflows), the backward sweep giving the marginals and the value gradient in one
pass; on the GPU the forward and backward messages come from scaled SpMVs in the data's dtype,
and the value gradient from one SDDMM of scaled factors (log space where they leave range);
Viterbi runs in log space (``spchain/kernels/*/sparse_chain.py``). On the CPU the path
functions run on the stored entries as well (``spchain/paths.py``, ``spchain/_entropy.py``,
``spchain/kernels/cpu/paths.py``; :func:`entries_of` looks up the steps of given paths), in
O(batch · v · c + nnz) memory; on the GPU ``chain_kbest`` does too (a thread a row over the
dense matrix would take c² steps per position), the others run on the dense matrix
(:func:`densified`, O(c²) memory).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import scipy.sparse

from . import _chain_scaled, _csr, _structures
from ._backend import Backend, read_only
from ._logspace import normalised, renormalise, weighted
from .kernels import cpu, cuda
from ._typing import Array, Sparse

if TYPE_CHECKING:
    from ._chain_layout import Chain


@dataclasses.dataclass(frozen=True)
class Structure:
    """The CSR structure of a sparse ``log_trans`` and of its transpose.

    Entry ``q`` of the transpose (``t_indptr``, ``t_rows``: the entries of each column, in order
    of their row) is entry ``order[q]`` of the matrix (``indptr``, ``indices``).
    """

    indptr: Array
    indices: Array
    t_indptr: Array
    t_rows: Array
    order: Array
    shape: tuple[int, int]


def is_sparse(a: object) -> bool:
    """Whether ``a`` is a SciPy or cupyx sparse matrix or array."""
    if scipy.sparse.issparse(a):
        return True
    module = type(a).__module__
    return module.startswith("cupyx.") and hasattr(a, "tocsr")


def split(backend: Backend, log_trans: Sparse, dtype: np.dtype[Any], caller: str,
          check: bool = True) -> tuple[Structure, Array]:
    """``(Structure, values (nnz,) of dtype)`` of a sparse ``log_trans``, in CSR order; a CSR
    matrix keeps its own order. ``ValueError`` for a bad structure or a repeated entry.

    The structure of a CSR matrix comes from the array level's one structure cache
    (:data:`spchain._structures.STRUCTURES`, found by content: SciPy and cupyx copy the index
    arrays of each new matrix), validated, checked for repeated entries and transposed once,
    so that a forward and its backward, or two operators on one structure, share it; ``check``
    matters for the other formats only (their structures are validated at each call)."""
    name = f"{caller}: log_trans"
    fmt, shape, data, index = _csr.sparse_parts(backend, log_trans, name)
    if fmt != "csr":
        structure, data = validated(backend, fmt, shape, data, index, name, check)
        return structure, backend.xp.asarray(data).astype(dtype, copy=False)
    if data.ndim != 1 or data.shape[0] != index[1].shape[0]:
        _csr.to_csr(backend, fmt, shape, data, *index, name)  # raises: the data do not match the structure
    csr, _ = _structures.STRUCTURES.lookup(backend, index, shape, name, by_content=True)
    assert isinstance(csr, _csr.Csr)  # a lookup without a block size
    structure = _structures.kept(csr, "sparse_chain", lambda: _structure_of(backend, csr, name))
    return structure, backend.xp.asarray(data).astype(dtype, copy=False)


def validated(backend: Backend, fmt: str, shape: tuple[int, ...], data: Array | None, index: tuple[Array, Array],
              name: str, check: bool = True) -> tuple[Structure, Array]:
    """The :class:`Structure` of a CSR, CSC or COO matrix's parts, validated (and, with
    ``check``, free of repeated entries) and transposed, and its data in CSR order."""
    csr = _csr.to_csr(backend, fmt, shape, data, *index, name)
    assert csr.data is not None  # the parts of a matrix, values included
    return _structure_of(backend, csr, name, check), csr.data


def _structure_of(backend: Backend, csr: _csr.Csr, name: str, check: bool = True) -> Structure:
    """The :class:`Structure` of a validated ``csr``, with ``check`` free of repeated entries."""
    if check and csr.nnz:
        marks = np.full(csr.shape[1], -1, np.int64)
        host = backend.to_host
        q = _first_duplicate(host(csr.indptr), host(csr.indices), marks)
        if q >= 0:
            i = int(np.searchsorted(host(csr.indptr), q, side="right") - 1)
            raise ValueError(f"{name} stores the entry ({i}, {int(host(csr.indices)[q])}) more than once; "
                             "combine repeated log-values first (their log-sum-exp)")
    transpose, order = csr.transposed(backend)
    return Structure(csr.indptr, csr.indices, transpose.indptr, transpose.indices, order, csr.shape)


def _first_duplicate(indptr: Array, indices: Array, marks: Array) -> int:
    return int(cpu.sparse_chain.first_duplicate(indptr, indices, marks))


def _structure(chain: Chain) -> Structure:
    """The structure of a sparse chain's transitions (the sweeps here run on sparse chains only)."""
    assert chain.sparse is not None
    return chain.sparse


def _values(chain: Chain) -> Array:
    return chain.trans.reshape(-1)


def transposed_values(chain: Chain) -> Array:
    """The stored values of a sparse chain in its transpose's order (``Structure.order``),
    contiguous: what the sweeps over each state's predecessors read."""
    return chain.xp.ascontiguousarray(_values(chain)[_structure(chain).order])


def forward(chain: Chain) -> tuple[Array, Array, Array]:
    """``forward_finite`` of a sparse chain: ``(log_partition (B,), pre (B, v, c), norm (B, v))``."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    pre = xp.empty((rows, v, c), chain.x.dtype)
    norm = xp.empty((rows, v), chain.x.dtype)
    s = _structure(chain)
    if rows and not chain.backend.on_gpu:
        scaled = _scaled(chain)
        kernels = cpu.sparse_chain_scaled
        cpu.team.run(kernels.sparse_chain_forward_scaled,
                     chain.x, s.t_indptr, s.t_rows, scaled.t_values, scaled.t_e, scaled.cmax, chain.init,
                     chain.lengths, pre, norm, cpu.sparse_chain.chunks(rows))
    elif rows:  # the GPU: scaled SpMVs too, the stored values exponentiated once in the data's dtype
        t_values = transposed_values(chain)
        cmax, t_e = xp.empty(c, chain.x.dtype), xp.empty_like(t_values)
        chain.backend.launcher(cuda.sparse_chain.launch_sparse_chain_shifted_exp)(s.t_indptr, t_values, cmax, t_e)
        chain.backend.launcher(cuda.sparse_chain.launch_sparse_chain_forward_scaled)(
            chain.x, s.t_indptr, s.t_rows, t_values, t_e, cmax, chain.init, chain.lengths,
            xp.empty((rows, c), chain.x.dtype), pre, norm)
    inside = xp.arange(v)[None, :] < chain.lengths[:, None]
    log_partition = xp.where(inside, norm, 0).sum(axis=1, dtype=np.float64).astype(chain.x.dtype)
    return log_partition, pre, norm


def backward(chain: Chain, pre: Array, norm: Array, weight: Array,
             trans_grad: bool = True) -> tuple[Array, Array | None]:
    """``backward_finite`` of a sparse chain: ``(d x (B, v, c), d values (1, 1, nnz) or None)``."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    grad_trans = xp.zeros(chain.trans.shape, chain.x.dtype) if trans_grad else None
    if not rows:
        return xp.zeros_like(chain.x), grad_trans
    s = _structure(chain)
    if not chain.backend.on_gpu:
        return _backward_scaled(chain, pre, norm, weight, grad_trans)
    values = xp.ascontiguousarray(_values(chain))
    beta = xp.empty_like(chain.x)
    rmax, row_e = xp.empty(c, chain.x.dtype), xp.empty_like(values)  # the GPU: scaled SpMVs, as the forward
    chain.backend.launcher(cuda.sparse_chain.launch_sparse_chain_shifted_exp)(s.indptr, values, rmax, row_e)
    chain.backend.launcher(cuda.sparse_chain.launch_sparse_chain_backward_scaled)(
        chain.x, s.indptr, s.indices, values, row_e, rmax, chain.lengths, norm, xp.empty((rows, c), chain.x.dtype),
        beta)
    inside = (xp.arange(v)[None, :] < chain.lengths[:, None])[..., None]
    marginals, _ = renormalise(xp, xp.where(inside, xp.exp(normalised(xp, pre, chain.x, norm) + beta), 0))
    if trans_grad and values.shape[0]:
        grad_trans = _values_grad_on_device(chain, values, pre, norm, marginals, weight).reshape(chain.trans.shape)
    return weighted(xp, marginals, weight), grad_trans


def _values_grad_on_device(chain: Chain, values: Array, pre: Array, norm: Array, marg: Array,
                           weight: Array) -> Array:
    """The gradient of the stored values on the GPU, by scaled products: entry ``q = (i, j)``
    gets ``e[q] · Σ p[i] r[j]`` over the row-steps (the factors of
    :func:`spchain._chain_scaled.scaled_factors`; ``e = exp(T - cmax)``), an SDDMM of ``Pᵀ`` and
    ``Rᵀ`` at the stored entries, in float64 and in chunks of rows. Where any scale factor left
    range, the log-space kernel recomputes the whole gradient; it reads that flag on the
    device, so nothing synchronises."""
    xp, s = chain.xp, _structure(chain)
    rows, v, c = chain.x.shape
    nnz, f64 = values.shape[0], np.float64
    cmax, t_e, e = xp.empty(c, f64), xp.empty(nnz, f64), xp.empty(nnz, f64)
    shifted_exp = chain.backend.launcher(cuda.sparse_chain.launch_sparse_chain_shifted_exp)
    shifted_exp(s.t_indptr, values[s.order].astype(f64), cmax, t_e)
    e[s.order] = t_e
    acc, part_acc = xp.zeros(nnz, f64), xp.empty(nnz, f64)
    bad = xp.zeros(1, bool)
    width = max(1, _chain_scaled.CHUNK // max(v * c, 1))
    for k in range(0, rows, width):
        part = slice(k, k + width)
        p, r, flags = _chain_scaled.scaled_factors(xp, chain.x[part], pre[part], norm[part], marg[part], weight[part],
                                                   chain.lengths[part] - 1, cmax)
        chain.backend.launcher(cuda.sparse.launch_sparse_sddmm)(
            s.indptr, s.indices, xp.ascontiguousarray(p.reshape(-1, c).T), xp.ascontiguousarray(r.reshape(-1, c).T),
            part_acc)
        acc += part_acc
        bad |= flags.any()
    partial = xp.zeros((1, nnz), values.dtype)
    chain.backend.launcher(cuda.sparse_chain.launch_sparse_chain_values_grad_masked)(
        chain.x, s.indptr, s.indices, values, chain.lengths, pre, norm, marg, weight, ~bad, partial)
    return xp.where(bad, partial[0], (e * acc).astype(values.dtype))


@dataclasses.dataclass(frozen=True)
class _Scaled:
    """The stored values exponentiated once for the scaled CPU kernels (``sparse_chain_shifted_exp`` of
    ``spchain/kernels/cpu/sparse_chain_scaled.py``): shifted by their column maxima ``cmax`` (``t_e``
    in the transpose's order, ``e`` in CSR order) and by their row maxima ``rmax`` (``row_e``)."""

    t_values: Array
    t_e: Array
    e: Array
    cmax: Array
    row_e: Array
    rmax: Array


def _scaled(chain: Chain) -> _Scaled:
    s = _structure(chain)
    values = read_only(np.ascontiguousarray(_values(chain)))
    t_values = read_only(transposed_values(chain))
    c, nnz = s.shape[0], values.shape[0]
    shifted_exp = cpu.sparse_chain_scaled.sparse_chain_shifted_exp
    cmax, t_e, rmax, row_e = np.empty(c), np.empty(nnz), np.empty(c), np.empty(nnz)
    shifted_exp(s.t_indptr, t_values, cmax, t_e)
    shifted_exp(s.indptr, values, rmax, row_e)
    e = np.empty(nnz)
    e[s.order] = t_e
    return _Scaled(t_values, t_e, e, cmax, row_e, rmax)


def _backward_scaled(chain: Chain, pre: Array, norm: Array, weight: Array,
                     grad_trans: Array | None) -> tuple[Array, Array | None]:
    """:func:`backward` on the CPU: one sweep for the marginals and the value gradient."""
    s = _structure(chain)
    scaled = _scaled(chain)
    rows = chain.x.shape[0]
    nnz = scaled.e.shape[0] if grad_trans is not None else 0
    partial = np.empty((cpu.sparse_chain.chunks(rows), nnz))  # per chunk: the same bits on any number of threads
    grad_x = np.empty_like(chain.x)
    values = read_only(np.ascontiguousarray(_values(chain)))
    kernels = cpu.sparse_chain_scaled
    cpu.team.run(kernels.sparse_chain_backward_scaled,
                 chain.x, s.indptr, s.indices, values, scaled.row_e, scaled.rmax, s.t_indptr, s.t_rows,
                 scaled.t_values, s.order, scaled.e, scaled.cmax, chain.lengths, pre, norm, weight, grad_x, partial)
    if grad_trans is not None:
        grad_trans = partial.sum(axis=0).astype(chain.x.dtype).reshape(chain.trans.shape)
    return grad_x, grad_trans


def viterbi(chain: Chain) -> tuple[Array, Array]:
    """``viterbi_finite`` of a sparse chain: ``(score (B,), path (B, v) int64)``."""
    xp = chain.xp
    rows, v, c = chain.x.shape
    score = xp.empty(rows, chain.x.dtype)
    path = xp.empty((rows, v), np.int64)
    if rows:
        s = _structure(chain)
        t_values = transposed_values(chain)
        work = xp.empty((rows, 2, c), chain.x.dtype)
        backptr = xp.empty((rows, v, c), np.int32)
        args = (chain.x, s.t_indptr, s.t_rows, t_values, chain.init, chain.lengths, work, backptr, score, path)
        if chain.backend.on_gpu:
            chain.backend.launcher(cuda.sparse_chain.launch_sparse_chain_viterbi)(*args)
        else:
            cpu.team.run(cpu.sparse_chain.sparse_chain_viterbi, *args)
        path = xp.where((score == -np.inf)[:, None], -1, path)
    return score, path


def entries_of(chain: Chain, src: Array, dst: Array) -> Array:
    """The stored entry (int64, CSR order) of each transition ``src -> dst`` (arrays of one
    shape), -1 where it is absent or ``src`` is negative: a look-up in each row's entries."""
    s = _structure(chain)
    host = chain.backend.to_host
    entry = np.empty(src.size, np.int64)
    _entry_of(host(s.indptr), host(s.indices), np.ascontiguousarray(host(src)).reshape(-1),
              np.ascontiguousarray(host(dst)).reshape(-1), entry)
    return chain.xp.asarray(entry.reshape(src.shape))


def path_counts(chain: Chain, state: Array, w: Array) -> Array:
    """``d values`` (1, 1, nnz) of ``sum(w * score)`` over the transitions of the paths
    ``state`` (B, v; ``w`` 0 past each end): ``w`` on each stored entry that a path takes."""
    host = chain.backend.to_host
    entry = host(entries_of(chain, state[:, :-1], state[:, 1:])).reshape(-1)
    taken = entry >= 0
    grad = np.zeros(chain.trans.size, chain.x.dtype)
    np.add.at(grad, entry[taken], host(w[:, 1:]).reshape(-1)[taken])
    return chain.xp.asarray(grad).reshape(chain.trans.shape)


def _entry_of(*args: Array) -> None:
    cpu.sparse_chain.entry_of(*args)


def densified(chain: Chain) -> Chain:
    """``chain`` with its sparse transitions as a dense (1, 1, c, c) matrix, ``-inf`` where absent."""
    if chain.sparse is None:
        return chain
    xp = chain.xp
    c = chain.sparse.shape[0]
    dense = xp.full(c * c, -np.inf, chain.x.dtype)
    rows = _csr.row_of_entries(chain.backend, _csr.Csr(chain.sparse.indptr, chain.sparse.indices, None,
                                                      chain.sparse.shape))
    dense[rows.astype(np.int64) * c + chain.sparse.indices] = _values(chain)
    return dataclasses.replace(chain, trans=dense.reshape(1, 1, c, c), sparse=None)


def trans_grad(backend: Backend, structure: Structure, grad: Array) -> Sparse:
    """The gradient of a sparse ``log_trans`` of this ``structure`` from the sweeps' ``grad`` (its
    values, (1, 1, nnz), or a dense (1, 1, c, c) one): a CSR matrix of the structure (in CSR order)."""
    if grad.ndim == 4:
        rows = _csr.row_of_entries(backend, _csr.Csr(structure.indptr, structure.indices, None, structure.shape))
        grad = grad[0, 0][rows, structure.indices]
    return backend.sparse.csr_matrix((grad.reshape(-1), structure.indices, structure.indptr), shape=structure.shape)
