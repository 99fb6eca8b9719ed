"""CPU twins of the GPU branches that check inputs without waiting for the device
(tests/test_gpu_sync.py reads their source): the max-plus product's ``+inf`` gradient, and the sparse layer's structure cache. Each runs the GPU branch on NumPy arrays
or CPU tensors and compares it with the CPU branch, whose errors stay as they were."""

import contextlib

import numpy as np
import pytest
import scipy.sparse
import torch

from spchain import _backend, _csr, _logspace, _structures, semiring


@contextlib.contextmanager
def gpu_branches(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(_backend.Backend, "on_gpu", property(lambda self: True))
        yield


@pytest.mark.parametrize("posinf", [False, True])
def test_maxmatmul_backward_gpu_branch_matches_the_cpu(monkeypatch, rng, posinf):
    a, b = rng.normal(size=(2, 4, 5)), rng.normal(size=(5, 3))
    a[0, 1, 2] = -np.inf
    if posinf:
        b[2, 1] = np.inf
    op = semiring.MAXMATMUL
    problem = op.prepare(a, b, caller="t")
    results, saved = op.forward(problem)
    grad = rng.normal(size=results[0].shape)
    want = op.backward(problem, saved, (grad, None), (True, True)).ordered()
    monkeypatch.setattr(_logspace, "on_device", lambda xp: True)
    got = op.backward(problem, saved, (grad, None), (True, True)).ordered()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_structure_cache_compares_on_the_device_and_rebuilds_for_a_write_or_new_tensors(monkeypatch):
    built = []

    def to_csr(backend, kind, shape, values, indptr, indices, caller):
        built.append(shape)
        return _csr.Csr(indptr, indices, None, shape)

    monkeypatch.setattr(_structures._csr, "to_csr", to_csr)
    gpu = _backend.Backend(np, scipy.sparse, 0)
    cache = _structures.StructureCache()
    indptr, indices = torch.tensor([0, 1, 3]), torch.tensor([2, 0, 1])
    arrays = (indptr.numpy(), indices.numpy())
    csr, same = cache.lookup(gpu, arrays, (2, 3), "t")
    assert same is None and len(built) == 1
    _, same = cache.lookup(gpu, arrays, (2, 3), "t")
    assert bool(same) and len(built) == 1, "a hit compares on the device, builds nothing"
    assert cache.lookup(gpu, (csr.indptr, csr.indices), (2, 3), "t", key_arrays=arrays)[1] is None  # its own arrays
    indices.numpy()[0] = 1  # a write no version counter sees
    cache.note_versions((indptr.data_ptr(), indices.data_ptr()), (indptr._version, indices._version),
                        (indptr, indices))
    _, same = cache.lookup(gpu, arrays, (2, 3), "t")
    assert not bool(same) and len(built) == 1, "the flag says changed: the forward makes its result NaN"
    indices[0] = 2  # an in-place torch write bumps the version: the entry is dropped and rebuilt
    cache.note_versions((indptr.data_ptr(), indices.data_ptr()), (indptr._version, indices._version),
                        (indptr, indices))
    csr, same = cache.lookup(gpu, arrays, (2, 3), "t")
    assert same is None and len(built) == 2 and csr.indices.tolist() == [2, 0, 1]
    # new tensors at the same addresses (torch's caching allocator hands a freed block out again)
    # whose own version counts happen to equal the noted ones: new contents, rebuilt, not NaN
    new_indptr, new_indices = torch.from_numpy(arrays[0]), torch.from_numpy(arrays[1])
    new_indices.numpy()[:] = [0, 2, 1]
    cache.note_versions((new_indptr.data_ptr(), new_indices.data_ptr()), (indptr._version, indices._version),
                        (new_indptr, new_indices))
    csr, same = cache.lookup(gpu, arrays, (2, 3), "t")
    assert same is None and len(built) == 3 and csr.indices.tolist() == [0, 2, 1]
