"""The README's Python examples run as they are (the docs' tutorials run in the docs build)."""

import pathlib
import re

import pytest

pytest.importorskip("torch")

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_the_readme_has_one_example_per_capability():
    assert len(BLOCKS) == 4
    assert all(name in README for name in ("SparseLinear", "chain_logsumexp", "LinearChainCRF", "BlockDiagonalLinear", "Dask"))


@pytest.mark.parametrize("block", range(len(BLOCKS)))
def test_a_readme_example_runs(block):
    exec(compile(BLOCKS[block], f"README.md example {block + 1}", "exec"), {})


def test_the_readme_links_resolve():
    root = pathlib.Path(__file__).resolve().parents[1]
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links and all((root / link).exists() for link in links if "://" not in link)
