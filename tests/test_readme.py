"""The README, exactly right: its Python examples run as they are, its links and paths resolve, and
each of its commands names extras, modules, files, options and markers that exist (the slow test
runs its ``pytest`` commands' collection); the docs' tutorials run in the docs build."""

import configparser
import importlib
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

pytest.importorskip("torch")

from spchain import bench  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
SPANS = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", README)
COMMANDS = [line for block in re.findall(r"```bash\n(.*?)```", README, re.S) for line in block.splitlines() if line.strip()] + [
    span for span in SPANS if re.match(r"(pip|python|pytest|bash) |[A-Z_]+=\S* ", span)]
"""Every command line of the README: its ``bash`` blocks' lines and the inline spans that start with a command."""


def test_the_readme_has_one_example_per_capability():
    assert len(BLOCKS) == 4
    assert all(name in README for name in ("SparseLinear", "chain_logsumexp", "LinearChainCRF", "BlockDiagonalLinear", "Dask"))


@pytest.mark.parametrize("block", range(len(BLOCKS)))
def test_a_readme_example_runs(block):
    exec(compile(BLOCKS[block], f"README.md example {block + 1}", "exec"), {})


def test_the_readme_links_resolve():
    links = [link for link in re.findall(r"\]\(([^)#]+)\)", README) if "://" not in link]
    assert links and all((ROOT / link).exists() for link in links), [link for link in links if not (ROOT / link).exists()]


def test_the_readme_paths_and_names_exist():
    paths = [span for span in SPANS if re.fullmatch(r"[\w.*-]+(/[\w.*-]+)*(/|\.py)", span)]
    assert paths and [p for p in paths if not [m for m in ROOT.glob("**/" + p) if ".git" not in m.parts]] == []
    names = [span for span in SPANS if re.fullmatch(r"spchain(\.\w+)+", span)]
    assert names and [name for name in names if not _resolves(name)] == []


def _resolves(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        module, _, attribute = name.rpartition(".")
        return hasattr(importlib.import_module(module), attribute)
    return True


def _requirements() -> tuple[set[str], list[Requirement]]:
    """spchain's extras, and every requirement of setup.cfg (install_requires and the extras')."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = config["options.extras_require"]
    lines = [config["options"]["install_requires"], *extras.values()]
    return set(extras), [Requirement(r) for text in lines for r in text.splitlines() if r.strip() and not r.startswith("#")]


def _segments(command: str):
    """``(environment, argv)`` of each ``&&``-joined part of a command line."""
    words = shlex.split(command)
    while words:
        part, words = (words[:words.index("&&")], words[words.index("&&") + 1:]) if "&&" in words else (words, [])
        env = dict(w.split("=", 1) for w in part if re.fullmatch(r"[A-Z_]+=\S*", w))
        yield env, part[len(env):]


def _check_pip(argv):
    extras, requirements = _requirements()
    assert argv[:2] == ["pip", "install"], argv
    for arg in (a for a in argv[2:] if not a.startswith("-")):
        if arg.startswith("."):
            assert set(re.findall(r"\w+", arg.partition("[")[2])) <= extras, arg
            continue
        wanted = Requirement(arg)
        if wanted.name == "spchain":
            assert wanted.extras <= extras, arg
        else:  # a dependency pinned before spchain's requirement: one that spchain accepts
            pinned = [s.version for s in wanted.specifier if s.operator == "=="]
            assert pinned and any(r.name == wanted.name and r.specifier.contains(pinned[0]) for r in requirements), arg


def _check_python(argv):
    assert argv[:2] == ["python", "-m"], argv
    if argv[2:4] == ["spchain", "bench"]:
        bench._parser()[0].parse_args(argv[3:])  # argparse exits on an unknown option or value
        return
    spec = importlib.util.find_spec(argv[2])
    assert len(argv) == 3 and spec is not None and "__main__" in pathlib.Path(spec.origin).read_text(), argv


def _check_pytest(argv, env, config):
    markers = {line.split(":")[0].strip() for line in config.getini("markers")}
    for word, following in zip(argv[1:], argv[2:] + [""]):
        if word.startswith("-"):
            config.getoption(word.split("=")[0])  # a ValueError for an option that does not exist
        if word == "-m":
            assert set(re.findall(r"\w+", following)) - {"and", "or", "not"} <= markers, following
    assert set(env) <= {"NUMBA_ENABLE_CUDASIM"}, env


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_command_names_what_exists(command, pytestconfig):
    for env, argv in _segments(command):
        if argv[0] == "pip":
            _check_pip(argv)
        elif argv[0] == "python":
            _check_python(argv)
        elif argv[0] == "pytest":
            _check_pytest(argv, env, pytestconfig)
        elif argv[0] == "bash":
            assert argv[1:] and (ROOT / argv[1]).is_file(), argv
        else:
            pytest.fail(f"no check for the README command {argv[0]!r}: add one")


def test_the_readme_options_exist(pytestconfig, capsys):
    """A bare option in the text (``--png``, ``--only WORKLOAD ...``) is one of the bench command's or pytest's."""
    with pytest.raises(SystemExit):
        bench._parser()[0].parse_args(["bench", "--help"])
    bench_help = capsys.readouterr().out
    options = [span.split()[0] for span in SPANS if span.startswith("--")]
    for option in options:
        if not re.search(rf"^\s+(-\w, )?{option}\b", bench_help, re.M):
            pytestconfig.getoption(option)
    assert options


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in COMMANDS if re.search(r"(^|&& |\S+=\S* )pytest\b", c)])
def test_a_readme_pytest_command_collects_tests(command):
    env, argv = list(_segments(command))[-1]
    run = subprocess.run([sys.executable, "-m", *argv, "--collect-only", "-q"], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, **env), timeout=600)
    assert run.returncode == 0 and re.search(r"^\d+(/\d+)? tests? collected", run.stdout, re.M), run.stdout + run.stderr
