"""Checkpoint digests: the hash algorithms a manifest ``files`` entry may carry, hashing a
file (``hash_file``) or the bytes on their way to disk (``HashingWriter``), and the ``files``
entries themselves (``file_entry``, ``entry_digest``). Which files a manifest lists, and
checking them against it, is ``manifest.py``'s.

Each ``files`` entry carries one digest: ``xxh3_128`` (format_version 2, written since the
hash became the bottleneck of save and load: sha256 runs at ~1.2 GB/s on one core here, xxh3
at ~13 GB/s, measured in benchmarks/checkpoint_io.py) or ``sha256`` (format_version 1, still
read and verified). The digest guards against torn writes, bit rot and truncation; it is not a
signature (whoever can rewrite the file can rewrite its manifest), so a non-cryptographic hash
loses nothing. Without the ``xxhash`` package, new manifests fall back to sha256.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .errors import CheckpointCorruptError

try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - a dependency; sha256 keeps checkpoints verifiable
    _xxhash = None  # type: ignore[assignment]
HASH_ALGOS = ('xxh3_128', 'sha256')  # what a files entry may carry, preferred first
HASH_ALGO = 'xxh3_128' if _xxhash is not None else 'sha256'  # what new manifests use

_READ_CHUNK = 16 << 20
_SMALL_WRITE_BUFFER = 1 << 20
_WRITEBACK_BYTES = 8 << 20


def new_hasher(algo: str = HASH_ALGO) -> Any:
    """A hashlib-like object (``update``, ``hexdigest``) for ``algo`` in HASH_ALGOS."""
    if algo == 'sha256':
        return hashlib.sha256()
    if algo == 'xxh3_128':
        if _xxhash is None:
            raise RuntimeError(
                'this checkpoint was hashed with xxh3_128; install the xxhash '
                'package (pip install xxhash) to verify it'
            )
        return _xxhash.xxh3_128()
    raise ValueError(f'unknown checkpoint hash {algo!r}; known: {list(HASH_ALGOS)}')


def entry_digest(entry: dict) -> tuple[str, str]:
    """(algorithm, hex digest) that a manifest ``files`` entry records."""
    for algo in HASH_ALGOS:
        if isinstance(entry.get(algo), str):
            return algo, entry[algo]
    raise CheckpointCorruptError(
        f'manifest entry {entry.get("path")!r} has no digest (one of {list(HASH_ALGOS)})'
    )


def file_entry(path: str, size: int, digest: str, algo: str = HASH_ALGO) -> dict:
    """A manifest ``files`` entry."""
    return {'path': path, 'size': size, algo: digest}


class HashingWriter:
    """A write-only file object for ``torch.save`` that hashes the bytes as they are written,
    so the digest of a checkpoint costs no second read. torch hands each tensor storage to
    ``write`` as a memoryview of the tensor's own memory, so a tensor is copied once (into the
    page cache) and never through an intermediate buffer.

    Small writes (zip headers) are buffered. A large write (a tensor storage) is hashed on
    ``pool``'s worker while this thread writes it (both release the GIL). Every
    ``_WRITEBACK_BYTES``, disk writeback of the range written is started (Linux
    ``sync_file_range``), so the disk works while we hash and serialise the rest and the final
    fsync only waits for the tail. Measured on 0.8 GB (benchmarks/checkpoint_io.py): without
    the early writeback, or hashing inline, the save took ~0.3 s longer.
    """

    def __init__(self, fd: int, pool: ThreadPoolExecutor | None = None) -> None:
        self._fd = fd
        self._pool = pool
        self._buffer = bytearray()
        self._synced = 0
        self.algo = HASH_ALGO
        self.hasher = new_hasher(self.algo)
        self.size = 0
        self.error: OSError | None = None  # torch turns our OSError into "unexpected pos"

    def write(self, data: Any) -> int:
        try:
            return self._write(data)
        except OSError as err:
            self.error = err
            raise

    def _write(self, data: Any) -> int:
        view = memoryview(data)
        if view.format != 'B' or view.ndim != 1:
            view = view.cast('B')
        nbytes = view.nbytes
        if nbytes >= _SMALL_WRITE_BUFFER:
            self._flush_buffer()
            if self._pool is not None:
                hashed = self._pool.submit(self.hasher.update, view)
                _write_all(self._fd, view)
                hashed.result()  # before returning: torch may reuse the memory afterwards
            else:
                self.hasher.update(view)
                _write_all(self._fd, view)
        else:
            self.hasher.update(view)
            self._buffer += view
            if len(self._buffer) >= _SMALL_WRITE_BUFFER:
                self._flush_buffer()
        self.size += nbytes
        if self.size - self._synced >= _WRITEBACK_BYTES:
            self._flush_buffer()
            start_writeback(self._fd, self._synced, self.size - self._synced)
            self._synced = self.size
        return nbytes

    def flush(self) -> None:
        self._flush_buffer()

    def tell(self) -> int:  # DCP records each item's offset in its file
        return self.size

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:  # DCP closes its streams; the descriptor is its opener's
        self._flush_buffer()

    def _flush_buffer(self) -> None:
        if self._buffer:
            _write_all(self._fd, memoryview(self._buffer))
            self._buffer = bytearray()


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a range to disk without waiting (a hint; Linux only)."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform.startswith('linux'):
            name = ctypes.util.find_library('c')
            func = getattr(ctypes.CDLL(name), 'sync_file_range', None) if name else None
            if func is not None:
                func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                func.restype = ctypes.c_int
                _sync_file_range = func
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # errors: hint ignored


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def hash_file(
    path: Path, pool: ThreadPoolExecutor | None = None, algo: str = HASH_ALGO
) -> tuple[int, str]:
    """(size in bytes, hex digest with ``algo``) of ``path``.

    The file is memory-mapped, not read: the hash then touches the page cache directly (no
    copy into a buffer, ~3x faster for xxh3 on a warm file), and a ``torch.load(mmap=True)``
    that follows maps the same pages instead of reading the bytes a second time. ``pool`` is
    accepted for callers that hash many files; mapped hashing needs no helper thread.
    """
    del pool
    hasher = new_hasher(algo)
    with open(path, 'rb') as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            return 0, hasher.hexdigest()
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            if hasattr(mapped, 'madvise'):
                mapped.madvise(mmap.MADV_SEQUENTIAL)  # deeper readahead on a cold file
            view = memoryview(mapped)
            try:
                for offset in range(0, size, _READ_CHUNK):
                    hasher.update(view[offset : offset + _READ_CHUNK])
            finally:
                view.release()
        finally:
            mapped.close()
    return size, hasher.hexdigest()


# Verified (device, inode, size, mtime_ns) -> 'algo:digest'. We never modify a committed file
