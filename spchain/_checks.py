"""Input validation shared by the array API.

Conventions (RELIABILITY.md): ``ValueError`` for bad structure or shape, ``TypeError`` for an
unsupported type or dtype; messages name the function and the offending values.
"""

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def float_dtype(caller: str, **arrays) -> np.dtype:
    """The floating dtype of a computation on ``arrays`` (``None`` values ignored).

    float32 and float64 are supported; a mix of the two computes in float64 (never a silent
    downcast). Any other dtype is a ``TypeError`` that names it.

    >>> float_dtype("f", x=np.ones(2, np.float32), y=None)
    dtype('float32')
    """
    result = None
    for name, a in arrays.items():
        if a is None:
            continue
        dtype = np.dtype(a.dtype)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"{caller}: {name} has dtype {dtype}; spchain supports float32 and float64")
        result = dtype if result is None else np.promote_types(result, dtype)
    return result if result is not None else np.dtype(np.float64)
