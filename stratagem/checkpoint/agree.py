"""Agreeing on the checkpoint to load across ranks: rank 0's choice, the same bytes on
every rank (``agree_on_checkpoint``; step 2 of docs/architecture.md, 'Load and resume').

``torch.distributed`` is used only when a process group is initialised; a single process gets
its own argument back, so callers need no branch.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from .errors import CheckpointLocationError, CheckpointNotShared
from .location import absolute, is_url

_PROBE = 1 << 16  # bytes hashed at each end of a file that has no manifest
_STORE_ERROR = f'{CheckpointLocationError.__name__}: '


def checkpoint_identity(path: str | os.PathLike) -> dict:
    """What makes ``path`` the same checkpoint on every node, cheaply.

    A file with a manifest: its size and the manifest's digest (no read of the file). A
    directory checkpoint: the sha256 of its ``manifest.json`` (which lists every file's hash).
    A foreign file (no manifest): its size and a digest of its first and last 64 KiB. Raises
    ``FileNotFoundError`` / ``OSError`` when ``path`` cannot be read.
    """
    import hashlib

    from .digest import entry_digest
    from .manifest import DIR_MANIFEST, find_manifest

    p = Path(path).absolute()
    if p.is_dir():
        data = (
            (p / DIR_MANIFEST).read_bytes()
            if (p / DIR_MANIFEST).is_file()
            else repr(sorted((f.name, f.stat().st_size) for f in p.iterdir())).encode()
        )
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


def agree_on_checkpoint(
    path: str | os.PathLike | None,
    *,
    what: str = 'checkpoint',
    group: Any = None,
    backend_args: Any = None,
) -> Path | str | None:
    """Rank 0's choice of checkpoint, checked to be the same file on every rank.

    1. Every rank makes its ``path`` absolute and takes its :func:`checkpoint_identity` (or
       notes why it cannot). One small collective (``all_gather_keys``) compares them: when
       every rank names the same path, sees the same bytes and can read them, that path is
       the answer. Otherwise they are gathered in full; rank 0's path is the choice (None:
       there is nothing to load, and every rank gets None).
    2. A rank whose own path is another one (or None) takes the identity of rank 0's path
       in a second round (rare: ranks normally pass the same path).
    3. If any rank cannot read the path or sees different bytes, :class:`CheckpointNotShared`
       is raised on every rank, naming the rank, its host, the path and the fix, before
       anything is loaded. Otherwise the path is returned.

    Without a process group (or with one process) this only checks that ``path`` exists.
    A URL (``location.is_url``) is returned as a ``str``, its identity read from the store
    (``backend_args``: the filesystem's storage options).
    """
    import socket

    from stratagem import env  # imported on use: see checkpoint/__init__.py

    distributed = env.get_world_size(group) > 1
    host = socket.gethostname()
    # host, absolute path, identity, why it cannot be read
    mine: tuple[str, str | None, dict | None, str | None] = (host, None, None, None)
    if path is not None:
        mine = (host, *_look(path, backend_args))
    views = [mine]
    if distributed:
        # the common case in one small collective: every rank names the same readable path
        # and sees the same bytes there; anything else is gathered in full to be reported
        keys = env.all_gather_keys(
            [env.key_of(mine[1]), env.key_of(mine[2]), int(mine[3] is not None)], group
        )
        if all(k == keys[0] for k in keys) and keys[0][2] == 0:
            return None if mine[1] is None else _as_target(mine[1])
        views = env.all_gather_object(mine, group)
    _, target, expected, error0 = views[0]
    if target is None:
        return None
    if any(view[1] != target for view in views):  # round 2: those ranks look at rank 0's
        if views[env.get_rank(group)][1] != target:
            mine = (host, *_look(target, backend_args))
        views = env.all_gather_object(mine, group)
        views[0] = (views[0][0], target, expected, error0)
    problems = [(host, error0)] + [
        (
            h,
            err
            if err is not None
            else None
            if seen == expected
            else f'sees different bytes there ({_describe(seen)}; '
            f'rank 0 sees {_describe(expected)})',
        )
        for h, _, seen, err in views[1:]
    ]
    bad = [(r, h, err) for r, (h, err) in enumerate(problems) if err is not None]
    if bad:
        r, h, err = bad[0]
        others = f' (and {len(bad) - 1} more rank(s))' if len(bad) > 1 else ''
        if r == 0 and err.startswith(_STORE_ERROR):  # the store's own message names the fix
            raise CheckpointLocationError(errno.EIO, err[len(_STORE_ERROR) :])
        if r == 0:
            raise (
                FileNotFoundError(f'{what} {target}: {err}')
                if 'no such' in err
                else CheckpointNotShared(f'{what} {target} cannot be read on rank 0: {err}')
            )
        raise CheckpointNotShared(
            f'rank {r} (host {h}){others} cannot use the {what} that rank 0 (host '
            f'{problems[0][0]}) chose, {target}: {err}. Every rank must read the same '
            f'{what}: put work_dir on a filesystem that all nodes share, or copy the '
            'checkpoint to this same path on every node and pass it explicitly (stratagem '
            "train --resume PATH, or strategy.resume('PATH')). Nothing was loaded or written."
        )
    return _as_target(target)


def _as_target(target: str) -> Path | str:
    """The agreed checkpoint: a local path, or a URL kept as its text."""
    return target if is_url(target) else Path(target)


def _look(target: str | os.PathLike, backend_args: Any) -> tuple[str, dict | None, str | None]:
    """``(absolute path, identity, None)``, or ``(path, None, why it cannot be read)``."""
    text = absolute(target)
    try:
        if is_url(text):
            from .remote_directory import remote_identity

            return text, remote_identity(text, backend_args), None
        return text, checkpoint_identity(text), None
    except OSError as err:
        return text, None, _reason(err)


def _reason(err: OSError) -> str:
    if isinstance(err, FileNotFoundError):
        return 'no such file or directory'
    return f'{type(err).__name__}: {err}'


def _describe(identity: dict | None) -> str:
    if not identity:
        return 'nothing'
    parts = [f'{k} {str(v)[:12]}' for k, v in identity.items() if k != 'kind']
    return ', '.join(parts)
