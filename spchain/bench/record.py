"""The committed benchmark record (``record.json`` beside this module) and the regression check.

The record holds, per workload, case and size (quick or full), every method's median time, peak
memory and error, each baseline's ratio to spchain, and the run that measured them (date,
machine, CPU, torch, threads, command). The README's headline table and the figures table of
``docs/tutorials/benchmarks.rst`` are generated from it (:mod:`.report`), and
``python -m spchain bench --check`` compares a fresh run's ratios with it::

    python -m spchain bench --check --only chain             # before you stop (quick sizes)
    python -m spchain bench --update-record --quick          # after a change that moves figures
"""

import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core import MiB, Result

PATH = Path(__file__).with_name("record.json")
"""The record committed in the repository."""

DROP = 0.25
"""``--check`` lists every ratio that fell by more than this fraction of the recorded one."""

RUN_KEYS = ("date", "machine", "cpu", "torch", "threads", "command")
"""What every run of the record holds (:func:`this_run` writes more)."""

CASE_KEYS = ("workload", "case", "quick", "run", "methods")
"""What every case of the record holds (:func:`entry` may add a label and a headline)."""


def load(path: Path = PATH) -> dict[str, Any]:
    """The record: ``{"runs": {id: run}, "cases": [case, ...]}``; ``ValueError`` where the file is
    not JSON or not a record (:func:`validate`), ``OSError`` where it cannot be read."""
    return validate(json.loads(path.read_text()))


def validate(data: Any) -> dict[str, Any]:
    """``data`` if it has the record's structure, else ``ValueError`` saying what is missing: every
    run holds :data:`RUN_KEYS`; every case :data:`CASE_KEYS`, a run of the record and a non-empty
    list of methods, each with a method and a median time, every baseline with its time ratio."""
    if not (isinstance(data, dict) and isinstance(data.get("runs"), dict) and isinstance(data.get("cases"), list)):
        raise ValueError('not a record: expected an object {"runs": {id: run, ...}, "cases": [case, ...]}')
    for name, run in data["runs"].items():
        if not (isinstance(run, dict) and set(RUN_KEYS) <= run.keys()):
            raise ValueError(f"run {name!r} is not an object with the keys {', '.join(RUN_KEYS)}")
    for i, case in enumerate(data["cases"]):
        if not (isinstance(case, dict) and set(CASE_KEYS) <= case.keys()):
            raise ValueError(f"case {i} is not an object with the keys {', '.join(CASE_KEYS)}")
        methods = case["methods"]
        what = f"case {i} ({case['workload']}: {case['case']})"
        if not (isinstance(methods, list) and methods and all(isinstance(m, dict) for m in methods)):
            raise ValueError(f"{what}: methods is not a non-empty list of objects")
        for k, m in enumerate(methods):
            needs = ("method", "median_s", "time_ratio") if k else ("method", "median_s")
            if not set(needs) <= m.keys():
                raise ValueError(f"{what}: method {k} is not an object with the keys {', '.join(needs)}")
        named = [case["run"], *(m["run"] for m in methods if "run" in m)]
        unknown = [run for run in named if not (isinstance(run, str) and run in data["runs"])]
        if unknown:
            raise ValueError(f"{what} names a run that the record lacks: {unknown[0]!r}")
    record: dict[str, Any] = data
    return record


def save(record: dict[str, Any], path: Path = PATH) -> None:
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


def key(case: dict[str, Any]) -> tuple[str, str, bool]:
    """``(workload, case, quick)``: what identifies a case in the record (one entry per CPU model)."""
    return case["workload"], case["case"], case["quick"]


def cpu(record: dict[str, Any], case: dict[str, Any]) -> str:
    """The CPU (or GPU) model that measured an entry: its run's."""
    model: str = record["runs"][case["run"]]["cpu"]
    return model


def find(record: dict[str, Any], workload: str, case: str, quick: bool, model: str | None = None
         ) -> dict[str, Any] | None:
    """The record's entry of one case at one size measured on the CPU ``model``, else the most
    recently measured one of any machine (``None`` where there is none)."""
    found = [(record["runs"][c["run"]]["date"], k, c) for k, c in enumerate(record["cases"])
             if key(c) == (workload, case, quick)]
    same = [f for f in found if cpu(record, f[2]) == model]
    return max(same or found, key=lambda f: f[:2], default=(None, None, None))[2]


def latest(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry a case and size, the most recently measured, in the record's order: what the
    README and the benchmarks page show."""
    keys = dict.fromkeys(key(c) for c in record["cases"])
    return [c for c in (find(record, *k) for k in keys) if c is not None]


def this_run(argv: list[str], quick: bool, threads: int, device: str) -> dict[str, Any]:
    """A run's description: date, machine, CPU (the GPU's name on CUDA), cores, torch and CuPy,
    threads, how times were taken, load and command."""
    import torch

    from .. import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, {platform.system()}",
        "cpu": torch.cuda.get_device_name() if device == "cuda" else cpu,
        "spchain": __version__,
        "torch": torch.__version__,
        "cupy": getattr(sys.modules.get("cupy"), "__version__", None),
        "device": device,
        "timing": "CUDA events after warm-up" if device == "cuda" else "wall clock after warm-up",
        "threads": threads,
        "sizes": "quick" if quick else "full",
        "command": shlex.join(["python", "-m", "spchain", *argv]),
        "note": f"load average {load_average:.1f} at the start",
    }


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (the record's figures are not more exact)."""
    return float(f"{x:.{digits}g}")


def entry(results: list[Result], run: str, quick: bool, old: dict[str, Any] | None) -> dict[str, Any]:
    """The record's entry of one case's results (spchain's first), measured in run ``run``.

    The presentation of the case's earlier entry ``old`` (its labels and headline) is kept.
    """
    base = results[0]
    labels = {m["method"]: m["label"] for m in old["methods"] if "label" in m} if old else {}
    methods = []
    for r in results:
        figures: dict[str, Any] = {"method": r.method, "label": labels.get(r.method, r.method),
                                   "median_s": _sig(r.median), "runs": len(r.times)}
        if not math.isnan(r.peak_bytes):
            figures["peak_mib"] = _sig(r.peak_bytes / MiB)
        if not math.isnan(r.max_rel_error):
            figures["max_rel_err"] = _sig(r.max_rel_error, 2)
        if r is not base:
            figures["time_ratio"] = _sig(r.median * r.scale / base.median)
            if base.peak_bytes > 0 and not math.isnan(r.peak_bytes):
                figures["memory_ratio"] = _sig(r.peak_bytes / base.peak_bytes)
            if r.scale != 1:
                figures["scale"] = r.scale
        methods.append(figures)
    kept: dict[str, Any] = {k: old[k] for k in ("label", "headline") if old and k in old}
    return {"workload": base.workload, "case": base.case, "quick": quick, "run": run, **kept, "methods": methods}


def update(record: dict[str, Any], results: list[Result], quick: bool, run: dict[str, Any]) -> list[str]:
    """Write ``results`` into ``record`` as measured in ``run``; returns the cases written.

    A case's entry at these sizes measured on this run's CPU model is replaced, another
    machine's kept (a new entry takes the labels of the case's latest one); runs that no entry
    names any more are dropped.
    """
    run_id = f"{run['date']} {run['sizes']}, {run['command']}, {run['cpu']}"
    record["runs"][run_id] = run
    written = []
    for group in _by_case(results):
        old = find(record, group[0].workload, group[0].case, quick, run["cpu"])
        new = entry(group, run_id, quick, old)
        if old is not None and cpu(record, old) == run["cpu"]:
            record["cases"][record["cases"].index(old)] = new
        else:
            record["cases"].append(new)
        written.append(f"{group[0].workload}: {group[0].case}")
    named = {m.get("run", c["run"]) for c in record["cases"] for m in [{}, *c["methods"]]}
    record["runs"] = {k: v for k, v in record["runs"].items() if k in named}
    return written


def as_json(results: list[Result], run: dict[str, Any]) -> dict[str, Any]:
    """A run's figures in the record's form: ``{"run": run, "cases": [entry, ...]}``."""
    quick = run["sizes"] == "quick"
    return {"run": run, "cases": [entry(group, "run", quick, None) for group in _by_case(results)]}


@dataclass
class Change:
    """One baseline's time ratio in the record and in this run."""

    workload: str
    case: str
    baseline: str
    recorded: float
    now: float
    elsewhere: str | None = None
    """The CPU model of the recorded ratio where the record has none of this machine's."""

    @property
    def fell(self) -> bool:
        """Whether the ratio fell by more than :data:`DROP` of the recorded one."""
        return self.now < (1 - DROP) * self.recorded


def compare(record: dict[str, Any], results: list[Result], quick: bool, model: str
            ) -> tuple[list[Change], list[str]]:
    """Each baseline's time ratio now against the record's at these sizes, measured on the CPU
    ``model`` where the record has it (ratios move between machines: torch's dense kernels use
    what each CPU has), else on the machine that measured the case last; and the cases that
    the record does not have at these sizes."""
    changes, missing = [], []
    for group in _by_case(results):
        old = find(record, group[0].workload, group[0].case, quick, model)
        if old is None:
            missing.append(f"{group[0].workload}: {group[0].case}")
            continue
        elsewhere = None if cpu(record, old) == model else cpu(record, old)
        recorded = {m["method"]: m.get("time_ratio") for m in old["methods"][1:]}
        base = group[0]
        for r in group[1:]:
            if recorded.get(r.method) is not None:
                now = r.median * r.scale / base.median
                changes.append(Change(r.workload, r.case, r.method, recorded[r.method], now, elsewhere))
    return changes, missing


def check_report(changes: list[Change], missing: list[str]) -> str:
    """The check's text: every ratio, then those that fell by more than :data:`DROP`."""
    def on(c: Change) -> str:
        return f" on {c.elsewhere}" if c.elsewhere else ""

    lines = [f"{c.workload}: {c.case}, {c.baseline}: {c.recorded:.3g}x recorded{on(c)}, {c.now:.3g}x now"
             f"{'  FELL' if c.fell else ''}" for c in changes]
    if missing:
        lines.append("not in the record at these sizes (python -m spchain bench --update-record): "
                     + ", ".join(missing))
    elsewhere = {c.elsewhere for c in changes if c.elsewhere}
    if elsewhere:
        lines.append(f"{sum(1 for c in changes if c.elsewhere)} ratios compared with another machine's "
                     f"({', '.join(sorted(elsewhere))}): the record has none of this CPU's for those cases "
                     "(python -m spchain bench --update-record, idle, records them)")
    fell = [c for c in changes if c.fell]
    lines.append(f"{len(fell)} of {len(changes)} ratios fell by more than {DROP:.0%}" + (":" if fell else ""))
    lines += [f"  {c.workload}: {c.case}, {c.baseline}: {c.recorded:.3g}x{on(c)} -> {c.now:.3g}x "
              f"({c.now / c.recorded - 1:+.0%})" for c in fell]
    return "\n".join(lines)


def _by_case(results: list[Result]) -> list[list[Result]]:
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.workload, r.case), []).append(r)
    return list(groups.values())
