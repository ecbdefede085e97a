"""The cosine family of the generic chainable schedulers (mmengine semantics).

Owns :class:`CosineAnnealingParamScheduler` (SGDR without restarts) and
:class:`CosineRestartParamScheduler` (with restarts), and their shared minimum
(``_eta_min``: ``eta_min`` or ``base * eta_min_ratio``). As in
``stratagem.scheduler.param_scheduler``, every ``_get_value`` is chainable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from stratagem.registry import PARAM_SCHEDULERS

from .base import INF, SchedulerArgumentError, _ParamScheduler
from .helpers import _check_positive_int

__all__ = ['CosineAnnealingParamScheduler', 'CosineRestartParamScheduler']


def _eta_min(eta_min: float | None, eta_min_ratio: float | None, base: float) -> float:
    if eta_min_ratio is not None:
        return base * eta_min_ratio
    assert eta_min is not None  # the constructors set exactly one of the two
    return eta_min


@PARAM_SCHEDULERS.register_module()
class CosineAnnealingParamScheduler(_ParamScheduler):
    """Cosine annealing: ``m + (b - m) * (1 + cos(pi * t / T_max)) / 2`` where ``m`` is
    ``eta_min`` or ``b * eta_min_ratio`` (SGDR without restarts).

    Args:
        optimizer: Optimizer or optim wrapper.
        param_name: Param-group key to schedule.
        T_max: Steps of the half period; defaults to ``end - begin``.
        eta_min: Minimum value. Defaults to 0 when ``eta_min_ratio`` is not given.
        begin, end, last_step, by_epoch, verbose: See :class:`_ParamScheduler`.
        eta_min_ratio: Minimum as a fraction of each group's base value; give
            this or ``eta_min``, not both.
    """

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        T_max: int | None = None,
        eta_min: float | None = None,
        begin: int = 0,
        end: int = INF,
        last_step: int = -1,
        by_epoch: bool = True,
        verbose: bool = False,
        eta_min_ratio: float | None = None,
    ) -> None:
        if eta_min is None and eta_min_ratio is None:
            eta_min = 0.0
        if eta_min is not None and eta_min_ratio is not None:
            raise SchedulerArgumentError(
                f'{type(self).__name__}: give eta_min or eta_min_ratio, not both '
                f'(got eta_min={eta_min}, eta_min_ratio={eta_min_ratio})'
            )
        self.T_max = T_max or (end - begin)
        self.eta_min = eta_min
        self.eta_min_ratio = eta_min_ratio
        super().__init__(
            optimizer,
            param_name,
            begin=begin,
            end=end,
            last_step=last_step,
            by_epoch=by_epoch,
            verbose=verbose,
        )

    _epoch_args = ('T_max',)

    def _get_value(self) -> list:
        groups = self.optimizer.param_groups
        t, T, key = self.last_step, self.T_max, self.param_name
        if t == 0:
            return [g[key] for g in groups]
        out = []
        for base, g in zip(self.base_values, groups):
            m = _eta_min(self.eta_min, self.eta_min_ratio, base)
            if (t - 1 - T) % (2 * T) == 0:
                # the ratio form below divides by zero at the trough; step up instead
                out.append(g[key] + (base - m) * (1 - math.cos(math.pi / T)) / 2)
            else:
                out.append(
                    (1 + math.cos(math.pi * t / T))
                    / (1 + math.cos(math.pi * (t - 1) / T))
                    * (g[key] - m)
                    + m
                )
        return out


@PARAM_SCHEDULERS.register_module()
class CosineRestartParamScheduler(_ParamScheduler):
    """Cosine annealing with restarts: in period ``i`` (length ``periods[i]``, step ``s``
    inside it) the value is ``m + (b * w_i - m) * (1 + cos(pi * s / periods[i])) / 2``;
    after the last period it is left alone.

    Args:
        optimizer: Optimizer or optim wrapper.
        param_name: Param-group key to schedule.
        periods: Length of each cycle, in steps.
        restart_weights: Peak of each cycle as a fraction of the base value; one
            per period. Defaults to ``(1,)``.
        eta_min: Minimum value; give this or ``eta_min_ratio``.
        eta_min_ratio: Minimum as a fraction of each group's base value.
        begin, end, last_step, by_epoch, verbose: See :class:`_ParamScheduler`.
    """

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        periods: Sequence[int],
        restart_weights: Sequence[float] = (1,),
        eta_min: float | None = None,
        eta_min_ratio: float | None = None,
        begin: int = 0,
        end: int = INF,
        last_step: int = -1,
        by_epoch: bool = True,
        verbose: bool = False,
    ) -> None:
        name = type(self).__name__
        if (eta_min is None) == (eta_min_ratio is None):
            raise SchedulerArgumentError(
                f'{name}: give exactly one of eta_min and eta_min_ratio (got '
                f'eta_min={eta_min}, eta_min_ratio={eta_min_ratio})'
            )
        if len(periods) != len(restart_weights):
            raise SchedulerArgumentError(
                f'{name}: periods ({len(periods)} values) and restart_weights '
                f'({len(restart_weights)} values) must have the same length'
            )
        for p in periods:
            _check_positive_int(name, 'periods', p)
        self.periods = list(periods)
        self.restart_weights = list(restart_weights)
        self.eta_min = eta_min
        self.eta_min_ratio = eta_min_ratio
        self.cumulative_periods = [sum(self.periods[: i + 1]) for i in range(len(self.periods))]
        super().__init__(
            optimizer,
            param_name,
            begin=begin,
            end=end,
            last_step=last_step,
            by_epoch=by_epoch,
            verbose=verbose,
        )

    _epoch_args = ('periods',)

    def _rescale_derived(self, state: dict, ratio: Any) -> dict:
        periods = state['periods']
        return {**state, 'cumulative_periods': [sum(periods[: i + 1]) for i in range(len(periods))]}

    @staticmethod
    def get_position_from_periods(iteration: int, cumulative_periods: list[int]) -> int | None:
        """Index of the first cumulative period end beyond ``iteration``, or None."""
        for i, period in enumerate(cumulative_periods):
            if iteration < period:
                return i
        return None

    def _get_value(self) -> list:
        groups = self.optimizer.param_groups
        idx = self.get_position_from_periods(self.last_step, self.cumulative_periods)
        if idx is None:
            return [g[self.param_name] for g in groups]
        weight = self.restart_weights[idx]
        step = self.last_step - (0 if idx == 0 else self.cumulative_periods[idx - 1])
        period = self.periods[idx]
        out = []
        for base, g in zip(self.base_values, groups):
            m = _eta_min(self.eta_min, self.eta_min_ratio, base)
            if step == 0:
                out.append(base * weight)
            else:
                out.append(
                    (1 + math.cos(math.pi * step / period))
                    / (1 + math.cos(math.pi * (step - 1) / period))
                    * (g[self.param_name] - m)
                    + m
                )
        return out
