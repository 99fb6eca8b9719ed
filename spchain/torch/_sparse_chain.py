"""The chain and path functions of ``spchain.torch`` with a sparse CSR ``log_trans``.

``custom_op`` takes dense tensors only, so the public functions pass a sparse CSR tensor as
its ``crow_indices``, ``col_indices`` and ``values`` (:func:`tensors`), and the operators made
here (``spchain::sparse_<name>``, defined by ``spchain.torch.chain`` and ``spchain.torch.paths``
beside their dense ones) rebuild it as a SciPy / cupyx CSR matrix for the array-level
functions. The gradient of ``values`` is that of the stored entries; autograd takes it
through ``log_trans.values()`` to a sparse CSR gradient of exactly ``log_trans``'s structure.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, overload

import torch

from .. import _backend, _chain_layout
from .._op import Grads, Op
from .._typing import Array, Sparse
from ._operator import Fake, Jvp, Operator, Public, run_eagerly

if TYPE_CHECKING:
    from .chain import ChainTensors, TensorLike


def is_csr(t: object) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` is a sparse CSR tensor."""
    return isinstance(t, torch.Tensor) and t.layout == torch.sparse_csr


def tensors(caller: str, x: "TensorLike", log_trans: torch.Tensor, log_init: "TensorLike | None",
            lengths: "TensorLike | None",
            dense_tensors: "Callable[[str, TensorLike, TensorLike, TensorLike | None, TensorLike | None], ChainTensors]",
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(x, crow, col, values, log_init, lengths)`` as the sparse operators take them, by
    ``dense_tensors`` (``spchain.torch.chain._tensors``) for all but the structure;
    ``ValueError`` unless ``log_trans`` is one (c, c) matrix with ``x`` of shape (..., v, c),
    its columns sorted within each row (torch's backward of ``sparse_csr_tensor`` would give
    the gradient of ``values`` in sorted order, permuted against unsorted ones)."""
    if log_trans.dim() != 2:
        raise ValueError(f"{caller}: a sparse CSR log_trans must be one (c, c) matrix, got shape "
                         f"{tuple(log_trans.shape)}")
    with torch._C._DisableFuncTorch():  # torch.func cannot wrap the parts of a CSR tensor; they need no wrapping
        crow, col, values = log_trans.crow_indices(), log_trans.col_indices(), log_trans.values()
    _check_sorted(caller, crow, col)
    x, values, log_init, lengths = dense_tensors(caller, x, values, log_init, lengths)
    _chain_layout.layout(caller, tuple(x.shape), tuple(log_trans.shape),
                         None if log_init is None else tuple(log_init.shape),
                         None if lengths is None else tuple(lengths.shape))
    return x, crow, col, values, log_init, lengths


def _check_sorted(caller: str, crow: torch.Tensor, col: torch.Tensor) -> None:
    """``ValueError`` naming the first row whose column indices are not in increasing order."""
    if col.numel() < 2:
        return
    rows = torch.repeat_interleave(torch.arange(crow.numel() - 1, device=crow.device), crow.diff(),
                                   output_size=col.numel())
    down = (col[1:] < col[:-1]) & (rows[1:] == rows[:-1])
    if bool(down.any()):
        row = int(rows[1:][down][0])
        raise ValueError(f"{caller}: a sparse CSR log_trans must have sorted column indices in each row, row {row} "
                         "has not (sort them, e.g. log_trans.to_sparse_coo().coalesce().to_sparse_csr())")


@run_eagerly
def eagerly(operator: Operator[Public], caller: str, x: "TensorLike", log_trans: torch.Tensor,
            log_init: "TensorLike | None", lengths: "TensorLike | None",
            dense_tensors: "Callable[[str, TensorLike, TensorLike, TensorLike | None, TensorLike | None], ChainTensors]",
            *extra: object) -> Public:
    """``operator`` on :func:`tensors` and ``extra``, run eagerly: ``torch.compile`` breaks the
    graph here (Dynamo cannot take the parts of a sparse CSR tensor) instead of crashing."""
    return operator(*tensors(caller, x, log_trans, log_init, lengths, dense_tensors), *extra)


def _matrix(x: Array, crow: Array, col: Array, values: Array) -> Sparse:
    """The (c, c) CSR matrix of a sparse operator's ``crow``, ``col`` and ``values``."""
    c = x.shape[-1]
    return _backend.backend_of(values).sparse.csr_matrix((values, col, crow), shape=(c, c))


@dataclasses.dataclass(frozen=True)
class SparseGrads(Grads):
    """The gradients of a sparse operator's ``(x, values, log_init)``, ``None`` where not needed."""

    x: Array | None
    values: Array | None
    log_init: Array | None


def sparse_op(dense: Op[Any, Any]) -> Op[Any, Any]:
    """The array half of a sparse operator from that of its dense one: the arguments
    ``(x, crow, col, values, *rest)`` prepared as ``(x, matrix, *rest)``, and the gradient of
    ``values`` that of the matrix's stored entries."""
    def prepare(x: Array, crow: Array, col: Array, values: Array, *rest: Any, caller: str | None = None,
                check: bool = True) -> Any:
        return dense.prepare(x, _matrix(x, crow, col, values), *rest, caller=caller, check=check)

    def backward(problem: Any, saved: Any, grads: Sequence[Array | None], needs: Sequence[bool]) -> SparseGrads:
        assert dense.backward is not None  # used only with a backward
        grad_x, grad_trans, grad_init = dense.backward(problem, saved, grads, needs).ordered()
        return SparseGrads(grad_x, None if grad_trans is None else grad_trans.data, grad_init)

    return dataclasses.replace(dense, prepare=prepare, backward=None if dense.backward is None else backward)


@overload
def operator(name: str, dense: Op[Any, Any], fake: Fake, *, schema_tail: str = ..., returns: str,
             outputs: Literal[1] = ..., jvp: Jvp | None = ...) -> Operator[torch.Tensor]: ...


@overload
def operator(name: str, dense: Op[Any, Any], fake: Fake, *, schema_tail: str = ..., returns: str,
             outputs: Literal[2], jvp: Jvp | None = ...) -> Operator[tuple[torch.Tensor, torch.Tensor]]: ...


def operator(name: str, dense: Op[Any, Any], fake: Fake, *, schema_tail: str = "", returns: str,
             outputs: Literal[1, 2] = 1, jvp: Jvp | None = None) -> Operator[Any]:
    """``Operator`` ``sparse_<name>`` over the array half ``dense`` (its dense operator's
    ``array``) of a chain or path function whose ``log_trans`` is the second argument (``fake``
    is the dense one); forward-mode AD by ``jvp`` (e.g. :func:`spchain.torch.chain.batch_jvp`)
    where it has a backward."""
    schema = f"(Tensor x, Tensor crow, Tensor col, Tensor values, Tensor? log_init{schema_tail}) -> {returns}"

    def sparse_fake(x: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
                    *rest: object) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return fake(x, values.new_empty((x.shape[-1], x.shape[-1])), *rest)

    graded = dense.backward is not None
    return Operator(f"sparse_{name}", schema, sparse_op(dense), sparse_fake, outputs=outputs,
                    differentiable=(0, 3, 4) if graded else (), jvp=jvp if graded else None, autocast="float32",
                    caller=f"spchain.torch.{name}")


LENGTHS = ", Tensor? lengths"
"""The schema of the operators' ``lengths`` argument."""
