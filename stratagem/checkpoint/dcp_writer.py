"""The files DCP writes for a sharded save: how many bytes they will take on this rank's disk
(``_bytes_needed``, ``_ranks_sharing_disk``: checked before anything is written), and hashing
them on their way to disk, through a DCP ``FileSystem`` (``_hashing_fs``) whose write streams
(``_HashingStream``) record each file's size and digest, so a save's manifest costs no second
read of its shards. ``sharded.py`` saves through it.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .commit import _OVERHEAD_BYTES, payload_bytes
from .dcp_state import local_tensors
from .digest import new_hasher

_OVERLAP_BYTES = 1 << 20  # writes this large are hashed on a helper thread meanwhile


def _bytes_needed(tensors: Mapping, side: list) -> int:
    """This rank's bytes of a sharded save: its shards, its side files, file overheads."""
    return (
        payload_bytes(local_tensors(tensors))
        + sum(map(payload_bytes, side))
        + _OVERHEAD_BYTES * (1 + len(side))
    )


def _ranks_sharing_disk() -> int:
    """How many ranks write to the disk this rank writes to, as far as it can tell: the
    ranks on its node (``LOCAL_WORLD_SIZE``), whose shards are about as large as its own. A
    filesystem shared by several nodes is assumed large enough for the other nodes' part;
    a shortfall there is still caught by the write (``CheckpointWriteError``)."""
    try:
        return max(1, int(os.environ.get('LOCAL_WORLD_SIZE', '1')))
    except ValueError:
        return 1


class _HashingStream(io.RawIOBase):
    """A write-only stream over a DCP file that hashes the bytes on their way to it; a large
    write (a tensor's storage) is hashed on ``pool``'s thread while this one writes it (both
    release the GIL), as ``digest.HashingWriter`` does for single files."""

    def __init__(self, raw: Any, pool: ThreadPoolExecutor) -> None:
        super().__init__()
        self._raw, self._pool, self.hasher, self.size = raw, pool, new_hasher(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.format != 'B' or view.ndim != 1:
            view = view.cast('B')
        if view.nbytes >= _OVERLAP_BYTES:
            hashed = self._pool.submit(self.hasher.update, view)
            self._raw.write(view)  # a buffered file: writes it all
            hashed.result()  # before returning: the caller may reuse the memory
        else:
            self.hasher.update(view)
            self._raw.write(view)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:  # DCP records item offsets
        return self._raw.tell()

    def fileno(self) -> int:  # DCP fsyncs its files
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()


def _hashing_fs(pool: ThreadPoolExecutor) -> Any:
    """A new HashingFileSystem (the class is defined on first use: importing DCP is not
    cheap)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        """DCP's file system, recording ``{path: (size, digest)}`` of every file written."""

        def __init__(self) -> None:
            super().__init__()
            self.written: dict[str, tuple[int, str]] = {}

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if 'w' not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with super().create_stream(path, mode) as raw:
                stream = _HashingStream(raw, pool)
                yield stream
                raw.flush()
            self.written[os.fspath(path)] = (stream.size, stream.hasher.hexdigest())

        def rename(self, path: Any, new_path: Any) -> None:  # .metadata.tmp -> .metadata
            super().rename(path, new_path)
            if os.fspath(path) in self.written:
                self.written[os.fspath(new_path)] = self.written.pop(os.fspath(path))

    return HashingFileSystem()
