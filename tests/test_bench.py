"""The benchmark workloads and the ``python -m spchain bench`` command (spchain/bench/), at quick sizes."""

import json
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
from spchain.bench import core, grouped, report  # noqa: E402

WRONG = {("chain", "torch pairwise broadcast tree")}
"""Baselines that are wrong on purpose: the pairwise tree pads odd levels with the all-ones matrix."""

CASES = [(w, c) for w in bench.WORKLOADS for c in bench.workload(w).CASES]


@pytest.mark.slow
@pytest.mark.parametrize("workload, case", CASES)
def test_every_method_matches_the_float64_reference(workload, case):
    built = bench.make_case(workload, case, quick=True)
    assert list(built.methods)[0] == "spchain"
    reference = built.reference()
    for method, run in built.methods.items():
        error = core.max_rel_error(run(), reference)
        if (workload, method) in WRONG:
            assert error > 0.1, "the pairwise broadcast tree pads with the all-ones matrix"
        else:
            assert error < 1e-5, method


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


def test_measure_stops_a_baseline_at_the_budget_but_runs_spchain_every_round():
    import time

    case = core.Case("w", "c", {"spchain": lambda: time.sleep(0.001), "baseline": lambda: time.sleep(0.001)})
    ours, baseline = core.measure(case, repeat=3, budget_s=0.0)
    assert len(ours.times) == 3 and len(baseline.times) == 1


def test_command_prints_a_table_and_writes_a_png(tmp_path, capsys):
    png = tmp_path / "bench.png"
    assert bench.main(["bench", "--quick", "--only", "viterbi", "--repeat", "1", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "viterbi" in out and "torch broadcasting max" in out and "time / spchain" in out
    assert f"viterbi  {bench.sizes('viterbi', True)}" in out  # the sizes, above the table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = report.rows(core.measure(bench.make_case("viterbi", "decode", quick=True), 1, 1.0))
    assert rows[0][2] == "spchain" and rows[0][7] == "1.0x"


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
    assert {"small SparseLinear(64, 64)", "small logmatmul 4x4", "small block_diag_matmul"} <= set(cases)
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
