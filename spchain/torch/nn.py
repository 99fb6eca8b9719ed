"""The torch modules of spchain: :class:`SparseLinear` (a CSR weight, with dynamic sparsity),
:class:`BlockDiagonalLinear` and :class:`GroupedLinear`, built on spchain's torch operators (so
they compile, export and run under ``torch.func``, in float16/bfloat16 too).

>>> import torch, spchain.torch as st
>>> layer = st.SparseLinear(8, 4, sparsity=0.5)
>>> layer(torch.ones(3, 8)).shape, layer.nnz
(torch.Size([3, 4]), 16)
"""

import math
import numbers

import torch
from torch import nn

from .. import _backend
from .. import sparse as _sparse
from ._bridge import on_device, to_array, to_tensor
from .blockdiag import block_diag_matmul, group_sizes_tensor, grouped_matmul
from .sparse import _as_array, _csr_tensor, _rows, prune, sparse_linear

__all__ = ["SparseLinear", "BlockDiagonalLinear", "GroupedLinear"]



class _Batch:
    """The input and output gradient of one training batch, held by reference (for RigL)."""

    __slots__ = ("x", "grad_y")

    def __init__(self, x):
        self.x, self.grad_y = x, None

    def record(self, grad_y):
        self.grad_y = grad_y


def _torch_seed() -> int:
    """A seed drawn from torch's default generator, so ``torch.manual_seed`` fixes our draws."""
    return int(torch.randint(0, 2**62, ()).item())


def _moved(t: torch.Tensor, old_slots, new_slots) -> torch.Tensor:
    out = torch.zeros_like(t)
    out[new_slots] = t[old_slots]
    return out


class SparseLinear(torch.nn.Module):
    """A linear layer with a CSR weight: ``y = x @ W.T + b`` with ``W`` sparse.

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
    device, dtype
        As for ``nn.Linear``.

    Attributes
    ----------
    weight_values : Parameter, shape (nnz,)
        The only weight parameter; its gradient and any optimizer state are O(nnz). Its name
        works with ``torch.nn.utils.parametrize``, ``torch.nn.utils.prune`` and
        ``torch.ao.pruning`` (``tensor_fqn="<layer>.weight_values"``).
    weight : Tensor, shape (out_features, in_features), read-only
        A fresh dense copy of the weight (differentiable in ``weight_values``), for utilities
        that ask for a dense ``weight``; writing to it does not change the layer.
    indptr, indices : buffers (int32, or int64 past 2**31)
        The CSR structure (sorted, no duplicates): ``state_dict``, ``.to()`` and optimizers
        work unchanged. Load a state dict only into a layer of the same nnz.

    Notes
    -----
    In training mode, when autograd records, ``forward`` keeps the last batch's input and (by
    a hook) output gradient by reference, for ``prune_and_regrow(regrow="gradient")``; they
    are the ones of that batch's step, so the layer holds one batch of activations between
    steps.

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

    def __init__(self, in_features, out_features, bias=True, *, sparsity=0.9, device=None, dtype=None):
        super().__init__()
        caller = "SparseLinear"
        in_features = _sparse.check_size(caller, "in_features", in_features)
        out_features = _sparse.check_size(caller, "out_features", out_features)
        total = in_features * out_features
        nnz = total - round(_sparse.check_fraction(caller, "sparsity", sparsity) * total)
        index = torch.int32 if max(in_features, out_features, nnz) <= _sparse._INT32_MAX else torch.int64
        self._setup(in_features, out_features, torch.zeros(out_features + 1, dtype=index),
                    torch.zeros(nnz, dtype=index), torch.empty(nnz, device=device, dtype=dtype),
                    torch.empty(out_features, device=device, dtype=dtype) if bias else None)
        self.reset_parameters()

    def _setup(self, in_features, out_features, indptr, indices, values, bias):
        self.in_features, self.out_features = in_features, out_features
        self.weight_values = torch.nn.Parameter(values)
        self.register_buffer("indptr", indptr.to(values.device))
        self.register_buffer("indices", indices.to(values.device))
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = torch.nn.Parameter(bias)
        self._last_batch = None

    def reset_parameters(self) -> None:
        """Draw a new random structure of the same nnz (torch's generator) and re-initialise
        ``weight_values`` (mean kept fan-in, see the class) and ``bias`` (as ``nn.Linear``).

        A layer built on the ``meta`` device, then ``to_empty()``, becomes valid by this call.
        """
        shape = (self.out_features, self.in_features)
        backend = _backend.NUMPY
        positions = _sparse.random_positions(backend, shape[0] * shape[1], self.nnz, seed=_torch_seed())
        indptr, indices = _sparse.positions_to_csr(backend, positions, shape)
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
    def from_dense(cls, linear: torch.nn.Linear, sparsity, method="magnitude"):
        """A ``SparseLinear`` keeping ``linear``'s weights chosen by :func:`prune`, and its bias.

        Examples
        --------
        >>> import torch, spchain.torch as st
        >>> dense = torch.nn.Linear(16, 8)
        >>> sparse = st.SparseLinear.from_dense(dense, 0.75)
        >>> sparse.nnz, bool((sparse.to_dense().weight != 0).sum() <= 32)
        (32, True)
        """
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"SparseLinear.from_dense takes a torch.nn.Linear, not {type(linear).__name__}")
        weight = linear.weight.detach()
        csr = prune(weight, sparsity, method=method, seed=_torch_seed() if method == "random" else None)
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        module._setup(linear.in_features, linear.out_features, csr.crow_indices(), csr.col_indices(),
                      csr.values().clone(), bias)
        return module

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_last_batch"] = None  # activations, not part of the layer: never pickled or deep-copied
        return state

    @property
    def nnz(self) -> int:
        """The number of stored weights."""
        return self.weight_values.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """A fresh dense ``(out_features, in_features)`` copy of the weight, differentiable in
        ``weight_values``; writing to it does not change the layer."""
        values = self.weight_values
        rows = torch.repeat_interleave(torch.arange(self.out_features, device=self.indptr.device),
                                       self.indptr.diff().long())
        flat = values.new_zeros(self.out_features * self.in_features)
        flat = flat.index_add(0, rows * self.in_features + self.indices.long(), values)
        return flat.view(self.out_features, self.in_features)

    @property
    def sparsity(self) -> float:
        """The fraction of the weight's entries that are not stored."""
        total = self.in_features * self.out_features
        return 1.0 - self.nnz / total if total else 0.0

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"nnz={self.nnz}, sparsity={self.sparsity:.4g}")

    def forward(self, x):
        y = sparse_linear(x, self.weight_values, self.indptr, self.indices, (self.out_features, self.in_features), self.bias)
        if self.training and y.requires_grad:
            self._last_batch = _Batch(x.detach())
            y.register_hook(self._last_batch.record)
        return y

    def weight_csr(self) -> torch.Tensor:
        """The weight as a torch sparse CSR tensor sharing ``indptr``, ``indices`` and ``weight_values``."""
        return _csr_tensor(self.indptr, self.indices, self.weight_values, (self.out_features, self.in_features))

    def to_dense(self) -> torch.nn.Linear:
        """An equivalent ``nn.Linear`` (dense copies of the weight and bias)."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                                 device=self.weight_values.device, dtype=self.weight_values.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def prune_and_regrow(self, fraction, *, regrow="random", optimizer=None) -> None:
        """Move ``round(fraction * nnz)`` connections: drop the smallest ``|weight_values|``, grow as many new.

        Parameters
        ----------
        fraction : float in [0, 1]
        regrow : {"random", "gradient"}
            Where the new connections go, among positions not stored after the drop (a
            just-dropped one may return): uniformly at random (SET; torch's generator), or
            where the dense weight gradient ``|grad_y.T @ x|`` of the last training batch is
            largest (RigL; computed now, in row blocks, from the batch this layer recorded).
        optimizer : torch.optim.Optimizer, optional
            Its per-weight state (every state tensor shaped like ``weight_values``, e.g. Adam's
            moments) follows each surviving weight to its new slot and is zero for new ones;
            scalar state (``step``) stays.

        Under ``torch.distributed`` (initialised), rank 0's choice and ``weight_values`` are
        broadcast (the default process group; every rank must call this), so the replicas stay
        identical (each moves its own gradient and optimizer state alike).

        New connections start at zero; ``weight_values.grad``, if any, moves like optimizer state. The
        structure stays canonical CSR with the same nnz; ``indptr`` and ``indices`` are
        updated in place.
        """
        caller = "SparseLinear.prune_and_regrow"
        n_move = round(_sparse.check_fraction(caller, "fraction", fraction) * self.nnz)
        if not isinstance(regrow, str):
            raise TypeError(f"{caller}: regrow must be a str ('random' or 'gradient'), not {type(regrow).__name__}")
        if regrow not in ("random", "gradient"):
            raise ValueError(f"{caller}: regrow must be 'random' or 'gradient', not {regrow!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{caller}: optimizer must be a torch.optim.Optimizer (the one that steps this layer's "
                            f"weight_values) or None, not {type(optimizer).__name__}")
        if optimizer is not None and not any(p is self.weight_values for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(f"{caller}: the optimizer does not hold this layer's weight_values")
        gradient = None
        if regrow == "gradient":
            batch = self._last_batch
            if batch is None or batch.grad_y is None:
                raise RuntimeError(f"{caller}: regrow='gradient' needs a training batch's gradient: "
                                   "run forward and backward in training mode first")
            gradient = (_rows(batch.grad_y), _rows(batch.x))
        seed = _torch_seed()
        shape = (self.out_features, self.in_features)
        with torch.no_grad(), on_device(self.weight_values.device):
            ia, ja, va = to_array(self.indptr), to_array(self.indices), to_array(self.weight_values)
            backend = _backend.backend_of(ia, ja, va, caller=caller)
            csr = _sparse.to_csr(backend, "csr", shape, None, ia, ja, caller)
            grad_y, x = (None, None) if gradient is None else (_as_array(t) for t in gradient)
            indptr, indices, old_slots, new_slots = _sparse.drop_and_grow(
                backend, csr, va, n_move, grad_y=grad_y, x=x, seed=seed, caller=caller)
            indptr, indices, old_slots, new_slots = (to_tensor(a) for a in (indptr, indices, old_slots, new_slots))
            replicated = torch.distributed.is_available() and torch.distributed.is_initialized()
            if replicated:  # rank 0 decides, so that every replica moves the same connections
                indptr, indices, old_slots, new_slots = (t.clone() for t in (indptr, indices, old_slots, new_slots))
                for t in (indptr, indices, old_slots, new_slots):
                    torch.distributed.broadcast(t, src=0)
            moving = [self.weight_values] + ([self.weight_values.grad] if self.weight_values.grad is not None else [])
            if optimizer is not None:
                state = optimizer.state.get(self.weight_values, {})
                moving += [v for v in state.values() if torch.is_tensor(v) and v.shape == self.weight_values.shape]
            for t in moving:
                t.copy_(_moved(t, old_slots, new_slots))
            self.indptr.copy_(indptr)
            self.indices.copy_(indices)
            if replicated:
                torch.distributed.broadcast(self.weight_values.data, src=0)



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
