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
import os
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future as _Pending
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ._fs import fsync_together, process_pool
from .digest import HashingWriter, file_entry
from .directory import CollectiveCommit
from .errors import RankError
from .rank_errors import describe_error

__all__ = ['DirectoryWriter', 'HashingFileSystem', 'FILES']

_T = TypeVar('_T')

#: the index of the write result that carries a rank's manifest entries to rank 0
FILES = MetadataIndex('stratagem/files')
METADATA = '.metadata'


@dataclasses.dataclass(frozen=True)
class Staged:
    """A rank's plan's storage data: DCP's file prefix (``__{rank}_``, which its writer reads
    as ``prefix``) and rank 0's staging directory."""

    prefix: str
    staging: str


class HashingFileSystem(FileSystem):
    """DCP's file system, whose files are written through ``digest.HashingWriter`` (hashed
    on their way to disk, a large write on ``pool``'s thread meanwhile, the disk's writeback
    started as they grow), recording ``{path: (size, digest)}`` of each (the writer fsyncs
    them)."""

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
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            writer = HashingWriter(fd, self._pool)
            try:
                yield writer
                writer.flush()
            except Exception:
                if writer.error is not None:  # the real cause (ENOSPC, EIO), not torch's echo
                    raise writer.error from None
                raise
        finally:
            os.close(fd)
        self.written[os.fspath(path)] = (writer.size, writer.hasher.hexdigest())

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
        #: the error of this rank's own step, which DCP carried to the others as a RankError
        self.own_error: BaseException | None = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # not DCP's: its mkdir and its look for an existing checkpoint concern the final
        # path, which nothing writes into (the staging directory is new)
        self._own(self._check)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        begin = self._commit.begin if self._commit is not None else lambda: self.path
        staging = os.fspath(self._own(begin))
        return [
            dataclasses.replace(plan, storage_data=Staged(f'__{i}_', staging))
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        return self._own(lambda: self._write(plan, planner))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._own(lambda: self._finish(metadata, results))

    def _own(self, step: Callable[[], _T]) -> _T:
        """One of this rank's steps; its error (kept in ``own_error``) reaches the other
        ranks as a ``RankError``, which any error can become."""
        try:
            return step()
        except BaseException as err:  # noqa: BLE001 - an interrupt too: raised again by fail
            self.own_error = err
            raise RankError(describe_error(err)) from None

    def _write(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._commit is not None:
            self.path = Path(plan.storage_data.staging)
        pending = self._side(Path(self.path))
        try:
            results = super().write_data(plan, planner).value()
            self._side_entries = [job.result() for job in pending]
        finally:  # nothing writes into the staging directory once this returns
            futures.wait(pending)
        if self._commit is not None:
            mine = self.entries()
            fsync_together([Path(entry['path']) for entry in mine])  # before rank 0 hears
            entries = self._commit.files(self.path, mine)
            results = [*results, WriteResult(index=FILES, size_in_bytes=0, storage_data=entries)]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
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
        path = os.fspath(Path(self.path) / METADATA)
        written = self.fs.written.get(path)
        return [] if written is None else [{**file_entry(path, *written), 'synced': False}]
