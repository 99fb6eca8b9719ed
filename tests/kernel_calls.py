"""Kernel entries as the kernel tests call them: a CPU kernel on a team of threads (``team.run``),
a CUDA kernel through its ``launch_`` function; and a spy on a CPU kernel's calls."""

import functools

from spchain.kernels.cpu import team


def entry(module, prefix, name):
    """``module``'s kernel ``name``: ``launch_<name>`` for a CUDA module (``prefix`` "launch_"),
    the CPU kernel on a team (``team.run``) for a CPU one (``prefix`` "")."""
    if prefix:
        return getattr(module, prefix + name)
    return functools.partial(team.run, getattr(module, name))


def spy(kernel, record):
    """``kernel`` calling ``record(args)`` first (``parallel`` and ``threads`` lead them): a
    stand-in for a CPU kernel that ``team.run`` takes as the kernel (read-only arguments too)."""
    def call(*args):
        record(args)
        return kernel(*args)

    call.reads, call.__name__ = kernel.reads, kernel.__name__
    return call
