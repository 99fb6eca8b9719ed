"""Parallel CPU kernels on a team of threads: torch's own OpenMP threads where torch is loaded,
Numba's threads elsewhere.

After each operator torch's OpenMP threads spin for milliseconds, waiting for the next one. A
kernel that starts then on Numba's threads (TBB) shares the cores with them and runs at one
thread's speed: the HMM forward kernel (batch 256, v 64, 50 states) takes 4.6 ms alone and
9.2 ms right after torch ops on 2 cores. So where torch has loaded GNU OpenMP (its Linux
wheels), a kernel runs on torch's threads instead, through ``GOMP_parallel``: 5.0 ms alone and
5.3 ms after torch ops (docs/design.rst, "Threads").

A kernel is a serial body ``body(lo, hi, *args)`` over rows ``lo:hi`` and one cached entry,
which passes the body to :func:`team_rows` with a launcher of ``GOMP_parallel``'s shape:
torch's own (:func:`parallel`) or :func:`numba_parallel`, which hands the team to Numba's
threading layer (the ``numba_parallel_for`` that Numba's ``prange`` loops call). :func:`run`
picks the launcher and the number of threads. A process compiles each kernel once, and
never a parfor (Numba's ``prange`` pass took 10-15 s of a cold compile for some kernels).

    @njit(cache=True, error_model="numpy")
    def _rows(lo, hi, x, out): ...

    @njit(nogil=True, cache=True)
    def kernel(parallel, threads, x, out):
        return team_rows(parallel, threads, _rows, x.shape[0], (x, out))

    team.run(kernel, x, out)       # team.serial(kernel, x, out): on the calling thread
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import crowded, forked

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)

CHUNKS = 8
"""Chunks of rows per thread, taken in turn by whichever thread is free (a thread that the
machine's other work delays leaves its rows to the others)."""


@intrinsic
def team_rows(typingctx: Any, parallel: Any, threads: Any, body: Any, rows: Any, args: Any) -> Any:
    """``body(lo, hi, *args)`` over rows ``0:rows`` in chunks, on a team of ``threads`` OpenMP
    threads started by the ``GOMP_parallel`` at address ``parallel`` (0, or one thread: in the
    calling thread). Each thread takes the next chunk until none is left (an atomic counter).
    Returns the number of chunks whose body raised (their rows are not done)."""
    if not isinstance(body, types.Dispatcher) or not isinstance(args, types.BaseTuple):
        return None
    body_sig = types.none(types.int64, types.int64, *args.types)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, llargs: Any) -> Any:
        parallel_v, threads_v, _, rows_v, args_v = llargs
        # what the team shares: the next row, the rows, the chunk, the failures, the arguments
        state_ty = ir.LiteralStructType([_I64, _I64, _I64, _I64, context.get_value_type(args)])
        field = lambda b, state, i: b.gep(state, [_I32(0), _I32(i)], inbounds=True)  # noqa: E731

        module = builder.module
        member = ir.Function(module, ir.FunctionType(ir.VoidType(), [_I8P]), module.get_unique_name("spchain_team"))
        member.linkage = "internal"
        m = ir.IRBuilder(member.append_basic_block("entry"))
        state = m.bitcast(member.args[0], state_ty.as_pointer())
        rows_m, chunk, shared = (m.load(field(m, state, i)) for i in (1, 2, 4))
        head, work, done = (member.append_basic_block(name) for name in ("head", "work", "done"))
        m.branch(head)
        m.position_at_end(head)
        lo = m.atomic_rmw("add", field(m, state, 0), chunk, "monotonic")
        m.cbranch(m.icmp_signed("<", lo, rows_m), work, done)
        m.position_at_end(work)
        end = m.add(lo, chunk)
        hi = m.select(m.icmp_signed("<", end, rows_m), end, rows_m)
        compiled = body.dispatcher.get_compile_result(body_sig)  # the body's own (cached) compile, linked
        context.add_linking_libs([compiled.library])
        items = [_unowned(m, m.extract_value(shared, i), t) for i, t in enumerate(args.types)]
        status, _ = context.call_conv.call_function(m, context.declare_function(module, compiled.fndesc),
                                                    types.none, compiled.fndesc.argtypes, [lo, hi, *items])
        with m.if_then(status.is_error):
            m.atomic_rmw("add", field(m, state, 3), _I64(1), "monotonic")
        m.branch(head)
        m.position_at_end(done)
        m.ret_void()

        state = cgutils.alloca_once(builder, state_ty)
        per_thread = builder.mul(builder.select(builder.icmp_signed(">", threads_v, _I64(1)), threads_v, _I64(1)),
                                 _I64(CHUNKS))
        chunk_v = builder.sdiv(builder.add(rows_v, builder.sub(per_thread, _I64(1))), per_thread)
        for i, value in enumerate((_I64(0), rows_v, builder.select(builder.icmp_signed(">", chunk_v, _I64(1)),
                                                                     chunk_v, _I64(1)), _I64(0), args_v)):
            builder.store(value, field(builder, state, i))
        data = builder.bitcast(state, _I8P)
        on_team = builder.and_(builder.icmp_signed(">", threads_v, _I64(1)), builder.icmp_signed("!=", parallel_v,
                                                                                                  _I64(0)))
        with builder.if_else(on_team) as (team, here):
            with team:
                gomp_ty = ir.FunctionType(ir.VoidType(), [member.type, _I8P, _I32, _I32])
                builder.call(builder.inttoptr(parallel_v, gomp_ty.as_pointer()),
                             [member, data, builder.trunc(threads_v, _I32), _I32(0)])
            with here:
                builder.call(member, [data])
        return builder.load(field(builder, state, 3))

    return types.int64(parallel, threads, body, rows, args), codegen


def _unowned(builder: ir.IRBuilder, value: Any, typ: Any) -> Any:
    """An array argument as the team's threads see it: without its memory's owner (``meminfo``
    and ``parent`` null), as Numba passes arrays into a ``prange`` body. The caller holds the
    arrays for the whole region; a body that takes views (``x[b]``) would otherwise count
    references on the owner, an atomic add on one cache line from every thread, for each view
    (the chain's GEMM-sweep backward step: 1.14 ms on two threads against 1.19 ms on one)."""
    if not isinstance(typ, types.Array):
        return value
    for field in (0, 1):  # meminfo, parent
        value = builder.insert_value(value, ir.Constant(value.type.elements[field], None), field)
    return value


def parallel() -> int:
    """The address of ``GOMP_parallel`` in the GNU OpenMP that torch loaded, or 0: torch not
    imported or built with another OpenMP, or a process forked after spchain's kernels loaded
    (GNU OpenMP's threads do not survive a fork; a ``DataLoader`` worker runs torch on one
    thread too): Numba's threads there. A child started by ``spawn`` has threads of its own."""
    torch = sys.modules.get("torch")
    if torch is None or forked():
        return 0
    return _gomp_parallel(os.path.dirname(torch.__file__))


@functools.cache
def _gomp_parallel(torch_dir: str) -> int:
    """``GOMP_parallel``'s address in the ``libgomp`` mapped from under ``torch_dir``, or 0."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:  # not Linux
        return 0
    for path in sorted(p for p in paths if p.startswith(torch_dir)):
        try:
            return int(ctypes.cast(ctypes.CDLL(path).GOMP_parallel, ctypes.c_void_p).value or 0)
        except (OSError, AttributeError):
            return 0
    return 0


@functools.cache
def numba_parallel() -> int:
    """The address of a launcher of ``GOMP_parallel``'s shape, ``(fn, data, threads, flags)``,
    that runs ``fn(data)`` on ``threads`` of Numba's threads (its threading layer, chosen by
    ``cpu.threading_layer``) through ``numba_parallel_for``, the entry of Numba's own
    parallel loops: a team for :func:`team_rows` where torch's is not found. Built once a
    process (a few LLVM instructions)."""
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.registry import cpu_target
    from numba.np.ufunc import parallel as numba_threads

    numba_threads._launch_threads()  # registers numba_parallel_for with LLVM
    member = ir.FunctionType(ir.VoidType(), [_I8P]).as_pointer()
    pack_type = ir.LiteralStructType([member, _I8P])  # the member and its data
    library = cpu_target.target_context.codegen().create_library("spchain_numba_parallel")
    module = library.create_ir_module("spchain_numba_parallel")
    # what numba_parallel_for runs on each thread, a gufunc's shape: (args, dimensions, steps, data)
    each = ir.Function(module, ir.FunctionType(ir.VoidType(), [_I8P.as_pointer(), _I64.as_pointer(),
                                                                _I64.as_pointer(), _I8P]), "spchain_numba_member")
    b = ir.IRBuilder(each.append_basic_block())
    pack = b.bitcast(each.args[3], pack_type.as_pointer())
    b.call(b.load(b.gep(pack, [_I32(0), _I32(0)])), [b.load(b.gep(pack, [_I32(0), _I32(1)]))])
    b.ret_void()
    launcher = ir.Function(module, ir.FunctionType(ir.VoidType(), [member, _I8P, _I32, _I32]), "spchain_numba_parallel")
    parallel_for = ir.Function(module, ir.FunctionType(ir.VoidType(), [_I8P] * 5 + [_I64] * 3), "numba_parallel_for")
    b = ir.IRBuilder(launcher.append_basic_block())
    fn, data, threads, _ = launcher.args
    pack = b.alloca(pack_type)
    b.store(fn, b.gep(pack, [_I32(0), _I32(0)]))
    b.store(data, b.gep(pack, [_I32(0), _I32(1)]))
    count = b.zext(threads, _I64)
    dimensions, steps = b.alloca(_I64), b.alloca(_I64)  # one loop of ``threads`` iterations, no arrays
    b.store(count, dimensions)
    b.store(_I64(0), steps)
    b.call(parallel_for, [b.bitcast(each, _I8P), ir.Constant(_I8P, None), b.bitcast(dimensions, _I8P),
                          b.bitcast(steps, _I8P), b.bitcast(pack, _I8P), _I64(0), _I64(0), count])
    b.ret_void()
    with global_compiler_lock:
        library.add_ir_module(module)
        library.finalize()
        _LAUNCHERS.append(library)  # its machine code lives as long as the library
        return int(library.get_pointer_to_function("spchain_numba_parallel"))


_LAUNCHERS: list[Any] = []
"""The code library of :func:`numba_parallel`'s launcher, kept for the process's lifetime."""


def run(kernel: Callable[..., Any], *args: Any) -> None:
    """``kernel(parallel, threads, *args)`` on torch's OpenMP threads where :func:`parallel`
    finds them, as many as both torch and Numba allow, or on the calling thread alone while
    the machine is :func:`crowded`; elsewhere on Numba's threads (:func:`numba_parallel`,
    ``numba.set_num_threads``), whose threading layer copes with a busy machine by itself."""
    import numba

    address = parallel()
    if address:
        import torch

        threads = 1 if crowded() else min(torch.get_num_threads(), numba.get_num_threads())
    else:
        address, threads = numba_parallel(), numba.get_num_threads()
    _check(kernel, kernel(address, threads, *args))


def serial(kernel: Callable[..., Any], *args: Any) -> None:
    """``kernel(0, 1, *args)``: on the calling thread alone (a small product's route)."""
    _check(kernel, kernel(0, 1, *args))


def _check(kernel: Callable[..., Any], failed: int) -> None:
    """A ``RuntimeError`` where chunks of rows failed (their rows were not written)."""
    if failed:
        raise RuntimeError(f"{kernel.__name__}: {failed} chunks of rows failed")  # kernels check their inputs first
