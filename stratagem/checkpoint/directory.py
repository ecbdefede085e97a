"""Directory checkpoints across ranks: every rank writes files, one atomic commit, one manifest.

A backend that writes a checkpoint as several files (FSDP's DCP shards, DeepSpeed's per-rank
files) hands this module a write function and gets the protocol of ``DESIGN.md``. Collective:
every rank of the default process group calls the same functions in the same order; without a
process group the same calls work in one process.

Save, ``save_directory(final_dir, write_fn, step=..., extra_manifest=...)``, is three steps
that can also be called one by one (an asynchronous saver runs them on its writer thread).
Under a process group the ranks agree through a ``SaveVote`` (``vote.py``: the process
group's store, no collective; a rank that dies or stalls is named within the vote's timeout),
which the caller passes (a strategy opens one per save) or ``save_directory`` opens:

1. ``staging = begin_directory_save(final_dir, vote)``: rank 0 checks the name and creates a
   fresh staging directory ``.{name}.tmp-{pid}-{rand}`` beside ``final_dir`` and publishes
   it; every rank gets its path (a failure there raises on every rank). Nothing is ever
   written into an existing checkpoint directory: an old checkpoint of the same name is only
   replaced, whole, by the rename of step 3.
2. ``written = write_directory_files(staging, write_fn)`` (local, no collective): runs
   ``write_fn(staging)`` on this rank. It returns the paths it wrote (absolute or relative to
   ``staging``), which are fsynced and hashed here, so ranks hash their own files in parallel;
   or, for files the writer already fsynced and hashed while writing them (no second read),
   ``file_entry`` dicts (path, size, digest); or None, in which case rank 0 fsyncs and hashes
   every unclaimed file in step 3. This process remembers the hashes of the files it wrote,
   so verifying them again in this process (a resume) reads nothing. Any
   exception, ``BaseException`` subclasses such as DCP's ``CheckpointException`` included (but
   not ``KeyboardInterrupt``/``SystemExit``), is caught and returned as a failed result.
3. ``finish_directory_save(staging, final_dir, written, vote, step=..., extra_manifest=...)``:
   (a) every rank posts its result (its files' entries, or its error); rank 0 waits for all
   of them; if any rank failed, died or stalled, rank 0 removes the staging dir and every
   rank raises (the failing rank its own ``Exception``, or a ``RuntimeError`` chained to its
   ``BaseException``; the others a ``CheckpointVoteError`` naming the rank and its error).
   (b) rank 0 runs ``finalize_directory``: it writes ``manifest.json`` (files with size,
   digest and the writing ``rank``, step, versions, ``world_size`` and the caller's
   ``extra_manifest``, e.g. the strategy), renames the staging dir to ``final_dir``, fsyncs
   the parent and updates ``last_checkpoint``. (c) rank 0 posts the outcome, so a failed
   commit also raises on every rank; the previous checkpoint and pointer are unchanged.

Load, ``verify_directory(path)`` then the backend's own reader: the manifest is read first
(none: ``CheckpointCorruptError``, the directory was never committed); every listed file's
size is checked on every rank and its digest by one rank (at the same world size, the rank
that wrote it; otherwise files are dealt round-robin; so the ranks hash in parallel); a
missing or altered file raises on every rank naming the file.
Every rank must also see the same manifest. Retention of whole directories is
``apply_retention``'s, which already treats a directory with a manifest as one checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ._fs import TEMP_RE
from .commit import finalize_directory, new_staging_dir
from .digest import HASH_ALGO, entry_digest, file_entry, hash_file
from .errors import CheckpointCorruptError, CheckpointWarning
from .manifest import (
    DIR_MANIFEST,
    _identity,
    check_extra_manifest,
    read_manifest,
    remember_verified,
    verify_file,
)
from .rank_errors import _all_ok, _raise_first, describe_error
from .vote import CheckpointVoteError, SaveVote

__all__ = [
    'begin_directory_save',
    'write_directory_files',
    'finish_directory_save',
    'save_directory',
    'verify_directory',
    'DirectoryWriteResult',
]

PathLike = str | os.PathLike
WriteFn = Callable[[Path], 'Iterable[PathLike | dict] | None']
_NOT_CAUGHT = (KeyboardInterrupt, SystemExit, GeneratorExit)


@dataclass
class DirectoryWriteResult:
    """What step 2 returns on one rank: the files it hashed, or the error it hit."""

    files: list[dict] = field(default_factory=list)
    error: BaseException | None = None

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


def begin_directory_save(final_dir: PathLike, vote: SaveVote | None = None) -> Path:
    """Step 1: rank 0 creates a staging dir beside ``final_dir`` and hands it to the others
    through ``vote`` (required under a process group); every rank returns its path."""
    _check_vote(vote, 'begin_directory_save')
    if vote is not None and vote.rank != 0:
        shared = json.loads(vote.receive('staging'))
        if 'error' in shared:
            vote.concluded = True  # rank 0 gave up: there is nothing to vote on
            raise RuntimeError(
                f'creating the staging directory for {final_dir} failed on '
                f'rank 0: {shared["error"]}'
            )
        return Path(shared['staging'])
    try:
        path = new_staging_dir(final_dir)
    except Exception as err:
        if vote is not None:
            vote.publish('staging', json.dumps({'error': describe_error(err)}))
            vote.concluded = True
        raise
    if vote is not None:
        vote.publish('staging', json.dumps({'staging': os.fspath(path)}))
    return path


def write_directory_files(staging: PathLike, write_fn: WriteFn) -> DirectoryWriteResult:
    """Step 2 (this rank only): run ``write_fn(staging)``; fsync and hash the files it returns.

    Never raises for a failed write (the error is returned, so step 3 can tell every rank).
    """
    staging = Path(staging)
    try:
        written = write_fn(staging)
        if written is None:
            return DirectoryWriteResult()
        return DirectoryWriteResult(files=[_hash_written(staging, p) for p in written])
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
) -> Path:
    """Step 3: post this rank's result, rank 0 commits, everyone learns the outcome
    (``vote``: required under a process group). Returns the committed directory's absolute
    path on every rank."""
    _check_vote(vote, 'finish_directory_save')
    staging = Path(staging)
    what = f'saving checkpoint directory {final_dir}'
    if vote is None:
        try:
            if not written.ok:
                _raise_own(written.error, what)  # type: ignore[arg-type]
            return _commit(
                staging, final_dir, [written.files], 1, step, extra_manifest, update_pointer
            )
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    vote.ready(
        None if written.ok else describe_error(written.error),  # type: ignore[arg-type]
        json.dumps(written.files) if written.ok else None,
    )
    if vote.rank != 0:
        if not written.ok:
            vote.concluded = True  # rank 0 learns it from the vote; close() acknowledges
            _raise_own(written.error, what)  # type: ignore[arg-type]
        vote.wait_outcome()
        return staging.parent / TEMP_RE.match(staging.name)['final']  # type: ignore[index]  # rank 0's final name
    try:
        if not written.ok:
            try:
                vote.wait_others()  # a peer that died is named (it may be why this rank failed)
            except CheckpointVoteError as err:
                raise err from written.error
            _raise_own(written.error, what)  # type: ignore[arg-type]
        payloads = vote.wait_ready()
        final = _commit(
            staging,
            final_dir,
            [json.loads(p) for p in payloads],
            vote.world_size,
            step,
            extra_manifest,
            update_pointer,
        )
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        vote.post_outcome(str(err) if isinstance(err, CheckpointVoteError) else describe_error(err))
        raise
    vote.post_outcome(None)
    return final


def _raise_own(error: BaseException, what: str) -> None:
    if isinstance(error, Exception):
        raise error
    # a BaseException (DCP's CheckpointException) becomes an Exception, so that callers'
    # `except Exception` sees it on this rank as on the others
    from stratagem import env  # imported on use: see checkpoint/__init__.py

    raise RuntimeError(
        f'{what} failed on rank {env.get_rank()}: {describe_error(error)}'
    ) from error


def _commit(
    staging: Path,
    final_dir: PathLike,
    per_rank: list[list[dict]],
    world: int,
    step: int | None,
    extra_manifest: dict | None,
    update_pointer: bool,
) -> Path:
    known = [{**entry, 'rank': r} for r, files in enumerate(per_rank) for entry in files]
    return finalize_directory(
        staging,
        final_dir,
        step=step,
        update_pointer=update_pointer,
        known_files=known,
        extra_manifest={'world_size': world, **(extra_manifest or {})},
    )


def save_directory(
    final_dir: PathLike,
    write_fn: WriteFn,
    *,
    step: int | None = None,
    extra_manifest: dict | None = None,
    update_pointer: bool = True,
    vote: SaveVote | None = None,
    timeout: float = 600.0,
) -> Path:
    """Collective atomic save of a multi-file checkpoint; steps 1-3 of the module docstring.

    Args:
        final_dir: the checkpoint directory's final path (must be the same on every rank;
            rank 0's is used).
        write_fn: ``write_fn(staging: Path)``, run on every rank, writes this rank's files
            into ``staging`` and returns the paths it wrote (fsynced and hashed by this rank)
            or None (rank 0 then fsyncs and hashes them). It must not write ``manifest.json``.
        step: training step (or epoch) recorded in the manifest; orders checkpoints.
        extra_manifest: JSON-able extras for the manifest (e.g. ``{'strategy': 'FSDP...'}``);
            ``world_size`` is added for you.
        update_pointer: point ``last_checkpoint`` at the new directory.
        vote: this save's ``SaveVote`` (a strategy's, opened for the whole save); by default
            one is opened (and closed) here under a process group, every rank in the same
            order, with ``timeout``: seconds a rank may show no sign of life before the
            others give up on the save, naming it.

    Returns:
        The committed directory's absolute path, on every rank.
    """
    if step is not None and (type(step) is not int or step < 0):
        raise TypeError(f'step must be a non-negative int or None, got {step!r}')
    check_extra_manifest(extra_manifest)
    own = SaveVote.open(timeout, f'saving {final_dir}') if vote is None else None
    vote = vote or own
    try:
        staging = begin_directory_save(final_dir, vote)
        written = write_directory_files(staging, write_fn)
        return finish_directory_save(
            staging,
            final_dir,
            written,
            vote,
            step=step,
            extra_manifest=extra_manifest,
            update_pointer=update_pointer,
        )
    finally:
        if own is not None:
            own.close()


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
    if collective and not _all_ok(error is not None, digest):
        outcomes = env.all_gather_object(mine)
    _raise_first(
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
