"""The types that spchain's annotations name.

``Array`` is a dense in-memory array of the array API: a NumPy ``ndarray`` or, on the GPU, a
CuPy one. CuPy ships no type information, so a type checker reads its half of the union as
``Any`` and checks the NumPy half. The functions marked ``@scales_out`` also take Dask arrays
(:mod:`spchain._dask`), which give Dask arrays back. ``Shape`` is an array's shape.
"""

from typing import TYPE_CHECKING, Any, TypeAlias, Union

from numpy.typing import NDArray

if TYPE_CHECKING:
    import cupy

Array: TypeAlias = Union[NDArray[Any], "cupy.ndarray"]
"""A NumPy or CuPy array."""

Shape: TypeAlias = tuple[int, ...]
"""The shape of an array."""
