"""Agreeing on a checkpoint name across ranks (step 1 of the save protocol).

``torch.distributed`` is used only when a process group is initialised; a single process gets
its own argument back, so callers need no branch.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def agree_on_path(path: str | os.PathLike | None, *, src: int = 0, group: Any = None) -> Path:
    """Return ``src``'s ``path`` on every rank (a broadcast); other ranks may pass None.

    Without an initialised process group this returns ``Path(path)``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if path is None:
            raise ValueError('agree_on_path(None) outside a process group: pass the path')
        return Path(path)
    box = [os.fspath(path) if path is not None else None]
    dist.broadcast_object_list(box, src=src, group=group)
    if box[0] is None:
        raise ValueError(f'agree_on_path: rank {src} passed None; the source rank must pass '
                         f'the path')
    return Path(box[0])


class CheckpointNotShared(RuntimeError):
    """The checkpoint rank 0 chose is missing or different on another rank (raised on all)."""


_PROBE = 1 << 16  # bytes hashed at each end of a file that has no manifest


def checkpoint_identity(path: str | os.PathLike) -> dict:
    """What makes ``path`` the same checkpoint on every node, cheaply.

    A file with a manifest: its size and the manifest's digest (no read of the file). A
    directory checkpoint: the sha256 of its ``manifest.json`` (which lists every file's hash).
    A foreign file (no manifest): its size and a digest of its first and last 64 KiB. Raises
    ``FileNotFoundError`` / ``OSError`` when ``path`` cannot be read.
    """
    import hashlib

    from .manifest import DIR_MANIFEST, entry_digest, find_manifest

    p = Path(path).absolute()
    if p.is_dir():
        data = (p / DIR_MANIFEST).read_bytes() if (p / DIR_MANIFEST).is_file() else \
            repr(sorted((f.name, f.stat().st_size) for f in p.iterdir())).encode()
        return {'kind': 'directory', 'digest': hashlib.sha256(data).hexdigest()}
    size = os.stat(p).st_size
    found = find_manifest(p)
    if found is not None:
        return {'kind': 'file', 'size': size, 'digest': ':'.join(entry_digest(found[1]))}
    digest = hashlib.sha256()
    with open(p, 'rb') as file:
        digest.update(file.read(_PROBE))
        if size > _PROBE:
            file.seek(max(_PROBE, size - _PROBE))
            digest.update(file.read(_PROBE))
    return {'kind': 'file', 'size': size, 'probe': digest.hexdigest()}


def agree_on_checkpoint(path: str | os.PathLike | None, *, what: str = 'checkpoint',
                        group: Any = None) -> Path | None:
    """Rank 0's choice of checkpoint, checked to be the same file on every rank.

    1. Rank 0 makes its ``path`` absolute and takes its :func:`checkpoint_identity`; both are
       broadcast (None: there is nothing to load, and every rank gets None).
    2. Every rank takes the identity of that same absolute path.
    3. The results are gathered. If any rank cannot read the path or sees different bytes,
       :class:`CheckpointNotShared` is raised on every rank, naming the rank, its host, the
       path and the fix, before anything is loaded. Otherwise the path is returned.

    Other ranks' ``path`` is ignored. Without a process group (or with one process) this only
    checks that ``path`` exists.
    """
    import socket

    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and \
        dist.get_world_size(group) > 1
    rank = dist.get_rank(group) if distributed else 0
    choice = None
    if rank == 0 and path is not None:
        target = Path(path).absolute()
        try:
            choice = (os.fspath(target), checkpoint_identity(target), None)
        except OSError as err:
            choice = (os.fspath(target), None, _reason(err))
    if distributed:
        box = [choice]
        dist.broadcast_object_list(box, src=0, group=group)
        choice = box[0]
    if choice is None:
        return None
    target, expected, error0 = choice
    mine: tuple[str, str | None] = (socket.gethostname(), error0 if rank == 0 else None)
    if rank != 0:
        try:
            seen = checkpoint_identity(target)
            if seen != expected:
                mine = (mine[0], f'sees different bytes there ({_describe(seen)}; rank 0 sees '
                                 f'{_describe(expected)})')
        except OSError as err:
            mine = (mine[0], _reason(err))
    views = [mine]
    if distributed:
        views = [None] * dist.get_world_size(group)
        dist.all_gather_object(views, mine, group=group)
    bad = [(r, host, err) for r, (host, err) in enumerate(views) if err is not None]
    if bad:
        r, host, err = bad[0]
        others = f' (and {len(bad) - 1} more rank(s))' if len(bad) > 1 else ''
        if r == 0:
            raise FileNotFoundError(f'{what} {target}: {err}') if 'no such' in err else \
                CheckpointNotShared(f'{what} {target} cannot be read on rank 0: {err}')
        raise CheckpointNotShared(
            f'rank {r} (host {host}){others} cannot use the {what} that rank 0 (host '
            f'{views[0][0]}) chose, {target}: {err}. Every rank must read the same '
            f'{what}: put work_dir on a filesystem that all nodes share, or copy the '
            'checkpoint to this same path on every node and pass it explicitly (stratagem '
            "train --resume PATH, or strategy.resume('PATH')). Nothing was loaded or written.")
    return Path(target)


def _reason(err: OSError) -> str:
    if isinstance(err, FileNotFoundError):
        return 'no such file or directory'
    return f'{type(err).__name__}: {err}'


def _describe(identity: dict | None) -> str:
    if not identity:
        return 'nothing'
    parts = [f'{k} {str(v)[:12]}' for k, v in identity.items() if k != 'kind']
    return ', '.join(parts)
