"""Kernel entries as the kernel tests call them: a CPU kernel on a team of threads (``team.run``),
a CUDA kernel through its ``launch_`` function."""

import functools

from spchain.kernels.cpu import team


def entry(module, prefix, name):
    """``module``'s kernel ``name``: ``launch_<name>`` for a CUDA module (``prefix`` "launch_"),
    the CPU kernel on a team (``team.run``) for a CPU one (``prefix`` "")."""
    if prefix:
        return getattr(module, prefix + name)
    return functools.partial(team.run, getattr(module, name))
