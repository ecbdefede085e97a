"""Directory checkpoints: every rank writes files, one atomic commit, one manifest.

A backend that writes a checkpoint as several files (FSDP's DCP shards, DeepSpeed's per-rank
files) hands this module a write function. ``save_directory(final_dir, write_fn, ...)`` is
the one directory commit: every rank of the default process group under the save's
``SaveVote`` (``vote.py``: the store, no collective; a rank that dies or stalls is named
within the vote's timeout), or this process alone (``collective=False``: ``stratagem
convert``). Its three steps can also be called one by one (an asynchronous saver and
DeepSpeed's storage do): ``begin_directory_save`` (rank 0 creates the staging directory and
publishes it), ``write_directory_files`` (this rank's files, fsynced and hashed here; an
error is returned, not raised), ``finish_directory_save`` (the vote, then rank 0's
``finalize_directory``: manifest, rename into place, pointer); or carried by the
collectives of a writer that has its own (``CollectiveCommit``: DCP's, for FSDP's sharded
save to a local path; the vote then only names a rank that died). What each step does, and
what a failure at each leaves, is told once: docs/architecture.md, 'Save' (the directory
commit).

Load: ``verify_directory(path)``, then the backend's own reader: every listed file's size
checked on every rank and its digest by one rank (at the same world size the rank that
wrote it, else round-robin), every rank seeing the same manifest; a missing or altered
file raises on every rank, naming it. Retention of whole directories is
``apply_retention``'s, which treats a directory with a manifest as one checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from . import _fs
from ._fs import TEMP_RE
from .digest import HASH_ALGO, entry_digest, file_entry, hash_file
from .errors import CheckpointCorruptError, CheckpointVoteError, CheckpointWarning
from .latest import PendingPointer
from .location import is_url
from .manifest import (
    DIR_MANIFEST,
    _identity,
    build_manifest,
    check_extra_manifest,
    dump_manifest,
    read_manifest,
    remember_verified,
    verify_file,
)
from .names import check_final_name, check_step
from .rank_errors import all_ok, dcp_failures, describe_error, raise_first, raised_here
from .vote import SaveVote

__all__ = [
    'begin_directory_save',
    'write_directory_files',
    'finish_directory_save',
    'save_directory',
    'new_staging_dir',
    'finalize_directory',
    'verify_directory',
    'DirectoryWriteResult',
    'CollectiveCommit',
]

PathLike = str | os.PathLike
WriteFn = Callable[[Path], 'Iterable[PathLike | dict] | None']
_NOT_CAUGHT = (KeyboardInterrupt, SystemExit, GeneratorExit)
#: seconds a rank may show no sign of life in a save's vote opened here (``SaveVote``)
VOTE_TIMEOUT = 600.0


@dataclass
class DirectoryWriteResult:
    """What step 2 returns on one rank: the files it hashed, or the error it hit;
    ``unsynced``: those of its files (paths in the staging dir) whose writer left their fsync
    to the commit, which issues it with the manifest's."""

    files: list[dict] = field(default_factory=list)
    error: BaseException | None = None
    unsynced: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


# ---------------------------------------------------------------------------- save: 3 steps
def _check_vote(vote: SaveVote | None, what: str) -> None:
    from stratagem import env  # imported on use: see checkpoint/__init__.py

    if vote is None and env.get_world_size() > 1:
        raise ValueError(
            f'{what} under a process group needs the SaveVote of this save: pass '
            f'vote=SaveVote.open(timeout, what), opened on every rank in the same '
            f'order, or call save_directory, which opens one'
        )


def begin_directory_save(
    final_dir: PathLike, vote: SaveVote | None = None, *, backend_args: Mapping | None = None
) -> Path:
    """Step 1: rank 0 creates a staging dir beside ``final_dir`` and hands it to the others
    through ``vote`` (required under a process group); every rank returns its path.

    ``final_dir`` a URL (``remote_directory.py``; ``backend_args``: its storage options):
    rank 0 checks the target there, and every rank gets a local staging dir of its own."""
    _check_vote(vote, 'begin_directory_save')
    remote = is_url(os.fspath(final_dir))
    if vote is not None and vote.rank != 0:
        shared = json.loads(vote.receive('staging'))
        if 'error' in shared:
            vote.concluded = True  # rank 0 gave up: there is nothing to vote on
            raise RuntimeError(
                f'creating the staging directory for {final_dir} failed on '
                f'rank 0: {shared["error"]}'
            )
        return _local_staging() if remote else Path(shared['staging'])
    try:
        if remote:
            from .remote_directory import prepare_remote_target

            prepare_remote_target(os.fspath(final_dir), backend_args)
            path = _local_staging()
        else:
            path = new_staging_dir(final_dir)
    except Exception as err:
        if vote is not None:
            vote.publish('staging', json.dumps({'error': describe_error(err)}))
            vote.concluded = True
        raise
    if vote is not None:
        vote.publish('staging', json.dumps({'staging': os.fspath(path)}))
    return path


def _local_staging() -> Path:
    """A staging directory of this rank's own for a save to a URL (its files go up from
    there; removed by ``finish_directory_save``)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix='stratagem-upload-'))


def write_directory_files(staging: PathLike, write_fn: WriteFn) -> DirectoryWriteResult:
    """Step 2 (this rank only): run ``write_fn(staging)``; fsync and hash the files it returns
    (an entry the writer hashed with ``'synced': False``: fsynced by the commit instead, on
    the rank that commits; see ``DirectoryWriteResult``).

    Never raises for a failed write (the error is returned, so step 3 can tell every rank).
    """
    staging = Path(staging)
    try:
        returned = write_fn(staging)
        if returned is None:
            return DirectoryWriteResult()
        written = list(returned)
        result = DirectoryWriteResult(files=[_hash_written(staging, p) for p in written])
        result.unsynced = [
            entry['path']
            for entry, item in zip(result.files, written)
            if isinstance(item, dict) and item.get('synced') is False
        ]
        return result
    except _NOT_CAUGHT:
        raise
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return DirectoryWriteResult(error=err)


def _hash_written(staging: Path, item: PathLike | dict) -> dict:
    """A written file's manifest entry: hashed here, or the writer's own (size checked)."""
    path = Path(item['path'] if isinstance(item, dict) else item)
    full = path if path.is_absolute() else staging / path
    try:
        rel = full.relative_to(staging).as_posix()
    except ValueError:
        raise ValueError(
            f'write_fn returned {full}, which is not inside the staging directory '
            f'{staging}; write every file of the checkpoint there'
        ) from None
    if isinstance(item, dict):  # fsynced and hashed by the writer as it wrote the bytes
        identity = _identity(full)
        if identity[2] != item['size']:
            raise ValueError(
                f'{full} has {identity[2]} bytes but its writer hashed '
                f'{item["size"]}; it changed after being written'
            )
        algo, digest = entry_digest(item)
    else:
        fd = os.open(full, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        identity = _identity(full)
        algo, (_, digest) = HASH_ALGO, hash_file(full)
    remember_verified(full, digest, identity, algo)  # the directory's rename keeps the identity
    return file_entry(rel, identity[2], digest, algo)


def finish_directory_save(
    staging: PathLike,
    final_dir: PathLike,
    written: DirectoryWriteResult,
    vote: SaveVote | None = None,
    *,
    step: int | None = None,
    extra_manifest: dict | None = None,
    update_pointer: bool = True,
    backend_args: Mapping | None = None,
    also_point: PathLike | None = None,
    collective: bool = True,
) -> Path:
    """Step 3: post this rank's result, rank 0 commits, everyone learns the outcome
    (``vote``: required under a process group, unless ``collective=False``: this process
    alone commits, as ``save_directory`` does for it). Returns the committed directory's
    absolute path on every rank (a URL: the URL).

    ``final_dir`` a URL: first every rank uploads its files (an upload error is its failed
    result), rank 0's commit is ``remote_directory.commit_remote_directory`` (the manifest
    after every file, then the pointer; ``also_point``: a local directory whose
    ``last_checkpoint`` names it too), and every rank removes its staging dir."""
    if collective:
        _check_vote(vote, 'finish_directory_save')
    staging = Path(staging)
    if not is_url(os.fspath(final_dir)):
        local = _local_commit(staging, final_dir, written, step, extra_manifest, update_pointer)
        return _finish(staging, final_dir, written, vote, local)
    from .remote_directory import commit_remote_directory, upload_directory_files

    url = os.fspath(final_dir)
    try:
        if written.ok:
            try:
                upload_directory_files(staging, url, written.files, backend_args)
            except Exception as err:  # noqa: BLE001 - this rank's failed result, voted on
                written = DirectoryWriteResult(error=err)
        commit = functools.partial(
            commit_remote_directory,
            url,
            step=step,
            extra_manifest=extra_manifest,
            backend_args=backend_args,
            update_pointer=update_pointer,
            also_point=also_point,
        )
        return _finish(
            staging, url, written, vote, lambda per_rank, world: commit(per_rank, world=world)
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _finish(
    staging: Path,
    final_dir: PathLike,
    written: DirectoryWriteResult,
    vote: SaveVote | None,
    commit: Callable[[list[list[dict]], int | None], Any],
) -> Any:
    """Step 3's vote around ``commit(per_rank_entries, world_size)`` (rank 0)."""
    what = f'saving checkpoint directory {final_dir}'
    if vote is None:
        return _commit_alone(staging, final_dir, written, 1, commit)
    if written.error is not None:
        _fail_voted(staging, what, written.error, vote)
    if vote.rank != 0 and written.unsynced and not is_url(os.fspath(final_dir)):
        # rank 0 commits: this rank's files are durable before it says they are written
        _fs.fsync_together([staging / p for p in written.unsynced])
    vote.ready(None, json.dumps(written.files))
    if vote.rank != 0:
        vote.wait_outcome()
        if is_url(os.fspath(final_dir)):
            return final_dir
        return _final_of(staging)  # rank 0's final name
    try:
        payloads = vote.wait_ready()
        final = commit([json.loads(p) for p in payloads], vote.world_size)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        vote.post_outcome(str(err) if isinstance(err, CheckpointVoteError) else describe_error(err))
        raise
    vote.post_outcome(None)
    return final


def _fail_voted(staging: Path | None, what: str, error: BaseException, vote: SaveVote) -> NoReturn:
    """This rank's part of a save failed: every rank posts its error through the vote; rank
    0 waits for the others (naming a peer that died: it may be why this rank failed),
    removes ``staging`` (None: it made none) and posts the outcome, then raises."""
    vote.ready(describe_error(error))
    if vote.rank != 0:
        vote.concluded = True  # rank 0 learns it from the vote; close() acknowledges
        _raise_own(error, what)
    try:
        try:
            vote.wait_others()
        except CheckpointVoteError as err:
            raise err from error
        _raise_own(error, what)
    except BaseException as err:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        vote.post_outcome(str(err) if isinstance(err, CheckpointVoteError) else describe_error(err))
        raise


class CollectiveCommit:
    """Steps 1-3 carried by the collectives of a writer that has its own (DCP's save: the
    planning gather and scatter, the write gather, the finish broadcast), which carry what
    the vote would: rank 0's staging directory to every rank (``begin``, in DCP's global
    plan), every rank's files or its error to rank 0 (``files``, in each rank's write
    result), rank 0's commit and its outcome to every rank (``commit``, in DCP's finish). A
    save that succeeds posts nothing to the store (``SaveVote.settle``); one that fails on
    any rank fails on every rank, through DCP (``fail``: each rank's own error, or one naming
    the rank that failed), and a rank that got a bare error (a peer died inside a collective)
    goes through the vote, which names the dead (``vote``: None in one process).

    ``collective=False``: this process alone (``world_size`` only what ``extra_manifest``
    says), as ``save_directory``'s."""

    def __init__(
        self,
        final_dir: PathLike,
        vote: SaveVote | None,
        *,
        step: int | None = None,
        extra_manifest: dict | None = None,
        update_pointer: bool = True,
        collective: bool = True,
    ) -> None:
        check_step(step)
        check_extra_manifest(extra_manifest)
        if collective:
            _check_vote(vote, 'CollectiveCommit')
        self.final = check_final_name(final_dir)
        self.vote = vote if collective else None
        self.collective = collective
        self._step, self._extra, self._pointer = step, extra_manifest, update_pointer
        #: rank 0's staging directory, on every rank once the writer handed it out
        self.staging: Path | None = None
        self._mine = False  # this rank created ``staging`` (and removes it on a failure)

    @property
    def what(self) -> str:
        return f'saving checkpoint directory {self.final}'

    def begin(self) -> Path:
        """Step 1 (rank 0, once every rank's plan is in): the staging directory."""
        self.staging, self._mine = new_staging_dir(self.final), True
        return self.staging

    def files(self, staging: PathLike, written: Iterable[PathLike | dict]) -> list[dict]:
        """Step 2 (every rank, its files written into rank 0's ``staging``): their entries
        (as ``write_directory_files`` makes them; raises instead of returning the error)."""
        self.staging = Path(staging)
        return [_hash_written(self.staging, item) for item in written]

    def commit(self, per_rank: list[list[dict]], unsynced: list[str]) -> Path:
        """Step 3 (rank 0, every rank's entries in hand): ``finalize_directory``; a failure
        removes the staging directory before it reaches the other ranks."""
        if self.staging is None:
            raise RuntimeError('CollectiveCommit.commit before begin')
        world = len(per_rank) if self.collective else None
        try:
            return _commit(
                self.staging,
                self.final,
                per_rank,
                world,
                step=self._step,
                extra_manifest=self._extra,
                update_pointer=self._pointer,
                unsynced=unsynced,
            )
        except BaseException:  # removed before the writer tells the other ranks
            shutil.rmtree(self.staging, ignore_errors=True)
            raise

    def done(self) -> Path:
        """After the writer returned on this rank: the committed directory (rank 0's name)."""
        if self.vote is not None:
            self.vote.settle()
        assert self.staging is not None  # handed out before any rank wrote
        return _final_of(self.staging)

    def fail(self, error: BaseException, own: BaseException | None = None) -> NoReturn:
        """The writer raised ``error`` on this rank (``own``: the error of this rank's own
        step, which DCP carried to the others as a ``RankError``): raise on every rank,
        nothing committed, rank 0's staging directory removed. DCP's ``CheckpointException``
        reached every rank alike: each raises at once, this rank's own error, or one naming
        the rank that failed. Any other error (a collective failed: a peer may have died
        inside it) goes through the vote, which names the dead."""
        failures = dcp_failures(error)
        if failures or isinstance(error, _NOT_CAUGHT) or self.vote is None:
            if self.vote is not None:
                self.vote.settle()  # every rank has the outcome: no key of steps 2-4
            if self._mine:
                shutil.rmtree(self.staging, ignore_errors=True)  # type: ignore[arg-type]
            rank = 0 if self.vote is None else self.vote.rank
            what = self.what if self.vote is None else self.vote.what  # as the vote says it
            _raise_own(raised_here(error, own, rank, what), self.what)
        _fail_voted(self.staging if self._mine else None, self.what, own or error, self.vote)


def _final_of(staging: Path) -> Path:
    """The final name a staging directory (``new_staging_dir``'s) was made for."""
    return staging.parent / TEMP_RE.match(staging.name)['final']  # type: ignore[index]


def _raise_own(error: BaseException, what: str) -> NoReturn:
    if isinstance(error, (Exception, *_NOT_CAUGHT)):
        raise error
    # a BaseException (DCP's CheckpointException) becomes an Exception, so that callers'
    # `except Exception` sees it on this rank as on the others
    from stratagem import env  # imported on use: see checkpoint/__init__.py

    raise RuntimeError(
        f'{what} failed on rank {env.get_rank()}: {describe_error(error)}'
    ) from error


def _commit_alone(
    staging: Path,
    final_dir: PathLike,
    written: DirectoryWriteResult,
    world: int | None,
    commit: Callable[[list[list[dict]], int | None], Any],
) -> Any:
    """Commit what this process wrote (no vote); the staging dir is removed if it fails."""
    try:
        if not written.ok:
            _raise_own(written.error, f'saving checkpoint directory {final_dir}')  # type: ignore[arg-type]
        return commit([written.files], world)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _local_commit(
    staging: Path,
    final_dir: PathLike,
    written: DirectoryWriteResult,
    step: int | None,
    extra_manifest: dict | None,
    update_pointer: bool,
) -> Callable[[list[list[dict]], int | None], Path]:
    """Rank 0's commit of a local staging directory: ``commit(per_rank_entries, world)``."""
    return functools.partial(
        _commit,
        staging,
        final_dir,
        step=step,
        extra_manifest=extra_manifest,
        update_pointer=update_pointer,
        unsynced=written.unsynced,
    )


def _commit(
    staging: Path,
    final_dir: PathLike,
    per_rank: list[list[dict]],
    world: int | None,
    *,
    step: int | None,
    extra_manifest: dict | None,
    update_pointer: bool,
    unsynced: list[str],
) -> Path:
    known = [{**entry, 'rank': r} for r, files in enumerate(per_rank) for entry in files]
    extra = extra_manifest if world is None else {'world_size': world, **(extra_manifest or {})}
    return finalize_directory(
        staging,
        final_dir,
        step=step,
        update_pointer=update_pointer,
        known_files=known,
        extra_manifest=extra,
        unsynced=unsynced,
    )


def save_directory(
    final_dir: PathLike,
    write_fn: WriteFn,
    *,
    step: int | None = None,
    extra_manifest: dict | None = None,
    update_pointer: bool = True,
    vote: SaveVote | None = None,
    timeout: float = VOTE_TIMEOUT,
    collective: bool = True,
    backend_args: Mapping | None = None,
    also_point: PathLike | None = None,
) -> Path:
    """Atomic save of a multi-file checkpoint, the one directory commit: steps 1-3 of
    docs/architecture.md, 'Save' (the directory commit).

    Args:
        final_dir: the checkpoint directory's final path (must be the same on every rank;
            rank 0's is used).
        write_fn: ``write_fn(staging: Path)``, run on every rank, writes this rank's files
            into ``staging`` and returns the paths it wrote (fsynced and hashed by this rank)
            or None (rank 0 then fsyncs and hashes them). It must not write ``manifest.json``.
        step: training step (or epoch) recorded in the manifest; orders checkpoints.
        extra_manifest: JSON-able extras for the manifest (e.g. ``{'strategy': 'FSDP...'}``);
            ``world_size`` is added for you (``collective=True``).
        update_pointer: point ``last_checkpoint`` at the new directory.
        vote: this save's ``SaveVote`` (a strategy's, opened for the whole save); by default
            one is opened (and closed) here under a process group, every rank in the same
            order, with ``timeout``: seconds a rank may show no sign of life before the
            others give up on the save, naming it.
        collective: False: this process alone writes and commits, whatever process group
            exists (``stratagem convert``; ``vote`` unused), and ``world_size`` is only
            what ``extra_manifest`` says. In one process (no vote) the staging dir is
            removed on any failure, an interrupt included.
        backend_args: ``final_dir`` a URL (``remote_directory.py``): its storage options.
        also_point: a local directory whose ``last_checkpoint`` also names the checkpoint
            (a URL target only).

    Returns:
        The committed directory's absolute path, on every rank.
    """
    check_step(step)
    check_extra_manifest(extra_manifest)
    with directory_vote(final_dir, vote, collective=collective, timeout=timeout) as vote:
        remote = is_url(os.fspath(final_dir))
        if vote is None and not remote:  # this process alone: no vote
            staging = new_staging_dir(final_dir)
            try:
                written = write_directory_files(staging, write_fn)
            except BaseException:  # an interrupt (write_directory_files returns any other error)
                shutil.rmtree(staging, ignore_errors=True)
                raise
            commit = _local_commit(
                staging, final_dir, written, step, extra_manifest, update_pointer
            )
            return _commit_alone(staging, final_dir, written, 1 if collective else None, commit)
        if vote is None:  # a URL, this process alone
            staging = _begin_alone(final_dir, backend_args)
        else:
            staging = begin_directory_save(final_dir, vote, backend_args=backend_args)
        try:
            written = write_directory_files(staging, write_fn)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return finish_directory_save(
            staging,
            final_dir,
            written,
            vote,
            step=step,
            extra_manifest=extra_manifest,
            update_pointer=update_pointer,
            backend_args=backend_args,
            also_point=also_point,
            collective=vote is not None,
        )


@contextlib.contextmanager
def directory_vote(
    final_dir: PathLike,
    vote: SaveVote | None,
    *,
    collective: bool = True,
    timeout: float = VOTE_TIMEOUT,
) -> Iterator[SaveVote | None]:
    """The vote of a directory save: ``vote`` (the caller's, e.g. a strategy's for its whole
    save), or one opened here (every rank in the same order) and closed after; None for a
    process alone (``collective=False``, or no process group)."""
    if not collective or vote is not None:
        yield vote if collective else None
        return
    own = SaveVote.open(timeout, f'saving {final_dir}')
    try:
        yield own
    finally:
        if own is not None:
            own.close()


def _begin_alone(final_dir: PathLike, backend_args: Mapping | None) -> Path:
    """Step 1 at a URL for this process alone (no vote, whatever process group exists)."""
    from .remote_directory import prepare_remote_target

    prepare_remote_target(os.fspath(final_dir), backend_args)
    return _local_staging()


# ---------------------------------------------------------------------------- the commit
def new_staging_dir(final_dir: PathLike) -> Path:
    """Create and return an empty staging directory next to ``final_dir`` (rank 0 only).

    Its name (``.{name}.tmp-{pid}-{rand}``) marks it as ours, so a crash leaves nothing that
    looks committed and retention can remove it later.
    """
    final = check_final_name(final_dir)
    if final.exists() and not final.is_dir():
        raise FileExistsError(f'cannot commit directory checkpoint {final}: a file has that name')
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = _fs.temp_name(final)
    staging.mkdir()
    return staging


def finalize_directory(
    staging_dir: PathLike,
    final_dir: PathLike,
    *,
    step: int | None = None,
    extra_manifest: dict | None = None,
    update_pointer: bool = True,
    known_files: list[dict] | None = None,
    unsynced: Iterable[str] = (),
) -> Path:
    """Commit a staging directory filled by the strategy (rank 0 only, after a barrier).

    Fsyncs and hashes every file under ``staging_dir``, writes ``manifest.json`` inside,
    renames it to ``final_dir`` (atomically exchanging with an existing one where the OS can,
    then deleting the old), fsyncs the parent and updates ``last_checkpoint``. Returns the
    absolute final path.

    ``known_files``: ``file_entry`` dicts (path, size, digest[, 'rank']; paths relative to
    the staging dir) already fsynced and hashed by the ranks that wrote them; those are not
    read again (their size is still checked; ``rank``, the writer, is kept in the manifest),
    every other file is fsynced and hashed here. ``unsynced``: known files (paths relative
    to the staging dir) not fsynced yet, fsynced here together with the manifest.
    """
    staging = Path(staging_dir).absolute()
    final = check_final_name(final_dir)
    check_step(step)
    check_extra_manifest(extra_manifest)
    if (
        not staging.is_dir()
        or staging.parent != final.parent
        or _fs.TEMP_RE.match(staging.name) is None
    ):
        raise ValueError(
            f'staging_dir {staging} is not a staging directory for {final}; '
            f'create it with new_staging_dir({str(final)!r})'
        )
    if (staging / DIR_MANIFEST).exists():
        raise ValueError(
            f'{staging / DIR_MANIFEST} exists: the name {DIR_MANIFEST!r} is '
            f'reserved for the checkpoint manifest; rename that file'
        )
    if final.exists() and not final.is_dir():
        raise FileExistsError(f'cannot commit directory checkpoint {final}: a file has that name')
    files, folders = _hash_tree(staging, {e['path']: e for e in known_files or ()})
    if not files:
        raise ValueError(f'staging directory {staging} is empty; nothing to commit for {final}')
    manifest = build_manifest('directory', final.name, files, step, extra_manifest)
    # nothing reads a staging directory, so its manifest needs no temp name; the manifest's
    # fsync, the directory's (and its folders'), the files' whose writers left theirs to
    # the commit and the new pointer's (a temp file until the rename below) are independent
    # and issued together (one journal commit, not several); then the renames, checkpoint
    # first, then the pointer, both made durable by one fsync of their parent on a helper
    # thread (see _rename_dir_into_place)
    pointer = PendingPointer(final.parent, final) if update_pointer else None
    try:
        _fs.write_new(staging / DIR_MANIFEST, dump_manifest(manifest))
        _fs.fsync_together(
            [
                staging / DIR_MANIFEST,
                staging,
                *folders,
                *(staging / p for p in unsynced),
                *([pointer.temp] if pointer is not None else []),
            ]
        )
        _rename_dir_into_place(staging, final)
    except BaseException:
        if pointer is not None:
            pointer.discard()
        raise
    if pointer is not None:
        pointer.commit()  # its parent's fsync, soon, covers the checkpoint's rename too
    else:
        _fs.fsync_dir_soon(final.parent)
    return final


def _hash_tree(root: Path, known: dict[str, dict] | None = None) -> tuple[list[dict], list[Path]]:
    """The manifest entries of every file under ``root`` (fsynced and hashed here unless
    ``known``), and the folders under it, whose fsync the caller issues with the root's."""
    known = known or {}
    files = []
    folders = []
    with ThreadPoolExecutor(1, thread_name_prefix='stratagem-hash') as pool:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath, name)
                if path.is_symlink():
                    raise ValueError(
                        f'{path} is a symlink; a checkpoint directory holds only regular files'
                    )
                rel = path.relative_to(root).as_posix()
                entry = known.get(rel)
                if entry is not None:
                    size = path.stat().st_size
                    if size != entry['size']:
                        raise ValueError(
                            f'{path} has {size} bytes but the rank that wrote it '
                            f'hashed {entry["size"]}; it changed after being written'
                        )
                    algo, digest = entry_digest(entry)
                    files.append(
                        {
                            **file_entry(rel, size, digest, algo),
                            **({'rank': entry['rank']} if 'rank' in entry else {}),
                        }
                    )
                    continue
                _fs.fsync_file(path)
                size, digest = hash_file(path, pool)
                files.append(file_entry(rel, size, digest))
            if Path(dirpath) != root:
                folders.append(Path(dirpath))
    return files, folders


def _rename_dir_into_place(staging: Path, final: Path) -> None:
    """A new name: the rename, made durable by the caller's fsync of the parent on a helper
    thread (``_fs.fsync_dir_soon``), as the pointer's. Until then a power cut may undo it:
    the checkpoint is lost, never torn (its files and manifest were fsynced before), the
    pointer names it or the previous one (a reader falls back to the newest complete
    checkpoint, ``find_latest_checkpoint``), and nothing was deleted meanwhile (retention
    waits for that fsync, ``_fs.wait_soon``). A name taken: the old checkpoint is replaced,
    and its files deleted only once the exchange is durable."""
    if not final.exists():
        os.replace(staging, final)
        return
    if _fs.exchange(staging, final):
        # `staging` now holds the old checkpoint under a temp name: retention would also
        # clean it up if we died here.
        _fs.fsync_dir(final.parent)
        shutil.rmtree(staging, ignore_errors=True)
        return
    # No atomic exchange on this platform: a crash between these two renames leaves the old
    # and the new checkpoint under temp names. Prefer unique names per step for directories.
    old = _fs.temp_name(final)
    os.replace(final, old)
    os.replace(staging, final)
    _fs.fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------ load
def verify_directory(
    path: PathLike,
    *,
    hash_bytes: bool = True,
    collective: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Verify a committed directory checkpoint before reading it; returns its manifest.
    ``progress(done, total)`` is called after each file (for a progress bar).

    ``collective=True`` (every rank calls it): each rank checks every size and hashes its
    round-robin share of the files; errors are exchanged, so all ranks raise the same error
    naming the missing or altered file. ``collective=False`` verifies everything here.
    Raises ``FileNotFoundError`` (no such directory, or a listed file missing),
    ``NotADirectoryError``, or ``CheckpointCorruptError`` (no or unreadable manifest, a size or
    digest mismatch, ranks seeing different manifests). Files present but not listed are
    reported with a ``CheckpointWarning`` (something wrote into a committed checkpoint).
    """
    from stratagem import env  # imported on use: see checkpoint/__init__.py

    rank, world = env.get_dist_info() if collective else (0, 1)
    directory = Path(path).absolute()
    manifest, digest, error = None, None, None
    try:
        manifest, digest = _read_dir_manifest(directory)
        mfile = directory / DIR_MANIFEST
        # at the same world size each rank hashes what it wrote (in this process: nothing
        # to read, its hashes are remembered); otherwise round-robin
        own = manifest.get('world_size') == world
        for i, entry in enumerate(manifest['files']):
            owner = entry.get('rank', i) if own else i
            verify_file(
                directory / entry['path'],
                entry,
                mfile,
                hash_bytes=hash_bytes and owner % world == rank,
            )
            if progress is not None:
                progress(i + 1, len(manifest['files']))
    except Exception as err:  # noqa: BLE001 - exchanged, raised on every rank
        error = err
    mine = (digest, None if error is None else describe_error(error))
    outcomes = [mine]  # the details travel only when something differs
    if collective and not all_ok(error is not None, digest):
        outcomes = env.all_gather_object(mine)
    raise_first(
        [msg for _, msg in outcomes], error, f'verifying {directory}', CheckpointCorruptError
    )
    if len({d for d, _ in outcomes}) > 1:
        raise CheckpointCorruptError(
            f'ranks read different manifests in {directory} (the '
            f'directory changed while loading, or ranks see different '
            f'filesystems); it was not loaded'
        )
    if rank == 0:
        _warn_unlisted(directory, manifest)  # type: ignore[arg-type]
    return manifest  # type: ignore[return-value]


def _read_dir_manifest(directory: Path) -> tuple[dict, str]:
    if not directory.exists():
        raise FileNotFoundError(f'checkpoint directory not found: {directory}')
    if not directory.is_dir():
        raise NotADirectoryError(f'{directory} is not a directory checkpoint')
    mfile = directory / DIR_MANIFEST
    manifest = read_manifest(mfile)
    if manifest is None:
        raise CheckpointCorruptError(
            f'{directory} has no {DIR_MANIFEST}: it is not a committed stratagem checkpoint '
            f'(a save that died before its commit, or written by another tool); it was not '
            f'loaded'
        )
    if manifest.get('kind') != 'directory':
        raise CheckpointCorruptError(
            f'{mfile} describes a {manifest.get("kind")!r} checkpoint, not a directory'
        )
    return manifest, hashlib.sha256(mfile.read_bytes()).hexdigest()


def _warn_unlisted(directory: Path, manifest: dict) -> None:
    listed = {entry['path'] for entry in manifest['files']} | {DIR_MANIFEST}
    extra = sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob('*')
        if p.is_file() and p.relative_to(directory).as_posix() not in listed
    )
    if extra:  # every rank verifies the same directory: warn once
        from stratagem import env  # imported on use: see checkpoint/__init__.py

        env.warn_rank_zero(
            f'{directory} holds files its manifest does not list: {extra[:5]}'
            f'{" ..." if len(extra) > 5 else ""}; they were written after the '
            f'commit and are ignored',
            CheckpointWarning,
            stacklevel=3,
        )
