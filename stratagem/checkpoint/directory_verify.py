"""Verifying a committed directory checkpoint before anything reads it: every listed file's
size on every rank, its digest on one rank (the ranks hash in parallel), the same manifest
everywhere; a missing or altered file raises on every rank, naming it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from .errors import CheckpointCorruptError, CheckpointWarning
from .manifest import DIR_MANIFEST, read_manifest, verify_file
from .rank_errors import _all_ok, _raise_first, describe_error

__all__ = ['verify_directory']

PathLike = str | os.PathLike


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
