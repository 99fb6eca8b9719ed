"""``import spchain`` stays light: no Numba, torch or CuPy until they are used."""

import subprocess
import sys

import pytest


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_import_loads_neither_numba_torch_nor_cupy():
    out = run("import sys, spchain; print(sorted(m for m in ('numba', 'torch', 'cupy') if m in sys.modules))")
    assert out.strip() == "[]"


def test_unknown_name_is_an_attribute_error():
    import spchain

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        spchain.nope  # noqa: B018


def test_works_without_torch():
    blocker = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'cupy'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import numpy as np, spchain._backend, spchain.kernels.cpu.logspace as k\n"
        "print(spchain._backend.backend_of(np.ones(1)).name, k.log_add_exp(0.0, 0.0))\n"
    )
    assert run(blocker).split() == ["numpy", "0.6931471805599453"]


def test_kernels_are_installed_as_spchain_kernels():
    out = run("import spchain.kernels, spchain.kernels.cpu; print(spchain.kernels.__name__)")
    assert out.strip() == "spchain.kernels"
