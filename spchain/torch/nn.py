"""The sparse torch layer of spchain: :class:`SparseLinear`, a CSR or block-sparse (BSR) weight
with dynamic sparsity, built on the one operator ``spchain::sparse_linear`` of both formats
(so it compiles with ``fullgraph=True``, exports and runs under ``torch.func``, in
float16/bfloat16 too). The block layers
(:class:`BlockDiagonalLinear`, :class:`GroupedLinear`) live beside their operators in
``spchain.torch.blockdiag``.

>>> import torch, spchain.torch as st
>>> layer = st.SparseLinear(8, 4, sparsity=0.5)
>>> layer(torch.ones(3, 8)).shape, layer.nnz
(torch.Size([3, 4]), 16)
"""

import math
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
from torch.nn.utils import parametrize

from .. import _csr
from . import _block_layer
from ._operator import Unscriptable
from .linear import LinearPlan, sparse_linear
from .sparse import csr_tensor, prune

__all__ = ["SparseLinear"]


class _Call:
    """One training call's input, held by its autograd graph (a hook on the node that made the
    output) until the backward hands that node the output gradient; both then join ``step``,
    the layer's record of the calls of one backward (for RigL), by reference. A call whose
    graph is dropped unused is dropped with it.

    The sparse product returns a view of the operator's output ``yᵀ`` (out, rows): its
    transpose, reshaped for an input of more than two dimensions. An in-place op on that view
    (``nn.ReLU(inplace=True)``) takes the view's own node out of the graph, so the hook goes on
    its base's node, whose gradient is the transpose of the rows' gradient.
    """

    __slots__ = ("x", "step", "transposed")

    def __init__(self, x: torch.Tensor, step: list[tuple[torch.Tensor, torch.Tensor]], y: torch.Tensor) -> None:
        self.x, self.step = x, step
        base = y._base
        self.transposed = base is not None and base.dim() == 2 and base.shape[0] == y.shape[-1] \
            and base.numel() == y.numel()
        node = base.grad_fn if base is not None and self.transposed else y.grad_fn
        if node is not None:  # y requires grad: an op's output, never a leaf
            node.register_prehook(self.record)  # a node's hook: a third of a tensor hook's cost

    def record(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        grad_y = grads[0]
        if grad_y is not None:
            self.step.append((self.x, grad_y.t() if self.transposed else grad_y))


_Arguments = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int], torch.Tensor | None]
""":func:`sparse_linear`'s arguments."""


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., features) as a matrix (batch, features), zero-size axes included."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _torch_seed() -> int:
    """A seed drawn from torch's default CPU generator, so ``torch.manual_seed`` fixes our draws
    (on the CPU whatever the default device, ``meta`` inside ``with torch.device("meta")`` included)."""
    return int(torch.randint(0, 2**62, (), device="cpu").item())


def _moved(t: torch.Tensor, old_slots: torch.Tensor, new_slots: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(t)
    out[new_slots] = t[old_slots]
    return out


class DenseCopy(torch.Tensor):
    """:attr:`SparseLinear.weight`: a dense copy of the weight that refuses writes.

    An in-place function (``nn.init.*_``, ``uniform_``, ``copy_``, ``w[...] = ...``, ``out=``)
    on it raises ``RuntimeError``, as it could not change the layer; every other function
    returns plain tensors.
    """

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        in_place = (name.endswith("_") and not name.startswith("__")) or name == "__setitem__" or \
            (name.startswith("__i") and name.endswith("__") and name != "__index__")
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
        if (in_place and isinstance(target, cls)) or isinstance(kwargs.get("out"), cls):
            raise RuntimeError(f"{name}: SparseLinear.weight is a fresh dense copy, writing to it cannot change the "
                               "layer; write to weight_values (e.g. nn.init.uniform_(layer.weight_values, -b, b)) "
                               "or call layer.reset_parameters()")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


_NORMS = {"_WeightNorm": "weight_norm", "WeightNorm": "weight_norm", "_SpectralNorm": "spectral_norm",
          "SpectralNorm": "spectral_norm"}
"""The classes of torch's weight and spectral norms (parametrizations and the older hooks)."""


class SparseLinear(Unscriptable, torch.nn.Module):
    """A linear layer with a sparse weight: ``y = x @ W.T + b`` with ``W`` CSR or block-sparse.

    Parameters
    ----------
    in_features, out_features : int
    bias : bool
        Whether to learn an additive bias (initialised as in ``nn.Linear``).
    sparsity : float in [0, 1]
        The weight stores ``nnz = in * out - round(sparsity * in * out)`` entries, at uniformly
        random positions (drawn from torch's generator, so ``torch.manual_seed`` fixes them),
        initialised ``U(-1/sqrt(f), 1/sqrt(f))`` with ``f = nnz / out_features`` the mean kept
        fan-in: the output variance of the dense ``nn.Linear`` it replaces.
    block : (R, C), optional
        Store the weight as dense ``R x C`` blocks (BSR) instead of single entries: the
        sparsity, the random structure, pruning and regrowth then count whole blocks
        (``nnzb = nblocks - round(sparsity * nblocks)``), and the forward runs
        :func:`block_sparse_linear`. ``out_features`` must be a multiple of ``R`` and
        ``in_features`` of ``C`` (``ValueError`` otherwise).
    device, dtype
        As for ``nn.Linear``.

    Attributes
    ----------
    weight_values : Parameter, shape (nnz,), or (nnzb, R, C) with ``block``
        The only weight parameter; its gradient and any optimizer state are O(nnz); initialise
        it with ``nn.init`` (elementwise ones: ``uniform_``, ``normal_``, ...). Elementwise
        ``torch.nn.utils.parametrize`` parametrizations, ``torch.nn.utils.prune`` and a
        ``torch.ao.pruning.BaseSparsifier`` with its own ``update_mask``
        (``tensor_fqn="<layer>.weight_values"``; the built-in ``WeightNormSparsifier`` takes
        2-D weights only) work on it; remove them before ``prune_and_regrow`` (which raises
        while one is attached). ``weight_norm`` and ``spectral_norm`` would normalise stored
        values, not output rows: the forward raises ``ValueError`` with them.
    weight : Tensor, shape (out_features, in_features), read-only
        A fresh dense copy of the weight (differentiable in ``weight_values``), for utilities
        that read a dense ``weight``; writing to it (``nn.init.*_(layer.weight)``, ``copy_``)
        raises ``RuntimeError``.
    indptr, indices : buffers (int32, or int64 past 2**31)
        The CSR structure (sorted, no duplicates), over the block grid with ``block``:
        ``state_dict``, ``.to()`` and optimizers work unchanged. Load a state dict only into a
        layer of the same nnz and block.
    block : (R, C) or None
        The block size of a block-sparse weight; None for a CSR one.

    Notes
    -----
    In training mode, when autograd records, an eager ``forward`` keeps its input and (by a
    hook) output gradient by reference, for ``prune_and_regrow(regrow="gradient")``: those of
    every call that the last backward reached (a layer called several times in one forward,
    shared or recurrent, adds up its calls' gradients), so the layer holds one step's
    activations between steps; a call whose output gets no backward is not kept. Under
    ``torch.compile`` (``fullgraph=True`` works) and ``torch.export`` it records nothing (a
    hook that stores Python state would break the graph): run the step before a gradient
    regrowth eagerly.

    On the CPU, eagerly, a layer whose structure stores every entry (``sparsity=0``, the
    dense start of :class:`~spchain.torch.GradualPruning`) computes as ``nn.Linear`` does:
    torch's dense product on ``weight_values`` viewed as the weight (for CSR; a copy of the
    blocks in their rows for ``block``), as fast as ``nn.Linear`` and 3x faster than the
    sparse kernels at 1024 x 1024; its output is then row-major, and a double backward
    works there.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> _ = torch.manual_seed(0)
    >>> layer = st.SparseLinear(64, 32, sparsity=0.9)
    >>> layer
    SparseLinear(in_features=64, out_features=32, bias=True, nnz=205, sparsity=0.8999)
    >>> y = layer(torch.randn(5, 64))
    >>> optimizer = torch.optim.Adam(layer.parameters())
    >>> y.square().mean().backward()
    >>> layer.prune_and_regrow(0.2, regrow="gradient", optimizer=optimizer)
    >>> layer.nnz
    205
    """

    in_features: int
    out_features: int
    block: tuple[int, int] | None
    weight_values: torch.nn.Parameter
    bias: torch.nn.Parameter | None
    indptr: torch.Tensor
    indices: torch.Tensor
    _step: list[tuple[torch.Tensor, torch.Tensor]]

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, sparsity: float = 0.9,
                 block: tuple[int, int] | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        caller = "SparseLinear"
        in_features = _csr.check_size(caller, "in_features", in_features)
        out_features = _csr.check_size(caller, "out_features", out_features)
        shape = (out_features, in_features)
        r, c = (1, 1) if block is None else _block_layer.check_block(caller, block, shape)
        total = in_features * out_features // (r * c)
        nnz = total - round(_csr.check_fraction(caller, "sparsity", sparsity) * total)
        index = torch.int32 if _csr.fits_int32(in_features, out_features, nnz) else torch.int64
        values = torch.empty((nnz,) if block is None else (nnz, r, c), device=device, dtype=dtype)
        self._setup(in_features, out_features, torch.zeros(out_features // r + 1, dtype=index),
                    torch.zeros(nnz, dtype=index), values,
                    torch.empty(out_features, device=device, dtype=dtype) if bias else None)
        self.reset_parameters()

    def _setup(self, in_features: int, out_features: int, indptr: torch.Tensor, indices: torch.Tensor,
               values: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.block = None if values.dim() == 1 else (values.shape[1], values.shape[2])
        self.weight_values = torch.nn.Parameter(values)
        self.register_buffer("indptr", indptr.to(values.device))
        self.register_buffer("indices", indices.to(values.device))
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = torch.nn.Parameter(bias)
        self._step = []

    def reset_parameters(self) -> None:
        """Draw a new random structure of the same nnz (torch's generator) and re-initialise
        ``weight_values`` (mean kept fan-in, see the class) and ``bias`` (as ``nn.Linear``).

        A layer built on the ``meta`` device, then ``to_empty()``, becomes valid by this call.
        """
        shape = (self.out_features, self.in_features)
        units = self.weight_values.shape[0]
        indptr, indices = _block_layer.random_structure(shape, self.block or (1, 1), units, _torch_seed())
        self.indptr.copy_(torch.from_numpy(indptr))
        self.indices.copy_(torch.from_numpy(indices))
        kept_fan_in = self.nnz / self.out_features if self.out_features else 0.0
        with torch.no_grad():
            bound = 1.0 / math.sqrt(kept_fan_in) if kept_fan_in > 0 else 0.0
            self.weight_values.uniform_(-bound, bound)
            if self.bias is not None:
                bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
                self.bias.uniform_(-bound, bound)

    @classmethod
    def from_dense(cls, linear: torch.nn.Linear, sparsity: float | None = None,
                   method: Literal["magnitude", "random"] = "magnitude", *, block: tuple[int, int] | None = None,
                   pattern: str | None = None) -> "SparseLinear":
        """A ``SparseLinear`` keeping ``linear``'s weights chosen by :func:`spchain.prune`, and its bias.

        ``method`` "magnitude" or "random" keeps ``sparsity`` of the entries, or with
        ``block=(R, C)`` of the blocks (those of largest Frobenius norm, or random ones; a BSR
        layer). ``pattern="n:m"`` (e.g. ``"2:4"``) keeps in every group of ``m`` consecutive
        inputs of each output the ``n`` of largest ``|w|``: a CSR layer with exactly ``n``
        entries per group (``sparsity`` is ``1 - n / m``: leave it None). It runs on spchain's
        kernels on every device (torch's semi-structured CUDA kernels are not used yet), and
        ``prune_and_regrow`` does not keep the pattern.

        Examples
        --------
        >>> import torch, spchain.torch as st
        >>> dense = torch.nn.Linear(16, 8)
        >>> sparse = st.SparseLinear.from_dense(dense, 0.75)
        >>> sparse.nnz, bool((sparse.to_dense().weight != 0).sum() <= 32)
        (32, True)
        >>> st.SparseLinear.from_dense(dense, 0.5, block=(4, 4)).weight_values.shape
        torch.Size([4, 4, 4])
        >>> st.SparseLinear.from_dense(dense, pattern="2:4").nnz
        64
        """
        caller = "SparseLinear.from_dense"
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"{caller} takes a torch.nn.Linear, not {type(linear).__name__}")
        if block is not None and pattern is not None:
            raise ValueError(f"{caller}: pass block or pattern, not both")
        if sparsity is None and pattern is None:
            raise ValueError(f"{caller} needs a sparsity (or an N:M pattern='n:m')")
        if not isinstance(method, str):
            raise TypeError(f"{caller}: method must be a str ('magnitude' or 'random'), not {type(method).__name__}")
        if method not in ("magnitude", "random") or (pattern is not None and method != "magnitude"):
            raise ValueError(f"{caller}: method must be 'magnitude' or 'random' (with a pattern, 'magnitude'; "
                             f"for N:M pruning pass pattern='n:m'), not {method!r}")
        weight = linear.weight.detach()
        seed = _torch_seed() if method == "random" else None
        if block is None and pattern is None:
            assert sparsity is not None  # checked above: no pattern, so a sparsity
            low = weight.dtype in (torch.float16, torch.bfloat16)  # prune takes float32/64: an exact copy
            csr = prune(weight.float() if low else weight, sparsity, method=method, seed=seed)
            indptr, indices, values = csr.crow_indices(), csr.col_indices(), csr.values().to(weight.dtype, copy=True)
        else:
            if block is not None:
                _block_layer.check_block(caller, block, tuple(weight.shape))
            indptr, indices, values = _block_layer.prune_dense(weight, sparsity, method, seed, block, pattern, caller)
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        module._setup(linear.in_features, linear.out_features, indptr, indices, values, bias)
        return module

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_step"] = []  # activations, not part of the layer: never pickled or deep-copied
        state.pop("_plan", None)  # a copy prepares its own
        return state

    @property
    def nnz(self) -> int:
        """The number of stored weights (``nnzb * R * C`` with ``block``)."""
        return self.weight_values.numel()

    @property
    def weight(self) -> torch.Tensor:
        """A fresh dense ``(out_features, in_features)`` copy of the weight, differentiable in
        ``weight_values``; writing to it raises ``RuntimeError`` (:class:`DenseCopy`)."""
        return self._dense().as_subclass(DenseCopy)

    def _dense(self) -> torch.Tensor:
        values = self.weight_values
        if self.block is not None:
            return _block_layer.dense_weight(values, self.indptr, self.indices, (self.out_features, self.in_features))
        rows = torch.repeat_interleave(torch.arange(self.out_features, device=self.indptr.device),
                                       self.indptr.diff().long())
        flat = values.new_zeros(self.out_features * self.in_features)
        flat = flat.index_add(0, rows * self.in_features + self.indices.long(), values)
        return flat.view(self.out_features, self.in_features)

    def _utilities(self) -> list[object]:
        """The torch utilities that compute ``weight_values``: its parametrizations and the
        forward pre-hooks of ``nn.utils.prune`` and the older ``weight_norm``/``spectral_norm``."""
        found: list[object] = []
        if parametrize.is_parametrized(self, "weight_values"):
            found += list(self.get_submodule("parametrizations.weight_values").children())
        return found + [h for h in self._forward_pre_hooks.values()
                        if "weight_values" in (getattr(h, "_tensor_name", None), getattr(h, "name", None))]

    @property
    def sparsity(self) -> float:
        """The fraction of the weight's entries that are not stored."""
        total = self.in_features * self.out_features
        return 1.0 - self.nnz / total if total else 0.0

    def extra_repr(self) -> str:
        block = "" if self.block is None else f", block={self.block}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"nnz={self.nnz}, sparsity={self.sparsity:.4g}{block}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # "parametrizations" in _modules: parametrize.is_parametrized(self), 1.5 us faster
        shape = (self.out_features, self.in_features)
        if self._forward_pre_hooks or "parametrizations" in self._modules:
            norms = [_NORMS[type(u).__name__] for u in self._utilities() if type(u).__name__ in _NORMS]
            if norms:
                raise ValueError(f"SparseLinear: {norms[0]} on weight_values would normalise the stored values, not "
                                 "each output row as on nn.Linear; it is not supported (remove it)")
            args: _Arguments = (x, self.weight_values, self.indptr, self.indices, shape, self.bias)
        else:
            try:  # the module's own dictionaries, where nn.Module.__getattr__ finds them (0.3 us an attribute)
                parameters, buffers = self._parameters, self._buffers
                args = cast(_Arguments, (x, parameters["weight_values"], buffers["indptr"], buffers["indices"], shape,
                                         parameters["bias"]))
            except KeyError:  # one replaced by a plain attribute
                args = (x, self.weight_values, self.indptr, self.indices, shape, self.bias)
        plan: LinearPlan | None = self.__dict__.get("_plan")
        if plan is None:  # also a layer unpickled without one
            plan = self.__dict__["_plan"] = LinearPlan()
        y = plan(*args)  # on the CPU: the kept structure, past the operator's checks
        if y is None:
            y = sparse_linear(*args)
        if self.training and y.requires_grad and not torch.compiler.is_compiling():  # a hook would break the graph
            step = self.__dict__["_step"]
            if step:  # a backward since the last call: this call starts the next step's record
                step = self.__dict__["_step"] = []  # not nn.Module's __setattr__ (2 us)
            _Call(x.detach(), step, y)
        return y

    def weight_csr(self) -> torch.Tensor:
        """The weight as a torch sparse CSR tensor (BSR with ``block``) sharing ``indptr``,
        ``indices`` and ``weight_values``."""
        if self.block is not None:
            return _block_layer.bsr_tensor(self.indptr, self.indices, self.weight_values,
                                           (self.out_features, self.in_features))
        return csr_tensor(self.indptr, self.indices, self.weight_values, (self.out_features, self.in_features))

    def to_dense(self) -> torch.nn.Linear:
        """An equivalent ``nn.Linear`` (dense copies of the weight and bias)."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                                 device=self.weight_values.device, dtype=self.weight_values.dtype)
        with torch.no_grad():
            linear.weight.copy_(self._dense())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def prune_and_regrow(self, fraction: float, *, regrow: Literal["random", "gradient"] = "random",
                         optimizer: torch.optim.Optimizer | None = None) -> None:
        """Move ``round(fraction * nnz)`` connections: drop the smallest ``|weight_values|``, grow as many new.

        With ``block``, whole blocks move: the ``round(fraction * nnzb)`` blocks of smallest
        Frobenius norm are dropped, and new blocks grow where the block norms of the dense
        gradient are largest (or at random); optimizer state follows each block.

        Parameters
        ----------
        fraction : float in [0, 1]
        regrow : {"random", "gradient"}
            Where the new connections go, among positions not stored after the drop (a
            just-dropped one may return): uniformly at random (SET; torch's generator), or
            where the dense weight gradient ``|grad_y.T @ x|`` of the last training batch is
            largest (RigL; computed now, in row blocks, from the calls this layer recorded: those
            of the last backward, summed over the calls of a layer used several times).
        optimizer : torch.optim.Optimizer, optional
            Its per-weight state (every state tensor shaped like ``weight_values``, e.g. Adam's
            moments, or factored over a block's axes, as Adafactor's) follows each surviving
            weight to its new slot and is zero for new ones; scalar state (``step``) stays.

        Under ``torch.distributed`` (initialised), rank 0's choice and ``weight_values`` are
        broadcast (the default process group; every rank must call this), so the replicas stay
        identical (each moves its own gradient and optimizer state alike).

        New connections start at zero; ``weight_values.grad``, if any, moves like optimizer state. The
        structure stays canonical CSR with the same nnz; ``indptr`` and ``indices`` are
        updated in place.
        """
        caller = "SparseLinear.prune_and_regrow"
        n_move = round(_csr.check_fraction(caller, "fraction", fraction) * self.weight_values.shape[0])
        if not isinstance(regrow, str):
            raise TypeError(f"{caller}: regrow must be a str ('random' or 'gradient'), not {type(regrow).__name__}")
        if regrow not in ("random", "gradient"):
            raise ValueError(f"{caller}: regrow must be 'random' or 'gradient', not {regrow!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{caller}: optimizer must be a torch.optim.Optimizer (the one that steps this layer's "
                            f"weight_values) or None, not {type(optimizer).__name__}")
        check_no_utilities(self, caller)
        if optimizer is not None and not any(p is self.weight_values for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(f"{caller}: the optimizer does not hold this layer's weight_values")
        gradient = None
        if regrow == "gradient":
            if not self._step:
                raise RuntimeError(f"{caller}: regrow='gradient' needs a training batch's gradient: "
                                   "run forward and backward in training mode (eagerly, not compiled) first")
            # the dense gradient of all the step's calls: sum_k grad_y_k.T @ x_k, one product of their rows
            grad_y, x = (torch.cat([_rows(t) for t in ts]) for ts in zip(*((g, x) for x, g in self._step)))
            gradient = (grad_y, x)
        seed = _torch_seed()
        shape = (self.out_features, self.in_features)
        with torch.no_grad():
            indptr, indices, old_slots, new_slots = _block_layer.drop_and_grow(
                self.weight_values, self.indptr, self.indices, shape, n_move, gradient=gradient, seed=seed, caller=caller)
            replicated = torch.distributed.is_available() and torch.distributed.is_initialized()
            if replicated:  # rank 0 decides, so that every replica moves the same connections
                indptr, indices, old_slots, new_slots = (t.clone() for t in (indptr, indices, old_slots, new_slots))
                for t in (indptr, indices, old_slots, new_slots):
                    torch.distributed.broadcast(t, src=0)
            _block_layer.carry(self.weight_values, optimizer, lambda t: _moved(t, old_slots, new_slots))
            self.indptr.copy_(indptr)
            self.indices.copy_(indices)
            if replicated:
                torch.distributed.broadcast(self.weight_values.data, src=0)


def check_no_utilities(layer: SparseLinear, caller: str) -> None:
    """``ValueError`` naming the torch utility attached to ``layer.weight_values``, if any: a
    change of structure would move the stored values but not the utility's own tensors."""
    utilities = layer._utilities()
    if utilities:
        names = ", ".join(sorted({type(u).__name__ for u in utilities}))
        raise ValueError(f"{caller}: weight_values has torch utilities attached ({names}: torch.nn.utils.parametrize, "
                         "nn.utils.prune, torch.ao.pruning or a weight/spectral norm); their tensors would not follow "
                         "the new structure: remove them first (parametrize.remove_parametrizations, "
                         "prune.remove, sparsifier.squash_mask)")
