"""The types that spchain's annotations name.

``Array`` is a dense in-memory array of the array API: a NumPy ``ndarray`` or, on the GPU, a
CuPy one. CuPy ships no type information, so a type checker reads its half of the union as
``Any`` and checks the NumPy half. The functions marked ``@scales_out`` also take Dask arrays
(:mod:`spchain._dask`), which give Dask arrays back. ``Shape`` is an array's shape. ``Sparse``
is a SciPy sparse matrix or array, or a cupyx sparse matrix; neither SciPy nor CuPy ships type
information, so a type checker reads it as ``Any``. ``Seed`` seeds ``numpy.random.default_rng``.
"""

from typing import TYPE_CHECKING, Any, TypeAlias, Union

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    import cupy
    import cupyx.scipy.sparse
    import scipy.sparse

Array: TypeAlias = Union[NDArray[Any], "cupy.ndarray"]
"""A NumPy or CuPy array."""

Shape: TypeAlias = tuple[int, ...]
"""The shape of an array."""

Sparse: TypeAlias = Union["scipy.sparse.sparray", "scipy.sparse.spmatrix", "cupyx.scipy.sparse.spmatrix"]
"""A SciPy sparse matrix or array, or a cupyx sparse matrix."""

Seed: TypeAlias = Union[int, np.random.Generator, None]
"""A seed of ``numpy.random.default_rng``: an int, a generator, or ``None`` (fresh entropy)."""
