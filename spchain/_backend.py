"""The one place that picks NumPy + SciPy or CuPy + cupyx for a set of inputs.

Every optional import (CuPy, torch, numba.cuda) is guarded here and nowhere else, so
``import spchain`` works, and stays fast, on a machine without them.

>>> import numpy as np
>>> backend_of(np.ones(3)).name
'numpy'
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import scipy.sparse
from numpy.typing import NDArray

from ._typing import Array
from .kernels.cpu import threading_layer as threading_layer

if TYPE_CHECKING:
    import dask.array
    from typing_extensions import TypeIs


class CudaUnavailableError(RuntimeError):
    """Raised when a CUDA path is asked for on a machine that cannot run it."""


@dataclass(frozen=True)
class Backend:
    """An array module, its sparse module, and the device the arrays live on.

    ``device`` is ``None`` for the CPU and the CUDA device id for CuPy.
    """

    xp: ModuleType
    sparse: ModuleType
    device: int | None = None

    @property
    def name(self) -> str:
        return "numpy" if self.device is None else "cupy"

    @property
    def on_gpu(self) -> bool:
        return self.device is not None

    def __str__(self) -> str:
        return "cpu (numpy)" if self.device is None else f"cuda:{self.device} (cupy)"

    def use(self) -> AbstractContextManager[Any]:
        """A context manager that makes this backend's device current (a no-op on the CPU)."""
        if self.device is None:
            return _NULL_CONTEXT
        device: AbstractContextManager[Any] = self.xp.cuda.Device(self.device)
        return device

    def launcher(self, launch: Callable[..., Any]) -> Callable[..., Any]:
        """A CUDA launcher (``launch_<op>`` of a ``spchain.kernels.cuda`` module) bound to this
        backend's stream (:func:`device_kernel`): ``backend.launcher(cuda.chain.launch_chain_forward)``.
        """
        return device_kernel(self.xp, launch)

    def to_host(self, a: Array) -> NDArray[Any]:
        """``a`` as a NumPy array (a copy from the device on the GPU)."""
        host: NDArray[Any] = a if self.device is None else self.xp.asnumpy(a)
        return host


def read_only(a: Array) -> Array:
    """``a`` as the CPU kernels take an array they only read: a read-only view of a writable
    NumPy array (any other ``a`` as it is), so that Numba compiles one signature for it
    whatever the caller's flags, not one per combination of writable and read-only arguments.

    >>> read_only(np.ones(3)).flags.writeable
    False
    """
    if isinstance(a, np.ndarray) and a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def device_kernel(xp: ModuleType, launcher: Callable[..., Any]) -> Callable[..., Any]:
    """``launcher`` (``launch_<op>`` of a ``spchain.kernels.cuda`` module) bound to ``xp``'s
    (CuPy's) current stream, its device arrays passed to Numba without a synchronisation.

    By the CUDA array interface (v3) Numba makes the host wait for the stream of every CuPy
    array it is given, at each launch. The kernel runs on that very stream, after the work
    that made its arguments, so the wait buys nothing and would stall every step of a sweep.
    """
    cuda = numba_cuda()
    if xp is np:  # the GPU branches on NumPy arrays, their kernels under Numba's simulator (CPU twins)
        def simulated(*args: Any) -> Any:  # a read-only view (a broadcast) goes in as a copy: none comes back
            return launcher(*(cuda.to_device(a) if isinstance(a, np.ndarray) and not a.flags.writeable else a
                              for a in args))

        return simulated
    stream = cuda.external_stream(xp.cuda.get_current_stream().ptr)

    def launch(*args: Any) -> Any:
        return launcher(*(cuda.as_cuda_array(a, sync=False) if hasattr(a, "__cuda_array_interface__") else a
                          for a in args), stream=stream)

    return launch


SERIAL_WORK = 2**17
"""Multiply-adds below which a CPU kernel runs on the calling thread alone: starting the
threads would cost about as much as such a product."""


def threads(work: int) -> int:
    """The number of threads for a parallel CPU kernel of ``work`` multiply-adds: 1 below
    :data:`SERIAL_WORK` (the caller then runs the kernel's one-thread version), else Numba's
    thread count (``numba.set_num_threads``; all cores unless the user lowered it).

    The one place where spchain sizes its CPU parallelism; see docs/design.rst, "Threads".
    """
    if work < SERIAL_WORK:
        return 1
    threading_layer()
    import numba

    return int(numba.get_num_threads())


class _NullContext:
    def __enter__(self) -> _NullContext:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


_NULL_CONTEXT = _NullContext()
NUMPY = Backend(np, scipy.sparse)

_CUDA_INSTALL = "install a CUDA build with `pip install spchain[cuda12]` (or [cuda13])"


@functools.cache
def cupy() -> ModuleType:
    """CuPy, imported on first use; ``CudaUnavailableError`` if it cannot run here."""
    try:
        module = importlib.import_module("cupy")
        importlib.import_module("cupyx.scipy.sparse")
        module.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, or a CUDA runtime error without a usable GPU
        raise CudaUnavailableError(
            f"spchain's CUDA path needs CuPy and a usable NVIDIA GPU ({exc}); {_CUDA_INSTALL}"
        ) from exc
    return module


@functools.cache
def numba_cuda() -> ModuleType:
    """``numba.cuda``, imported on first use; ``CudaUnavailableError`` if it cannot run here."""
    try:
        cuda = importlib.import_module("numba.cuda")
    except Exception as exc:
        raise CudaUnavailableError(f"spchain's CUDA kernels need numba-cuda ({exc}); {_CUDA_INSTALL}") from exc
    if not cuda.is_available():
        raise CudaUnavailableError(f"numba.cuda finds no usable GPU; {_CUDA_INSTALL}")
    return cuda


def numpy_matmul(a: Array, b: Array, out: Array | None = None, log: bool = False) -> Array:
    """``np.matmul(a, b, out=out)``, and with ``log`` its logarithm in place (0 gives ``-inf``)."""
    product: Array = np.matmul(a, b, out=out)
    if log:
        with np.errstate(divide="ignore", invalid="ignore"):
            np.log(product, out=product)
    return product


CPU_MATMUL: contextvars.ContextVar[Callable[..., Any]] = contextvars.ContextVar(
    "spchain_cpu_matmul", default=numpy_matmul)
"""The matrix product used for NumPy arrays (:func:`numpy_matmul`'s arguments); ``spchain.torch``
sets torch's for its calls."""


def matmul(xp: ModuleType, a: Array, b: Array, out: Array | None = None, log: bool = False) -> Array:
    """``xp.matmul(a, b, out=out)``, and with ``log`` its logarithm in place (0 gives ``-inf``:
    the GEMM sweeps' scaled products); for NumPy arrays, by :data:`CPU_MATMUL`.

    In a torch program NumPy's BLAS (OpenBLAS) would run a thread pool of its own beside
    torch's, and OpenBLAS's idle threads spin for a while after each call: on a machine with
    few cores the two pools slow each other down several times over. So ``spchain.torch``
    lends torch's BLAS to the array level for the length of its calls, on zero-copy views
    (and torch's logarithm, on its threads: 25 us against NumPy's 67 us for 500 x 200 float32).
    """
    if xp is np:
        product: Array = CPU_MATMUL.get()(a, b, out=out, log=log)
        return product
    product = xp.matmul(a, b, out=out)
    if log:
        xp.log(product, out=product)
    return product


def scatter_add(xp: ModuleType, out: Array, indices: Any, values: Array) -> None:
    """``out[indices] += values`` with repeated indices summed (``np.add.at``; cupyx on the GPU)."""
    if xp is np:
        np.add.at(out, indices, values)
    else:
        importlib.import_module("cupyx").scatter_add(out, indices, values)


def torch_or_none() -> ModuleType | None:
    """The torch module if the caller's process has already imported it, else ``None``.

    Never imports torch: a tensor can only exist if torch is already imported.
    """
    return sys.modules.get("torch")


def is_dask(obj: object) -> TypeIs[dask.array.Array]:
    """Whether ``obj`` is a ``dask.array.Array`` (never imports Dask: an array needs it imported)."""
    dask_array = sys.modules.get("dask.array")
    return dask_array is not None and isinstance(obj, dask_array.Array)


def _is_cupy_object(obj: object) -> bool:
    module = type(obj).__module__
    return module.startswith("cupy") or module.startswith("cupyx")


def _is_torch_tensor(obj: object) -> bool:
    torch = torch_or_none()
    return torch is not None and isinstance(obj, torch.Tensor)


def backend_of(*arrays: Any, caller: str = "spchain") -> Backend:
    """The backend of ``arrays`` (``None`` entries and Python scalars are ignored).

    Raises ``TypeError`` for torch tensors (they belong to ``spchain.torch``) and other
    unsupported types, and ``ValueError`` for inputs on different devices.
    """
    found: Backend | None = None
    for a in arrays:
        if type(a) is np.ndarray:  # the common case first: small calls pay for every check
            current = NUMPY
        elif a is None or isinstance(a, (int, float, np.generic)):
            continue
        elif _is_torch_tensor(a):
            hint = " and requires grad" if a.requires_grad else ""
            name = caller.rsplit(".", 1)[-1]
            twin = hasattr(importlib.import_module("spchain.torch"), name)  # torch is loaded: a tensor came
            use = f"use spchain.torch.{name} for tensors (it supports autograd), or " if twin else ""
            raise TypeError(f"{caller} got a torch.Tensor{hint}; the array API takes NumPy/CuPy arrays: "
                            f"{use}pass t.detach().numpy()")
        elif is_dask(a):
            raise TypeError(f"{caller} takes in-memory arrays, not a dask.array.Array (call .compute() first)")
        elif isinstance(a, np.ndarray) or scipy.sparse.issparse(a):
            current = NUMPY
        elif _is_cupy_object(a):
            cp = cupy()
            sparse = importlib.import_module("cupyx.scipy.sparse")
            device = (a.data if sparse.issparse(a) else a).device  # cupyx matrices have no .device
            current = Backend(cp, sparse, device.id)
        else:
            raise TypeError(f"{caller} takes NumPy/SciPy or CuPy/cupyx arrays, not {type(a).__name__}")
        if found is None:
            found = current
        elif found is not current and found != current:
            raise ValueError(f"{caller}: inputs are on different devices: {found} and {current}")
    return found if found is not None else NUMPY
