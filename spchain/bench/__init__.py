"""``python -m spchain bench``: spchain beside the baselines it must beat, in one process.

Each workload of DESIGN.md lives in a module here with ``CASES`` (the names of its cases),
``SIZES`` (``{False: full sizes, True: quick sizes}``, each a dict of named sizes), optionally
``FULL_ONLY`` (cases that ``--quick`` leaves out), and ``make_case(name, quick, device)``
returning a :class:`~.core.Case`, inputs built; asv's suite (``asv_bench/``) times the same cases.
The command prints a table (median time, peak memory, max error against a float64
reference, ratios against spchain) and writes a PNG bar chart.

    python -m spchain bench --quick            # small sizes, under a minute
    python -m spchain bench --only chain       # one full-size workload
    python -m spchain bench --device cuda --json out.json   # on a GPU (CUDA-event times), also as JSON
"""

import argparse
import gc
import importlib
import json
import math
import platform
import sys
from types import ModuleType

from .core import Case, Result, measure
from .report import plot, table

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
    "hmm-forward": "hmm_forward",
    "torch-layer": "torch_layer",
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spchain", description="spchain's command line")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run the benchmark workloads beside their baselines")
    bench.add_argument("--quick", action="store_true", help="small sizes (under a minute in all)")
    bench.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), metavar="WORKLOAD",
                       help=f"run only these workloads ({', '.join(WORKLOADS)})")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    bench.add_argument("--repeat", type=int, default=None, help="timed rounds (default 5, quick 3)")
    bench.add_argument("--budget", type=float, default=None,
                       help="seconds after which a method's timed runs stop repeating (default 20, quick 2)")
    bench.add_argument("--png", default="spchain-bench.png", help="where to write the bar chart")
    bench.add_argument("--json", default=None, metavar="OUT",
                       help="also write the results, the device and the versions to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        import torch
        from tqdm import tqdm
    except ImportError as exc:
        print(f"python -m spchain bench needs torch and tqdm ({exc}): pip install 'spchain[torch,bench]'",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    repeat = max(1, args.repeat or (3 if args.quick else 5))
    budget = args.budget if args.budget is not None else (2.0 if args.quick else 20.0)
    selected = [(w, c) for w in args.only or WORKLOADS for c in cases(w, args.quick)]
    results = []
    with tqdm(total=len(selected), desc="benchmarks", file=sys.stderr,
              bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}") as bar:
        for name, case_name in selected:
            bar.set_postfix_str(f"{name}: {case_name}")
            gc.collect()
            gc.freeze()  # what outlives the cases so far (modules, caches) is left out of later collections
            case = make_case(name, case_name, args.quick, args.device)
            runs = len(case.methods) * (repeat + 2)
            results.extend(measure(case, repeat, budget, lambda: bar.update(1 / runs)))
            del case
    machine = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or platform.machine()}"
    title = (f"spchain {importlib.import_module('spchain').__version__} on {machine}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads{' (quick sizes)' if args.quick else ''}")
    print(title)
    names = list(dict.fromkeys(w for w, _ in selected))
    print("\n".join(f"  {name.ljust(max(map(len, names)))}  {sizes(name, args.quick)}" for name in names))
    print(table(results))
    plot(results, args.png, title)
    print(f"bar chart written to {args.png}")
    if args.json:
        write_json(args.json, results, machine=machine, device=args.device, quick=args.quick)
        print(f"results written to {args.json}")
    return 0


def write_json(path: str, results: list[Result], **run: object) -> None:
    """The results of a run as JSON: ``run`` (device, machine, ...) with the versions of
    spchain, torch and CuPy (``None`` where not installed), and one record a method."""
    import torch

    cupy = sys.modules.get("cupy")
    record = {**run, "spchain": importlib.import_module("spchain").__version__, "torch": torch.__version__,
              "cupy": getattr(cupy, "__version__", None),
              "timing": "CUDA events after warm-up" if run.get("device") == "cuda" else "wall clock after warm-up",
              "results": [{"workload": r.workload, "case": r.case, "method": r.method, "median_s": r.median,
                           "times_s": r.times, "peak_bytes": None if math.isnan(r.peak_bytes) else r.peak_bytes,
                           "max_rel_error": None if math.isnan(r.max_rel_error) else r.max_rel_error}
                          for r in results]}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
