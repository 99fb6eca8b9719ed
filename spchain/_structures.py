"""The one structure cache of the array level: each sparse structure (CSR or BSR) is
validated and prepared once (its transpose built) and then served to every product on it:
the forward and the backward of :func:`spchain.torch.sparse_linear` (CSR and block layers
alike) and the chain sweeps on a sparse ``log_trans`` (``spchain._sparse_chain``). What a
product derives from a structure besides (the sparse chain's check for repeated entries, the
GPU's cuSPARSE form) is kept on the structure itself (:func:`kept`), so it lives exactly as
long as the cache holds the structure.

The cache keys a structure by its index arrays' addresses, dtypes and lengths, the shape, the
block size and the device, not by the arrays' identity: the torch operators see new array
views of the same tensors at every call. An address may be reused by new arrays and contents
may change behind it, so every lookup compares the contents with the cached private copy.
Where a caller's index arrays are new at every call (SciPy and cupyx copy a matrix's index
arrays into their own dtype: a sparse ``log_trans`` rebuilt from torch tensors), a lookup
``by_content`` finds the structure by comparing contents with the entries of the same sizes.

>>> import numpy as np, spchain._backend as B
>>> cache = StructureCache()
>>> indptr, indices = np.array([0, 1, 2]), np.array([1, 0])
>>> csr, _ = cache.lookup(B.NUMPY, (indptr, indices), (2, 2), "doc")
>>> cache.lookup(B.NUMPY, (indptr, indices), (2, 2), "doc")[0] is csr
True
>>> cache.lookup(B.NUMPY, (indptr.copy(), indices.copy()), (2, 2), "doc", by_content=True)[0] is csr
True
"""

from __future__ import annotations

import collections
import ctypes
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, cast

import numpy as np

from . import _csr, blocksparse
from ._backend import Backend
from ._typing import Array, Shape
from ._csr import Csr
from .blocksparse import Bsr

T = TypeVar("T")


class StructureCache:
    """Validated, prepared sparse structures (:class:`~spchain._csr.Csr` or
    :class:`~spchain.blocksparse.Bsr`), the most recently used first out.

    It holds at most ``size`` structures and at most ``budget`` bytes of arrays in all
    (default 256 MiB, counted with what was built on them since, such as a transpose; the
    most recent one is kept whatever its size), so that the structures that a drop-and-grow
    or a stream of new ``log_trans`` leave behind do not pin memory. A structure holds private
    copies of the validated index arrays, and every lookup compares the arrays' contents with
    them (O(nnz), next to an O(nnz * batch) product): version counters are not trusted
    (writes through a NumPy view or ``.data`` do not bump them, and an unchecked index would
    reach a kernel), nor is an address that new arrays may reuse. On the CPU a difference
    validates and rebuilds the entry. On the GPU a lookup by address compares on the device
    (reading it would wait for the device): :meth:`lookup` returns its flag with the
    structure, for the caller to make its result NaN where the structure changed; a lookup
    ``by_content`` reads its comparisons (one synchronisation a call).
    :meth:`note_versions` drops the entries of arrays whose torch version counters moved or
    whose tensors are new (host integers and identities, no synchronisation), so that an
    in-place torch write or a new index tensor at a freed one's address validates and rebuilds
    at the next lookup.
    """

    def __init__(self, size: int = 64, budget: int = 256 * 2**20) -> None:
        self._entries: collections.OrderedDict[tuple[Hashable, ...], Csr | Bsr] = collections.OrderedDict()
        self._size, self._budget = size, budget
        self._versions: collections.OrderedDict[tuple[int, int], tuple[tuple[int, int], tuple[weakref.ref[object], ...]]] \
            = collections.OrderedDict()

    def note_versions(self, addresses: tuple[int, int], versions: tuple[int, int], owners: tuple[object, object]
                      ) -> None:
        """Drop the entries of the index arrays at ``addresses`` if their ``versions`` (torch's
        version counters) changed since the last call, or the objects that hold them
        (``owners``, the torch tensors, held by weak reference) are new: a new tensor at a freed
        tensor's address (as torch's caching allocator hands out) starts its own count."""
        noted = self._versions.pop(addresses, None)
        if noted is not None and (noted[0] != versions or any(ref() is not o for ref, o in zip(noted[1], owners))):
            for key in [key for key in self._entries if key[:2] == addresses]:
                del self._entries[key]
        self._versions[addresses] = versions, tuple(weakref.ref(o) for o in owners)
        while len(self._versions) > self._size:
            self._versions.popitem(last=False)

    def lookup(self, backend: Backend, arrays: tuple[Array, Array], shape: Shape, caller: str, *,
               blocksize: Shape | None = None, key_arrays: tuple[Array, Array] | None = None,
               by_content: bool = False) -> tuple[Csr | Bsr, Array | None]:
        """``(structure, same)`` for ``arrays = (indptr, indices)``: a :class:`Csr` (or with
        ``blocksize``, a :class:`Bsr` pattern) on private validated copies, prepared.

        The entry is the one of ``key_arrays`` (default ``arrays``): a backward looks up its
        forward's structure under the caller's arrays. ``same`` is ``None`` where ``arrays``
        are the entry's own (not compared: the results of a forward, handed to its backward) or
        were compared on the host (the CPU, a new entry, a lookup ``by_content``), else the
        device's 0-d flag that they equal the entry's.
        With ``by_content``, the entry is the most recently used one of the same sizes and
        contents, whatever its arrays' addresses.
        """
        first, second = key_arrays or arrays
        sizes = (first.shape, second.shape, tuple(shape), None if blocksize is None else tuple(blocksize),
                 backend.device)
        found = self._by_content(sizes, arrays) if by_content else None
        if found is not None:
            return found, None
        at = address(first), address(second)
        key = (*at, first.dtype, second.dtype, *sizes)
        entry = None if by_content else self._entries.get(key)
        if entry is not None and entry.indices.shape == arrays[1].shape and entry.indptr.shape == arrays[0].shape:
            given = at if key_arrays is None else (address(arrays[0]), address(arrays[1]))
            if given == kept(entry, "addresses", lambda: (address(entry.indptr), address(entry.indices))):
                # arrays are the entry's own private copies: a backward handed the arrays its
                # forward ran on, which nothing else writes to, needs no comparison
                self._entries.move_to_end(key)
                return entry, None
            if backend.on_gpu:
                self._entries.move_to_end(key)
                return entry, _same_on_device(entry, arrays)
            if equal(entry, arrays):
                self._entries.move_to_end(key)
                return entry, None
        copies = arrays[0].copy(), arrays[1].copy()
        structure: Csr | Bsr
        if blocksize is None:
            structure = _csr.to_csr(backend, "csr", shape, None, *copies, caller)
        else:
            structure = blocksparse.to_bsr(backend, shape, None, *copies, caller, blocksize=blocksize)
        structure.prepare(backend)
        self._entries.pop(key, None)
        self._entries[key] = structure
        while len(self._entries) > 1 and (len(self._entries) > self._size or self.nbytes > self._budget):
            self._entries.popitem(last=False)
        return structure, None

    def _by_content(self, sizes: tuple[Hashable, ...], arrays: tuple[Array, Array]) -> Csr | Bsr | None:
        """The most recently used entry whose key ends in ``sizes`` (all of it but the
        addresses and dtypes) and whose index arrays equal ``arrays`` (compared on the host)."""
        for key in reversed(self._entries):
            if key[4:] == sizes and equal(self._entries[key], arrays):
                self._entries.move_to_end(key)
                return self._entries[key]
        return None

    @property
    def nbytes(self) -> int:
        """The bytes of the arrays that the cache holds (with what was built on its structures)."""
        return sum(structure.nbytes for structure in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


def kept(structure: object, name: str, build: Callable[[], T]) -> T:
    """``build()``, made once per ``structure`` and kept on it under ``name``: what a product
    derives from a cached structure lives as long as the cache keeps the structure (and what
    a chain's forward derives from its prepared :class:`~spchain._chain_layout.Chain`, as long
    as its backward may read it).

    >>> import numpy as np, spchain._backend as B
    >>> csr, _ = StructureCache().lookup(B.NUMPY, (np.array([0, 1]), np.array([0])), (1, 1), "doc")
    >>> kept(csr, "doc", lambda: [1]) is kept(csr, "doc", lambda: [2])
    True
    """
    memo: dict[str, Any] = structure.__dict__.setdefault("_kept", {})  # a cache on a frozen value, not a change of it
    if name not in memo:
        memo[name] = build()
    found: T = memo[name]
    return found


_BYTES = 2**15
"""Index arrays of at most this many bytes are compared as bytes (a copy each and a
``memcmp``: 0.3 us for a 64 x 64 layer's, against 2.7 us for NumPy's element-wise comparison,
which makes a temporary and reduces it); larger ones by the C library's ``memcmp`` on their
memory (a 4096 x 4096 layer's at 99 %: 36 us against 69 us element-wise, and the product
after it 0.1 ms faster, its caches not flushed by NumPy's temporary)."""


def _libc_memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's ``memcmp`` (``None`` where the process has none to find)."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):  # no C library loaded by name (Windows)
        return None
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memcmp.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], memcmp)


_MEMCMP = _libc_memcmp()


def equal(structure: Csr | Bsr, arrays: tuple[Array, Array]) -> bool:
    """Whether ``arrays`` hold ``structure``'s index arrays (on the GPU: waits for the device)."""
    return _same(structure.indices, arrays[1]) and _same(structure.indptr, arrays[0])


def _same(mine: Array, given: Array) -> bool:
    """Whether ``given`` holds ``mine``'s values (a cached index array and a caller's)."""
    if mine.shape != given.shape:
        return False
    if type(given) is np.ndarray and given.dtype == mine.dtype:
        if given.nbytes <= _BYTES:
            return bool(mine.tobytes() == given.tobytes())
        if _MEMCMP is not None and given.flags.c_contiguous and mine.flags.c_contiguous:
            return _MEMCMP(address(mine), address(given), given.nbytes) == 0
    return bool((mine == given).all())


def _same_on_device(structure: Csr | Bsr, arrays: tuple[Array, Array]) -> Array:
    """The 0-d device flag that the contents of ``arrays`` equal ``structure``'s: no synchronisation."""
    same: Array = (structure.indices == arrays[1]).all() & (structure.indptr == arrays[0]).all()
    return same


def address(a: Array) -> int:
    """The address of ``a``'s first element (NumPy or CuPy)."""
    if not isinstance(a, np.ndarray):
        return int(a.data.ptr)
    try:  # 0.4 us against 2.8 us for __array_interface__ (a lookup takes two, a small layer's call one)
        return ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]  # a buffer; the stubs say no
    except (TypeError, ValueError):  # read-only, empty or not C-contiguous
        return int(a.__array_interface__["data"][0])


STRUCTURES = StructureCache()
"""The process's structure cache: :func:`spchain.torch.sparse_linear` (CSR and block weights)
and the chain functions with a sparse ``log_trans`` look their structures up here."""
