"""Reduce a value when a validation metric stops improving (mmengine semantics).

Unlike the other schedulers it is driven by metrics: the loop calls
``step(metrics)`` after each validation (``need_val_args`` says so); a plain
``step()`` only counts an epoch, which is what ``begin``/``end`` are measured in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stratagem.registry import PARAM_SCHEDULERS

from .base import (
    INF,
    SchedulerArgumentError,
    _ParamScheduler,
    check_initial_values,
    check_window,
)
from .helpers import check_optimizer, raw_optimizer

__all__ = ['ReduceOnPlateauParamScheduler']


@PARAM_SCHEDULERS.register_module()
class ReduceOnPlateauParamScheduler(_ParamScheduler):
    """Multiply by ``factor`` after more than ``patience`` validations without improvement.

    Args:
        optimizer: Optimizer or optim wrapper.
        param_name: Param-group key to schedule.
        monitor: Key of the metric in the ``metrics`` dict. Defaults to ``'loss'``.
        rule: ``'less'`` (default; lower is better) or ``'greater'``.
        factor: Multiplier applied on a plateau, < 1. Defaults to 0.1.
        patience: Validations without improvement tolerated before reducing.
            Defaults to 10.
        threshold: Minimum change that counts as an improvement. Defaults to 1e-4.
        threshold_rule: ``'rel'`` (default; relative to the best) or ``'abs'``.
        cooldown: Validations to wait after a reduction before counting bad
            ones again. Defaults to 0.
        min_value: Lower bound, one for all groups or one per group. Defaults to 0.
        eps: Reductions smaller than this are skipped. Defaults to 1e-8.
        begin, end: Window in epochs (counted by plain ``step()`` calls).
        last_step, verbose: See :class:`_ParamScheduler`.
        by_epoch: Must be True (``SchedulerArgumentError``, a ValueError and an
            AssertionError as mmengine's assert raises, otherwise).
    """

    need_val_args = True

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        monitor: str = 'loss',
        rule: str = 'less',
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        threshold_rule: str = 'rel',
        cooldown: int = 0,
        min_value: float | Sequence[float] = 0.0,
        eps: float = 1e-8,
        begin: int = 0,
        end: int = INF,
        last_step: int = -1,
        by_epoch: bool = True,
        verbose: bool = False,
    ) -> None:
        name = type(self).__name__
        check_optimizer(optimizer, name)
        check_window(name, begin, end, last_step)
        if not by_epoch:
            raise SchedulerArgumentError(
                f'{name}: by_epoch must be True (it reacts to validation metrics, once per '
                'validation, and begin/end count epochs), got by_epoch=False; to react more '
                'often, validate more often (val_interval)'
            )
        if factor >= 1.0:
            raise ValueError(f'{name}: factor must be < 1, got {factor}')
        if threshold < 0:
            raise ValueError(f'{name}: threshold must be >= 0, got {threshold}')
        if rule not in ('less', 'greater'):
            raise ValueError(f"{name}: rule must be 'less' or 'greater', got {rule!r}")
        if threshold_rule not in ('rel', 'abs'):
            raise ValueError(
                f"{name}: threshold_rule must be 'rel' or 'abs', got {threshold_rule!r}"
            )
        self.optimizer = optimizer
        self.param_name = param_name
        self.begin, self.end, self.by_epoch, self.verbose = begin, end, by_epoch, verbose
        key = f'initial_{param_name}'
        if last_step == -1:
            for group in optimizer.param_groups:
                group.setdefault(key, group[param_name])
        else:
            check_initial_values(name, optimizer.param_groups, param_name, last_step)
        self.last_step = last_step
        # epochs counted by plain step() calls; no step is applied at construction
        self._global_step = 0
        self.factor = factor
        n_raw = len(raw_optimizer(optimizer).param_groups)
        if isinstance(min_value, (list, tuple)):
            if len(min_value) != n_raw:
                raise ValueError(
                    f'{name}: min_value has {len(min_value)} values but the '
                    f'optimizer has {n_raw} param groups'
                )
            self.min_values = list(min_value)
            # a wrapper may expose one extra group (its base settings): bound it like the last
            self.min_values += [self.min_values[-1]] * (len(optimizer.param_groups) - n_raw)
        else:
            self.min_values = [min_value] * len(optimizer.param_groups)
        self.monitor = monitor
        self.rule = rule
        self.threshold = threshold
        self.threshold_rule = threshold_rule
        self.patience = patience
        self.cooldown = cooldown
        self.eps = eps
        self.rule_worse = INF if rule == 'less' else -INF
        self.best: float = self.rule_worse
        self.cooldown_counter = 0
        self.num_bad_epochs = 0
        self._last_value = [g[param_name] for g in optimizer.param_groups]

    def rescaled_state_dict(self, state: dict, ratio: Any, done_iters: int) -> dict:
        """Epoch-based: unchanged. By iteration, patience and cooldown count iterations of
        validation, which a world-size change cannot convert: refused."""
        if state.get('by_epoch', self.by_epoch):
            return state
        raise ValueError(
            f'{type(self).__name__} stepped by iteration counts validations '
            '(patience, cooldown) in iterations, which cannot be converted to '
            'another world size'
        )

    def step(self, metrics: Mapping[str, Any] | None = None) -> None:
        """Count an epoch (no ``metrics``) or react to a validation result.

        Args:
            metrics: Validation results by name; must contain ``monitor``.
        """
        name = type(self).__name__
        if metrics is None:
            self._global_step += 1
            return
        if not isinstance(metrics, Mapping):
            raise TypeError(
                f'{name}: metrics must be a dict of name -> value, got {type(metrics).__name__}'
            )
        if self.begin <= self._global_step < self.end:
            if self.monitor not in metrics:
                raise KeyError(
                    f'{name}: monitor {self.monitor!r} is not in the metrics given '
                    f'to step(); got keys {sorted(metrics)}; set monitor= to one '
                    'of them'
                )
            self.last_step += 1
            # a 0-dim tensor would keep autograd/device state in self.best; read it once
            metric = float(metrics[self.monitor])
            if self._is_better(metric, self.best):
                self.best = metric
                self.num_bad_epochs = 0
            else:
                self.num_bad_epochs += 1
            if self.cooldown_counter > 0:
                self.cooldown_counter -= 1
                self.num_bad_epochs = 0  # bad epochs during cooldown do not count
            if self.num_bad_epochs > self.patience:
                for i, (group, value) in enumerate(
                    zip(self.optimizer.param_groups, self._get_value())
                ):
                    if group[self.param_name] - value > self.eps:
                        group[self.param_name] = value
                        self.print_value(self.verbose, i, value)
                self.cooldown_counter = self.cooldown
                self.num_bad_epochs = 0
        self._last_value = [g[self.param_name] for g in self.optimizer.param_groups]

    def _get_value(self) -> list:
        values = [float(g[self.param_name]) * self.factor for g in self.optimizer.param_groups]
        return [max(v, m) for v, m in zip(values, self.min_values)]

    def _is_better(self, a: float, best: float) -> bool:
        if self.rule == 'less':
            return a < (
                best * (1.0 - self.threshold)
                if self.threshold_rule == 'rel'
                else best - self.threshold
            )
        return a > (
            best * (1.0 + self.threshold) if self.threshold_rule == 'rel' else best + self.threshold
        )
