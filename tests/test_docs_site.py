"""The documentation site's API reference lists every public name (docs/api_*.rst)."""

import pathlib
import re

import pytest

import spchain

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def documented(page: str) -> list[str]:
    text = (DOCS / page).read_text()
    return re.findall(r"^\.\. auto(?:function|class):: (\w+)$", text, flags=re.MULTILINE)


def test_array_reference_lists_every_public_name_once():
    names = documented("api_array.rst")
    assert sorted(names) == sorted(spchain.__all__)


def test_torch_reference_lists_every_public_name_once():
    st = pytest.importorskip("spchain.torch")
    names = documented("api_torch.rst")
    assert sorted(names) == sorted(st.__all__)
