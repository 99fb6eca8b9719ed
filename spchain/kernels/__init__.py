"""Numba kernels, installed as ``spchain.kernels``.

``cpu/`` holds ``@njit`` kernels, ``cuda/`` their ``@cuda.jit`` twins with ``launch_<op>``
host launchers. Kernels take raw arrays and fill preallocated outputs; they import numpy and
numba only (never spchain, torch or CuPy). Importing this package compiles nothing.
"""
