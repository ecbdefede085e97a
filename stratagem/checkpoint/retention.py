"""Deleting old checkpoints, and the debris of crashed saves. Only what we wrote is touched:
committed checkpoints with a stratagem manifest, and entries with our temp-name pattern."""

from __future__ import annotations

import fnmatch
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from . import _fs
from .latest import list_checkpoints, read_pointer
from .manifest import SIDECAR_SUFFIX, read_manifest


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

    Also removes debris of crashed saves: temp entries named ``.{name}.tmp-{pid}-{rand}`` (not
    of this process) and sidecar manifests whose file is missing, when last modified before
    ``stale_before`` (a ``time.time()`` value; default: the creation time of the newest
    committed checkpoint, which no save still in flight can predate).

    Args:
        directory: the checkpoint directory (not recursive).
        max_keep_ckpts: how many checkpoints to keep; ``<= 0`` keeps all (mmengine's -1).
        protect: checkpoints never to delete.
        pattern: only checkpoints whose name matches this glob (e.g. ``'epoch_*.pth'``) are
            counted and deleted, so ``best_*.pth`` in the same directory are kept.
        stale_before: see above.

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
    if stale_before is not None:
        removed += _remove_debris(directory, stale_before)
    return removed


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


def _delete_checkpoint(path: Path) -> None:
    if path.is_dir():
        # Rename first: a crash mid-rmtree then leaves a temp entry, not a half checkpoint.
        doomed = _fs.temp_name(path)
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        return
    # The file before its manifest: a crash between leaves an orphan manifest (removed as
    # debris later), never a committed-looking file without one.
    _fs.unlink_quietly(path)
    _fs.unlink_quietly(path.with_name(path.name + SIDECAR_SUFFIX))


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
        pid = _fs.temp_pid(entry.name)
        if pid is not None:
            if pid == me or _pid_alive(pid) or _newest_mtime(path) >= stale_before:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path, ignore_errors=True)
            else:
                _fs.unlink_quietly(path)
            removed.append(path)
        elif entry.name.endswith(SIDECAR_SUFFIX):
            target = entry.name[: -len(SIDECAR_SUFFIX)]
            if target in live_targets or _newest_mtime(path) >= stale_before:
                continue  # a live save wrote it and is about to rename its file into place
            if _is_orphan_manifest(path):
                _fs.unlink_quietly(path)
                removed.append(path)
    return removed


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
