"""``import spchain`` stays light: no Numba, torch or CuPy until they are used."""

import subprocess
import sys

import numpy as np
import pytest


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_import_loads_neither_numba_torch_cupy_nor_dask():
    out = run("import sys, spchain; print(sorted(m for m in ('numba', 'torch', 'cupy', 'dask') if m in sys.modules))")
    assert out.strip() == "[]"


def test_in_memory_calls_load_no_dask():
    out = run("import sys, numpy as np, spchain as sc; sc.chain_logsumexp(np.zeros((2, 3)), np.zeros((3, 3))); "
              "sc.logmatmul(np.zeros((2, 2)), np.zeros((2, 2))); print('dask' in sys.modules)")
    assert out.strip() == "False"


def test_products_on_torch_load_no_numba():
    """A product that the bridge lends to torch's BLAS asks whether the machine is crowded
    without loading the kernels (Numba took 0.2 s to import on the first product)."""
    pytest.importorskip("torch")
    out = run("import sys, torch, spchain.torch as st; "
              "st.block_diag_matmul(torch.ones(64, 4, 64), torch.ones(4, 64, 64)); print('numba' in sys.modules)")
    assert out.strip() == "False"


def test_array_api_names_load_on_first_use():
    out = run("import spchain; print(spchain.spmm.__module__, 'viterbi' in dir(spchain), hasattr(spchain, 'torch'))")
    assert out.split() == ["spchain.sparse", "True", "False"]


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
        "import numpy as np, spchain as sc\n"
        "print(sc.block_diag_matmul(np.ones((1, 2, 3)), np.ones((2, 3, 1))).sum(),\n"
        "      sc.chain_logsumexp(np.zeros((3, 2)), np.zeros((2, 2))))\n"
    )
    assert [float(v) for v in run(blocker).split()] == [6.0, pytest.approx(3 * np.log(2.0))]


def test_kernels_are_installed_as_spchain_kernels():
    out = run("import spchain.kernels, spchain.kernels.cpu; print(spchain.kernels.__name__)")
    assert out.strip() == "spchain.kernels"
