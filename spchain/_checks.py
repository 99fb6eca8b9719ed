"""Input validation shared by the array API.

Conventions (docs/design.rst): ``ValueError`` for bad structure or shape, ``TypeError`` for an
unsupported type or dtype; messages name the function and the offending values.
"""

from typing import Any

import numpy as np
import scipy.sparse

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def broadcast_shapes(*shapes: tuple[Any, ...]) -> tuple[Any, ...]:
    """``np.broadcast_shapes`` on the sizes as they are, so that torch's symbolic sizes stay
    symbolic (``torch.export`` with dynamic shapes); ``ValueError`` where they do not broadcast.

    >>> broadcast_shapes((2, 1), (3,), ())
    (2, 3)
    """
    out: list[Any] = [1] * max((len(s) for s in shapes), default=0)
    for shape in shapes:
        for k, d in enumerate(shape, len(out) - len(shape)):
            if d != 1:
                if out[k] == 1:
                    out[k] = d
                elif out[k] != d:
                    raise ValueError(f"shapes {shapes} do not broadcast")
    return tuple(out)


def float_dtype(caller: str, **arrays: Any) -> np.dtype[Any]:
    """The floating dtype of a computation on ``arrays`` (``None`` values ignored).

    float32 and float64 are supported; a mix of the two computes in float64 (never a silent
    downcast). Any other dtype is a ``TypeError`` that names it.

    >>> float_dtype("f", x=np.ones(2, np.float32), y=None)
    dtype('float32')
    """
    result: np.dtype[Any] | None = None
    for name, a in arrays.items():
        if a is None:
            continue
        dtype = np.dtype(a.dtype)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"{caller}: {name} has dtype {dtype}; spchain supports float32 and float64")
        result = dtype if result is None or result == dtype else np.promote_types(result, dtype)
    return result if result is not None else np.dtype(np.float64)


def dense(caller: str, **arrays: Any) -> list[Any]:
    """``arrays`` checked to be dense arrays (NumPy, CuPy, or in ``spchain.torch`` tensors).

    An ``np.matrix`` comes back as the plain ndarray it views (its methods differ from
    ndarray's); a Python scalar, ``None``, a list or a tuple is a ``TypeError`` naming the
    argument, and so is a sparse matrix or a sparse (non-strided) torch tensor, naming its
    layout. Anything else is left to ``_backend.backend_of``.

    >>> dense("f", a=np.ones(2), b=[1.0])
    Traceback (most recent call last):
    ...
    TypeError: f: b must be an array, not list
    """
    checked = []
    for name, a in arrays.items():
        layout = getattr(a, "layout", None)
        if layout is not None and str(layout) != "torch.strided":
            raise TypeError(f"{caller}: {name} is a {layout} tensor; it must be a dense (torch.strided) one")
        if scipy.sparse.issparse(a) or type(a).__module__.startswith("cupyx.scipy.sparse"):
            raise TypeError(f"{caller}: {name} is a sparse {a.format} matrix; it must be a dense array")
        if a is None or isinstance(a, (bool, int, float, complex, list, tuple, np.generic)):
            wanted = "a torch.Tensor" if caller.startswith("spchain.torch") else "an array"
            raise TypeError(f"{caller}: {name} must be {wanted}, not {type(a).__name__}")
        checked.append(np.asarray(a) if isinstance(a, np.matrix) else a)
    return checked
