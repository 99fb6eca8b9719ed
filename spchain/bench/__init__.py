"""``python -m spchain bench``: spchain beside the baselines it must beat, in one process.

Each workload of the design (``docs/design.rst``) lives in a module here with ``CASES`` (the names of its cases),
``SIZES`` (``{False: full sizes, True: quick sizes}``, each a dict of named sizes), optionally
``FULL_ONLY`` (cases that ``--quick`` leaves out), and ``make_case(name, quick, device)``
returning a :class:`~.core.Case`, inputs built; asv's suite (``asv_bench/``) times the same cases.
To add a workload, add its module and one line to ``WORKLOADS``. The command prints a table
(median time, peak memory, max error against a float64 reference, ratios against spchain),
draws a PNG bar chart with ``--png``, and checks the ratios against the committed record
(:mod:`.record`) with ``--check``.

    python -m spchain bench --quick                        # small sizes
    python -m spchain bench --only chain                   # one full-size workload
    python -m spchain bench --check --only chain           # the regression check (quick sizes)
    python -m spchain bench --device cuda --json out.json  # on a GPU (CUDA-event times), also as JSON
"""

import argparse
import gc
import importlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from . import record
from .core import Case, Result, measure
from .report import LEGEND, plot, table, write_docs

WORKLOADS = {
    "sparse-linear": "sparse",
    "block-sparse": "blocksparse",
    "block-diag": "blockdiag",
    "chain": "chain",
    "sparse-chain": "sparse_chain",
    "logmatmul": "logmatmul",
    "viterbi": "viterbi",
    "grouped": "grouped",
    "chains-at-scale": "dask",
    "crf": "crf",
    "torch-layer": "torch_layer",
    "hmm-forward": "hmm_forward",
    "hmm-fit": "hmm",
}
"""Workload name → module (relative to this package) with ``CASES`` and ``make_case``."""


def workload(name: str) -> ModuleType:
    """The module of one workload of ``WORKLOADS``."""
    return importlib.import_module(f".{WORKLOADS[name]}", __name__)


def cases(name: str, quick: bool) -> list[str]:
    """The cases of a workload that a run (``--quick`` or not) measures."""
    module = workload(name)
    return [c for c in module.CASES if not (quick and c in getattr(module, "FULL_ONLY", ()))]


def sizes(name: str, quick: bool) -> str:
    """The sizes of a workload's cases, as in the table's header: ``"batch 64, features 512"``,
    and the cases that ``--quick`` leaves out."""
    text = ", ".join(f"{key} {value:,}" for key, value in workload(name).SIZES[quick].items())
    left_out = [c for c in workload(name).CASES if c not in cases(name, quick)]
    return text + (f"; not in --quick: {', '.join(left_out)}" if left_out else "")


def make_case(name: str, case: str, quick: bool, device: str = "cpu") -> Case:
    """One case of a workload, its inputs built (a case's inputs are built only when it runs)."""
    module = workload(name)
    if case not in module.CASES:
        raise ValueError(f"workload {name!r} has no case {case!r}; its cases: {module.CASES}")
    built: Case = module.make_case(case, quick, device)
    return built


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def _writable(path: str, suffix: str) -> None:
    """Raise ``ValueError`` unless ``path`` ends in ``suffix`` and a file can be written there."""
    if not path.endswith(suffix):
        raise ValueError(f"{path!r} does not end in {suffix}")
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{path!r} is a directory")
    folder = target.parent
    if not folder.is_dir():
        raise ValueError(f"{path!r}: no directory {str(folder)!r}")
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise ValueError(f"{path!r} cannot be written")
    if not target.exists():  # root passes os.access where no file can be made (/proc)
        try:
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            raise ValueError(f"{path!r} cannot be written ({exc.strerror})") from None


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="python -m spchain", description="spchain's command line")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run the benchmark workloads beside their baselines")
    size = bench.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (the default of --check)")
    size.add_argument("--full", action="store_true", help="full sizes (the default but with --check)")
    bench.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), metavar="WORKLOAD",
                       help=f"run only these workloads ({', '.join(WORKLOADS)})")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    bench.add_argument("--repeat", type=_positive_int, default=None, help="timed rounds (default 5, quick 3)")
    bench.add_argument("--budget", type=_seconds, default=None,
                       help="seconds after which a baseline's timed runs stop repeating (default 20, quick 2)")
    bench.add_argument("--png", default=None, help="also draw the bar chart into this PNG file")
    bench.add_argument("--json", default=None,
                       help="also write the figures into this JSON file (the run and its cases, as in the record)")
    bench.add_argument("--check", action="store_true",
                       help=f"compare each baseline's time ratio with the record's at these sizes (quick unless "
                            f"--full); exit 1 if one fell by more than {record.DROP:.0%}%")
    bench.add_argument("--update-record", action="store_true",
                       help="write this run's figures into the record (and the README and docs tables in a clone)")
    bench.add_argument("--write-docs", action="store_true",
                       help="only rewrite the README's and the docs' tables from the record (runs nothing)")
    bench.add_argument("--record", type=Path, default=record.PATH, help="the record file (default: the committed one)")
    return parser, bench


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    """The parsed arguments, every check that can fail done before anything runs; ``saved`` is the
    record, loaded and validated where ``--check``, ``--update-record`` or ``--write-docs`` reads it."""
    top, parser = _parser()
    args = top.parse_args(argv)
    twice = sorted({w for w in args.only or () if args.only.count(w) > 1})
    if twice:
        parser.error(f"--only: {', '.join(twice)} named more than once")
    if args.write_docs:
        run_only = [("--only", args.only), ("--quick", args.quick), ("--full", args.full),
                    ("--device", args.device != "cpu"), ("--repeat", args.repeat),
                    ("--budget", args.budget is not None), ("--png", args.png), ("--json", args.json),
                    ("--check", args.check), ("--update-record", args.update_record)]
        given = [flag for flag, value in run_only if value]
        if given:
            parser.error(f"--write-docs runs nothing and rewrites every table from the whole record: "
                         f"{', '.join(given)} not allowed with it")
    args.quick = args.quick or (args.check and not args.full)
    args.saved = None
    if args.check or args.update_record or args.write_docs:
        if not args.record.is_file():
            parser.error(f"--record: no file {str(args.record)!r}")
        try:
            args.saved = record.load(args.record)
        except json.JSONDecodeError as exc:
            parser.error(f"--record: {str(args.record)!r} is not JSON ({exc})")
        except (OSError, ValueError) as exc:
            parser.error(f"--record: {str(args.record)!r}: {exc}")
    if (args.check or args.update_record) and args.device != "cpu":
        parser.error("--check and --update-record: the record holds CPU figures (--device cpu)")
    outputs = [("--png", args.png, ".png"), ("--json", args.json, ".json"),
               ("--record", str(args.record) if args.update_record else None, ".json")]
    for flag, path, suffix in outputs:
        if path is None:
            continue
        try:
            _writable(path, suffix)
        except ValueError as exc:
            parser.error(f"{flag}: {exc}")
    if (args.update_record or args.write_docs) and args.record == record.PATH and not (ROOT / "README.md").is_file():
        parser.error("--update-record and --write-docs rewrite the README of a clone of the repository; "
                     "this spchain is installed without one")
    return args


ROOT = Path(__file__).resolve().parents[2]
"""The repository's root in a clone (where ``README.md`` and ``docs/`` are)."""


def kernel_indexes() -> list[Path]:
    """The index file that Numba's on-disk cache keeps for each of spchain's cached CPU kernels
    (where ``NUMBA_CACHE_DIR`` or the ``__pycache__`` beside the kernels puts it; it may not exist)."""
    from numba.core.registry import CPUDispatcher

    from ..kernels import cpu

    modules = [getattr(cpu, name) for name in cpu.MODULES]  # through cpu: its threading layer first
    return [Path(kernel._cache._cache_file._index_path) for module in modules for kernel in vars(module).values()
            if isinstance(kernel, CPUDispatcher) and kernel.__module__ == module.__name__
            and hasattr(kernel._cache, "_cache_file")]  # a kernel without cache=True has a NullCache


def kernels_cached() -> bool:
    """Whether Numba's on-disk cache holds most of spchain's CPU kernels, as after a first run
    (a test run that compiled a few leaves the compiling step to the next ``bench``)."""
    indexes = kernel_indexes()
    return 2 * sum(index.is_file() for index in indexes) >= len(indexes)


COMPILE_ORDER = ["torch-layer", "hmm-fit", "hmm-forward", "crf", "chains-at-scale", "chain", "logmatmul", "block-diag",
                 "grouped", "viterbi", "sparse-linear", "block-sparse", "sparse-chain"]
"""The order in which :func:`compile_kernels` compiles the workloads: this process from the
front, the worker processes from the back. torch-layer comes first: its small calls need the
chain kernels of hmm-forward and crf and the sparse ones of block-sparse and sparse-linear, so
these are in the cache before either end reaches a workload that shares them (where the ends
met at torch-layer, both processes compiled ``sparse_sddmm``, 6 s each). Then the workloads
whose cases import other libraries (hmmlearn, pomegranate, Dask, the CRFs; the run then has
them imported); the back holds those with the most kernels of their own; workloads that share
kernels sit together, and the quickest sit in the middle, where the two ends meet. Measured
alone on an empty cache (seconds at quick sizes, 2026-11-29, an idle machine): torch-layer 29,
sparse-chain 29, hmm-fit 24, block-sparse 7 after torch-layer (20 before it)."""


def _compile(name: str, quick: bool) -> str:
    """Run spchain's methods (those named ``spchain...`` and the case's ``spchain_methods``) and
    the float64 reference of each case of workload ``name`` once, which compiles the kernels they
    need into Numba's on-disk cache (for :func:`compile_kernels`)."""
    from ..kernels import cpu

    with cpu.assume_idle():  # its worker keeps the machine busy: compile what an idle run calls
        for case_name in cases(name, quick):
            case = make_case(name, case_name, quick)
            for method, fn in case.methods.items():
                if method.startswith("spchain") or method in case.spchain_methods:
                    fn()
            if case.reference is not None:
                case.reference()
    return name


def _one_thread() -> None:
    """A compiling worker's torch runs on one thread: the workers share the cores."""
    import torch

    torch.set_num_threads(1)


def compile_kernels(names: list[str], quick: bool) -> None:
    """Compile the kernels that the workloads ``names`` need into Numba's on-disk cache, with a
    progress bar: the first run after an install only.

    Numba compiles one function at a time in a process, so on each free core but this
    process's a worker process compiles too: this process takes the workloads from the front
    of :data:`COMPILE_ORDER`, the workers from its back, until they meet. What this process
    compiled stays loaded for the run after it."""
    import multiprocessing
    import threading
    from concurrent.futures import Future, ProcessPoolExecutor

    from tqdm import tqdm

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    free = cores - (os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0)
    # One worker beside this process even on a busy machine: it costs its start-up, and there two
    # processes get about twice one's share of the cores (2026-11-25, 2 cores at a load of 2-4:
    # 57 s against 107 s). More only for the cores the load leaves free.
    workers = min(len(names), cores, max(2, int(free + 0.5))) - 1
    names = sorted(names, key=COMPILE_ORDER.index)
    with tqdm(total=len(names), desc="compiling kernels (first run only)", file=sys.stderr,
              bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} workloads, {elapsed} {postfix}") as bar:
        lock = threading.Lock()  # a worker's workload is reported on the pool's thread

        def show(name: str, done: int) -> None:
            with lock:
                bar.set_postfix_str(name)
                bar.update(done)

        def here(name: str) -> None:
            show(name, 0)
            show(_compile(name, quick), 1)

        def finished(future: Future[str]) -> None:
            if not future.cancelled() and future.exception() is None:
                show(future.result(), 1)

        if workers < 1:
            for name in names:
                here(name)
            return
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_one_thread) as pool:
            queued = {name: pool.submit(_compile, name, quick) for name in reversed(names)}
            for future in queued.values():
                future.add_done_callback(finished)
            for name in names:
                if not queued[name].cancel():  # a worker has it: so has it every workload after it
                    break
                here(name)
            for future in queued.values():
                if not future.cancelled():
                    future.result()  # raises a worker's error here


def run(selected: list[tuple[str, str]], quick: bool, device: str, repeat: int, budget: float) -> list[Result]:
    """Measure the ``(workload, case)`` pairs, a progress bar on stderr."""
    from tqdm import tqdm

    results = []
    with tqdm(total=len(selected), desc="benchmarks", file=sys.stderr,
              bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}") as bar:
        for i, (name, case_name) in enumerate(selected):
            bar.set_postfix_str(f"{name}: {case_name}")
            gc.collect()
            gc.freeze()  # what outlives the cases so far (modules, caches) is left out of later collections
            case = make_case(name, case_name, quick, device)
            runs = len(case.methods) * (repeat + 2)
            done = [0]

            def tick() -> None:
                done[0] += 1
                bar.update(i + min(done[0] / runs, 1.0) - bar.n)

            results.extend(measure(case, repeat, budget, tick))
            bar.n = i + 1  # exact, so that the bar ends at its total
            bar.refresh()
            del case
    return results


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.write_docs:
        for path in write_docs(args.saved, ROOT):
            print(f"rewritten: {path}")
        return 0
    try:
        import torch
        import tqdm  # noqa: F401
    except ImportError as exc:
        print(f"python -m spchain bench needs torch and tqdm ({exc}): pip install 'spchain[torch,bench]'",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    repeat = args.repeat or (3 if args.quick else 5)
    budget = args.budget if args.budget is not None else (2.0 if args.quick else 20.0)
    selected = [(w, c) for w in args.only or WORKLOADS for c in cases(w, args.quick)]
    this_run = record.this_run(argv if argv is not None else sys.argv[1:], args.quick, torch.get_num_threads(),
                               args.device)
    if args.device == "cpu" and not kernels_cached():
        compile_kernels(list(dict.fromkeys(w for w, _ in selected)), args.quick)
    results = run(selected, args.quick, args.device, repeat, budget)
    title = (f"spchain {importlib.import_module('spchain').__version__} on {this_run['cpu']}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads{' (quick sizes)' if args.quick else ''}")
    print(title)
    names = list(dict.fromkeys(w for w, _ in selected))
    print("\n".join(f"  {name.ljust(max(map(len, names)))}  {sizes(name, args.quick)}" for name in names))
    print(table(results))
    print(LEGEND)
    if args.png is not None:
        plot(results, args.png, title)
        print(f"bar chart written to {args.png}")
    if args.json is not None:
        Path(args.json).write_text(json.dumps(record.as_json(results, this_run), indent=1) + "\n")
        print(f"figures written to {args.json}")
    status = 0
    if args.check:
        changes, missing = record.compare(args.saved, results, args.quick, this_run["cpu"])
        print(record.check_report(changes, missing))
        status = 1 if any(c.fell for c in changes) else 0
    if args.update_record:
        saved = record.load(args.record)  # not args.saved: another run may have written it since
        written = record.update(saved, results, args.quick, this_run)
        record.save(saved, args.record)
        print(f"{args.record}: {len(written)} cases written")
        if args.record == record.PATH:
            for path in write_docs(saved, ROOT):
                print(f"rewritten: {path}")
    return status
