"""No orphan manifest under mmengine's runners: ``stratagem.CheckpointDebrisHook``.

mmengine's ``CheckpointHook`` deletes a checkpoint it replaces (the previous best of
``save_best``, one past ``max_keep_ckpts``) as a plain file, leaving the stratagem manifest
beside it. The hook, registered in mmengine's HOOKS by ``stratagem.integrations.mmengine``
and added by ``stratagem train`` to every config it runs under FlexibleRunner
(``mmengine_runner.runner_config``):

1. ``before_save_checkpoint``: a save is under way (the runner's ``save_checkpoint`` calls
   it through the strategy's save).
2. At the end of the hook point that saved (``after_train_iter``, ``after_train_epoch``,
   ``after_val_epoch``, ``after_train``; priority ``LOWEST``, after the ``CheckpointHook``):
   rank 0 sweeps ``work_dir`` and each ``CheckpointHook``'s ``out_dir`` with
   ``stratagem.checkpoint.sweep_debris``, whose rule removes only stratagem manifests whose
   file is gone and dead saves' temp entries, older than the newest commit; an ``out_dir``
   at a URL with ``store_debris.remove_debris`` (the same rule for a store's debris; never
   under the name of the hook's last save, which an asynchronous save may still upload).
"""

from __future__ import annotations

from typing import Any

from mmengine.hooks import CheckpointHook, Hook

from stratagem.checkpoint import sweep_debris
from stratagem.checkpoint.location import is_url
from stratagem.checkpoint.store_debris import remove_debris

from .mmengine_storage import storage_options

__all__ = ['CheckpointDebrisHook']


class CheckpointDebrisHook(Hook):
    """After each save, rank 0 sweeps the checkpoint directories (see module doc)."""

    priority = 'LOWEST'  # after the CheckpointHook's save of the same hook point

    def __init__(self) -> None:
        self._saved = False

    def before_save_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        self._saved = True

    def after_train_iter(
        self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None
    ) -> None:
        self._sweep(runner)

    def after_train_epoch(self, runner: Any) -> None:
        self._sweep(runner)

    def after_val_epoch(self, runner: Any, metrics: Any = None) -> None:
        self._sweep(runner)

    def after_train(self, runner: Any) -> None:
        self._sweep(runner)

    def _sweep(self, runner: Any) -> None:
        if not self._saved:
            return
        self._saved = False
        if getattr(runner, 'rank', 0) != 0:
            return
        dirs = {str(runner.work_dir)}
        urls: dict[str, tuple[dict | None, str, list[str]]] = {}
        for hook in runner.hooks:
            if isinstance(hook, CheckpointHook) and hook.out_dir:
                if is_url(str(hook.out_dir)):
                    # its checkpoints' names only: a LoggerHook may copy logs to the prefix
                    series = hook.filename_tmpl.replace('{}', '*')
                    options = storage_options({'backend_args': hook.backend_args})
                    last = [str(hook.last_ckpt)] if hook.last_ckpt else []
                    urls[str(hook.out_dir)] = (options, series, last)
                else:
                    dirs.add(str(hook.out_dir))
        for directory in sorted(dirs):
            sweep_debris(directory)
        for url, (options, series, last) in sorted(urls.items()):
            remove_debris(url, options, pattern=series, keep=last)
