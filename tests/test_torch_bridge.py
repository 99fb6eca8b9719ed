"""The DLPack bridge between torch tensors and NumPy/CuPy arrays (spchain/torch/_bridge.py)."""

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spchain.torch import _bridge  # noqa: E402


def test_tensor_to_array_shares_memory():
    t = torch.zeros(4, 3)
    a = _bridge.to_array(t)
    a[1, 2] = 5.0
    assert t[1, 2] == 5.0
    t[0, 0] = -1.0
    assert a[0, 0] == -1.0


def test_array_to_tensor_shares_memory():
    a = np.zeros((2, 5), np.float32)
    t = _bridge.to_tensor(a)
    t[1, 4] = 7.0
    assert a[1, 4] == 7.0 and t.dtype == torch.float32


def test_requires_grad_tensor_is_detached():
    t = torch.ones(3, requires_grad=True)
    assert _bridge.to_array(t).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0).reshape(3, 4).t(),
        lambda: torch.arange(20.0)[::3],
        lambda: torch.arange(3.0).expand(4, 3),
        lambda: torch.zeros(0, 3),
    ],
    ids=["transposed", "sliced", "zero-stride", "empty"],
)
def test_non_contiguous_tensors_become_contiguous_arrays(make):
    t = make()
    a = _bridge.to_array(t)
    assert a.flags.c_contiguous
    np.testing.assert_array_equal(a, t.numpy())


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(6.0)[::-1],
        lambda: np.arange(12.0).reshape(3, 4).T,
        lambda: np.broadcast_to(np.arange(3.0), (2, 3)),
    ],
    ids=["negative-stride", "fortran-order", "read-only-broadcast"],
)
def test_odd_layouts_are_copied_not_handed_to_dlpack(make):
    a = make()
    t = _bridge.to_tensor(a)
    np.testing.assert_array_equal(t.numpy(), a)


def test_read_only_array_is_never_written_through_the_tensor():
    a = np.arange(4.0)
    a.flags.writeable = False
    t = _bridge.to_tensor(a)
    t += 1
    np.testing.assert_array_equal(a, np.arange(4.0))


def test_bfloat16_is_a_type_error_before_dlpack():
    with pytest.raises(TypeError, match="bfloat16"):
        _bridge.to_array(torch.ones(2, dtype=torch.bfloat16))


def test_tensors_on_different_devices_are_a_value_error():
    with pytest.raises(ValueError, match=r"x is on cpu but w is on meta"):
        _bridge.check_same_device("f", x=torch.ones(2), bias=None, w=torch.ones(2, device="meta"))
    assert _bridge.check_same_device("f", x=torch.ones(2), bias=None) == torch.device("cpu")


def test_non_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, not ndarray"):
        _bridge.check_same_device("f", x=np.ones(2))


@pytest.mark.gpu
def test_cuda_tensor_round_trip_shares_memory_on_the_current_stream():
    from spchain import _backend

    cp = _backend.cupy()
    t = torch.zeros(3, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), _bridge.bridge(t.device):
        assert cp.cuda.get_current_stream().ptr == stream.cuda_stream
        a = _bridge.to_array(t)
        a += 2
        back = _bridge.to_tensor(a)
    torch.cuda.synchronize()
    assert isinstance(a, cp.ndarray)
    assert t.tolist() == [2.0, 2.0, 2.0] and back.data_ptr() == t.data_ptr()


def test_cpu_products_run_on_torch_blas_inside_spchain_torch(monkeypatch):
    from spchain import _backend

    calls = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 40, 50)), rng.normal(size=(50, 20))  # above SMALL_PRODUCT
    out = np.empty((40, 3, 20)).swapaxes(0, 1)  # strided results
    batched_out = np.empty((40, 3, 20)).swapaxes(0, 1)
    with _bridge.bridge(torch.device("cpu")):
        got = _backend.matmul(np, a, b)
        _backend.matmul(np, a, b, out=out)
        _backend.matmul(np, a, np.broadcast_to(b, (3, 50, 20)).copy(), out=batched_out)
        read_only = a.copy()
        read_only.flags.writeable = False
        fallback = _backend.matmul(np, read_only, b)  # torch would warn: NumPy computes it
        mixed = _backend.matmul(np, a.astype(np.float32), b)
        small = _backend.matmul(np, a[:, :4, :5], b[:5, :2])  # one thread either way: NumPy's is faster
    assert len(calls) == 3
    for result in (got, out, batched_out, fallback):
        np.testing.assert_allclose(result, a @ b, rtol=1e-12)
    np.testing.assert_allclose(small, a[:, :4, :5] @ b[:5, :2], rtol=1e-12)
    assert mixed.dtype == np.float64
    assert _backend.matmul(np, a, b).shape == (3, 40, 20) and len(calls) == 3  # outside: NumPy's


def test_logarithms_of_products_on_every_route():
    """``matmul(..., log=True)`` (the GEMM sweeps' scaled products): the logarithm of the
    product in place, 0 giving ``-inf``, on torch's route (into ``out``, strided or not, and
    without one) and NumPy's (small, read-only), inside the bridge and outside."""
    from spchain import _backend

    rng = np.random.default_rng(0)
    a, b = rng.random((3, 40, 50)), rng.random((50, 20))  # above SMALL_PRODUCT
    a[0, 1] = 0.0  # a zero row of the product: -inf
    read_only = a.copy()
    read_only.flags.writeable = False
    with np.errstate(divide="ignore"):
        want = np.log(a @ b)
    for inside in (True, False):
        with _bridge.bridge(torch.device("cpu")) if inside else contextlib.nullcontext():
            out = np.empty((40, 3, 20)).swapaxes(0, 1)
            batched_out = np.empty((3, 40, 20))
            found = [_backend.matmul(np, a, b, log=True), _backend.matmul(np, a, b, out=out, log=True), out,
                     _backend.matmul(np, a, np.broadcast_to(b, (3, 50, 20)).copy(), out=batched_out, log=True),
                     batched_out, _backend.matmul(np, read_only, b, log=True)]
            small = _backend.matmul(np, a[:, :4, :5], b[:5, :2], log=True)
        for got in found:
            np.testing.assert_allclose(got, want, rtol=1e-12)
            assert (got[0, 1] == -np.inf).all()
        np.testing.assert_allclose(np.exp(small), a[:, :4, :5] @ b[:5, :2], rtol=1e-12)


def test_cpu_products_run_on_one_torch_thread_while_the_machine_is_crowded(monkeypatch):
    """On a crowded machine (other processes' threads runnable) spchain's own products run on
    one torch thread, called from several threads at once too, and torch's count comes back."""
    import threading

    from spchain import _backend
    from spchain.kernels import cpu

    seen = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 40, 50)), rng.normal(size=(50, 20))  # above SMALL_PRODUCT
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for crowded in (False, True):
            monkeypatch.setattr(cpu, "crowded", lambda crowded=crowded: crowded)

            def products():
                with _bridge.bridge(torch.device("cpu")):
                    for _ in range(20):
                        np.testing.assert_allclose(_backend.matmul(np, a, b), a @ b, rtol=1e-12)

            threads = [threading.Thread(target=products) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(seen) == 60 and set(seen) == ({1} if crowded else {2})
            assert torch.get_num_threads() == 2
            seen.clear()
    finally:
        torch.set_num_threads(before)
