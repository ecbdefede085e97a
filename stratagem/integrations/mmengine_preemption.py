"""Preemption for mmengine's runners: ``custom_hooks=[dict(type='stratagem.PreemptionHook')]``.

The hook is ``stratagem.env.preemption.Preemption`` in mmengine's hook points:

1. ``before_train``: the signal handlers are installed (the runner runs in the main thread).
2. ``after_train_iter``: ``should_stop(runner.iter + 1)`` (every rank the same iteration);
   when True: ``runner.save_checkpoint`` of ``iter_<n>.pth`` in ``work_dir`` (the strategy's
   save: every rank, the vote), pending asynchronous saves waited for, ``finish`` (Slurm
   requeue, the marker), and ``SystemExit(exit_code)``: an epoch-based loop has no way to
   stop in the middle of an epoch, and the job is to end anyway.
3. ``after_train`` (a run that ended normally) and any exit: the handlers are restored.

Resume the next run with ``resume=True`` (mmengine finds the newest checkpoint in work_dir).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmengine.hooks import Hook

from stratagem.env.preemption import DEFAULT_EXIT_CODE, DEFAULT_SIGNALS, Preemption

__all__ = ['PreemptionHook']


class PreemptionHook(Hook):
    """Save one checkpoint and exit on a preemption signal (see module doc).

    Args:
        signals: signal names that mean "preempted" (default SIGTERM, SIGUSR1).
        requeue: under Slurm, rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` after the save.
        exit_code: the process's exit status after the save (default 75).
        lead: iterations between the first signal and the stop (more than ranks drift apart
            between collectives: the accumulation window + 1).
    """

    priority = 'VERY_LOW'  # after the CheckpointHook: a regular save of the same iteration first

    def __init__(
        self,
        signals: Sequence[str] = DEFAULT_SIGNALS,
        requeue: bool = False,
        exit_code: int = DEFAULT_EXIT_CODE,
        lead: int = 2,
    ) -> None:
        self.preemption = Preemption(signals, requeue=requeue, exit_code=exit_code, lead=lead)
        self._entered = False

    def before_train(self, runner: Any) -> None:
        self.preemption.__enter__()
        self._entered = True

    def after_train_iter(
        self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None
    ) -> None:
        done = runner.iter + 1
        if not self.preemption.should_stop(done):
            return
        filename = f'iter_{done}.pth'
        runner.save_checkpoint(runner.work_dir, filename, by_epoch=False)
        wait = getattr(runner.strategy, 'wait_for_checkpoints', None)
        if callable(wait):
            wait()
        self.preemption.finish(
            runner.work_dir, f'{runner.work_dir}/{filename}', getattr(runner, 'rank', 0)
        )
        runner.logger.warning(
            f'preempted by {self.preemption.received}: {filename} committed; exit status '
            f'{self.preemption.exit_code}'
        )
        self._leave()
        raise SystemExit(self.preemption.exit_code)

    def after_train(self, runner: Any) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._entered:
            self._entered = False
            self.preemption.__exit__(None, None, None)
