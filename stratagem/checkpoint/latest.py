"""Finding the checkpoint to resume from: the ``last_checkpoint`` pointer, then a scan.

The pointer is mmengine's: a text file ``last_checkpoint`` in the work directory whose content
is the checkpoint's path (we write it absolute, without a newline). Fallbacks are reported with
``warnings.warn(..., CheckpointWarning)``, on global rank 0 only (every rank would say the
same), so tests can assert them and a host trainer can route
them to its logger (``logging.captureWarnings``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import _fs
from .errors import CheckpointWarning
from .location import is_url
from .manifest import (
    DIR_MANIFEST,
    SIDECAR_SUFFIX,
    ManifestOrder,
    read_manifest,
    verify_checkpoint,
)

#: the name of the file in a work directory that names its latest committed checkpoint
POINTER_NAME = 'last_checkpoint'
_POINTER_MAX_BYTES = 4096


@dataclass(frozen=True)
class CheckpointInfo(ManifestOrder):
    """A checkpoint whose manifest is present (not yet hash-verified)."""

    path: Path
    manifest: dict


def update_pointer(directory: str | os.PathLike, checkpoint: str | os.PathLike) -> Path:
    """Point ``directory/last_checkpoint`` at ``checkpoint`` (absolute path) by temp + rename."""
    pointer = Path(directory).absolute() / POINTER_NAME
    _fs.write_atomic(pointer, os.fsencode(Path(checkpoint).absolute()))
    _fs.fsync_dir(pointer.parent)
    return pointer


class PendingPointer:
    """``update_pointer`` in two halves, so the new pointer's fsync joins the caller's
    (``_fs.fsync_together``): ``temp`` holds the new content now (a temp name: never read,
    removed by retention if a crash leaves it), ``commit()`` renames it into place once the
    checkpoint it names is committed, ``discard()`` removes it when that fails."""

    def __init__(self, directory: str | os.PathLike, checkpoint: str | os.PathLike) -> None:
        self.pointer = Path(directory).absolute() / POINTER_NAME
        self.temp = _fs.temp_name(self.pointer)
        _fs.write_new(self.temp, os.fsencode(Path(checkpoint).absolute()))

    def commit(self) -> Path:
        """Rename the (fsynced) temp file over the pointer; the rename is made durable on a
        helper thread (``_fs.fsync_dir_soon``): the save does not wait for a second fsync of
        the directory, and a power cut before it leaves the pointer on the previous
        checkpoint, which is complete."""
        os.replace(self.temp, self.pointer)
        _fs.fsync_dir_soon(self.pointer.parent)
        return self.pointer

    def discard(self) -> None:
        _fs.unlink_quietly(self.temp)


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """Checkpoints in ``directory`` (not recursive) that have a readable manifest and whose
    files exist, newest first (by manifest step, then creation time). Nothing is hashed."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        return []
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith('.'):  # temp names and hidden files are never committed
                continue
            if entry.is_dir(follow_symlinks=False):
                mfile = Path(entry.path) / DIR_MANIFEST
            elif entry.name.endswith(SIDECAR_SUFFIX) or entry.name == POINTER_NAME:
                continue
            else:
                mfile = Path(entry.path + SIDECAR_SUFFIX)
            try:
                manifest = read_manifest(mfile)
            except (ValueError, OSError):
                continue
            if manifest is not None:
                found.append(CheckpointInfo(Path(entry.path), manifest))
    found.sort(key=CheckpointInfo.sort_key, reverse=True)
    return found


def read_pointer(directory: str | os.PathLike) -> Path | None:
    """The path in ``directory/last_checkpoint`` (resolved like mmengine), or None if there is
    no pointer. Raises ValueError if the pointer is not a plausible path."""
    directory = Path(directory).absolute()
    pointer = directory / POINTER_NAME
    try:
        raw = pointer.read_bytes()
    except FileNotFoundError:
        return None
    text = raw[: _POINTER_MAX_BYTES + 1].decode('utf-8', errors='replace').strip()
    if (
        not text
        or len(raw) > _POINTER_MAX_BYTES
        or '\n' in text
        or '\x00' in text
        or '\ufffd' in text
    ):
        raise ValueError(f'{pointer} does not hold a checkpoint path: {text[:80]!r}')
    if is_url(text):  # mmengine's out_dir: the store's own pointer and scan decide there
        raise ValueError(
            f'{pointer} names {text}, a checkpoint at a URL: a resume with that out_dir (or '
            'load_or_resume(checkpoint_dir=...)) finds it there'
        )
    target = Path(text)
    name = target.name
    if (
        not name
        or name in ('.', '..', POINTER_NAME)
        or name.endswith(SIDECAR_SUFFIX)
        or _fs.is_temp_name(name)
        or target.absolute() == directory
    ):
        raise ValueError(f'{pointer} does not name a checkpoint: {text[:80]!r}')
    # A work dir copied elsewhere keeps a pointer to the old location: the same name here wins.
    local = directory / target.name
    if target.parent != directory and local.exists():
        return local
    if target.is_absolute():
        return target
    # mmengine writes the path relative to the launch directory; try that, then the work dir.
    return target.absolute() if target.exists() else directory / target


def _plausible_foreign(path: Path) -> bool:
    """A manifest-less pointer target is accepted only if it looks like a torch.save file."""
    if not path.is_file():
        return False
    with open(path, 'rb') as file:
        head = file.read(4)
    return head == b'PK\x03\x04' or (len(head) > 0 and head[0] == 0x80)


def find_latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from in ``directory``, or None if there is none.

    1. Follow ``last_checkpoint``. If its target has a manifest and verifies (size + sha256),
       return it. If it exists without a manifest (written by mmengine or plain ``torch.save``)
       return it too: ``load_checkpoint_file`` will warn that it cannot be verified.
    2. Otherwise (no pointer, garbage, target missing or corrupt) warn with
       ``CheckpointWarning`` and return the newest committed checkpoint that verifies, trying
       them newest first and hashing only until one passes (each failure also warns).
    """
    from stratagem import env  # imported on use: see checkpoint/__init__.py

    directory = Path(directory).absolute()
    if not directory.is_dir():
        return None
    rejected: set[Path] = set()
    reason = None
    try:
        target = read_pointer(directory)
    except (ValueError, OSError) as err:
        target, reason = None, f'{err}'
    if target is not None:
        try:
            if verify_checkpoint(target) is None and not _plausible_foreign(target):
                raise ValueError(
                    f'{target} is not a checkpoint (no manifest, and not a torch.save file)'
                )
            return target
        except FileNotFoundError:
            reason = f'{directory / POINTER_NAME} points to {target}, which does not exist'
        except ValueError as err:  # CheckpointCorruptError
            reason = f'{directory / POINTER_NAME} points to a damaged checkpoint: {err}'
        rejected.add(target)
    candidates = [c for c in list_checkpoints(directory) if c.path not in rejected]
    if reason is None and candidates:
        reason = f'{directory / POINTER_NAME} is missing'
    for candidate in candidates:
        try:
            verify_checkpoint(candidate.path)
        except (ValueError, OSError) as err:
            env.warn_rank_zero(
                f'skipping checkpoint {candidate.path}: {err}', CheckpointWarning, stacklevel=2
            )
            continue
        env.warn_rank_zero(
            f'{reason}; resuming from the newest committed checkpoint '
            f'{candidate.path} (step {candidate.step})',
            CheckpointWarning,
            stacklevel=2,
        )
        return candidate.path
    if reason is not None:
        env.warn_rank_zero(
            f'{reason}, and {directory} holds no other committed checkpoint',
            CheckpointWarning,
            stacklevel=2,
        )
    return None
