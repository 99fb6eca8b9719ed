"""The test run's own options (tests/conftest.py): plain ``pytest`` deselects slow tests and tries
few Hypothesis examples, ``--all`` and ``-m slow`` run slow tests and the full Hypothesis budget,
``--max-default-seconds`` fails a run whose default set holds a longer test, and plain ``pytest``
runs on two pytest-xdist workers."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

EXAMPLE = """
import time

import pytest
from hypothesis import given, settings, strategies as st


def test_plain():
    time.sleep(0.3)


@pytest.mark.slow
def test_long():
    pass


@given(st.integers())
def test_property(n):
    print("examples", settings.default.max_examples)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(*args, path=True)``: pytest on a copy of spchain's conftest and setup.cfg beside ``EXAMPLE``; (exit code, output)."""
    folder = tmp_path_factory.mktemp("suite")
    shutil.copy(ROOT / "tests/conftest.py", folder)
    shutil.copy(ROOT / "setup.cfg", folder)
    (folder / "test_example.py").write_text(EXAMPLE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("HYPOTHESIS_PROFILE", None)

    def run(*args, path=True):
        result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-s", *args,
                                 *([str(folder)] if path else [])],
                                cwd=folder, env=env, capture_output=True, text=True, timeout=300)
        return result.returncode, result.stdout + result.stderr

    return run


def ran(output: str) -> list[str]:
    return sorted(re.findall(r"::(\w+) .*?PASSED", output, re.S))


def test_plain_pytest_deselects_slow_tests_tries_few_examples_and_times_the_default_set(run):
    code, out = run("--max-default-seconds=0.2")
    assert ran(out) == ["test_plain", "test_property"] and "1 deselected" in out and "examples 10\n" in out, out
    assert "pytest --all runs everything" in out
    assert code == 1 and re.search(r"over 0.2 s in the default set.*\n\s+0\.\d+s \S+::test_plain\n", out), out


@pytest.mark.parametrize("args, tests", [(["--all"], ["test_long", "test_plain", "test_property"]),
                                         (["-m", "slow"], ["test_long", "test_property"])])
def test_all_and_m_slow_run_slow_tests_and_the_full_hypothesis_budget(run, args, tests):
    code, out = run(*args, "--max-default-seconds=60")
    assert code == 0 and ran(out) == tests and "examples 100\n" in out, out


def test_plain_pytest_runs_on_two_workers_where_pytest_xdist_is_installed(run):
    pytest.importorskip("xdist")
    code, out = run("--max-default-seconds=0.2", path=False)
    assert "2 workers" in out and sorted(re.findall(r"PASSED \S+::(\w+)", out)) == ["test_plain", "test_property"], out
    assert code == 1 and re.search(r"over 0.2 s in the default set.*\n\s+0\.\d+s \S+::test_plain\n", out), out
    code, out = run("-n", "0", path=False)
    assert code == 0 and "workers" not in out and ran(out) == ["test_plain", "test_property"], out
    code, out = run()  # given a path: one process
    assert code == 0 and "workers" not in out, out
