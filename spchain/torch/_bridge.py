"""The DLPack bridge: torch tensors to NumPy/CuPy arrays and back, without copies.

CPU tensors become NumPy arrays and CUDA tensors CuPy arrays that share their memory. Inside
``bridge(device)``'s context, CuPy (and every Numba kernel spchain launches) runs on torch's
current CUDA stream, so no synchronisation is needed on either side.

>>> import torch
>>> t = torch.zeros(3)
>>> a = to_array(t)
>>> a[0] = 1.0
>>> float(t[0])
1.0
"""

import contextlib
from collections.abc import Callable, Container, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.dlpack import from_dlpack

from .. import _backend
from .._typing import Array
from ..kernels import cpu


def to_array(t: torch.Tensor, *, strided: bool = False) -> Array:
    """A NumPy (CPU) or CuPy (CUDA) array sharing ``t``'s memory.

    ``t`` is detached; a non-contiguous ``t`` is made contiguous first (one copy), so that
    kernels and DLPack always see a dense row-major layout, unless ``strided``: then the array
    is a view with ``t``'s strides, for a caller that reads any layout.

    >>> to_array(torch.zeros(2, 3).t(), strided=True).flags.f_contiguous
    True
    """
    if not (strided or t.is_contiguous()):
        t = t.detach().contiguous()
    if t.is_cpu:  # the same view as np.from_dlpack, several times faster; force: detached (0.4 us faster)
        try:
            return t.numpy(force=True) if t.requires_grad else t.numpy()
        except TypeError:  # checked only then: small calls convert several tensors
            _no_bfloat16(t)
            raise
    _no_bfloat16(t)
    if t.is_cuda:
        return _backend.cupy().from_dlpack(t.detach())
    raise TypeError(f"spchain supports CPU and CUDA tensors, not {t.device.type} ones")


def _no_bfloat16(t: torch.Tensor) -> None:
    if t.dtype == torch.bfloat16:
        raise TypeError("bfloat16 tensors have no NumPy/CuPy dtype; convert with t.float() first")


def to_tensor(a: Array) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (a NumPy or CuPy array).

    A NumPy array that is read-only or not row-major contiguous (negative strides included)
    is copied first: torch would otherwise write through a read-only view or reject the strides.
    """
    if isinstance(a, np.ndarray):
        flags = a.flags
        if not (flags.c_contiguous and flags.writeable):
            a = np.array(a, order="C")
        return torch.from_numpy(a)  # the same view as torch.from_dlpack, several times faster
    return from_dlpack(a)  # torch.from_dlpack itself, under the name torch declares public


def check_same_device(caller: str, **tensors: object) -> torch.device:
    """The one device of ``tensors`` (``None`` values ignored, any layout); ``ValueError``
    naming two that differ, ``TypeError`` naming one that is not a tensor."""
    return _checked(caller, tensors, lambda name: True, dense=False)


def check_dense(caller: str, optional: Container[str] = (), **tensors: object) -> torch.device:
    """The one device of ``tensors``, each a dense (strided) tensor: ``TypeError`` naming the
    first that is not a tensor (``None`` is allowed for the names in ``optional``) or not dense,
    ``ValueError`` naming two on different devices. Traceable by ``torch.compile``.

    >>> check_dense("f", a=torch.ones(2), b=torch.ones(2).to_sparse())
    Traceback (most recent call last):
    ...
    TypeError: f: b must be a dense tensor, not one of layout torch.sparse_coo
    """
    return _checked(caller, tensors, optional.__contains__, dense=True)


def _checked(caller: str, tensors: dict[str, object], may_be_none: Callable[[str], bool], dense: bool) -> torch.device:
    """The checks of :func:`check_dense` and :func:`check_same_device`, in one pass."""
    device = first = None
    for name, t in tensors.items():
        if t is None and may_be_none(name):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{caller}: {name} must be a torch.Tensor, not {type(t).__name__}")
        if dense and t.layout != torch.strided:
            raise TypeError(f"{caller}: {name} must be a dense tensor, not one of layout {t.layout}")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{caller}: {first} is on {device} but {name} is on {t.device}")
    return device if device is not None else torch.device("cpu")


SMALL_PRODUCT = 2**16
"""Multiply-adds (all batches) up to which :func:`_torch_matmul` leaves a product to NumPy:
below it OpenBLAS runs on the calling thread alone, and torch's dispatch would cost several
times the product (a 4 x 4 product: 1.6 us against 7 us)."""


def _torch_matmul(a: NDArray[Any], b: NDArray[Any], out: NDArray[Any] | None = None,
                  log: bool = False) -> NDArray[Any]:
    """:func:`spchain._backend.numpy_matmul` computed by torch on zero-copy views (NumPy's own
    for products of at most :data:`SMALL_PRODUCT` multiply-adds, which run on one thread, and
    for operands torch cannot take as they are: read-only, negatively strided, or of mixed
    dtypes), in the operands' dtype also under ``torch.autocast`` (which would round to bfloat16)."""
    if a.size * b.shape[-1] <= SMALL_PRODUCT and b.size * a.shape[-2] <= SMALL_PRODUCT:
        return _backend.numpy_matmul(a, b, out, log)
    operands = [t for t in (a, b, out) if t is not None]
    if not all(t.flags.writeable and min(t.strides, default=0) >= 0 and t.dtype == a.dtype for t in operands):
        return _backend.numpy_matmul(a, b, out, log)
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return _torch_matmul(a, b, out, log)
    if not cpu.crowded():
        return _torch_product(a, b, out, log)
    # A crowded machine (other processes' threads runnable): one torch thread. A GNU OpenMP
    # region ends when every thread of its team has had a time slice, so each product of the
    # chain's GEMM sweep waited for the scheduler: the chain workload's forward + backward took
    # 968 ms beside two spinning processes against 113 ms idle, 232 ms with torch on one thread.
    # The count is an OpenMP setting of each thread: the calling thread's comes back after.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _torch_product(a, b, out, log)
    finally:
        torch.set_num_threads(threads)


def _torch_product(a: NDArray[Any], b: NDArray[Any], out: NDArray[Any] | None, log: bool) -> NDArray[Any]:
    """:func:`_torch_matmul`'s product (and logarithm) by torch, once the operands are known to suit it."""
    if out is not None and a.ndim == b.ndim == out.ndim:  # straight into out, strided or not
        into = torch.from_numpy(out)
        torch.matmul(torch.from_numpy(a), torch.from_numpy(b), out=into)
        if log:
            into.log_()
        return out
    tensor = torch.matmul(torch.from_numpy(a), torch.from_numpy(b))
    product = (tensor.log_() if log else tensor).numpy()
    if out is None:
        return product
    np.copyto(out, product)  # torch folds broadcast batches into rows, which a strided out resists
    return out


def bridge(device: torch.device) -> AbstractContextManager[None]:
    """The one context in which ``spchain.torch`` runs the array level for tensors on ``device``.

    On the CPU the array level's products run on torch's BLAS (one thread pool for the whole
    program, see ``_backend.matmul``); on CUDA CuPy and spchain's kernels run on ``device`` and
    torch's current stream there. On both NumPy's floating-point warnings are off (log space
    meets ``-inf``, ``inf - inf`` and ``0 * inf`` by design; the array level gives them their
    documented values).
    """
    return _CpuBridge() if device.type != "cuda" else _CudaBridge(device)


class _CpuBridge:
    """The CPU bridge in one object (entered on every small call)."""

    def __enter__(self) -> None:
        self._errstate = np.errstate(divide="ignore", invalid="ignore", over="ignore")
        self._errstate.__enter__()
        self._token = _backend.CPU_MATMUL.set(_torch_matmul)

    def __exit__(self, *exc: Any) -> None:
        _backend.CPU_MATMUL.reset(self._token)
        self._errstate.__exit__(*exc)


class _CudaBridge:
    def __init__(self, device: torch.device) -> None:
        self._device = _on_cuda(device)
        self._errstate = np.errstate(divide="ignore", invalid="ignore", over="ignore")

    def __enter__(self) -> None:
        self._device.__enter__()
        self._errstate.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        self._errstate.__exit__(*exc)
        return self._device.__exit__(*exc)


@contextlib.contextmanager
def _on_cuda(device: torch.device) -> Iterator[None]:
    cp = _backend.cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    with cp.cuda.Device(index), cp.cuda.ExternalStream(stream.cuda_stream, index):
        yield
