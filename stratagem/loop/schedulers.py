"""The parameter schedulers' three kinds of steps, as mmengine's ParamSchedulerHook takes them:
iteration-based ones after every iteration, epoch-based ones after an epoch's last iteration,
metric-driven ones (ReduceOnPlateau: ``need_val_args``) with each validation's values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ['Schedulers', 'monitor_problem']


def monitor_problem(where: str, monitor: Any, names: Any) -> str | None:
    """Why a metric-driven scheduler at ``where`` would fail at the first validation (None when
    it would not): its ``monitor`` is none of the validation's ``names``. ``train`` checks it
    before its first step (:meth:`Schedulers.check_monitors`), ``stratagem doctor`` too."""
    names = list(names)
    if monitor in names:
        return None
    return (
        f"{where}: monitor {monitor!r} is not a validation value: the model's validation "
        f'output has {names}; set monitor= to one of them'
    )


class Schedulers:
    """``schedulers``: what ``strategy.prepare`` built (a list, or a dict of lists per
    optimizer); ``epoch_length``: iterations per epoch."""

    def __init__(self, schedulers: Any, epoch_length: int) -> None:
        if isinstance(schedulers, Mapping):
            self.all = [s for v in schedulers.values() for s in v]
        else:
            self.all = list(schedulers or [])
        self.epoch_length = epoch_length

    def after_step(self, it: int, updated: bool = True) -> None:
        """After iteration ``it`` (1-based): the iteration-based ones (unless its update was
        dropped: ``updated=False``, ``train_cfg.anomaly``), then, at an epoch's end, the
        epoch-based ones."""
        for s in self.all:
            if updated and not s.by_epoch:
                s.step()
        if it % self.epoch_length == 0:
            for s in self.all:
                if s.by_epoch:
                    s.step()

    def check_monitors(self, names: Any) -> None:
        """Every metric-driven scheduler's ``monitor`` against the names validation returns
        (from the forward at the start): a ValueError before the first step."""
        for i, s in enumerate(self.all):
            if getattr(s, 'need_val_args', False) and hasattr(s, 'monitor'):
                problem = monitor_problem(f'{type(s).__name__} (scheduler {i})', s.monitor, names)
                if problem is not None:
                    raise ValueError(problem)

    def after_validation(self, values: Mapping[str, float]) -> None:
        """The metric-driven ones, with the validation's means."""
        for s in self.all:
            if getattr(s, 'need_val_args', False):
                s.step(values)
