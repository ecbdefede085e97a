"""Deleting old checkpoints, and the debris of crashed saves. Only what we wrote is touched:
committed checkpoints with a stratagem manifest, and entries with our temp-name pattern.

Deleting a checkpoint (``apply_retention``), each step a single rename or unlink, so that a kill
between any two leaves nothing that looks like something else:

1. Rename it to a trash name ``.{name}.trash-{pid}-{rand}`` (a directory: the whole
   directory). It is now gone for ``list_checkpoints``, ``find_latest_checkpoint`` and
   ``previous_run_traces`` (hidden names) in one atomic step.
2. A single file: unlink its sidecar manifest (a kill before this leaves an orphan manifest,
   which names no file and is never listed as a checkpoint).
3. Remove the trash entry (``rmtree`` for a directory).

Never the other order: a checkpoint file whose manifest went first would look like a foreign
(mmengine) checkpoint, which we must never delete, and ``previous_run_traces`` would show it.

Sweeping debris (``sweep_debris``; also the end of every ``apply_retention``, and a run's start
in ``BaseStrategy.load_or_resume``) removes trash entries, temp entries (files and staging
directories of ``single_file.py`` / ``directory.py``) and orphan manifests, by this rule:

- a trash entry always: it is a checkpoint already deleted, which no writer ever writes to
  (a second deleter racing on it is harmless);
- a temp entry whose pid (in its name) is this process or alive on this machine is never
  removed, however old: an async save of this process, or rank 0 of a live distributed save
  (the staging directory of a directory save is always named by rank 0, which also sweeps, so
  other ranks' files live under a name carrying rank 0's live pid);
- otherwise it is removed only if nothing in it was modified at or after ``stale_before``,
  by default the creation time of the newest committed checkpoint. A run's saves are
  sequential (an async save starts after the previous one committed), so a save still being
  written, on any host, has touched its staging entry after the newest commit; only entries
  of writers that stopped before that commit, i.e. dead ones, are older. (A pid says nothing
  about a writer on another machine sharing the filesystem; there the age alone protects it,
  and one run per work_dir is assumed.) With no committed checkpoint only trash is swept.
- an orphan manifest (a stratagem sidecar whose file is missing) is removed by the same age
  rule, and never while a live temp entry of its file exists (a save between its manifest and
  its rename: docs/architecture.md, 'Save', the file commit).

Never the newest committed checkpoint nor one in ``protect``: those are committed, and the
sweep only ever removes temp entries and orphan manifests.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path

from . import _fs
from .latest import list_checkpoints, read_pointer
from .manifest import SIDECAR_SUFFIX, read_manifest

TRASH_RE = re.compile(r'^\.(?P<final>.+)\.trash-(?P<pid>\d+)-[0-9a-f]{8}$')


def apply_retention(
    directory: str | os.PathLike,
    max_keep_ckpts: int,
    *,
    protect: Iterable[str | os.PathLike] = (),
    pattern: str | None = None,
    stale_before: float | None = None,
) -> list[Path]:
    """Delete committed checkpoints in ``directory`` beyond the newest ``max_keep_ckpts``.

    Call it only after the newest checkpoint is committed. Never deletes the newest, the one
    ``last_checkpoint`` points to, nor any path in ``protect`` (the one resumed from). Files
    without a stratagem manifest are never touched.

    Also removes debris of crashed saves and deletions (``sweep_debris``): temp entries named
    ``.{name}.tmp-{pid}-{rand}`` of dead writers and sidecar manifests whose file is missing,
    when last modified before ``stale_before`` (a ``time.time()`` value; default: the
    creation time of the newest committed checkpoint, which no save still in flight can
    predate). A kill while deleting leaves only such debris (module docstring).

    Args:
        directory: the checkpoint directory (not recursive).
        max_keep_ckpts: how many checkpoints to keep; ``<= 0`` keeps all (mmengine's -1).
        protect: checkpoints never to delete.
        pattern: only checkpoints whose name matches this glob (e.g. ``'epoch_*.pth'``) are
            counted and deleted, so ``best_*.pth`` in the same directory are kept.
        stale_before: see above and ``sweep_debris``.

    Returns:
        The paths removed (checkpoints and debris), for logging.
    """
    if type(max_keep_ckpts) is not int:
        raise TypeError(f'max_keep_ckpts must be an int (<= 0 keeps all), got {max_keep_ckpts!r}')
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise NotADirectoryError(f'checkpoint directory not found: {directory}')
    committed = list_checkpoints(directory)
    if stale_before is None:
        stale_before = max((c.created for c in committed), default=None)
    removed = _remove_old(directory, committed, max_keep_ckpts, protect, pattern)
    return removed + _remove_debris(directory, -math.inf if stale_before is None else stale_before)


def _remove_old(
    directory: Path, committed: list, max_keep: int, protect: Iterable, pattern: str | None
) -> list[Path]:
    if max_keep <= 0:
        return []
    series = [c for c in committed if pattern is None or fnmatch.fnmatch(c.path.name, pattern)]
    keep = {c.path for c in series[:max_keep]}
    keep.update(Path(p).absolute() for p in protect)
    try:
        pointed = read_pointer(directory)
    except (ValueError, OSError):
        pointed = None
    if pointed is not None:
        keep.add(pointed.absolute())
    removed = []
    for info in series[max_keep:]:
        if info.path in keep or info.path.resolve() in {p.resolve() for p in keep}:
            continue
        _delete_checkpoint(info.path)
        removed.append(info.path)
    return removed


def delete_checkpoint(
    path: str | os.PathLike, *, protect: Iterable[str | os.PathLike] = ()
) -> bool:
    """Delete one committed checkpoint by the steps of the module docstring (a replaced best
    checkpoint). Refused (False, nothing touched) for a file without a stratagem manifest,
    for the one ``last_checkpoint`` points to and for any path in ``protect`` (the one resumed
    from); True once deleted."""
    path = Path(path).absolute()
    if not any(info.path == path for info in list_checkpoints(path.parent)):
        return False
    try:
        pointed = read_pointer(path.parent)
    except (ValueError, OSError):
        pointed = None
    kept = [Path(p).absolute().resolve() for p in protect]
    if pointed is not None:
        kept.append(pointed.absolute().resolve())
    if path.resolve() in kept:
        return False
    _delete_checkpoint(path)
    return True


def _delete_checkpoint(path: Path) -> None:
    # Steps 1-3 of the module docstring: rename away, then the manifest, then the temp entry;
    # after the pointer's last rename is durable (it may name the checkpoint kept instead).
    _fs.wait_soon()
    doomed = path.with_name(f'.{path.name}.trash-{os.getpid()}-{secrets.token_hex(4)}')
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return
    if not doomed.is_dir():
        _fs.unlink_quietly(path.with_name(path.name + SIDECAR_SUFFIX))
        _fs.unlink_quietly(doomed)
        return
    shutil.rmtree(doomed, ignore_errors=True)


def sweep_debris(directory: str | os.PathLike, *, stale_before: float | None = None) -> list[Path]:
    """Remove the debris of dead saves in ``directory``: temp entries and orphan manifests,
    by the rule of this module's docstring; committed checkpoints are never touched.

    Args:
        directory: the checkpoint directory (not recursive); a missing one holds nothing.
        stale_before: a ``time.time()`` value; only debris untouched since before it goes.
            Default: the creation time of the newest committed checkpoint (none: only trash
            is swept).

    Returns:
        The paths removed, for logging.
    """
    directory = Path(directory).absolute()
    if not directory.is_dir():
        return []
    if stale_before is None:
        stale_before = max((c.created for c in list_checkpoints(directory)), default=None)
    return _remove_debris(directory, -math.inf if stale_before is None else stale_before)


def _remove_debris(directory: Path, stale_before: float) -> list[Path]:
    """Temp entries of dead writers and orphan sidecars, last modified before ``stale_before``.

    A temp entry whose writer (the pid in its name) is alive on this machine is never
    removed, however old: a sharded save can write into its staging directory for long.
    Directories are aged by the newest mtime anywhere inside them. (On a filesystem shared
    between machines a pid says nothing about another machine's writer; there only the age
    protects it.)
    """
    removed = []
    me = os.getpid()
    with os.scandir(directory) as scan:
        entries = list(scan)
    live_targets = {
        m['final']
        for e in entries
        if (m := _fs.TEMP_RE.match(e.name)) and _pid_alive(int(m['pid']))
    }
    for entry in entries:
        path = Path(entry.path)
        if TRASH_RE.match(entry.name):
            _remove(entry, path)
            removed.append(path)
            continue
        pid = _fs.temp_pid(entry.name)
        if pid is not None:
            if pid == me or _pid_alive(pid) or _newest_mtime(path) >= stale_before:
                continue
            _remove(entry, path)
            removed.append(path)
        elif entry.name.endswith(SIDECAR_SUFFIX):
            target = entry.name[: -len(SIDECAR_SUFFIX)]
            if target in live_targets or _newest_mtime(path) >= stale_before:
                continue  # a live save wrote it and is about to rename its file into place
            if _is_orphan_manifest(path):
                _fs.unlink_quietly(path)
                removed.append(path)
    return removed


def _remove(entry: os.DirEntry, path: Path) -> None:
    if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(path, ignore_errors=True)
    else:
        _fs.unlink_quietly(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's), or we cannot tell: keep its files
    return True


def _newest_mtime(path: Path) -> float:
    try:
        newest = path.stat(follow_symlinks=False).st_mtime
    except OSError:
        return float('inf')  # vanished or unreadable: not ours to judge now
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    newest = max(
                        newest, os.stat(os.path.join(root, name), follow_symlinks=False).st_mtime
                    )
                except OSError:
                    continue
    return newest


def _is_orphan_manifest(path: Path) -> bool:
    target = path.with_name(path.name[: -len(SIDECAR_SUFFIX)])
    if target.exists():
        return False
    try:
        return read_manifest(path) is not None  # only manifests we wrote
    except (ValueError, OSError):
        return False
