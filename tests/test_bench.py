"""The benchmark workloads and the ``python -m spchain bench`` command (spchain/bench/), at quick sizes."""

import json
import logging
import math
import os
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest

pytest.importorskip("torch")

from spchain import bench  # noqa: E402
from spchain.bench import core, grouped, record, report  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

WRONG = {("chain", "torch pairwise broadcast tree")}
"""Baselines that are wrong on purpose: the pairwise tree pads odd levels with the all-ones matrix."""

CASES = [(w, c) for w in bench.WORKLOADS for c in bench.workload(w).CASES]

RUN = {"date": "2026-01-01", "machine": "2 cores, Linux", "cpu": "A", "torch": "2.13.0", "threads": 2,
       "command": "python -m spchain bench"}
"""A run of the record, as far as :func:`record.validate` asks."""


@pytest.mark.slow
@pytest.mark.parametrize("workload, case", CASES)
def test_every_method_matches_the_float64_reference(workload, case):
    built = bench.make_case(workload, case, quick=True)
    assert list(built.methods)[0] == "spchain"
    if built.reference is None:  # a case of different functions, measured for memory: each runs
        for run in built.methods.values():
            run()
        return
    reference = built.reference()
    for method, run in built.methods.items():
        error = core.max_rel_error(run(), reference)
        if (workload, method) in WRONG:
            assert error > 0.1, "the pairwise broadcast tree pads with the all-ones matrix"
        else:
            assert error < 1e-5, method


def test_the_hmm_fit_baseline_logs_nothing_into_the_progress_bar(caplog):
    """hmmlearn warns that the quick sizes' few samples fit many parameters; the workload keeps
    that line off the screen, where it broke the progress bar."""
    built = bench.make_case("hmm-fit", "sparse categorical", quick=True)
    with caplog.at_level(logging.WARNING):
        built.methods["hmmlearn (dense transmat_)"]()
    assert not [r for r in caplog.records if r.name.startswith("hmmlearn")]


@pytest.mark.parametrize("workload", bench.WORKLOADS)
def test_every_workload_names_its_full_and_quick_sizes(workload):
    full, quick = bench.workload(workload).SIZES[False], bench.workload(workload).SIZES[True]
    assert full.keys() == quick.keys() and all(isinstance(n, int) and n > 0 for n in (*full.values(), *quick.values()))


def test_unknown_case_is_a_value_error():
    with pytest.raises(ValueError, match="workload 'chain' has no case 'nope'"):
        bench.make_case("chain", "nope", quick=True)


def test_group_sizes_are_uneven_and_sum_to_the_rows():
    sizes = grouped.group_sizes(16384, 16)
    assert len(sizes) == 16 and sum(sizes) == 16384 and max(sizes) > 2 * min(sizes)


def test_max_rel_error_counts_matching_infinities_and_flags_new_ones():
    ref = np.array([1.0, -np.inf, 4.0])
    assert core.max_rel_error(np.array([1.0, -np.inf, 4.0]), ref) == 0.0
    assert core.max_rel_error(np.array([1.0, -np.inf, 3.0]), ref) == pytest.approx(0.25)
    assert core.max_rel_error(np.array([1.0, 0.0, 4.0]), ref) == math.inf
    assert core.max_rel_error((np.ones(2), np.array([np.nan])), (np.ones(2), np.array([np.nan]))) == 0.0


def test_measure_times_alternating_methods_and_measures_memory():
    calls = []
    case = core.Case("w", "c", {"fast": lambda: calls.append("fast") or np.ones(3),
                                "big": lambda: calls.append("big") or np.ones(4_000_000)},
                     reference=lambda: np.ones(3), slow={"big"})
    fast, big = core.measure(case, repeat=2, budget_s=10.0)
    assert calls.count("big") == 1  # a slow method's one run is its timing and its memory measurement
    assert calls.count("fast") == 4  # warm-up, two timed rounds, memory
    assert len(fast.times) == 2 and len(big.times) == 1
    assert fast.max_rel_error == 0 and big.max_rel_error == math.inf  # a shape mismatch
    assert big.peak_bytes > 16e6 or math.isnan(big.peak_bytes)


def test_a_timed_run_of_a_small_case_is_the_mean_of_its_calls():
    calls = []
    case = core.Case("w", "c", {"spchain": lambda: calls.append(len(calls)) or len(calls)}, calls=5)
    (ours,) = core.measure(case, repeat=2, budget_s=10.0)
    assert len(ours.times) == 2 and len(calls) == 5 + 2 * 5 + 1  # warm-up, two timed runs, memory (one call)
    assert math.isnan(ours.max_rel_error)  # no reference: no error figure
    out, seconds = core.timed(lambda: calls.append(0) or len(calls), "cpu", calls=3)
    assert out == len(calls) and seconds >= 0  # the last call's result


def test_measure_stops_a_baseline_at_the_budget_but_runs_spchain_every_round():
    import time

    case = core.Case("w", "c", {"spchain": lambda: time.sleep(0.001), "baseline": lambda: time.sleep(0.001)})
    ours, baseline = core.measure(case, repeat=3, budget_s=0.0)
    assert len(ours.times) == 3 and len(baseline.times) == 1


def test_command_prints_a_table_and_its_legend_and_writes_a_png_only_when_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bench.main(["bench", "--quick", "--only", "viterbi", "--repeat", "1"]) == 0
    out, err = capsys.readouterr()
    assert "viterbi" in out and "torch broadcasting max" in out and "time / spchain" in out
    assert f"viterbi  {bench.sizes('viterbi', True)}" in out  # the sizes, above the table
    assert report.LEGEND in out and "runs: how many" in out
    assert list(tmp_path.iterdir()) == []  # no PNG without --png
    assert "-0" not in err.split("\r")[-1] and "100%" in err  # the bar ends at its total, no negative time left
    png = tmp_path / "bench.png"
    assert bench.main(["bench", "--quick", "--only", "viterbi", "--repeat", "1", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = report.rows(core.measure(bench.make_case("viterbi", "decode", quick=True), 1, 1.0))
    assert rows[0][2] == "spchain" and rows[0][7] == "1x"


def test_the_progress_bar_ends_exactly_at_its_total_without_a_warning(monkeypatch):
    import warnings

    from tqdm import tqdm

    ends = []
    original = tqdm.close

    def close(bar):
        ends.append((bar.n, bar.total))
        original(bar)

    monkeypatch.setattr(tqdm, "close", close)
    fake = [core.Case("w", f"c{i}", {"spchain": lambda: None, "other": lambda: None}) for i in range(3)]
    monkeypatch.setattr(bench, "make_case", lambda name, case, quick, device: fake[int(case[1])])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bench.run([("w", "c0"), ("w", "c1"), ("w", "c2")], True, "cpu", repeat=7, budget=1.0)
    assert set(ends) == {(3, 3)}


@pytest.mark.parametrize("args, message", [
    (["--repeat", "0"], "--repeat: must be a whole number >= 1, got '0'"),
    (["--repeat", "-3"], "--repeat: must be a whole number >= 1, got '-3'"),
    (["--repeat", "two"], "--repeat: must be a whole number >= 1"),
    (["--budget", "-1"], "--budget: must be a finite number of seconds >= 0, got '-1'"),
    (["--budget", "nan"], "--budget: must be a finite number of seconds >= 0, got 'nan'"),
    (["--budget", "inf"], "--budget: must be a finite number"),
    (["--only", "chain", "viterbi", "chain"], "--only: chain named more than once"),
    (["--png", "/no/such/folder/bench.png"], "--png: '/no/such/folder/bench.png': no directory"),
    (["--png", "bench.svg"], "does not end in .png"),
    (["--check", "--record", "/no/such/record.json"], "--record: no file"),
    (["--full"], "argument --full: not allowed with argument --quick"),
    (["--json", "/no/such/folder/figures.json"], "--json: '/no/such/folder/figures.json': no directory"),
    (["--check", "--device", "cuda"], "the record holds CPU figures"),
    (["--update-record", "--record", "/no/such/record.json"], "--record: no file"),
])
def test_bad_arguments_are_clear_errors_before_anything_runs(args, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("ran despite a bad argument"))
    with pytest.raises(SystemExit) as exit:
        bench.main(["bench", "--quick", *args])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_an_unwritable_png_fails_before_the_run(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: answer as the folder's mode does for its owner
        monkeypatch.setattr(bench.os, "access", lambda path, mode: bool(os.stat(path).st_mode & 0o200))
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("ran despite an unwritable --png"))
    with pytest.raises(SystemExit):
        bench.main(["bench", "--quick", "--png", str(folder / "bench.png")])
    assert "cannot be written" in capsys.readouterr().err


def test_a_png_where_no_file_can_be_made_fails_before_the_run(capsys, monkeypatch):
    if not os.path.isdir("/proc"):
        pytest.skip("no /proc")
    monkeypatch.setattr(bench.os, "access", lambda path, mode: True)  # as for root
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("ran despite an unwritable --png"))
    with pytest.raises(SystemExit):
        bench.main(["bench", "--quick", "--png", "/proc/bench.png"])
    assert "--png: '/proc/bench.png' cannot be written" in capsys.readouterr().err


_CASE = {"workload": "chain", "case": "forward", "quick": True, "run": "r",
         "methods": [{"method": "spchain", "median_s": 1.0}, {"method": "loop", "median_s": 2.0, "time_ratio": 2.0}]}


@pytest.mark.parametrize("text, message", [
    ("{bad", "is not JSON (Expecting property name"),
    ("[]", 'not a record: expected an object {"runs"'),
    ('{"runs": {}}', "not a record"),
    (json.dumps({"runs": {"r": {"cpu": "A"}}, "cases": []}), "run 'r' is not an object with the keys date, machine"),
    (json.dumps({"runs": {"r": RUN}, "cases": [{"workload": "chain"}]}), "case 0 is not an object with the keys"),
    (json.dumps({"runs": {"r": RUN}, "cases": [{**_CASE, "methods": []}]}), "methods is not a non-empty list"),
    (json.dumps({"runs": {"r": RUN}, "cases": [{**_CASE, "methods": _CASE["methods"][:1] + [{"method": "loop"}]}]}),
     "case 0 (chain: forward): method 1 is not an object with the keys method, median_s, time_ratio"),
    (json.dumps({"runs": {"r": RUN}, "cases": [{**_CASE, "run": "s"}]}), "names a run that the record lacks: 's'"),
])
@pytest.mark.parametrize("flag", ["--check", "--update-record", "--write-docs"])
def test_a_malformed_record_is_a_clear_error_before_anything_runs(flag, text, message, tmp_path, capsys, monkeypatch):
    path = tmp_path / "record.json"
    path.write_text(text)
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("ran despite a malformed record"))
    monkeypatch.setattr(bench, "write_docs", lambda *a, **k: pytest.fail("wrote despite a malformed record"))
    with pytest.raises(SystemExit) as exit:
        bench.main(["bench", flag, "--record", str(path)])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and f"--record: {str(path)!r}" in err and message in err
    with pytest.raises(ValueError):  # the same check where the record is loaded (a JSONDecodeError is one)
        record.load(path)


@pytest.mark.parametrize("args", [["--only", "chain"], ["--check"], ["--quick"], ["--png", "x.png"],
                                  ["--device", "cuda"], ["--repeat", "2", "--update-record"]])
def test_write_docs_refuses_what_only_a_run_uses(args, capsys, monkeypatch):
    monkeypatch.setattr(bench, "write_docs", lambda *a, **k: pytest.fail("wrote despite a run's argument"))
    with pytest.raises(SystemExit) as exit:
        bench.main(["bench", "--write-docs", *args])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "--write-docs runs nothing" in err
    assert f"{', '.join(a for a in args if a.startswith('--'))} not allowed with it" in err


def test_a_first_run_compiles_the_kernels_of_the_selected_workloads_first_and_only_then(monkeypatch):
    compiled = []
    monkeypatch.setattr(bench, "compile_kernels", lambda names, quick: compiled.append((names, quick)))
    monkeypatch.setattr(bench, "run", lambda *a: _results("viterbi", "decode", 1.0, {"torch broadcasting max": 2.0}))
    monkeypatch.setattr(bench, "kernels_cached", lambda: False)
    assert bench.main(["bench", "--quick", "--only", "viterbi", "logmatmul"]) == 0
    assert compiled == [(["viterbi", "logmatmul"], True)]
    monkeypatch.setattr(bench, "kernels_cached", lambda: True)
    assert bench.main(["bench", "--quick", "--only", "viterbi"]) == 0
    assert len(compiled) == 1


def test_kernels_count_as_cached_once_most_of_them_are(monkeypatch, tmp_path):
    indexes = [tmp_path / f"kernel{i}.nbi" for i in range(10)]
    monkeypatch.setattr(bench, "kernel_indexes", lambda: indexes)
    for index in indexes[:4]:  # a test run that compiled a few kernels
        index.touch()
    assert not bench.kernels_cached()
    indexes[4].touch()
    assert bench.kernels_cached()


def test_every_cached_kernel_has_an_index_path():
    from spchain.kernels.cpu import blocksparse, chain

    indexes = bench.kernel_indexes()
    assert len(set(indexes)) == len(indexes) > 40
    assert {pathlib.Path(k._cache._cache_file._index_path) for k in (blocksparse.blocksparse_spmm, chain.chain_viterbi)} <= set(indexes)
    assert all(index.suffix == ".nbi" for index in indexes)


def test_compiling_on_one_core_stays_in_this_process_and_shows_its_progress(monkeypatch, capsys):
    import torch

    compiled = []
    monkeypatch.setattr(bench, "_compile", lambda name, quick: compiled.append((name, quick)))
    threads = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    bench.compile_kernels(["chain", "viterbi"], True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    bench.compile_kernels(["logmatmul"], True)  # one workload
    assert compiled == [("chain", True), ("viterbi", True), ("logmatmul", True)]
    assert torch.get_num_threads() == threads
    assert "compiling kernels (first run only)" in capsys.readouterr().err


class _OneWorker:
    """A stand-in for the compiling workers' pool: its one worker takes the first workload
    submitted (recording it in ``started``) and starts nothing else; ``error`` is what that
    workload raises."""

    started: list[str] = []
    error: Exception | None = None

    def __init__(self, workers, **kwargs):
        assert workers == 1
        self.idle = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, name, quick):
        from concurrent.futures import Future

        future = Future()
        if self.idle:
            self.idle = False
            future.set_running_or_notify_cancel()
            self.started.append(name)
            future.set_exception(self.error) if self.error else future.set_result(name)
        return future


def test_compiling_on_two_free_cores_goes_from_both_ends_of_the_compile_order(monkeypatch, capsys):
    import concurrent.futures

    compiled = []
    monkeypatch.setattr(bench, "_compile", lambda name, quick: compiled.append(name) or name)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", _OneWorker)
    monkeypatch.setattr(_OneWorker, "started", [])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    bench.compile_kernels(["chain", "sparse-chain", "hmm-fit", "block-sparse"], True)
    assert _OneWorker.started == ["sparse-chain"]  # the worker from the back of bench.COMPILE_ORDER
    assert compiled == ["hmm-fit", "chain", "block-sparse"]  # this process from the front, to what no worker took
    assert "4/4 workloads" in capsys.readouterr().err
    assert sorted(bench.COMPILE_ORDER) == sorted(bench.WORKLOADS)
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 0.0, 0.0))  # a busy machine: still one worker
    bench.compile_kernels(["chain", "viterbi"], True)
    assert _OneWorker.started[-1] == "viterbi"
    monkeypatch.setattr(_OneWorker, "error", RuntimeError("a worker failed"))
    with pytest.raises(RuntimeError, match="a worker failed"):
        bench.compile_kernels(["chain", "viterbi"], True)


def test_compiling_a_workload_runs_spchains_methods_and_the_reference_of_each_case(monkeypatch):
    ran = []
    monkeypatch.setattr(bench, "make_case", lambda name, case, quick: core.Case(
        name, case, {"spchain": lambda: ran.append(case), "spchain dense": lambda: ran.append("dense"),
                     "baseline": lambda: pytest.fail("a baseline ran"), "chain_kbest": lambda: ran.append("kbest")},
        reference=lambda: ran.append("reference"), spchain_methods={"chain_kbest"}))
    assert bench._compile("chain", True) == "chain"
    assert ran == [x for case in bench.cases("chain", True) for x in (case, "dense", "kbest", "reference")]


# --- the record, the check, and the tables generated from it --------------------------------------

def test_the_readme_and_benchmarks_page_tables_are_the_ones_the_record_generates():
    saved = record.load()
    readme, page = (ROOT / "README.md").read_text(), (ROOT / "docs/tutorials/benchmarks.rst").read_text()
    assert readme == report.regenerate(readme, report.markdown(saved), "md"), "python -m spchain bench --write-docs"
    assert page == report.regenerate(page, report.rst(saved), "rst"), "python -m spchain bench --write-docs"
    assert "| sparse linear 4096², 99 %, x (256, 4096), forward [" in readme  # the headline row is there


def test_every_record_entry_names_a_known_case_its_run_and_consistent_figures():
    saved = record.load()
    keys = [(*record.key(c), record.cpu(saved, c)) for c in saved["cases"]]  # one entry a case, size and CPU
    assert len(keys) == len(set(keys))
    for case in saved["cases"]:
        names = bench.workload(case["workload"]).CASES  # a case may add a note: "forward, threaded scheduler"
        assert any(case["case"] == name or case["case"].startswith(f"{name}, ") for name in names), case
        assert case["methods"][0]["method"] == "spchain"
        for m in [case, *case["methods"]]:
            run = saved["runs"][m.get("run", case["run"])]
            assert {"date", "machine", "cpu", "torch", "threads", "command"} <= run.keys()
        for m in case["methods"][1:]:
            assert m["time_ratio"] > 0
            if "run" not in m:  # measured beside this spchain figure: the ratio is the times' (rounded as stated)
                expected = m["median_s"] * m.get("scale", 1) / case["methods"][0]["median_s"]
                assert m["time_ratio"] == pytest.approx(expected, rel=0.1), (case["case"], m["method"])
    assert any(c["quick"] for c in saved["cases"]) and any(not c["quick"] for c in saved["cases"])


def _results(workload, case, spchain_s, baselines):
    return [core.Result(workload, case, "spchain", [spchain_s], 1.0 * core.MiB, 0.0),
            *(core.Result(workload, case, name, [t], 2.0 * core.MiB, 0.0) for name, t in baselines.items())]


def test_check_lists_every_ratio_that_fell_by_more_than_a_quarter():
    saved = {"runs": {"r": {"cpu": "A", "date": "2026-01-01"}}, "cases": [
        {"workload": "chain", "case": "forward", "quick": True, "run": "r",
         "methods": [{"method": "spchain", "median_s": 1.0}, {"method": "slow", "median_s": 10.0, "time_ratio": 10.0},
                     {"method": "fast", "median_s": 4.0, "time_ratio": 4.0}]}]}
    now = _results("chain", "forward", 1.0, {"slow": 7.4, "fast": 3.1}) + _results("chain", "new", 1.0, {"b": 2.0})
    changes, missing = record.compare(saved, now, quick=True, model="A")
    assert [(c.baseline, c.fell) for c in changes] == [("slow", True), ("fast", False)]  # 26 % and 22.5 % down
    assert missing == ["chain: new"]
    text = record.check_report(changes, missing)
    assert "1 of 2 ratios fell by more than 25%" in text and "chain: forward, slow: 10x -> 7.4x (-26%)" in text
    assert record.compare(saved, now, quick=False, model="A") == ([], ["chain: forward", "chain: new"])  # other sizes


def test_check_exits_nonzero_when_a_ratio_fell(tmp_path, capsys, monkeypatch):
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"runs": {"r": {**RUN, "cpu": "another CPU"}}, "cases": [
        {"workload": "viterbi", "case": "decode", "quick": True, "run": "r",
         "methods": [{"method": "spchain", "median_s": 1.0},
                     {"method": "torch broadcasting max", "median_s": 1.0, "time_ratio": 1.0}]}]}))
    monkeypatch.setattr(bench, "run", lambda *a: _results("viterbi", "decode", 1.0, {"torch broadcasting max": 0.5}))
    assert bench.main(["bench", "--only", "viterbi", "--check", "--record", str(path)]) == 1  # quick sizes
    assert "decode, torch broadcasting max: 1x on another CPU -> 0.5x (-50%)" in capsys.readouterr().out
    monkeypatch.setattr(bench, "run", lambda *a: _results("viterbi", "decode", 1.0, {"torch broadcasting max": 0.8}))
    assert bench.main(["bench", "--quick", "--only", "viterbi", "--check", "--record", str(path)]) == 0


def test_update_record_writes_the_run_and_keeps_labels(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    here = record.this_run([], True, 1, "cpu")["cpu"]
    path.write_text(json.dumps({"runs": {"old": {**RUN, "date": "2000-01-01", "cpu": here}}, "cases": [
        {"workload": "viterbi", "case": "decode", "quick": True, "run": "old", "label": "`viterbi`", "headline": "h",
         "methods": [{"method": "spchain", "label": "spchain", "median_s": 1.0},
                     {"method": "torch broadcasting max", "label": "broadcasting", "median_s": 1.0, "time_ratio": 1.0}]}]}))
    monkeypatch.setattr(bench, "run", lambda *a: _results("viterbi", "decode", 0.5, {"torch broadcasting max": 2.0}))
    argv = ["bench", "--quick", "--only", "viterbi", "--update-record", "--record", str(path)]
    assert bench.main(argv) == 0
    saved = record.load(path)
    (case,) = saved["cases"]
    assert case["label"] == "`viterbi`" and case["headline"] == "h" and case["quick"]
    assert [m["label"] for m in case["methods"]] == ["spchain", "broadcasting"]
    assert case["methods"][1]["time_ratio"] == 4.0 and case["methods"][1]["memory_ratio"] == 2.0
    assert list(saved["runs"]) == [case["run"]]  # the old run is named by nothing now
    run = saved["runs"][case["run"]]
    assert run["command"] == "python -m spchain " + " ".join(argv) and run["sizes"] == "quick"
    assert run["torch"] and run["cpu"] and run["threads"] >= 1


def _machines_record():
    def case(run, ratio):
        return {"workload": "chain", "case": "forward", "quick": True, "run": run,
                "methods": [{"method": "spchain", "median_s": 1.0},
                            {"method": "loop", "median_s": ratio, "time_ratio": ratio}]}
    runs = {"a": {"cpu": "AMD", "date": "2026-01-02"}, "i": {"cpu": "Intel", "date": "2026-01-01"}}
    return {"runs": runs, "cases": [case("a", 20.0), case("i", 10.0)]}


def test_check_compares_with_the_ratio_recorded_on_the_same_cpu_else_the_latest_and_says_so():
    saved, now = _machines_record(), _results("chain", "forward", 1.0, {"loop": 9.0})
    (intel,), _ = record.compare(saved, now, quick=True, model="Intel")
    assert (intel.recorded, intel.elsewhere, intel.fell) == (10.0, None, False)
    (other,), _ = record.compare(saved, now, quick=True, model="ARM")
    assert (other.recorded, other.elsewhere, other.fell) == (20.0, "AMD", True)  # the latest: AMD's
    text = record.check_report([other], [])
    assert "20x recorded on AMD, 9x now  FELL" in text and "1 ratios compared with another machine's (AMD)" in text
    assert [c["run"] for c in record.latest(saved)] == ["a"]  # what the README shows


def test_update_record_keeps_other_machines_entries_and_replaces_this_ones():
    saved = _machines_record()
    run = {"date": "2026-01-03", "cpu": "Intel", "sizes": "quick", "command": "python -m spchain bench"}
    assert record.update(saved, _results("chain", "forward", 1.0, {"loop": 12.0}), True, run) == ["chain: forward"]
    assert [(record.cpu(saved, c), c["methods"][1]["time_ratio"]) for c in saved["cases"]] == [("AMD", 20.0),
                                                                                              ("Intel", 12.0)]
    assert record.latest(saved)[0]["methods"][1]["time_ratio"] == 12.0
    run = {**run, "cpu": "ARM"}
    record.update(saved, _results("chain", "forward", 1.0, {"loop": 3.0}), True, run)
    assert [record.cpu(saved, c) for c in saved["cases"]] == ["AMD", "Intel", "ARM"]
    assert len(saved["runs"]) == 3


def test_json_writes_the_run_and_its_cases_in_the_records_form(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run", lambda *a: _results("viterbi", "decode", 0.5, {"torch broadcasting max": 2.0}))
    path = tmp_path / "figures.json"
    assert bench.main(["bench", "--quick", "--only", "viterbi", "--json", str(path)]) == 0
    saved = json.loads(path.read_text())
    assert saved["run"]["sizes"] == "quick" and "--json" in saved["run"]["command"]
    (case,) = saved["cases"]
    assert record.key(case) == ("viterbi", "decode", True) and case["methods"][1]["time_ratio"] == 4.0


def test_regenerate_replaces_only_between_the_markers_and_needs_them():
    start, end = report.MARKERS["md"]
    text = f"before\n{start}\nold\n{end}\nafter\n"
    assert report.regenerate(text, "new", "md") == f"before\n{start}\nnew\n\n{end}\nafter\n"
    with pytest.raises(ValueError, match="no generated-table markers"):
        report.regenerate("no markers", "new", "md")


def test_scaled_baselines_count_their_scaled_time_in_ratios():
    case = core.Case("w", "c", {"spchain": lambda: None, "small": lambda: None}, scale={"small": 100.0})
    ours, small = core.measure(case, repeat=1, budget_s=1.0)
    assert small.scale == 100.0 and ours.scale == 1.0
    assert report.rows([ours, small])[1][7] == report._ratio(small.median * 100, ours.median)


def test_no_file_refers_to_design_or_reliability_documents_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    named = [f for f in tracked if (ROOT / f).is_file() and re.search(r"(DESIGN|RELIABILITY)\.md",
                                                                     (ROOT / f).read_text(errors="ignore"))]
    assert named == []


@pytest.mark.slow
def test_the_documented_asv_quick_command_saves_results(tmp_path):
    """The documented ``SPCHAIN_BENCH_QUICK=1 asv run ...`` line (docs/tutorials/benchmarks.rst), on one benchmark, with a copy of
    asv.conf.json that keeps results and the machine file in ``tmp_path``: it must save numbers
    under this commit (without ``--set-commit-hash`` asv saves nothing for ``--python=same``)."""
    pytest.importorskip("asv")
    if shutil.which("git") is None or shutil.which("asv") is None:
        pytest.skip("needs git and asv on PATH")
    root = pathlib.Path(__file__).resolve().parents[1]
    (line,) = [ln.split("#")[0].strip() for ln in (root / "docs/tutorials/benchmarks.rst").read_text().splitlines()
               if ln.strip().startswith("SPCHAIN_BENCH_QUICK=1 asv run")]
    conf = json.loads("\n".join(ln for ln in (root / "asv_bench/asv.conf.json").read_text().splitlines()
                                if not ln.strip().startswith("//")))
    conf.update(repo=str(root), benchmark_dir=str(root / "asv_bench/benchmarks"), results_dir=str(tmp_path / "results"),
                html_dir=str(tmp_path / "html"), env_dir=str(tmp_path / "env"))
    (tmp_path / "asv.conf.json").write_text(json.dumps(conf))
    env = dict(os.environ, HOME=str(tmp_path))
    subprocess.run(["asv", "machine", "--yes", "--config", str(tmp_path / "asv.conf.json")], cwd=root / "asv_bench",
                   env=env, check=True, capture_output=True)
    command = re.sub(r"\basv run\b", f"asv run --config {tmp_path / 'asv.conf.json'}", line) + " --bench LogMatmul.time_run"
    run = subprocess.run(["bash", "-c", command], cwd=root / "asv_bench", env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    saved = [json.loads(p.read_text()) for p in (tmp_path / "results").glob("*/*.json")
             if p.name not in ("machine.json", "benchmarks.json")]
    times = [t for r in saved if r["commit_hash"] == head for t in r["results"]["semiring.LogMatmul.time_run"][0]]
    assert len(times) == 4 and all(isinstance(t, float) and 0 < t < 60 for t in times), run.stdout


def test_torch_layer_has_a_compiled_case_for_each_module_and_small_call_cases():
    cases = bench.workload("torch-layer").CASES
    assert {"compiled BlockDiagonalLinear", "compiled GroupedLinear", "compiled SparseLinear"} <= set(cases)
    assert {"small SparseLinear(64, 64)", "small SparseLinear(64, 64) forward", "small SparseLinear(64, 64) inference",
            "small logmatmul 4x4",
            "small block_diag_matmul", "small chain_logsumexp (4, 8, 4)"} <= set(cases)
    assert list(bench.make_case("torch-layer", "compiled GroupedLinear", quick=True).methods) == ["spchain", "eager"]


def test_quick_leaves_out_the_compiled_cases_and_says_so():
    assert bench.cases("torch-layer", quick=False) == bench.workload("torch-layer").CASES
    quick = bench.cases("torch-layer", quick=True)
    assert quick and not any(c.startswith("compiled") for c in quick)
    assert "not in --quick: compiled BlockDiagonalLinear" in bench.sizes("torch-layer", True)
    assert "not in --quick" not in bench.sizes("torch-layer", False) + bench.sizes("chain", True)


def test_sparse_training_trains_both_models_on_the_same_task_at_90_percent_erk():
    from spchain.bench import sparse_training

    result = sparse_training.run(features=8, hidden=32, classes=3, train=256, epochs=2, batch=64, every=2)
    assert result["dense weights"] == 8 * 32 + 32 * 32 + 32 * 3
    assert abs(result["sparse weights"] - 0.1 * result["dense weights"]) <= 3  # ERK over all 3 layers together
    assert 0.2 < result["dense accuracy"] <= 1 and 0.2 < result["sparse accuracy"] <= 1
    assert result["dense s/epoch"] > 0 and result["sparse s/epoch"] > 0


def test_rst_labels_escape_a_trailing_underscore_outside_literals():
    """``transmat_`` in a baseline's name would be a reference target in reStructuredText."""
    assert report._code("hmmlearn (dense transmat_), `model.transmat_`, my_name", "rst") == \
        "hmmlearn (dense transmat\\_), ``model.transmat_``, my_name"
    assert report._code("dense transmat_", "md") == "dense transmat_"
