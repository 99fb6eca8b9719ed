"""The structure cache of the sparse layers: each sparse weight's structure (CSR or BSR) is
validated and prepared once (its transpose built) and then served to every product on it, the
forward and the backward of :func:`spchain.torch.sparse_linear` (CSR and block layers alike),
and to any other caller that multiplies by one structure many times (a sparse ``log_trans``:
``STRUCTURES.lookup(backend, (indptr, indices), shape, caller, check=...)`` gives its
validated :class:`~spchain._csr.Csr`, whose ``transposed(backend)`` is built once).

The cache keys a structure by its index arrays' addresses, dtypes and lengths, the shape, the
block size and the device, not by the arrays' identity: the torch operators see new array
views of the same tensors at every call. An address may be reused by new arrays and contents
may change behind it, so every lookup compares the contents with the cached private copy.

>>> import numpy as np, spchain._backend as B
>>> cache = StructureCache()
>>> indptr, indices = np.array([0, 1, 2]), np.array([1, 0])
>>> csr, _ = cache.lookup(B.NUMPY, (indptr, indices), (2, 2), "doc")
>>> cache.lookup(B.NUMPY, (indptr, indices), (2, 2), "doc")[0] is csr
True
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable

import numpy as np

from . import _csr, blocksparse
from ._backend import Backend
from ._typing import Array, Shape
from ._csr import Csr
from .blocksparse import Bsr


class StructureCache:
    """Validated, prepared sparse structures (:class:`~spchain._csr.Csr` or
    :class:`~spchain.blocksparse.Bsr`), the most recently used first out.

    It holds at most ``size`` structures and at most ``budget`` bytes of arrays in all
    (default 256 MiB; the most recent one is kept whatever its size), so that the structures
    that a drop-and-grow leaves behind do not pin memory. A structure holds private copies of
    the validated index arrays, and every lookup compares the arrays' contents with them
    (O(nnz), next to an O(nnz * batch) product): version counters are not trusted (writes
    through a NumPy view or ``.data`` do not bump them, and an unchecked index would reach a
    kernel), nor is an address that new arrays may reuse. On the CPU a difference validates and
    rebuilds the entry. On the GPU the comparison stays on the device (reading it would wait
    for the device): :meth:`lookup` returns its flag with the structure, for the caller to make
    its result NaN where the structure changed. :meth:`note_versions` drops the entries of
    arrays whose torch version counters moved (host integers, no synchronisation), so that
    an in-place torch write validates and rebuilds at the next lookup.
    """

    def __init__(self, size: int = 64, budget: int = 256 * 2**20) -> None:
        self._entries: collections.OrderedDict[tuple[Hashable, ...], tuple[Csr | Bsr, int]] = collections.OrderedDict()
        self._size, self._budget, self._bytes = size, budget, 0
        self._versions: collections.OrderedDict[tuple[int, int], tuple[int, int]] = collections.OrderedDict()

    def note_versions(self, addresses: tuple[int, int], versions: tuple[int, int]) -> None:
        """Drop the entries of the index arrays at ``addresses`` if their ``versions`` (torch's
        version counters) changed since the last call."""
        if self._versions.pop(addresses, versions) != versions:
            for key in [key for key in self._entries if key[:2] == addresses]:
                self._forget(key)
        self._versions[addresses] = versions
        while len(self._versions) > self._size:
            self._versions.popitem(last=False)

    def lookup(self, backend: Backend, arrays: tuple[Array, Array], shape: Shape, caller: str, *,
               blocksize: Shape | None = None, key_arrays: tuple[Array, Array] | None = None,
               check: Callable[[Csr | Bsr], None] | None = None) -> tuple[Csr | Bsr, Array | None]:
        """``(structure, same)`` for ``arrays = (indptr, indices)``: a :class:`Csr` (or with
        ``blocksize``, a :class:`Bsr` pattern) on private validated copies, prepared.

        The entry is the one of ``key_arrays`` (default ``arrays``): a backward looks up its
        forward's structure under the caller's arrays. ``same`` is ``None`` where ``arrays``
        are the entry's own (not compared: the results of a forward, handed to its backward) or
        were compared on the host (the CPU, a new entry), else the device's 0-d flag that they
        equal the entry's. ``check`` is a further
        check of a new structure (e.g. that no entry repeats: it raises ``ValueError``), run
        once per structure; entries checked by different ``check`` functions are apart.
        """
        first, second = key_arrays or arrays
        key = (address(first), address(second), first.dtype, second.dtype, first.shape, second.shape, tuple(shape),
               None if blocksize is None else tuple(blocksize), backend.device, check)
        entry = self._entries.get(key, (None, 0))[0]
        if entry is not None and entry.indices.shape == arrays[1].shape and entry.indptr.shape == arrays[0].shape:
            if _owns(entry, arrays):
                self._entries.move_to_end(key)
                return entry, None
            if backend.on_gpu:
                self._entries.move_to_end(key)
                return entry, _same_on_device(entry, arrays)
            if bool((entry.indices == arrays[1]).all()) and bool((entry.indptr == arrays[0]).all()):
                self._entries.move_to_end(key)
                return entry, None
        copies = arrays[0].copy(), arrays[1].copy()
        structure: Csr | Bsr
        if blocksize is None:
            structure = _csr.to_csr(backend, "csr", shape, None, *copies, caller)
        else:
            structure = blocksparse.to_bsr(backend, shape, None, *copies, caller, blocksize=blocksize)
        if check is not None:
            check(structure)
        structure.prepare(backend)
        self._forget(key)
        self._entries[key] = structure, structure.nbytes
        self._bytes += structure.nbytes
        while len(self._entries) > 1 and (len(self._entries) > self._size or self._bytes > self._budget):
            self._forget(next(iter(self._entries)))
        return structure, None

    def _forget(self, key: tuple[Hashable, ...]) -> None:
        self._bytes -= self._entries.pop(key, (None, 0))[1]

    @property
    def nbytes(self) -> int:
        """The bytes of the arrays that the cache holds."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)


def _owns(structure: Csr | Bsr, arrays: tuple[Array, Array]) -> bool:
    """Whether ``arrays`` are ``structure``'s own private copies (by address): a backward handed
    the arrays its forward ran on, which nothing else writes to, needs no comparison."""
    return address(arrays[0]) == address(structure.indptr) and address(arrays[1]) == address(structure.indices)


def _same_on_device(structure: Csr | Bsr, arrays: tuple[Array, Array]) -> Array:
    """The 0-d device flag that the contents of ``arrays`` equal ``structure``'s: no synchronisation."""
    same: Array = (structure.indices == arrays[1]).all() & (structure.indptr == arrays[0]).all()
    return same


def address(a: Array) -> int:
    """The address of ``a``'s first element (NumPy or CuPy)."""
    return int(a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr)


STRUCTURES = StructureCache()
"""The process's structure cache: :func:`spchain.torch.sparse_linear` (CSR and block weights)
looks its structures up here; other products on a fixed structure may share it."""
