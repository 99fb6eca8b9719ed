"""``scripts/gpu-check.sh``: without a GPU it runs nothing, says so and names what it would run;
the ``bench --json`` file it collects on a GPU machine (written here on the CPU)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import GPU

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(GPU, reason="this machine has a GPU: the check would run")
def test_without_a_gpu_it_says_so_and_names_its_steps(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(out)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout.startswith("gpu-check: no GPU: ")
    assert re.search(r"-m pytest -q -m 'gpu or cuda_kernel' (-n 8 )?tests", run.stdout)
    assert "-m spchain bench --device cuda" in run.stdout and "--json" in run.stdout
    assert "sparse-linear" in run.stdout and "torch-layer" in run.stdout  # every workload, by name
    assert not out.exists(), "nothing is run or written without a GPU"


def test_bench_json_records_the_run(tmp_path):
    pytest.importorskip("torch")
    from spchain import bench

    path = tmp_path / "bench.json"
    assert bench.main(["bench", "--quick", "--only", "viterbi", "--repeat", "1", "--png", str(tmp_path / "b.png"),
                       "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    run = record["run"]
    assert run["device"] == "cpu" and run["torch"] and "cupy" in run and run["machine"] and run["timing"]
    methods = [m for case in record["cases"] for m in case["methods"]]
    assert methods[0]["method"] == "spchain" and len(methods) > 1
    assert all(m["median_s"] > 0 and m["runs"] >= 1 for m in methods)
