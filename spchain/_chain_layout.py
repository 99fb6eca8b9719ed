"""The layout of a chain problem: validation, the broadcast batch and the rows the sweeps use.

:func:`layout` is the one shape rule of the chain functions (the broadcast batch shape, and
whether ``log_trans`` holds one matrix per step or one shared by all), on shapes alone, so
that ``spchain.torch``'s fake implementations share it; :func:`prepare` validates the inputs
with it and brings them to the sweeps' :class:`Chain` layout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import scipy.sparse

from . import _backend, _checks, _sparse_chain
from ._typing import Array, Shape


@dataclass
class Chain:
    """A chain problem in the layout the sweeps use.

    The broadcast batch axes are reordered so that the axes along which the transitions vary
    come first: rows ``g * group ... (g + 1) * group - 1`` then share ``trans[g]``.
    """

    backend: _backend.Backend
    x: Array  # (B, v, c), contiguous
    trans: Array  # (G, S, c, c): S = v - 1 per-step matrices, or S = 1 shared by all steps
    init: Array  # (B, c)
    lengths: Array  # (B,) int64, in 1..v
    group: int
    max_length: int
    batch_shape: Shape
    order: Shape
    x_shape: Shape
    sparse: _sparse_chain.Structure | None = None  # where trans holds its values, (1, 1, nnz)

    def __post_init__(self) -> None:
        # The inputs are read, never written: on the CPU they reach the kernels as read-only
        # views, whether or not they came from a broadcast or from the caller read-only, so
        # that Numba compiles one signature a dtype and rank, not one per combination of flags.
        for name in ("x", "trans", "init", "lengths"):
            setattr(self, name, _backend.read_only(getattr(self, name)))

    @property
    def xp(self) -> ModuleType:
        return self.backend.xp

    @functools.cached_property
    def _maxima(self) -> tuple[float, ...]:
        """The largest entry of x, the transitions and init (NaN where one holds NaN: NaN wins
        a max; ``-inf`` where one is empty): one pass each without a temporary, and one read of
        the device on the GPU, which tells the usual case (no ``+inf``, no NaN) at once."""
        xp = self.xp
        found = [xp.asarray(a.max() if a.size else -np.inf, np.float64) for a in (self.x, self.trans, self.init)]
        return tuple(float(m) for m in self.backend.to_host(xp.stack(found)))

    @property
    def has_nan(self) -> bool:
        """Whether an input holds NaN (anywhere: also past a length or in an untaken step)."""
        return any(math.isnan(m) for m in self._maxima)

    @functools.cached_property
    def has_plus_inf(self) -> bool:
        """Whether an input holds ``+inf`` (read once: the forward's scan serves its backward)."""
        if not self.has_nan:
            return any(m == np.inf for m in self._maxima)
        # NaN hides a +inf from the max; a == inf: one pass, where isposinf takes three
        return bool((self.x == np.inf).any() | (self.trans == np.inf).any() | (self.init == np.inf).any())

    @functools.cached_property
    def nan_rows(self) -> Array:
        """(B,) whether each row reads a NaN: in ``x`` before its length, in ``init``, or in
        the transition matrix of one of its steps (a sparse ``log_trans``: in any stored value);
        found once, for a forward and its backward."""
        xp = self.xp
        rows, v, _ = self.x.shape
        if not self.has_nan:
            return xp.zeros(rows, bool)
        positions = xp.arange(v)
        nan = (xp.isnan(self.x).any(axis=2) & (positions < self.lengths[:, None])).any(axis=1)
        nan |= xp.isnan(self.init).any(axis=1)
        if rows and v > 1:
            matrices = xp.isnan(self.trans).any(axis=-1)  # (G, S) for sparse values, (G, S, c) dense
            matrices = matrices if self.sparse is not None else matrices.any(axis=-1)
            used = positions[:matrices.shape[1]] < self.lengths[:, None] - 1  # (B, S): the steps each row takes
            nan |= (xp.repeat(matrices, self.group, axis=0) & used).any(axis=1)
        return nan

    @property
    def per_step(self) -> bool:
        """Whether step t uses its own matrix ``trans[:, t]`` (else all use ``trans[:, 0]``)."""
        return bool(self.trans.shape[1] > 1)

    def step_matrices(self, t: int) -> Array:
        """The (G, c, c) transition matrices of step ``t -> t + 1``."""
        return self.trans[:, t if self.per_step else 0]

    def rows(self, a: Array, tail: Shape = ()) -> Array:
        """A batch-shaped array (``batch_shape + tail``, broadcastable) in row order, (B, *tail)."""
        return _rows(self.xp, self.batch_shape, self.order, a, tail)

    def unrows(self, a: Array) -> Array:
        """The inverse of :meth:`rows`: (B, *tail) back to ``batch_shape + tail`` (contiguous)."""
        nd = len(self.batch_shape)
        tail = a.shape[1:]
        a = a.reshape(tuple(self.batch_shape[k] for k in self.order) + tail)
        if self.order == tuple(range(nd)):
            return a
        return a.transpose(tuple(np.argsort(self.order)) + tuple(range(nd, nd + len(tail)))).copy()


def _rows(xp: ModuleType, batch_shape: Shape, order: Shape, a: Array, tail: Shape) -> Array:
    """:meth:`Chain.rows` of a chain with this batch shape and order."""
    nd = len(batch_shape)
    a = xp.broadcast_to(a, batch_shape + tail)
    a = a.transpose(order + tuple(range(nd, nd + len(tail))))
    return xp.ascontiguousarray(a).reshape((int(np.prod(batch_shape)),) + tail)


def _check_dense(caller: str, name: str, a: object, required: bool) -> None:
    """``TypeError`` naming ``name`` unless ``a`` is a dense array, a list / tuple or a Python
    scalar (or ``None``, where the argument is optional)."""
    if a is None:
        if required:
            raise TypeError(f"{caller}: {name} is required (an array), got None")
        return
    if scipy.sparse.issparse(a) or hasattr(a, "tocsr"):
        hint = " (a sparse log_trans must be one (c, c) matrix)" if name == "log_trans" else ""
        raise TypeError(f"{caller}: {name} must be a dense array, not a sparse {type(a).__name__}{hint}")
    if not (hasattr(a, "dtype") and hasattr(a, "shape") or isinstance(a, (list, tuple, int, float, np.generic))):
        raise TypeError(f"{caller}: {name} must be an array (or a list or a number), not {type(a).__name__}")

def layout(caller: str, x_shape: Shape, trans_shape: Shape, init_shape: Shape | None = None,
           lengths_shape: Shape | None = None) -> tuple[Shape, bool]:
    """``(batch_shape, per_step)`` of chain inputs of these shapes; ``ValueError`` where they
    do not fit together.

    ``log_trans`` holds one matrix per step where it has one more axis than ``x``, else one
    matrix shared by all steps; a 0-d ``log_trans`` is a (c, c) matrix and a 0-d ``log_init``
    a (c,) vector. The leading axes of all four broadcast to ``batch_shape``.

    >>> layout("f", (2, 5, 3), (3, 3))
    ((2,), False)
    >>> layout("f", (2, 5, 3), (2, 4, 3, 3), (3,), (2,))
    ((2,), True)
    """
    x_shape, trans_shape = tuple(x_shape), tuple(trans_shape)
    if len(x_shape) < 2:
        raise ValueError(f"{caller}: x must have shape (..., v, c), got {x_shape}")
    v, c = x_shape[-2:]
    if v < 1:
        raise ValueError(f"{caller}: x has shape {x_shape}: a chain needs at least one position (v >= 1)")
    trans_shape = trans_shape or (c, c)
    init_shape = (c,) if init_shape is None or init_shape == () else tuple(init_shape)
    if len(trans_shape) < 2 or trans_shape[-2:] != (c, c):
        raise ValueError(f"{caller}: log_trans must end in (c, c) = ({c}, {c}) to match x {x_shape}, "
                         f"got {trans_shape}")
    per_step = len(trans_shape) == len(x_shape) + 1
    if per_step and trans_shape[-3] != v - 1:
        raise ValueError(f"{caller}: log_trans {trans_shape} has one more axis than x {x_shape}, so it "
                         f"holds one matrix per step and its axis -3 must be v - 1 = {v - 1}")
    trans_batch = trans_shape[:-3] if per_step else trans_shape[:-2]
    if init_shape[-1] != c:
        raise ValueError(f"{caller}: log_init must have shape (..., c) with c = {c}, got {init_shape}")
    length_shape = () if lengths_shape is None else tuple(lengths_shape)
    try:
        batch_shape = _checks.broadcast_shapes(x_shape[:-2], trans_batch, init_shape[:-1], length_shape)
    except ValueError:
        kind = "one matrix per step" if per_step else "shared by all steps (per-step transitions have one more axis than x)"
        raise ValueError(f"{caller}: batch shapes do not broadcast: x {x_shape[:-2]}, log_trans {trans_batch} "
                         f"(log_trans {trans_shape} is {kind}), log_init {init_shape[:-1]}, "
                         f"lengths {length_shape}") from None
    return tuple(batch_shape), per_step


def prepare(x: Any, log_trans: Any, log_init: Any, lengths: Any, caller: str, check: bool = True) -> Chain:
    """Validate the inputs of a chain function and bring them to the sweeps' layout.

    Lists and Python numbers are converted to arrays; a number broadcasts like a 0-d array
    (a scalar ``log_trans`` is a (c, c) matrix filled with it, a scalar ``log_init`` a
    (c,) vector), so only ``x`` needs its full (..., v, c) shape. ``check=False`` rebuilds
    the layout of inputs that a forward has validated (a backward's): no type or value checks.
    The inputs are anything a caller passed (hence ``Any``): this is where they are checked.
    """
    sparse = _sparse_chain.is_sparse(log_trans) and len(log_trans.shape) == 2
    if check:
        for name, a, required in (("x", x, True), ("log_trans", log_trans, True),
                                  ("log_init", log_init, False), ("lengths", lengths, False)):
            if not (sparse and name == "log_trans"):
                _check_dense(caller, name, a, required)
    backend = _backend.backend_of(*(a for a in (x, log_trans, log_init, lengths) if hasattr(a, "dtype")),
                                  caller=caller)
    xp = backend.xp
    named = {"x": x, "log_trans": log_trans, "log_init": log_init}
    dtype = _checks.float_dtype(caller, **{k: a for k, a in named.items() if hasattr(a, "dtype")})
    x, log_trans, log_init = (a if a is None or hasattr(a, "dtype") else xp.asarray(a, dtype)
                              for a in named.values())
    structure = None
    if sparse:  # from here on, log_trans is its stored values and its shape is the structure's
        structure, log_trans = _sparse_chain.split(backend, log_trans, dtype, caller, check)
    if lengths is not None:
        lengths = xp.asarray(lengths)
        if check and not np.issubdtype(np.dtype(lengths.dtype), np.integer):
            raise TypeError(f"{caller}: lengths must hold integers, got dtype {lengths.dtype}")
    trans_shape = log_trans.shape if structure is None else structure.shape
    batch_shape, per_step = layout(caller, x.shape, trans_shape, None if log_init is None else log_init.shape,
                                   None if lengths is None else lengths.shape)
    v, c = x.shape[-2:]
    if log_trans.ndim == 0:
        log_trans = xp.broadcast_to(log_trans, (c, c))
    if log_init is None:
        log_init = xp.zeros((c,), dtype)
    elif log_init.ndim == 0:
        log_init = xp.broadcast_to(log_init, (c,))
    nd = len(batch_shape)
    trans_batch = trans_shape[:-3] if per_step else trans_shape[:-2]
    trans_batch = (1,) * (nd - len(trans_batch)) + tuple(trans_batch)
    varying = tuple(k for k in range(nd) if trans_batch[k] != 1)  # an empty axis varies too: 0 groups
    order = varying + tuple(k for k in range(nd) if trans_batch[k] == 1)
    groups = int(np.prod([batch_shape[k] for k in varying], dtype=np.int64))
    rows = int(np.prod(batch_shape, dtype=np.int64))
    group = rows // groups if groups else 0
    steps = v - 1 if per_step else 1
    trans = log_trans.reshape(1, 1, -1) if sparse else \
        xp.ascontiguousarray(log_trans, dtype=dtype).reshape(groups, steps, c, c)
    x_rows = _rows(xp, batch_shape, order, x.astype(dtype, copy=False), (v, c))
    init = _rows(xp, batch_shape, order, log_init.astype(dtype, copy=False), (c,))
    max_length = v
    if lengths is None:
        lengths = xp.full((rows,), v, dtype=np.int64)
    else:
        if rows:  # read in the caller's dtype: a uint64 past int64 is reported as given
            low, high = int(lengths.min()), int(lengths.max())
            if check and (low < 1 or high > v):
                raise ValueError(f"{caller}: lengths must lie in 1..v = 1..{v}, got values from {low} to {high}")
            max_length = high
        lengths = _rows(xp, batch_shape, order, lengths.astype(np.int64, copy=False), ())
    return Chain(backend, x_rows, trans, init, lengths, group, max_length, batch_shape, order, x.shape, structure)
