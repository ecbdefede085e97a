"""Files a third-party saver hands over one state dict at a time, written by us.

DeepSpeed's ``engine.save_checkpoint`` interleaves its collectives and barriers with the
files it writes, each through ``engine.checkpoint_engine.save(state_dict, path)``. Swapping
that engine for a :class:`CapturingCheckpointEngine` (``installed_on(engine)``) keeps
DeepSpeed's collectives where they are (the calling thread) and gives us every file:

1. ``save(state_dict, path)``, called by DeepSpeed on the training thread, either writes the
   file at once with ``write_torch_file`` (no ``writer``: free space checked first, hashed
   as written and fsynced, no second read) or copies ``state_dict`` into the ``writer``'s
   CPU staging buffers (``AsyncCheckpointWriter.snapshot``, one key per file so each file's
   buffers are reused by the next save) and records the path. The caller may add its own files
   the same way.
2. ``write()`` (the caller's writer thread, or at once) checks the free space for all staged
   files, writes them and returns every file's manifest entry (path, size, digest), for
   ``write_directory_files``. A filesystem failure raises ``CheckpointWriteError`` naming
   the file and the cause.

A failure in step 1 does not raise inside DeepSpeed (its other ranks would wait at its next
barrier forever): it is kept, the later files of the save are skipped, and ``write()``
raises it, so the directory protocol's vote reports it on every rank.

The other methods follow DeepSpeed 0.19's ``CheckpointEngine`` (``create``, ``commit``,
``makedirs``, ``is_decoupled``, ``preserves_storage_sharing``); what this engine does not
implement (``load``, ``is_data_parallel_writer``, ...) is the original engine's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stratagem.checkpoint.disk import OVERHEAD_BYTES, check_free_space, payload_bytes, write_error
from stratagem.checkpoint.torch_file import write_torch_file

__all__ = ['CapturingCheckpointEngine']


class CapturingCheckpointEngine:
    """Write (``writer`` None) or stage (an ``AsyncCheckpointWriter``) each saved file.

    Args:
        original: the engine's own checkpoint engine; methods not defined here are its.
        root: the directory the files go to (a save's staging directory); a file's staging
            buffers are named by its path relative to it, so the next save reuses them.
        writer: stage into this writer's buffers and write in ``write()``; None writes at
            once. Peak extra memory when staging: one CPU copy of the files' tensors.
    """

    def __init__(self, original: Any, root: str | os.PathLike, writer: Any = None) -> None:
        self._original, self._root, self._writer = original, Path(root), writer
        self.name = 'StratagemCapturingCheckpointEngine'
        self.error: BaseException | None = None
        self._entries: list[dict] = []  # written files' manifest entries
        self._staged: list[tuple[Any, Path]] = []  # (snapshot, path), written by write()

    def __getattr__(self, name: str) -> Any:  # only for names not defined here
        if name.startswith('_'):
            raise AttributeError(name)
        return getattr(self._original, name)

    # ------------------------------------------------------------- DeepSpeed's interface
    def save(self, state_dict: Any, path: str | os.PathLike) -> None:
        """Write ``state_dict`` to ``path`` now, or stage it (see module doc); never raises."""
        if self.error is not None:
            return  # the save already failed: the vote reports it, nothing more is written
        try:
            if self._writer is None:
                self._entries.append(_write(state_dict, Path(path), check_space=True))
            else:
                path = Path(path)
                try:
                    name = path.relative_to(self._root).as_posix()
                except ValueError:
                    name = path.as_posix()
                self._staged.append((self._writer.snapshot(state_dict, key=f'file:{name}'), path))
        except BaseException as err:  # noqa: BLE001 - raised by write(), after DeepSpeed's barriers
            self.fail(err)

    def create(self, info: Any) -> None:
        """Nothing to prepare: files go into the directory DeepSpeed was given."""

    def commit(self, info: Any) -> bool:
        """DeepSpeed's 'all files of the tag are saved'; our commit is the directory
        protocol's, after ``write()``."""
        return True

    def makedirs(self, path: str | os.PathLike, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        """Writing at once, ``torch.save`` keeps views of one storage sharing it, so DeepSpeed
        clones them first (as for its own torch engine); a snapshot copies every tensor into
        a buffer of its own size, so no clone is needed."""
        return self._writer is None

    # ------------------------------------------------------------------------- ours
    def fail(self, error: BaseException) -> None:
        """Record the first error of this save; ``write()`` raises it."""
        if self.error is None:
            self.error = error

    def write(self, staging: Path | None = None) -> list[dict]:
        """Write the staged files (fsynced, hashed as written); every file's manifest entry.
        Raises the save's first error instead. ``staging`` (ignored) lets this be the
        ``write_fn`` of ``write_directory_files``."""
        if self.error is not None:
            raise self.error
        if self._staged:  # a full disk is refused before the first byte of this rank's files
            check_free_space(
                self._staged[0][1],
                sum(payload_bytes(state) + OVERHEAD_BYTES for state, _ in self._staged),
            )
        while self._staged:
            state, path = self._staged.pop(0)
            self._entries.append(_write(state, path))
        return list(self._entries)

    @contextlib.contextmanager
    def installed_on(self, engine: Any) -> Iterator[CapturingCheckpointEngine]:
        """``engine.checkpoint_engine`` is this capturing engine inside the block, the
        original again after it (also when the block raises)."""
        engine.checkpoint_engine = self
        try:
            yield self
        finally:
            engine.checkpoint_engine = self._original


def _write(state: Any, path: Path, check_space: bool = False) -> dict:
    """``write_torch_file``; a filesystem failure (full, EIO, ...) becomes
    ``CheckpointWriteError`` naming the file and the cause. ``check_space``: refuse a full
    disk before writing."""
    needed = payload_bytes(state) + OVERHEAD_BYTES
    if check_space:
        check_free_space(path, needed)
    try:
        return write_torch_file(state, path)
    except OSError as err:
        converted = write_error(err, path, needed)
        if converted is err:
            raise
        raise converted from err
