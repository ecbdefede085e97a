"""What the disk can take: the free space a save needs, checked before anything is written,
and a filesystem failure while writing (full, quota, I/O error, read-only) turned into a
``CheckpointWriteError`` naming the file, the cause and, for a full disk, the space needed
and free."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import torch

from stratagem._torch import local_shard

from .errors import CheckpointWriteError

# zip headers, pickle stream, alignment padding and the manifest, on top of the tensor bytes
OVERHEAD_BYTES = 1 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_WRITE_ERRNOS = _FULL_ERRNOS + (errno.EIO, errno.EROFS)


def payload_bytes(obj: Any) -> int:
    """Bytes of tensor storage that ``torch.save(obj)`` writes (each storage once, whole; of
    a DTensor, this rank's shard's)."""
    seen: dict[tuple, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = local_shard(item).untyped_storage()
            seen[(item.device, storage.data_ptr())] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
    return sum(seen.values())


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem that holds, or will
    hold, ``path`` (its nearest existing folder's: a first save creates the folders)."""
    while not path.is_dir() and path.parent != path:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_free_space(final: Path, needed: int) -> None:
    """Raise ``CheckpointWriteError`` (ENOSPC) if ``final``'s filesystem has less than
    ``needed`` bytes free; called before anything of a save is written."""
    try:
        free = free_bytes(final.parent)
    except OSError:
        return  # statvfs unsupported here: the write itself will tell
    if free < needed:
        raise CheckpointWriteError(
            errno.ENOSPC,
            _full_message(final, needed, free)
            + '; nothing was written: free space or lower max_keep_ckpts',
        )


def _full_message(path: Path, needed: int, free: int) -> str:
    return (
        f'no space left on device writing {path} (needed ~{needed / 2**20:.0f} MB, free '
        f'{free / 2**20:.0f} MB)'
    )


def write_error(err: OSError, path: Path, needed: int | None = None) -> OSError:
    """The error to raise for ``err`` while writing checkpoint ``path``: a filesystem failure
    (full, quota, EIO, read-only) becomes ``CheckpointWriteError`` naming the path and the
    cause; anything else is returned as it is."""
    if isinstance(err, CheckpointWriteError) or err.errno not in _WRITE_ERRNOS:
        return err
    cause = os.strerror(err.errno)
    if err.errno in _FULL_ERRNOS:
        try:
            free = free_bytes(path.parent)
        except OSError:
            free = 0
        message = (
            _full_message(path, needed or 0, free)
            if err.errno == errno.ENOSPC
            else f'{cause.lower()} writing {path} (needed ~{(needed or 0) / 2**20:.0f} MB, '
            f'free {free / 2**20:.0f} MB)'
        )
    else:
        message = f'{cause} writing {path} (errno {errno.errorcode.get(err.errno, err.errno)})'
    return CheckpointWriteError(err.errno, message + '; the previous checkpoint is unchanged')
