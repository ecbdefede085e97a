"""mmengine's ``CheckpointHook(out_dir='s3://...', backend_args=...)`` under ``FlexibleRunner``
on stratagem's strategies: the checkpoints at any fsspec URL, committed as ``stratagem
train``'s reference loop commits them (``checkpoint/location.py``).

mmengine maps ``s3://`` to its Petrel (Ceph) client, and nothing to ``gs://``. So:

1. :class:`FsspecBackend`, a file backend of mmengine's ``fileio`` registered under the name
   ``'stratagem_fsspec'`` (no URL prefix of mmengine's is taken over): joins, tests and
   deletes paths in an fsspec filesystem whose storage options are the ``backend_args``
   without ``backend``. A deletion removes the object, then its manifest (a kill between
   leaves a manifest listing nothing, never a checkpoint without its manifest).
2. :class:`FsspecCheckpointHook` (``stratagem.FsspecCheckpointHook`` in mmengine's HOOKS):
   mmengine's ``CheckpointHook`` reaching a URL ``out_dir`` through that backend.
3. :func:`use_fsspec_for_urls` (``mmengine_runner.runner_config`` calls it): a
   ``CheckpointHook`` whose ``out_dir`` is a URL (and whose ``backend_args`` name no
   backend of mmengine's) becomes that hook; with ``resume=True`` (no path), the newest
   committed checkpoint at ``out_dir/<the work_dir's last component>`` becomes the one
   resumed (``load_from``), so an empty work_dir on a new machine resumes from the bucket
   alone, as in the reference loop.
4. :func:`storage_options` gives the strategy's checkpointer those options
   (``mmengine_runner.train_with_flexible_runner``, before the runner resumes), so the
   strategy's own upload and verified load reach the same store.

A ``FlexibleRunner`` built without ``stratagem train`` gets the same by naming the hook:
``default_hooks=dict(checkpoint=dict(type='stratagem.FsspecCheckpointHook', out_dir=...))``
and, for options beyond the environment's, ``runner.strategy.checkpointer.backend_args``.

The strategy writes the ``last_checkpoint`` pointer beside the checkpoints in ``out_dir``;
mmengine's hook writes the one in the local work_dir. The debris of interrupted uploads is
removed after each save (``mmengine_debris.py``, ``store_debris.remove_debris``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mmengine.fileio import BaseStorageBackend, FileClient, get_file_backend, register_backend
from mmengine.hooks import CheckpointHook

from stratagem.checkpoint import location
from stratagem.checkpoint.manifest import SIDECAR_SUFFIX

__all__ = [
    'BACKEND_NAME',
    'FsspecBackend',
    'FsspecCheckpointHook',
    'storage_options',
    'use_fsspec_for_urls',
]

BACKEND_NAME = 'stratagem_fsspec'


class FsspecBackend(BaseStorageBackend):
    """mmengine's storage-backend interface over an fsspec filesystem (``s3://``, ``gs://``,
    ``memory://``, ...); the constructor's keyword arguments are its storage options."""

    def __init__(self, **storage_options: Any) -> None:
        self.storage_options = storage_options

    def _fs(self, filepath: str | Path) -> tuple[Any, str]:
        return location.filesystem(str(filepath), self.storage_options)

    def get(self, filepath: str | Path) -> bytes:
        fs, path = self._fs(filepath)
        with location.store_errors(str(filepath), 'reading'):
            return bytes(fs.cat_file(path))

    def get_text(self, filepath: str | Path, encoding: str = 'utf-8') -> str:
        return self.get(filepath).decode(encoding)

    def put(self, obj: bytes, filepath: str | Path) -> None:
        fs, path = self._fs(filepath)
        with location.store_errors(str(filepath), 'saving'):
            fs.pipe_file(path, obj)

    def put_text(self, obj: str, filepath: str | Path, encoding: str = 'utf-8') -> None:
        self.put(obj.encode(encoding), filepath)

    def exists(self, filepath: str | Path) -> bool:
        fs, path = self._fs(filepath)
        fs.invalidate_cache(path)
        with location.store_errors(str(filepath), 'reading'):
            return bool(fs.exists(path))

    def isdir(self, filepath: str | Path) -> bool:
        fs, path = self._fs(filepath)
        fs.invalidate_cache(path)
        with location.store_errors(str(filepath), 'reading'):
            return bool(fs.isdir(path))

    def isfile(self, filepath: str | Path) -> bool:
        fs, path = self._fs(filepath)
        fs.invalidate_cache(path)
        with location.store_errors(str(filepath), 'reading'):
            return bool(fs.isfile(path))

    def join_path(self, filepath: str | Path, *filepaths: str | Path) -> str:
        joined = str(filepath)
        for part in filepaths:
            joined = location.join(joined, str(part))
        return joined

    def remove(self, filepath: str | Path) -> None:
        """The object, then its manifest (see the module docstring)."""
        fs, path = self._fs(filepath)
        with location.store_errors(str(filepath), 'deleting'):
            for target in (path, path + SIDECAR_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(target)

    def rmtree(self, dir_path: str | Path) -> None:
        fs, path = self._fs(dir_path)
        with location.store_errors(str(dir_path), 'deleting'):
            fs.rm(path, recursive=True)

    @contextlib.contextmanager
    def get_local_path(self, filepath: str | Path) -> Iterator[str]:
        fs, path = self._fs(filepath)
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, os.path.basename(path))
            with location.store_errors(str(filepath), 'reading'):
                fs.get_file(path, local)
            yield local

    def list_dir_or_file(
        self,
        dir_path: str | Path,
        list_dir: bool = True,
        list_file: bool = True,
        suffix: str | tuple[str, ...] | None = None,
        recursive: bool = False,
    ) -> Iterator[str]:
        fs, path = self._fs(dir_path)
        root = path.rstrip('/')
        with location.store_errors(str(dir_path), 'listing'):
            found = fs.find(root, withdirs=list_dir, detail=True) if recursive else None
            entries = found or {e['name']: e for e in fs.ls(root, detail=True)}
        for name, entry in sorted(entries.items()):
            relative = name[len(root) :].lstrip('/')
            is_dir = entry.get('type') == 'directory'
            if (is_dir and list_dir) or (
                not is_dir and list_file and (suffix is None or relative.endswith(suffix))
            ):
                yield relative


register_backend(BACKEND_NAME, FsspecBackend, force=True)
FileClient.register_backend(BACKEND_NAME, FsspecBackend, force=True)


class FsspecCheckpointHook(CheckpointHook):
    """mmengine's ``CheckpointHook``, its ``out_dir`` at an fsspec URL reached through
    :class:`FsspecBackend` (a local ``out_dir``: mmengine's hook unchanged).

    mmengine's ``before_train`` builds the deprecated ``FileClient`` for ``out_dir``'s
    prefix before anything else, and that table has no fsspec entry (``s3`` is Petrel's,
    ``gs`` nothing), so for that call the client is named by ``file_client_args``; every
    other use goes through ``backend_args`` (``backend='stratagem_fsspec'``)."""

    def before_train(self, runner: Any) -> None:
        if not location.is_url(str(self.out_dir)):
            super().before_train(runner)
            return
        options: dict = dict(getattr(self, 'backend_args', None) or {})
        self.backend_args = {'backend': BACKEND_NAME, **options}
        hook: Any = self  # mmengine types these attributes narrower than it uses them
        hook.file_client_args = dict(self.backend_args)
        try:
            super().before_train(runner)
        finally:
            hook.file_client_args = None
        self.file_backend = get_file_backend(self.out_dir, backend_args=self.backend_args)


def storage_options(hook_cfg: Mapping) -> dict | None:
    """The fsspec storage options of a ``CheckpointHook`` cfg's URL ``out_dir``: its
    ``backend_args`` without ``backend``; None when it has none (the environment's)."""
    options = {k: v for k, v in dict(hook_cfg.get('backend_args') or {}).items() if k != 'backend'}
    return options or None


def use_fsspec_for_urls(cfg: dict, resume: bool | str) -> None:
    """Point the config's ``CheckpointHook`` with a URL ``out_dir`` at :class:`FsspecBackend`,
    and with ``resume=True`` resume from the newest committed checkpoint there (the module
    docstring, 2). Changes ``cfg`` in place."""
    hook = dict((cfg.get('default_hooks') or {}).get('checkpoint') or {})
    out_dir = hook.get('out_dir')
    if not isinstance(out_dir, str) or not location.is_url(out_dir):
        return
    backend_args = dict(hook.get('backend_args') or {})
    if backend_args.get('backend', BACKEND_NAME) != BACKEND_NAME:
        return  # the user chose one of mmengine's backends (petrel): theirs
    if hook.get('type', 'CheckpointHook') not in ('CheckpointHook', CheckpointHook):
        return  # a hook of the user's own
    hook['type'] = f'stratagem.{FsspecCheckpointHook.__name__}'
    cfg['default_hooks'] = {**dict(cfg['default_hooks']), 'checkpoint': hook}
    if resume is True and cfg.get('load_from') is None:
        from stratagem.loop.plan import CheckpointPlan

        # mmengine's CheckpointHook names the folder after the runner's work_dir (the top
        # level's), not the strategy's
        directory = CheckpointPlan(out_dir=out_dir).directory(str(cfg.get('work_dir', 'work_dirs')))
        latest = location.find_latest(directory, storage_options(hook))
        if latest is not None:
            cfg['load_from'] = latest
