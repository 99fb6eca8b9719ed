"""Whole-model sparse training: ``sparsify``, ``GradualPruning`` and ``CosineDropFraction``.

``sparsify`` turns a model's ``nn.Linear`` layers into :class:`~spchain.torch.SparseLinear` in
place (uniform or ERK per-layer densities); ``GradualPruning`` lowers their density during
training on Zhu & Gupta's cubic schedule; ``CosineDropFraction`` is the cosine-decayed drop
fraction of RigL and SET, for ``SparseLinear.prune_and_regrow``.

>>> import torch, spchain.torch as st
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
>>> st.sparsify(model, 0.75)
['0', '2']
>>> model[0].nnz, model[2].nnz
(128, 32)
"""

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import torch

from .. import _backend, _csr, _selection
from . import _block_layer
from ._bridge import to_array, to_tensor
from .nn import SparseLinear, check_no_utilities

__all__ = ["sparsify", "erk_densities", "GradualPruning", "CosineDropFraction"]

Skip = str | Iterable[str] | Callable[[str, torch.nn.Module], bool] | None
"""Layers to leave dense: a name, names, or a predicate ``(name, module) -> bool``."""


def erk_densities(shapes: Sequence[tuple[int, int]], density: float) -> list[float]:
    """Per-layer densities of the Erdős-Rényi-Kernel distribution (RigL, Evci et al. 2020).

    Layer ``l`` of shape ``(n_out, n_in)`` gets density ``eps * (n_in + n_out) / (n_in * n_out)``
    with ``eps`` chosen so that the layers hold ``density`` of all their weights together; a
    layer whose density would pass 1 is kept dense and the excess goes to the others.

    Examples
    --------
    >>> [round(d, 3) for d in erk_densities([(100, 100), (10, 100)], 0.5)]
    [0.45, 1.0]
    """
    sizes = [n_out * n_in for n_out, n_in in shapes]
    raw = [(n_out + n_in) / size if size else 0.0 for (n_out, n_in), size in zip(shapes, sizes)]
    dense = {k for k, size in enumerate(sizes) if size == 0}
    eps = 0.0
    while len(dense) < len(sizes):
        sparse = [k for k in range(len(sizes)) if k not in dense]
        budget = density * sum(sizes) - sum(sizes[k] for k in dense)
        eps = max(budget, 0.0) / sum(raw[k] * sizes[k] for k in sparse)
        over = {k for k in sparse if eps * raw[k] > 1.0}
        if not over:
            break
        dense |= over
    return [1.0 if k in dense else eps * raw[k] for k in range(len(sizes))]


def _skipped(skip: Skip, linears: Mapping[str, torch.nn.Module]) -> Callable[[str, torch.nn.Module], bool]:
    """``skip`` (None, a name, names, or a predicate) as a predicate; ``ValueError`` for a name
    that is no linear layer (a typo would otherwise leave the layer silently pruned)."""
    if skip is None:
        return lambda name, module: False
    if callable(skip):
        return skip
    names = {skip} if isinstance(skip, str) else skip
    if not isinstance(names, Iterable):
        raise TypeError(f"sparsify: skip must be layer names or a predicate (name, module) -> bool, not {skip!r}")
    names = set(names)
    unknown = sorted(names - set(linears))
    if unknown:
        raise ValueError(f"sparsify: skip names {unknown}, which are not nn.Linear layers of the model")
    return lambda name, module: name in names


def sparsify(model: torch.nn.Module, sparsity: float, *, method: Literal["magnitude", "random"] = "magnitude",
             distribution: str = "uniform", skip: Skip = None, block: tuple[int, int] | None = None,
             optimizer: torch.optim.Optimizer | None = None) -> list[str]:
    """Replace ``model``'s ``nn.Linear`` layers, in place, by :class:`SparseLinear` layers.

    Build the optimizer after this call, or pass it as ``optimizer``: an optimizer made before
    and not passed keeps stepping the removed dense weights and never the new ``weight_values``.

    Only modules of type ``nn.Linear`` itself are replaced: subclasses (such as the output
    projection of ``nn.MultiheadAttention``, whose owner reads ``.weight`` directly) stay.

    Parameters
    ----------
    model : torch.nn.Module
    sparsity : float in [0, 1]
        The fraction of the replaced layers' weights to drop, over all of them together.
    method : {"magnitude", "random"}
        Which weights each layer keeps (:meth:`SparseLinear.from_dense`); the kept weights and
        the biases keep their values, device and dtype.
    distribution : {"uniform", "erk"}
        Every layer at ``sparsity``, or per-layer densities by :func:`erk_densities` (small
        layers denser, large ones sparser).
    skip : str, iterable of str, or callable (name, module) -> bool, optional
        Layers to leave dense (e.g. the classifier), by their names in ``named_modules()``.
    block : (R, C), optional
        Make block-sparse layers, pruned by whole blocks (every replaced layer's features must
        be multiples of the block; ``skip`` the others).
    optimizer : torch.optim.Optimizer, optional
        An optimizer made before the call: in its param groups each replaced ``weight``
        becomes the new ``weight_values`` and its state follows (every state tensor shaped
        like the weight, e.g. Adam's moments, keeps the kept entries; ``step`` stays). The
        biases stay the same parameters.

    Returns
    -------
    list of str
        The names of the replaced layers, in ``named_modules()`` order.

    Raises
    ------
    ValueError
        ``model`` itself an ``nn.Linear``, a name in ``skip`` that is no linear layer of
        ``model``, an unknown ``distribution``, ``sparsity`` outside [0, 1], a layer that is
        not a whole number of blocks (before any layer is replaced).

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 10))
    >>> st.sparsify(model, 0.9, distribution="erk", skip=["1"])
    ['0']
    >>> type(model[1]).__name__
    'Linear'
    """
    caller = "sparsify"
    _check_model(caller, model)
    sparsity = _csr.check_fraction(caller, "sparsity", sparsity)
    if distribution not in ("uniform", "erk"):
        raise ValueError(f"{caller}: distribution must be 'uniform' or 'erk', not {distribution!r}")
    if type(model) is torch.nn.Linear:
        raise ValueError(f"{caller} replaces layers inside a model; for one layer use SparseLinear.from_dense")
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    skipped = _skipped(skip, linears)
    chosen = [(name, m) for name, m in linears.items() if not skipped(name, m)]
    if block is not None:
        for name, m in chosen:
            _block_layer.check_block(f"{caller} (layer {name!r})", block, (m.out_features, m.in_features))
    if distribution == "erk":
        densities = erk_densities([(m.out_features, m.in_features) for _, m in chosen], 1.0 - sparsity)
    else:
        densities = [1.0 - sparsity] * len(chosen)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{caller}: optimizer must be a torch.optim.Optimizer or None, not {type(optimizer).__name__}")
    for (name, linear), density in zip(chosen, densities):
        layer = SparseLinear.from_dense(linear, min(1.0, max(0.0, 1.0 - density)), method=method, block=block)
        layer.train(linear.training)
        if linear.bias is not None:  # the same parameter: optimizers holding it keep working
            layer.bias = linear.bias
        if optimizer is not None:
            _swap(optimizer, linear.weight, layer)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return [name for name, _ in chosen]


def _swap(optimizer: torch.optim.Optimizer, weight: torch.Tensor, layer: SparseLinear) -> None:
    """Put ``layer.weight_values`` in the place of the dense ``weight`` in ``optimizer``, with
    its state gathered at the stored entries."""
    groups = [g for g in optimizer.param_groups if any(p is weight for p in g["params"])]
    for group in groups:
        group["params"] = [layer.weight_values if p is weight else p for p in group["params"]]
    state = optimizer.state.pop(weight, None)
    if state is None:
        return
    r, c = layer.block or (1, 1)
    gm, gn = layer.out_features // r, layer.in_features // c
    rows = torch.repeat_interleave(torch.arange(gm, device=layer.indptr.device), layer.indptr.diff().long())
    positions = rows * gn + layer.indices.long()

    def kept(t: torch.Tensor) -> torch.Tensor:
        if layer.block is None:
            return t.reshape(-1)[positions].clone()
        return t.reshape(gm, r, gn, c).transpose(1, 2).reshape(gm * gn, r, c)[positions].clone()

    moved = _block_layer.following(state, weight)
    optimizer.state[layer.weight_values] = {k: kept(v) if k in moved else v for k, v in state.items()}


def _units(layer: SparseLinear) -> int:
    """The number of entries (blocks, for a block layer) of ``layer``'s full weight matrix."""
    r, c = layer.block or (1, 1)
    units: int = layer.in_features * layer.out_features // (r * c)
    return units


def prune_to(layer: SparseLinear, nnz: int, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Keep the ``nnz`` stored weights of largest ``|w|`` in ``layer`` (ties to the earlier slot).

    A block layer keeps ``nnz // (R * C)`` blocks, those of largest Frobenius norm.

    The weight parameter stays the same object (its data shrinks), so optimizers keep holding
    it; its gradient and every optimizer state tensor shaped like it (Adam's moments; with
    blocks also one factored over a block's axes, as Adafactor's) keep the entries of the kept
    weights, in their new slots, exactly as in :meth:`SparseLinear.prune_and_regrow`; scalar
    state (``step``) stays.
    """
    check_no_utilities(layer, "prune_to")
    weights = layer.weight_values
    r, c = layer.block or (1, 1)
    count, block_rows = nnz // (r * c), layer.out_features // r
    if count >= weights.shape[0]:
        return
    indptr, indices = layer.get_buffer("indptr"), layer.get_buffer("indices")
    with torch.no_grad():
        scores = to_array(_block_layer.selectable(weights))
        backend = _backend.backend_of(scores)
        kept = to_tensor(_selection.largest(backend, _selection.magnitudes(backend, scores), count)).to(weights.device)
        rows = torch.repeat_interleave(torch.arange(block_rows, device=weights.device), indptr.diff())
        counts = torch.bincount(rows[kept], minlength=block_rows)
        _block_layer.carry(weights, optimizer, lambda t: t[kept])
        layer.indices = indices[kept]
        indptr[1:] = torch.cumsum(counts, 0).to(indptr.dtype)


def _check_model(caller: str, model: object) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module, not {type(model).__name__}")


class GradualPruning:
    """Gradual magnitude pruning on Zhu & Gupta's cubic schedule (arXiv:1710.01878).

    Each :class:`SparseLinear` layer of ``model`` goes from its initial sparsity ``s_i`` to its
    final sparsity ``s_f`` at the training steps ``t = start, start + every, ...,
    start + steps * every``: ``s_t = s_f + (s_i - s_f) * (1 - (t - start) / (steps * every))**3``.
    Call :meth:`step` once per training step (after ``optimizer.step()``); the first call is
    step 0, and at a scheduled step each layer keeps the ``total - round(s_t * total)``
    weights of largest magnitude (never more than it holds); a block layer counts, and
    keeps, whole blocks (those of largest norm).

    Parameters
    ----------
    model : torch.nn.Module
    final_sparsity : float in [0, 1], or mapping of layer name to float
    start : int >= 0
    steps : int >= 1
        The number of pruning steps after ``start`` (``n``).
    every : int >= 1
        Training steps between pruning steps (``Δt``).
    initial_sparsity : float in [0, 1], optional
        ``s_i`` of every layer; by default each layer's sparsity when the schedule is made.
    optimizer : torch.optim.Optimizer, optional
        Its per-weight state follows the kept weights (see :func:`prune_to`).

    Notes
    -----
    Under ``torch.compile`` each new ``nnz`` recompiles (module shapes are static); see
    :doc:`compatibility` for the configuration that keeps one graph.

    Examples
    --------
    >>> import torch, spchain.torch as st
    >>> model = torch.nn.Sequential(torch.nn.Linear(10, 10))
    >>> _ = st.sparsify(model, 0.0)
    >>> schedule = st.GradualPruning(model, 0.9, start=0, steps=3)
    >>> for _ in range(4):
    ...     schedule.step()
    ...     print(model[0].nnz)
    100
    37
    13
    10
    """

    def __init__(self, model: torch.nn.Module, final_sparsity: float | Mapping[str, float], *, start: int = 0,
                 steps: int, every: int = 1, initial_sparsity: float | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        caller = "GradualPruning"
        _check_model(caller, model)
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, SparseLinear)}
        if not self.layers:
            raise ValueError(f"{caller}: the model has no SparseLinear layers (convert it with sparsify first)")
        for name, value in (("start", start), ("steps", steps), ("every", every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "start" else 1):
                raise ValueError(f"{caller}: {name} must be an int >= {0 if name == 'start' else 1}, got {value!r}")
        self.start, self.steps, self.every, self.optimizer = start, steps, every, optimizer
        if not isinstance(final_sparsity, Mapping):
            final_sparsity = dict.fromkeys(self.layers, final_sparsity)
        if set(final_sparsity) != set(self.layers):
            raise ValueError(f"{caller}: final_sparsity names {sorted(final_sparsity)}, "
                             f"but the SparseLinear layers are {sorted(self.layers)}")
        self.final = {k: _csr.check_fraction(caller, "final_sparsity", v) for k, v in final_sparsity.items()}
        self.initial = {k: (m.sparsity if initial_sparsity is None
                            else _csr.check_fraction(caller, "initial_sparsity", initial_sparsity))
                        for k, m in self.layers.items()}
        self.t = 0

    def sparsity(self, name: str, t: int) -> float:
        """The scheduled sparsity of layer ``name`` at step ``t`` (constant between pruning steps)."""
        if t < self.start:
            return self.initial[name]
        done = min((t - self.start) // self.every, self.steps)
        s_i, s_f = self.initial[name], self.final[name]
        return s_f + (s_i - s_f) * (1.0 - done / self.steps) ** 3

    def step(self) -> None:
        """Run the current training step, then advance: at a pruning step, prune every layer to
        its scheduled sparsity."""
        t, self.t = self.t, self.t + 1
        if t < self.start or (t - self.start) % self.every or (t - self.start) // self.every > self.steps:
            return
        for name, layer in self.layers.items():
            r, c = layer.block or (1, 1)
            total = _units(layer)
            prune_to(layer, (total - round(self.sparsity(name, t) * total)) * r * c, self.optimizer)


class CosineDropFraction:
    """The drop fraction of RigL / SET at a step: ``initial / 2 * (1 + cos(pi * step / end_step))``,
    and 0 from ``end_step`` on (Evci et al. 2020).

    Examples
    --------
    >>> fraction = CosineDropFraction(0.3, end_step=100)
    >>> fraction(0), round(fraction(50), 6), fraction(100)
    (0.3, 0.15, 0.0)
    """

    def __init__(self, initial: float, end_step: int) -> None:
        self.initial = _csr.check_fraction("CosineDropFraction", "initial", initial)
        if isinstance(end_step, bool) or not isinstance(end_step, int) or end_step < 1:
            raise ValueError(f"CosineDropFraction: end_step must be an int >= 1, got {end_step!r}")
        self.end_step = end_step

    def __call__(self, step: int) -> float:
        if step >= self.end_step:
            return 0.0
        return self.initial / 2 * (1 + math.cos(math.pi * max(step, 0) / self.end_step))
