"""Backend selection, optional-import guards and device checks (spchain/_backend.py)."""

import numpy as np
import pytest
import scipy.sparse

from spchain import _backend


def test_numpy_and_scipy_inputs_pick_numpy():
    backend = _backend.backend_of(np.ones(2), scipy.sparse.csr_array(np.eye(2)), None, 3.0)
    assert backend is _backend.NUMPY
    assert backend.xp is np and backend.sparse is scipy.sparse and not backend.on_gpu


def test_no_arrays_means_numpy():
    assert _backend.backend_of(None) is _backend.NUMPY


def test_unsupported_type_is_a_type_error():
    with pytest.raises(TypeError, match="takes NumPy/SciPy or CuPy/cupyx arrays, not list"):
        _backend.backend_of([1.0, 2.0], caller="spchain.spmm")


def test_tensor_that_requires_grad_points_to_spchain_torch():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"requires grad.*spchain\.torch\.spmm.*detach\(\)"):
        _backend.backend_of(torch.ones(2, requires_grad=True), caller="spchain.spmm")
    with pytest.raises(TypeError, match=r"spchain\.torch\.spmm"):
        _backend.backend_of(np.ones(2), torch.ones(2), caller="spchain.spmm")
    with pytest.raises(TypeError, match=r"arrays: pass t\.detach\(\)\.numpy\(\)$"):  # no spchain.torch twin
        _backend.backend_of(torch.ones(2), caller="GaussianHMM")


def test_missing_cupy_gives_one_clear_error(monkeypatch):
    real_import = _backend.importlib.import_module

    def no_cupy(name, *args):
        if name.startswith("cupy"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(_backend.importlib, "import_module", no_cupy)
    _backend.cupy.cache_clear()
    try:
        with pytest.raises(_backend.CudaUnavailableError, match=r"needs CuPy.*pip install spchain\[cuda12\]"):
            _backend.cupy()
    finally:
        _backend.cupy.cache_clear()


@pytest.mark.gpu
def test_cupy_inputs_pick_cupy_and_mixing_devices_is_a_value_error():
    cp = _backend.cupy()
    backend = _backend.backend_of(cp.ones(2))
    assert backend.xp is cp and backend.on_gpu and backend.device == 0
    with pytest.raises(ValueError, match=r"different devices: cpu \(numpy\) and cuda:0 \(cupy\)"):
        _backend.backend_of(np.ones(2), cp.ones(2))
