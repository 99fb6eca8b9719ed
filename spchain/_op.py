"""The array half of an operator: one prepared problem per call.

An :class:`Op` is three functions on NumPy/CuPy arrays:

- ``prepare(*args, caller=..., check=True) -> problem``: validates the arguments and lays
  them out (a frozen dataclass, or any object the other two read); ``check=False`` rebuilds
  the layout of arguments that a ``prepare`` has validated, without checks;
- ``forward(problem) -> (outputs, saved)``: the public results (a tuple of arrays) and what
  the backward needs besides the problem (a :class:`Saved`);
- ``backward(problem, saved, grads, needs) -> Grads``: from the incoming gradients of the
  outputs (``None`` where one is unused), the gradient of each differentiable argument whose
  ``needs`` is true (a :class:`Grads`, ``None`` elsewhere).

``spchain.torch``'s ``Operator`` prepares once a call: its backward reuses the forward's
problem and saved residuals. Where a torch route only passes tensors from the forward to the
backward (a registered operator's backward), :meth:`Op.residuals` flattens the residuals and
:meth:`Op.restore` rebuilds them, and the backward prepares again with ``check=False``.

>>> import numpy as np
>>> @dataclasses.dataclass(frozen=True)
... class Twice(Saved):
...     pass
>>> double = Op(lambda x, caller="f", check=True: np.asarray(x), lambda x: ((2 * x,), Twice()), Twice,
...             backward=lambda x, saved, grads, needs: Positional((2 * grads[0],)))
>>> problem = double.prepare([1.0, 2.0])
>>> outputs, saved = double.forward(problem)
>>> outputs, double.backward(problem, saved, (np.ones(2),), (True,)).ordered()
((array([2., 4.]),), (array([2., 2.]),))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from ._typing import Array

P = TypeVar("P")
S = TypeVar("S", bound="Saved")


@dataclasses.dataclass(frozen=True)
class Saved:
    """What a forward leaves for its backward: a frozen dataclass whose fields are arrays."""

    def arrays(self) -> tuple[Array, ...]:
        """The fields, in order (how a registered operator passes them as tensors)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclasses.dataclass(frozen=True)
class Grads:
    """The gradients of a backward: one field per differentiable argument, in their order,
    ``None`` where not needed."""

    def ordered(self) -> tuple[Any, ...]:
        """The fields, in the order of the differentiable arguments."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclasses.dataclass(frozen=True)
class Positional(Grads):
    """Gradients given as a sequence in the order of the differentiable arguments."""

    grads: Sequence[Any]

    def ordered(self) -> tuple[Any, ...]:
        return tuple(self.grads)


Forward = Callable[[P], tuple[tuple[Array, ...], S]]
Backward = Callable[[P, S, Sequence[Array | None], Sequence[bool]], Grads]


@dataclasses.dataclass(frozen=True)
class Op(Generic[P, S]):
    """An array-level operation as ``prepare`` / ``forward`` / ``backward`` (see the module);
    ``saved`` is the type of its residuals, ``backward`` ``None`` where it has no gradient."""

    prepare: Callable[..., P]
    forward: Forward[P, S]
    saved: Callable[..., S]
    backward: Backward[P, S] | None = None
    value: Callable[[P], tuple[Array, ...]] | None = None
    """The outputs alone, where they cost less without the residuals (default: ``forward``'s)."""
    reads_outputs: bool = True
    """Whether ``backward`` may read the outputs (its residuals hold them, or arrays sharing their
    memory): a torch operator then saves them for autograd's check that none changed in place
    before the backward, as ``torch.logsumexp`` saves its result. ``False`` where it reads only
    the arguments, as ``nn.Linear``: an in-place op on the output (``nn.ReLU(inplace=True)``)
    leaves the gradient right, so it is allowed."""

    def outputs(self, problem: P) -> tuple[Array, ...]:
        """The outputs, without residuals: a call that needs no gradient."""
        return self.value(problem) if self.value is not None else self.forward(problem)[0]

    def residuals(self, saved: S) -> tuple[Array, ...]:
        """The residuals as arrays (a registered operator's extra results)."""
        return saved.arrays()

    def restore(self, outputs: Sequence[Array], residuals: Sequence[Array]) -> S:
        """:meth:`residuals`' inverse (``outputs`` for operations whose backward reads them)."""
        return self.saved(*residuals)
