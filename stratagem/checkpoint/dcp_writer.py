"""DCP's writer for our sharded directories: every file hashed on its way to disk, and the
directory commit carried by DCP's own collectives.

``DirectoryWriter`` is a ``FileSystemWriter`` (imported with DCP: this module loads when a
sharded directory is saved). Its ``FileSystem`` (``HashingFileSystem``) records each file's
size and digest as DCP writes it, so the manifest costs no second read. Nothing is fsynced
file by file (DCP's writer is told not to): a rank's files, its shards and its side files,
are fsynced together once written (one journal commit, where one after another costs one
each; every rank at about the same time, so often the same one), but rank 0's
``.metadata``, which the commit fsyncs with the manifest; a save to a URL fsyncs nothing
locally (its files go up from a temporary directory).

With a ``directory.CollectiveCommit`` the save needs no exchange of its own: DCP's planning
runs each rank's checks (``prepare_local_plan``: a failure there reaches every rank before
anything is written), rank 0 makes the staging directory once every plan is in and hands it
out with the plans (``prepare_global_plan``), each rank's write result carries its files'
manifest entries to rank 0 (an extra ``WriteResult`` under ``FILES``, taken out before DCP's
metadata is made), and rank 0 commits inside DCP's ``finish``, whose outcome DCP hands every
rank. Without one (a save to a URL, each rank's files staged in a local directory of its
own, ``directory.save_directory`` commits), ``entries()`` lists this rank's files after the
save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future as _Pending
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ._fs import fsync_together, process_pool
from .digest import WRITEBACK_BYTES, file_entry, new_hasher, start_writeback
from .directory import CollectiveCommit

__all__ = ['DirectoryWriter', 'HashingFileSystem', 'FILES']

#: the index of the write result that carries a rank's manifest entries to rank 0
FILES = MetadataIndex('stratagem/files')
METADATA = '.metadata'
_OVERLAP_BYTES = 1 << 20  # writes this large are hashed on a helper thread meanwhile


@dataclasses.dataclass(frozen=True)
class Staged:
    """A rank's plan's storage data: DCP's file prefix (``__{rank}_``, which its writer reads
    as ``prefix``) and rank 0's staging directory."""

    prefix: str
    staging: str


class _HashingStream(io.RawIOBase):
    """A write-only stream over a DCP file that hashes the bytes on their way to it; a large
    write (a tensor's storage) is hashed on ``pool``'s thread while this one writes it (both
    release the GIL), and the disk's writeback of what is written is started every
    ``WRITEBACK_BYTES`` (so the fsync after the last write waits for the tail only), as
    ``digest.HashingWriter`` does for single files."""

    def __init__(self, raw: Any, pool: ThreadPoolExecutor) -> None:
        super().__init__()
        self._raw, self._pool, self.hasher, self.size = raw, pool, new_hasher(), 0
        self._started = 0  # bytes whose writeback was started

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
        if self.size - self._started >= WRITEBACK_BYTES:
            self._raw.flush()
            start_writeback(self._raw.fileno(), self._started, self.size - self._started)
            self._started = self.size
        return view.nbytes

    def tell(self) -> int:  # DCP records item offsets
        return self._raw.tell()

    def fileno(self) -> int:  # DCP fsyncs its files
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()


class HashingFileSystem(FileSystem):
    """DCP's file system, recording ``{path: (size, digest)}`` of every file written (the
    writer fsyncs them)."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        super().__init__()
        self._pool = pool
        self.written: dict[str, tuple[int, str]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if 'w' not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw, self._pool)
            yield stream
        self.written[os.fspath(path)] = (stream.size, stream.hasher.hexdigest())

    def rename(self, path: Any, new_path: Any) -> None:  # .metadata.tmp -> .metadata
        super().rename(path, new_path)
        if os.fspath(path) in self.written:
            self.written[os.fspath(new_path)] = self.written.pop(os.fspath(path))


class DirectoryWriter(FileSystemWriter):
    """DCP's writer of one sharded directory (see the module doc).

    Args:
        path: where the files go: with ``commit``, the checkpoint's final path (a stand-in:
            the files go to the staging directory rank 0 hands out); else a directory of
            this rank's own.
        side: ``side(directory)`` starts writing this rank's files beside DCP's (each a
            future of its manifest entry), run while DCP writes the shards.
        check: run by every rank before anything is written (the free space); its error
            ends the save on every rank.
        commit: the directory commit carried by DCP's collectives (see above).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        side: Callable[[Path], list[_Pending]],
        check: Callable[[], None],
        commit: CollectiveCommit | None = None,
    ) -> None:
        super().__init__(path, thread_count=1, sync_files=False)
        self.fs: HashingFileSystem = HashingFileSystem(process_pool('hash', 2))
        self._side, self._check, self._commit = side, check, commit
        self._side_entries: list[dict] = []

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # not DCP's: its mkdir and its look for an existing checkpoint concern the final
        # path, which nothing writes into (the staging directory is new)
        self._check()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        staging = os.fspath(self._commit.begin() if self._commit is not None else self.path)
        return [
            dataclasses.replace(plan, storage_data=Staged(f'__{i}_', staging))
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._commit is not None:
            self.path = Path(plan.storage_data.staging)
        pending = self._side(Path(self.path))
        try:
            results = super().write_data(plan, planner).value()
            self._side_entries = [job.result() for job in pending]
        finally:  # nothing writes into the staging directory once this returns
            futures.wait(pending)
        if self._commit is not None:
            # durable before rank 0 hears they are written
            fsync_together([Path(entry['path']) for entry in self.entries()])
            entries = self._commit.files(self.path, self.entries())
            results = [*results, WriteResult(index=FILES, size_in_bytes=0, storage_data=entries)]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        per_rank = [[r.storage_data for r in rank if r.index == FILES] for rank in results]
        super().finish(metadata, [[r for r in rank if r.index != FILES] for rank in results])
        if self._commit is None:
            return
        per_rank = [entries[0] if entries else [] for entries in per_rank]
        per_rank[0] = per_rank[0] + self._commit.files(self.path, self._metadata_entry())
        self._commit.commit(per_rank, unsynced=[METADATA])

    def entries(self) -> list[dict]:
        """This rank's files written so far, none fsynced: its shards (rank 0's
        ``.metadata`` after the save, marked for the commit to fsync) and its side files."""
        shards = [
            file_entry(path, size, digest)
            for path, (size, digest) in self.fs.written.items()
            if not path.endswith(METADATA)
        ]
        return [*shards, *self._metadata_entry(), *self._side_entries]

    def _metadata_entry(self) -> list[dict]:
        written = self.fs.written.get(os.fspath(Path(self.path) / METADATA))
        if written is None:
            return []
        path = os.fspath(Path(self.path) / METADATA)
        return [{**file_entry(path, *written), 'synced': False}]
