"""One way to make a torch operator of an array-level forward/backward pair.

:class:`Operator` registers ``spchain::<name>`` (``torch.library.custom_op``) with a fake
implementation (symbolic sizes stay symbolic: ``torch.export`` with dynamic shapes), a
batching rule and autograd, and ``spchain::<name>_backward`` for its gradient; calling it runs
the public function. Each call takes one of three routes:

- plain eager tensors (no compile, export, ``torch.func`` transform, dual level, tracer or fake
  tensor): the array-level functions run directly, inside an ``autograd.Function`` only when a
  gradient is needed (an operator's dispatch would cost more than a small product itself),
  which keeps the forward's prepared problem and residuals on its context for the backward:
  one ``prepare`` a forward and backward (:meth:`Operator.record` takes a problem its caller
  kept, as ``SparseLinear``'s plan does);
- a ``torch.func`` transform or an eager ``torch.autograd.forward_ad`` dual level (outside
  ``torch.compile``): the registered operators inside an ``autograd.Function`` with
  ``setup_context`` and a ``jvp``;
- anything else: the registered operators, inside the same ``autograd.Function`` without the
  ``jvp`` (Dynamo refuses a custom one); ``torch.compile`` and ``torch.export`` see opaque
  operators with fake implementations.

The array half is an :class:`spchain._op.Op` (``prepare`` / ``forward`` / ``backward``).
The registered operators pass tensors only, so ``spchain::<name>_backward`` prepares again
from the saved arguments, without checks (``check=False``). All routes run the same
array-level code, so they give the same results. float16 and
bfloat16 inputs are cast to float32 before the operator and its results back after, so the
operators see float32 and float64 only and what autograd saves stays in float32. Under
``torch.autocast`` an operator computes in float32 too and returns what torch's own operations
would: autocast's dtype for a product (as ``torch.matmul``), float32 for a log-space operator
(as ``torch.logsumexp``); float64 inputs stay float64.

Forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``) gives the exact
tangent where an operator has a ``jvp`` and raises ``NotImplementedError`` where it has none
(or for a tangent of an argument it does not differentiate); integer results have no tangent.
Double backward is not implemented: differentiating a gradient (``create_graph=True``,
Hessians, gradient penalties, nested ``torch.func.grad``, forward over reverse) raises a
``RuntimeError`` (``NotImplementedError`` for forward over reverse): never a silently
first-order answer. :data:`OPERATORS` holds every operator made, for ``torch.library.opcheck``.
"""

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, NoReturn, TypeVar, cast, overload

import torch
from torch._compile import _disable_dynamo
from torch.autograd import forward_ad

from .. import _op
from ._bridge import bridge, to_array, to_tensor

if TYPE_CHECKING:
    from torch._functorch.autograd_function import VmapInfo

_LOW = (torch.float16, torch.bfloat16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)

Fake = Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
"""A forward on fake tensors."""
Jvp = Callable[["Operator[Any]", Sequence[Any], Sequence[torch.Tensor], Sequence[torch.Tensor | None]],
               Sequence[torch.Tensor | None]]
"""``jvp(operator, args, results, tangents)`` on tensors: the tangents of the public results
from those of the differentiable arguments (``None`` where one has none), by torch operations
and operators (``operator.op``, :meth:`Operator.gradients`), so that transforms compose with it."""
Public = TypeVar("Public", bound=torch.Tensor | tuple[torch.Tensor, ...])
"""What calling an :class:`Operator` returns: a tensor, or a tuple of its ``outputs`` tensors."""
Batched = tuple[torch.Tensor | tuple[torch.Tensor, ...], int | tuple[int, ...]]
"""What a vmap rule returns: the batched results and the batch axis of each."""


F = TypeVar("F", bound=Callable[..., Any])


def run_eagerly(fn: F) -> F:
    """``torch.compiler.disable`` on demand: ``torch.compile`` breaks the graph at ``fn`` and
    runs it eagerly. Dynamo is imported at ``fn``'s first call, not by decorating it (Dynamo's
    import takes a second, which every ``import spchain.torch`` paid); torch's own lazy form."""
    return cast(F, _disable_dynamo(fn))


class Unscriptable:
    """A base of spchain's modules: ``torch.jit.script`` (of the module or of a model holding
    it) raises a ``RuntimeError`` that names the supported compilers, where TorchScript would
    fail on whichever Python construct of the forward it met first.

    >>> import torch, spchain.torch as st
    >>> torch.jit.script(torch.nn.Sequential(st.SparseLinear(4, 4)))
    Traceback (most recent call last):
    ...
    RuntimeError: spchain.torch.SparseLinear: torch.jit.script cannot compile spchain's modules
    (their forward is Python around spchain's operators); use torch.compile or torch.export
    """

    def __prepare_scriptable__(self) -> NoReturn:  # torch.jit.script calls it first, on every submodule
        raise RuntimeError(f"spchain.torch.{type(self).__name__}: torch.jit.script cannot compile spchain's modules "
                           "(their forward is Python around spchain's operators); use torch.compile or torch.export")


def plain_eager(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether ``tensors`` are ordinary CPU/CUDA tensors outside every tracer and transform."""
    return _untraced() and all(_plain(t) for t in tensors)


def _untraced() -> bool:
    """Whether no compiler, tracer, ``torch.func`` transform or dispatch mode is active."""
    return not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
                or torch._C._is_tracing() or torch._C._len_torch_dispatch_stack())


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is an ordinary CPU/CUDA tensor (no subclass, no fake or meta tensor)."""
    return type(t) in _PLAIN and (t.is_cpu or t.is_cuda)


OPERATORS: dict[str, "Operator[Any]"] = {}
"""Every :class:`Operator` made, by its operator's name (``spchain::<name>``)."""


class Operator(Generic[Public]):
    """An array-level forward/backward pair as the torch operator ``spchain::<name>``.

    Parameters
    ----------
    name, schema
        The operator's name and schema, e.g. ``"logmatmul"``, ``"(Tensor a, Tensor b) -> Tensor"``.
    forward
        The array half, an :class:`spchain._op.Op` whose ``prepare`` takes the operator's
        arguments (tensors as NumPy/CuPy arrays); its ``forward``'s outputs are the public
        results, its residuals (:meth:`~spchain._op.Op.residuals`) the registered operator's
        further results, and its ``backward`` (``None``: not differentiable) gives the gradient
        of each argument at ``differentiable`` whose ``needs`` is true.
    fake
        The same on fake tensors: results of the right shapes, dtypes and devices.
    outputs
        How many of the results the public function returns.
    differentiable
        Positions of the differentiable arguments.
    leading_batch
        Positions of the tensor arguments whose leading axes are batch axes that the function
        maps over independently: ``vmap`` over those makes one call; over others, a call a slice.
    backward_reads
        Positions of the arguments that ``backward`` reads (default all); the others reach it
        as ``None``, so that no array is made of them (a non-contiguous one would be copied).
    strided
        Positions of the tensor arguments that cross in their own layout (a NumPy/CuPy view
        with their strides) for an array-level function that reads any layout; the others are
        made contiguous first. Where it names any, the incoming gradients cross in their own
        layout too (the backward reads any layout as well).

    Examples
    --------
    >>> from spchain._op import Op, Positional, Saved
    >>> twice = Op(lambda x, caller, check=True: x, lambda x: ((2 * x,), Saved()), Saved,
    ...            backward=lambda x, saved, grads, needs: Positional((2 * grads[0],)))
    >>> double = Operator("doc_double", "(Tensor x) -> Tensor", twice, torch.empty_like,
    ...                   differentiable=(0,), leading_batch=(0,))
    >>> torch.func.grad(lambda x: double(x).sum())(torch.ones(2))
    tensor([2., 2.])
    """

    @overload
    def __init__(self: "Operator[torch.Tensor]", name: str, schema: str, forward: _op.Op[Any, Any],
                 fake: Fake, *, outputs: Literal[1] = ...,
                 differentiable: Iterable[int] = ..., leading_batch: Sequence[int] = ...,
                 backward_reads: Iterable[int] | None = ..., strided: Iterable[int] = ..., jvp: Jvp | None = ...,
                 autocast: Literal["lower", "float32"] = ..., caller: str | None = ...) -> None: ...

    @overload
    def __init__(self: "Operator[tuple[torch.Tensor, torch.Tensor]]", name: str, schema: str,
                 forward: _op.Op[Any, Any], fake: Fake, *, outputs: Literal[2],
                 differentiable: Iterable[int] = ...,
                 leading_batch: Sequence[int] = ..., backward_reads: Iterable[int] | None = ...,
                 strided: Iterable[int] = ...,
                 jvp: Jvp | None = ..., autocast: Literal["lower", "float32"] = ...,
                 caller: str | None = ...) -> None: ...

    @overload
    def __init__(self: "Operator[tuple[torch.Tensor, ...]]", name: str, schema: str,
                 forward: _op.Op[Any, Any], fake: Fake, *,
                 outputs: int, differentiable: Iterable[int] = ...,
                 leading_batch: Sequence[int] = ..., backward_reads: Iterable[int] | None = ...,
                 strided: Iterable[int] = ...,
                 jvp: Jvp | None = ..., autocast: Literal["lower", "float32"] = ...,
                 caller: str | None = ...) -> None: ...

    def __init__(self, name: str, schema: str, forward: _op.Op[Any, Any], fake: Fake, *,
                 outputs: int = 1, differentiable: Iterable[int] = (),
                 leading_batch: Sequence[int] = (), backward_reads: Iterable[int] | None = None,
                 strided: Iterable[int] = (), jvp: Jvp | None = None, autocast: Literal["lower", "float32"] = "lower",
                 caller: str | None = None) -> None:
        self.name = f"spchain.torch.{name}"
        self.caller = caller or self.name
        self.array = forward
        self.jvp, self.autocast = jvp, autocast
        self._reads = None if backward_reads is None else frozenset(backward_reads)
        self._strided = frozenset(strided)
        self._grads_strided = frozenset(range(outputs)) if self._strided else frozenset()
        self.outputs, self.differentiable = outputs, tuple(differentiable)
        op = torch.library.custom_op(f"spchain::{name}", self._forward_op, mutates_args=(), schema=schema)
        op.register_fake(fake)
        op.register_vmap(_batch_rule(op._opoverload, leading_batch))
        self.op = op._opoverload
        OPERATORS[f"spchain::{name}"] = self
        backward_op = self._backward = None
        if self.array.backward is not None:
            arguments = schema.split("->")[0].strip()[1:-1]
            backward_op = torch.library.custom_op(
                f"spchain::{name}_backward", self._backward_op, mutates_args=(),
                schema=f"({arguments}, Tensor[] results, Tensor?[] grads, bool[] needs) -> Tensor[]")
            backward_op.register_fake(self._backward_fake)
            # results and incoming gradients lead with the batch only where the arguments do
            backward_leading = tuple(leading_batch) + (-3, -2) if leading_batch else ()
            backward_op.register_vmap(_batch_rule(backward_op._opoverload, backward_leading))
            self._eager = _eager_function(self)
            self._backward = backward_op._opoverload
        self._transform, self._tangent = _transform_functions(self, self._backward)
        if self.array.backward is not None:
            op.register_autograd(self._transform.backward, setup_context=self._transform.setup_context)

    def record(self, problem: Any, *args: torch.Tensor | object) -> tuple[torch.Tensor, ...]:
        """The plain eager route with a gradient on a ``problem`` its caller has prepared from
        ``args`` (plain eager float32/float64 tensors it has checked, outside autocast and
        forward mode): the forward's public results, recorded for the backward as
        :meth:`__call__` records them, without preparing again (a kept structure, as
        :class:`spchain.torch.linear.LinearPlan` keeps)."""
        results: tuple[torch.Tensor, ...] = self._eager.apply(problem, *args)  # type: ignore[no-untyped-call]
        return results

    @property
    def backward(self) -> Any:
        """The array-level backward (``None`` for an operator without a gradient)."""
        return self.array.backward

    def __call__(self, *args: object) -> Public:
        compiling = torch.compiler.is_compiling()
        tensors: list[torch.Tensor] = []
        low, requires, plain = None, False, not compiling
        for a in args:  # one pass: a small call pays for each
            if isinstance(a, torch.Tensor):
                tensors.append(a)
                requires = requires or a.requires_grad
                plain = plain and _plain(a)
                if low is None and a.dtype in _LOW:
                    low = a.dtype
        if low is not None:  # computed in float32; the results in the promoted dtype, if still a low one
            low = functools.reduce(torch.promote_types, (t.dtype for t in tensors if t.is_floating_point()))
            low = low if low in _LOW else None
            args = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype in _LOW else a for a in args)
        # _is_any_autocast_enabled: a cheap first test, which Dynamo need not trace
        if tensors and (compiling or torch._C._is_any_autocast_enabled()) \
                and torch.is_autocast_enabled(tensors[0].device.type):
            low = self._autocast(tensors)
        # the ignores: torch leaves Function.apply unannotated
        if not compiling and _forward_mode():  # tangents cross only through the Function
            results = self._tangent.apply(*args)  # type: ignore[no-untyped-call]
        else:
            differentiable = self.array.backward is not None
            if requires and compiling and not differentiable:  # constants: the joint graph would trace the
                args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)  # raising backward
                requires = False
            grad = requires and torch.is_grad_enabled()
            # not compiling and no forward mode: no torch.func transform is active
            if plain and (differentiable or not grad) and not (torch._C._is_tracing()
                                                               or torch._C._len_torch_dispatch_stack()):
                # without a graph, only the public results become tensors
                results = (self._eager.apply(None, *args) if grad  # type: ignore[no-untyped-call]
                           else self._run(args, self.outputs))
            else:  # an operator without a backward: results whose backward raises, never a zero gradient
                results = self._transform.apply(*args) if grad else self.op(*args)  # type: ignore[no-untyped-call]
        if isinstance(results, torch.Tensor):
            results = (results,)
        public = results if len(results) == self.outputs else results[:self.outputs]
        if low is not None:
            public = tuple(r.to(low) if r.is_floating_point() else r for r in public)
        return cast(Public, public if self.outputs > 1 else public[0])

    def _autocast(self, tensors: Sequence[torch.Tensor]) -> torch.dtype | None:
        """The dtype of the results under autocast (the computation is in float32 anyway):
        autocast's own where the operator is a product like ``torch.matmul``, none (float32)
        where it lies in log space like ``torch.logsumexp``; none for float64 inputs, which
        autocast leaves alone."""
        if self.autocast == "float32" or any(t.dtype == torch.float64 for t in tensors):
            return None
        return torch.get_autocast_dtype(tensors[0].device.type)

    def gradients(self, args: Sequence[Any], results: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                  needs: Sequence[bool]) -> Sequence[torch.Tensor]:
        """The reverse rule (the backward operator) at ``args`` (those the forward saw, or
        broadcast versions of them) with the forward's ``results``: the gradient of each
        differentiable argument whose ``needs`` is true (an empty tensor for the others)."""
        assert self._backward is not None  # only operators with a backward have a reverse rule
        out: Sequence[torch.Tensor] = self._backward(*args, results, grads, needs)
        return out

    def _run(self, args: Sequence[object], count: int | None = None) -> tuple[torch.Tensor, ...]:
        """The forward's results as tensors: its outputs and residuals (the first ``count``)."""
        with bridge(_device(args)):
            problem = self.array.prepare(*_arrays(args, self._strided), caller=self.caller)
            if count is not None and count <= self.outputs:  # no gradient: no residuals
                results = self.array.outputs(problem)
            else:
                outputs, saved = self.array.forward(problem)
                results = (*outputs, *self.array.residuals(saved))
        return tuple(to_tensor(r) for r in results[:count])

    def _forward_op(self, *args: object) -> torch.Tensor | tuple[torch.Tensor, ...]:
        results = _own(self._run(args), args)
        return results if len(results) > 1 else results[0]

    def _gradients(self, args: Sequence[Any], results: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   needs: Sequence[bool]) -> list[torch.Tensor | None]:
        """The gradients from the arguments and results as tensors: prepared again, unchecked."""
        backward = self.array.backward
        assert backward is not None  # only operators with a backward register gradients
        read = args if self._reads is None else \
            [a if k in self._reads or not isinstance(a, torch.Tensor) else None for k, a in enumerate(args)]
        with bridge(_device(args)):
            problem = self.array.prepare(*_arrays(read, self._strided), caller=self.caller, check=False)
            saved = self.array.restore(_arrays(results[:self.outputs]), _arrays(results[self.outputs:]))
            arrays = backward(problem, saved, _arrays(grads, self._grads_strided), needs).ordered()
        return [to_tensor(g).to(args[k].dtype) if need else None
                for k, need, g in zip(self.differentiable, needs, arrays)]

    def _backward_op(self, *flat: Any) -> list[torch.Tensor]:
        *args, results, grads, needs = flat
        gradients = self._gradients(args, results, grads, needs)
        like = args[self.differentiable[0]]  # one empty tensor per missing gradient: returns may not alias
        return list(_own([like.new_empty(0) if g is None else g for g in gradients], args + list(results)))

    def _backward_fake(self, *flat: Any) -> list[torch.Tensor]:
        *args, results, grads, needs = flat
        like = args[self.differentiable[0]]  # an optional argument may be None
        # contiguous, as _backward_op returns them, whatever the arguments' strides
        return [args[k].new_empty(args[k].shape) if need else like.new_empty(0)
                for k, need in zip(self.differentiable, needs)]


def linear_jvp(operator: Operator[Any], args: Sequence[Any], results: Sequence[torch.Tensor],
               tangents: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The ``jvp`` of an operator linear in its differentiable arguments together: the
    operator at the tangents (zeros for an argument without one)."""
    at = list(args)
    for k, t in zip(operator.differentiable, tangents):
        at[k] = t if t is not None or args[k] is None else torch.zeros_like(args[k])
    out = operator.op(*at)
    return list(out[:operator.outputs]) if isinstance(out, tuple) else [out]


def multilinear_jvp(operator: Operator[Any], args: Sequence[Any], results: Sequence[torch.Tensor],
                    tangents: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The ``jvp`` of an operator linear in each differentiable argument (a product): the sum,
    over the arguments with a tangent, of the operator with that argument replaced by it."""
    total: list[torch.Tensor] = []
    for k, t in zip(operator.differentiable, tangents):
        if t is not None:
            out = operator.op(*(t if j == k else a for j, a in enumerate(args)))
            part = list(out[:operator.outputs]) if isinstance(out, tuple) else [out]
            total = part if not total else [a + b for a, b in zip(total, part)]
    return total


def _device(args: Sequence[object]) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return next(t.device for t in _flat_tensors(args))


def _flat_tensors(args: Iterable[object]) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _arrays(args: Iterable[object], strided: frozenset[int] = frozenset()) -> list[Any]:
    """Tensors, also inside lists, as arrays (those at ``strided`` in their own layout);
    everything else as it is."""
    out: list[Any] = []
    for k, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            a = to_array(a, strided=k in strided)
        elif isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
            a = [None if t is None else to_array(t) for t in a]
        out.append(a)
    return out


def _own(results: Iterable[torch.Tensor], args: Iterable[object]) -> tuple[torch.Tensor, ...]:
    """``results`` as contiguous tensors sharing no memory with ``args`` or one another (an
    operator's outputs may not alias its inputs or each other)."""
    taken = {t.untyped_storage().data_ptr() for t in _flat_tensors(args) if t.numel()}
    return cast(tuple[torch.Tensor, ...], tuple(_distinct(results, taken, contiguous=True)))


def _distinct(tensors: Iterable[torch.Tensor | None], taken: set[int], contiguous: bool = False
              ) -> list[torch.Tensor | None]:
    """``tensors`` with each one that shares memory with ``taken`` (storage addresses) or an
    earlier one cloned (``contiguous``: the others made contiguous). Gradients must not share
    memory: autograd keeps each as a leaf's ``.grad`` and accumulates into it in place (the
    chain functions' ``log_init`` gradient is a view of the ``x`` gradient's first position)."""
    out: list[torch.Tensor | None] = []
    for t in tensors:
        if t is not None and t.numel():
            address = t.untyped_storage().data_ptr()
            kept = t.clone() if address in taken else t.contiguous() if contiguous else t
            taken.add(address if kept is t else kept.untyped_storage().data_ptr())
            t = kept
        out.append(t)
    return out


# ctx is autograd's node object, typed Any as in torch: FunctionCtx does not declare
# saved_tensors or needs_input_grad, and _save keeps the arguments on it.
def _save(ctx: Any, inputs: Sequence[object], results: torch.Tensor | tuple[torch.Tensor, ...],
          outputs: int, jvp: bool = False) -> None:
    """Save the tensor arguments and the results (also for ``jvp``); keep the other arguments
    on ``ctx``; results from ``outputs`` on are not differentiable."""
    results = results if isinstance(results, tuple) else (results,)
    slots = tuple(k for k, a in enumerate(inputs) if isinstance(a, torch.Tensor))
    ctx.arguments = (slots, tuple(None if k in slots else a for k, a in enumerate(inputs)))
    saved = (*(inputs[k] for k in slots), *results)
    ctx.save_for_backward(*saved)
    if jvp:
        ctx.save_for_forward(*saved)
    fixed = [r for k, r in enumerate(results) if k >= outputs or not r.is_floating_point()]
    if fixed:
        ctx.mark_non_differentiable(*fixed)
    ctx.set_materialize_grads(False)  # no zeros for the saved results' gradients: see _public_grads


def _public_grads(grads: Sequence[torch.Tensor | None], results: Sequence[torch.Tensor],
                  outputs: int) -> list[torch.Tensor]:
    """The incoming gradients of the public results, zeros where one is unused; the saved
    results' gradients (always unused) are not filled with zeros, which took as long as a
    small product for a saved ``x.T``."""
    return [torch.zeros_like(r) if g is None else g for g, r in zip(grads[:outputs], results)]


def _restore(ctx: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """``(args, results)`` saved by :func:`_save` (autograd checks their versions here)."""
    slots, args = ctx.arguments
    saved = ctx.saved_tensors
    args = list(args)
    for k, t in zip(slots, saved):
        args[k] = t
    return args, list(saved[len(slots):])


def _place(count: int, differentiable: Sequence[int], needs: Sequence[bool],
           grads: Iterable[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    """Gradients for all ``count`` arguments: ``grads`` at ``differentiable`` where needed."""
    out: list[torch.Tensor | None] = [None] * count
    for k, need, g in zip(differentiable, needs, grads):
        if need:
            out[k] = g
    return tuple(out)


def _forward_mode() -> bool:
    """Whether tangents may be about: a ``torch.func`` transform or an eager dual level is active."""
    return bool(torch._C._are_functorch_transforms_active()) or forward_ad._current_level >= 0


def _double_backward_error(name: str) -> RuntimeError:
    return RuntimeError(f"{name}: double backward (create_graph=True, Hessians, gradient penalties, nested "
                        "torch.func.grad) is not implemented")


def _eager_function(op: Operator[Any]) -> type[torch.autograd.Function]:
    """The ``autograd.Function`` of the plain eager route: its context keeps the prepared
    problem and the residuals (arrays) for the backward, which prepares nothing again; the
    tensor arguments, and the outputs where the backward reads them (``reads_outputs``: the
    arrays may share their memory), are saved for autograd's check that none changed in
    between. Its first argument is the problem where its caller prepared one
    (:meth:`Operator.record`), else ``None``."""
    array, outputs, differentiable = op.array, op.outputs, op.differentiable
    strided, caller = op._strided, op.caller

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, problem: Any, *args: Any) -> tuple[torch.Tensor, ...]:
            ctx.device = _device(args)
            with bridge(ctx.device):
                ctx.problem = array.prepare(*_arrays(args, strided), caller=caller) if problem is None else problem
                results, ctx.saved = array.forward(ctx.problem)
            public = tuple(to_tensor(r) for r in results[:outputs])
            ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)),
                                  *(public if array.reads_outputs else ()))
            ctx.dtypes = [args[k].dtype if isinstance(args[k], torch.Tensor) else None for k in differentiable]
            fixed = [r for r in public if not r.is_floating_point()]
            if fixed:
                ctx.mark_non_differentiable(*fixed)
            if array.reads_outputs:  # zeros for the unused float outputs alone (below); else autograd's
                ctx.set_materialize_grads(False)
            return public

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
            if torch.is_grad_enabled():
                raise _double_backward_error(op.name)
            saved = ctx.saved_tensors  # autograd's check that no argument (or read output) changed since the forward
            assert array.backward is not None  # built only with a backward
            needs = [ctx.needs_input_grad[k + 1] for k in differentiable]  # after the problem
            incoming = [torch.zeros_like(r) if g is None else g for g, r in zip(grads, saved[-outputs:])] \
                if array.reads_outputs else grads
            with bridge(ctx.device):
                arrays = array.backward(ctx.problem, ctx.saved, _arrays(incoming, op._grads_strided), needs).ordered()
            out: list[torch.Tensor | None] = [None] * len(ctx.needs_input_grad)
            for k, need, g, dtype in zip(differentiable, needs, arrays, ctx.dtypes):
                if need:
                    t = to_tensor(g)
                    out[k + 1] = t if t.dtype == dtype else t.to(dtype)
            return tuple(_distinct(out, set()))

    return Eager


def _transform_functions(op: Operator[Any], backward_op: torch._ops.OpOverload | None
                         ) -> tuple[type[torch.autograd.Function], type[torch.autograd.Function]]:
    """The ``autograd.Function`` over the operators, and the same with forward mode; their
    methods close over operators, numbers and module functions only, which ``torch.compile``
    can trace."""
    name, forward_op, outputs, differentiable = op.name, op.op, op.outputs, op.differentiable

    class Backward(torch.autograd.Function):
        """The backward operator, differentiable once: a second derivative raises."""

        generate_vmap_rule = True

        @staticmethod
        def forward(counts: "_Leaf", *flat: Any) -> tuple[torch.Tensor, ...]:
            (n_args, n_results), needs = counts.value
            plain = [a.value if isinstance(a, _Leaf) else a for a in flat]
            args, results, grads = plain[:n_args], plain[n_args:n_args + n_results], plain[n_args + n_results:]
            assert backward_op is not None  # built only with a backward
            return tuple(backward_op(*args, results, grads, needs))

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
            raise _double_backward_error(name)

        @staticmethod
        def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
            raise NotImplementedError(f"{name}: forward over reverse (torch.func.hessian, jacfwd of a gradient) "
                                      "is not implemented (no second derivative is)")

    class Transform(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(*args: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
            out: torch.Tensor | tuple[torch.Tensor, ...] = forward_op(*args)
            return out

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            _save(ctx, inputs, output, outputs)

        @staticmethod
        def backward(ctx: Any, *incoming: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
            if backward_op is None:
                raise NotImplementedError(f"{name} has no gradient (its docstring names a differentiable "
                                          "alternative); call it on detached tensors to use its results as constants")
            args, results = _restore(ctx)
            needs = [bool(ctx.needs_input_grad[k]) for k in differentiable]
            grads = _public_grads(incoming, results, outputs)
            if torch.compiler.is_compiling():  # compiled graphs have no double backward anyway
                gradients = backward_op(*args, results, grads, needs)
            else:
                counts = _Leaf(((len(args), len(results)), needs))  # the ignore: Function.apply is unannotated
                gradients = Backward.apply(counts, *(a if isinstance(a, torch.Tensor) or a is None else _Leaf(a)
                                                     for a in (*args, *results, *grads)))  # type: ignore[no-untyped-call]
            return _place(len(args), differentiable, needs, gradients)

    class Tangent(Transform):
        """:class:`Transform` with forward-mode AD (outside ``torch.compile``, which refuses a custom jvp)."""

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            _save(ctx, inputs, output, outputs, jvp=True)

        @staticmethod
        def jvp(ctx: Any, *tangents: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor | None, ...] | None:
            args, results = _restore(ctx)
            public = results[:outputs]
            moving = [k for k, t in enumerate(tangents) if t is not None and torch.is_floating_point(t)]
            floating = any(r.is_floating_point() for r in public)  # integer results have no tangent
            if floating and moving and (op.jvp is None or any(k not in differentiable for k in moving)):
                raise NotImplementedError(
                    f"{name}: forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) is not "
                    "implemented for this operator or argument; use reverse mode (torch.func.vjp, jacrev)")
            out: list[torch.Tensor | None] = [None] * len(results)
            if op.jvp is not None and moving:
                for k, t in enumerate(op.jvp(op, args, results, [tangents[k] for k in differentiable])):
                    out[k] = t
            return tuple(out) if len(results) > 1 else out[0]

    return Transform, Tangent


class _Leaf:
    """A non-tensor argument of a backward ``autograd.Function`` as one pytree leaf: torch's
    generated vmap rule flattens a list or tuple argument's ``in_dims`` but not its tangents,
    and fails on it under ``torch.func.hessian`` before the ``jvp`` that says why it cannot."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


# A vmap rule's in_dims hold an int or None per argument, a list of them per Tensor[] argument;
# _lead and _select take them as Any, as their shape follows the argument's.
def _batch_rule(op: torch._ops.OpOverload, leading: Sequence[int]) -> Callable[..., Batched]:
    """vmap of ``op``: one call with the batch as leading axis where every batched argument
    allows it (unbatched ones expanded, so that each slice gets its own gradient), else one
    call a slice."""

    def rule(info: "VmapInfo", in_dims: tuple[Any, ...], *args: Any) -> Batched:
        positions = {k % len(args) for k in leading}
        batched = [k for k, d in enumerate(in_dims) if _batched(d)]
        if all(k in positions for k in batched):
            out = op(*(_lead(a, d, info.batch_size) if k in positions else a
                       for k, (a, d) in enumerate(zip(args, in_dims))))
        else:
            slices = [op(*(_select(a, d, i) for a, d in zip(args, in_dims))) for i in range(info.batch_size)]
            out = torch.stack(slices) if isinstance(slices[0], torch.Tensor) else \
                type(slices[0])(torch.stack(parts) for parts in zip(*slices))
        return out, (0 if isinstance(out, torch.Tensor) else type(out)(0 for _ in out))

    return rule


def _batched(d: Any) -> bool:
    return any(x is not None for x in d) if isinstance(d, (list, tuple)) else d is not None


def _lead(a: object, d: Any, size: int) -> object:
    if isinstance(a, (list, tuple)):
        return [None if t is None else _lead(t, dd, size) for t, dd in zip(a, d)]
    if not isinstance(a, torch.Tensor):
        return a
    return a.movedim(d, 0) if d is not None else a.expand(size, *a.shape)


def _select(a: object, d: Any, i: int) -> object:
    if isinstance(a, (list, tuple)):
        return [None if t is None else _select(t, dd, i) for t, dd in zip(a, d)]
    return a.select(d, i) if isinstance(a, torch.Tensor) and d is not None else a
