"""The generic chainable schedulers of any param-group value (mmengine semantics).

Every ``_get_value`` computes the next value from the *current* one, so that
overlapping schedulers compose; when a scheduler is alone, its values are the
closed forms given in each docstring (``b`` is the base value, ``t`` the step
counted from ``begin``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from stratagem.registry import PARAM_SCHEDULERS

from .base import INF, SchedulerArgumentError, _ParamScheduler

__all__ = [
    'StepParamScheduler',
    'MultiStepParamScheduler',
    'ConstantParamScheduler',
    'ExponentialParamScheduler',
    'CosineAnnealingParamScheduler',
    'LinearParamScheduler',
    'PolyParamScheduler',
    'CosineRestartParamScheduler',
]


def _check_factor(owner: str, arg: str, value: float) -> None:
    if not 0 <= value <= 1:
        raise ValueError(f'{owner}: {arg} must be in [0, 1], got {value!r}')


def _check_positive_int(owner: str, arg: str, value: Any) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f'{owner}: {arg} must be a positive int, got {value!r}')


@PARAM_SCHEDULERS.register_module()
class StepParamScheduler(_ParamScheduler):
    """Multiply by ``gamma`` every ``step_size`` steps: ``b * gamma ** (t // step_size)``.

    Args:
        optimizer: Optimizer or optim wrapper.
        param_name: Param-group key to schedule.
        step_size: Period of the decay, in steps (epochs if ``by_epoch``).
        gamma: Multiplicative decay. Defaults to 0.1.
        begin, end, last_step, by_epoch, verbose: See :class:`_ParamScheduler`.
    """

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        step_size: int | float,
        gamma: float = 0.1,
        begin: int = 0,
        end: int = INF,
        last_step: int = -1,
        by_epoch: bool = True,
        verbose: bool = False,
    ) -> None:
        if isinstance(step_size, float) and step_size.is_integer():
            step_size = int(step_size)  # mmengine accepts 2.0 for 2
        _check_positive_int(type(self).__name__, 'step_size', step_size)
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(
            optimizer,
            param_name,
            begin=begin,
            end=end,
            last_step=last_step,
            by_epoch=by_epoch,
            verbose=verbose,
        )

    _epoch_args = ('step_size',)

    def _get_value(self) -> list:
        groups = self.optimizer.param_groups
        if self.last_step == 0 or self.last_step % self.step_size != 0:
            return [g[self.param_name] for g in groups]
        return [g[self.param_name] * self.gamma for g in groups]


@PARAM_SCHEDULERS.register_module()
class MultiStepParamScheduler(_ParamScheduler):
    """Multiply by ``gamma`` at each milestone: ``b * gamma ** #{m in milestones: m <= t}``.

    A milestone listed twice decays twice (mmengine semantics).

    Args:
        optimizer: Optimizer or optim wrapper.
        param_name: Param-group key to schedule.
        milestones: Steps (epochs if ``by_epoch``) at which to decay; sorted.
        gamma: Multiplicative decay. Defaults to 0.1.
        begin, end, last_step, by_epoch, verbose: See :class:`_ParamScheduler`.
    """

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        milestones: Sequence[int],
        gamma: float = 0.1,
        last_step: int = -1,
        begin: int = 0,
        end: int = INF,
        by_epoch: bool = True,
        verbose: bool = False,
    ) -> None:
        milestones = list(milestones)
        if milestones != sorted(milestones):
            raise ValueError(
                f'{type(self).__name__}: milestones must be sorted in increasing '
                f'order, got {milestones}; did you mean {sorted(milestones)}?'
            )
        # a plain dict (step -> count), not a Counter, so that state dicts load weights_only
        self.milestones = dict(Counter(milestones))
        self.gamma = gamma
        super().__init__(
            optimizer,
            param_name,
            begin=begin,
            end=end,
            last_step=last_step,
            by_epoch=by_epoch,
            verbose=verbose,
        )

    _epoch_args = ('milestones',)

    def _get_value(self) -> list:
        groups = self.optimizer.param_groups
        count = self.milestones.get(self.last_step, 0)
        if not count:
            return [g[self.param_name] for g in groups]
        return [g[self.param_name] * self.gamma**count for g in groups]


@PARAM_SCHEDULERS.register_module()
class ConstantParamScheduler(_ParamScheduler):
    """Multiply by ``factor`` until step ``end - 1``, then restore: ``b * factor`` for
    ``t < end - begin - 1``, ``b`` afterwards (mmengine/torch ``ConstantLR`` semantics).

    Args:
        optimizer: Optimizer or optim wrapper.
        param_name: Param-group key to schedule.
        factor: Multiplier in [0, 1] applied during the window. Defaults to 1/3.
        begin, end, last_step, by_epoch, verbose: See :class:`_ParamScheduler`.
    """

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        factor: float = 1.0 / 3,
        begin: int = 0,
        end: int = INF,
        last_step: int = -1,
        by_epoch: bool = True,
        verbose: bool = False,
    ) -> None:
        _check_factor(type(self).__name__, 'factor', factor)
        self.factor = factor
        self.total_iters = end - begin - 1
        super().__init__(
            optimizer,
            param_name,
            begin=begin,
            end=end,
            last_step=last_step,
            by_epoch=by_epoch,
            verbose=verbose,
        )

    def _get_value(self) -> list:
        groups = self.optimizer.param_groups
        if self.last_step == 0:
            return [g[self.param_name] * self.factor for g in groups]
        if self.last_step != self.total_iters:
            return [g[self.param_name] for g in groups]
        return [g[self.param_name] * (1.0 / self.factor) for g in groups]


@PARAM_SCHEDULERS.register_module()
class ExponentialParamScheduler(_ParamScheduler):
    """Multiply by ``gamma`` every step: ``b * gamma ** t``.

    Args:
        optimizer: Optimizer or optim wrapper.
        param_name: Param-group key to schedule.
        gamma: Multiplicative decay per step.
        begin, end, last_step, by_epoch, verbose: See :class:`_ParamScheduler`.
    """

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        gamma: float,
        begin: int = 0,
        end: int = INF,
        last_step: int = -1,
        by_epoch: bool = True,
        verbose: bool = False,
    ) -> None:
        self.gamma = gamma
        super().__init__(
            optimizer,
            param_name,
            begin=begin,
            end=end,
            last_step=last_step,
            by_epoch=by_epoch,
            verbose=verbose,
        )

    def _get_value(self) -> list:
        groups = self.optimizer.param_groups
        if self.last_step == 0:
            return [g[self.param_name] for g in groups]
        return [g[self.param_name] * self.gamma for g in groups]


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
class LinearParamScheduler(_ParamScheduler):
    """Linear factor from ``start_factor`` to ``end_factor`` over the window:
    ``b * (s + (e - s) * t / (end - begin - 1))``, held at ``e`` after.

    Args:
        optimizer: Optimizer or optim wrapper.
        param_name: Param-group key to schedule.
        start_factor: Factor at the first step, in [0, 1]. Defaults to 1/3.
        end_factor: Factor at the last step of the window, in [0, 1]. Defaults to 1.
        begin, end, last_step, by_epoch, verbose: See :class:`_ParamScheduler`.
    """

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        start_factor: float = 1.0 / 3,
        end_factor: float = 1.0,
        begin: int = 0,
        end: int = INF,
        last_step: int = -1,
        by_epoch: bool = True,
        verbose: bool = False,
    ) -> None:
        _check_factor(type(self).__name__, 'start_factor', start_factor)
        _check_factor(type(self).__name__, 'end_factor', end_factor)
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = end - begin - 1
        super().__init__(
            optimizer,
            param_name,
            begin=begin,
            end=end,
            last_step=last_step,
            by_epoch=by_epoch,
            verbose=verbose,
        )

    def _get_value(self) -> list:
        groups = self.optimizer.param_groups
        s, e = self.start_factor, self.end_factor
        if self.last_step == 0:
            return [g[self.param_name] * s for g in groups]
        ratio = 1.0 + (e - s) / (self.total_iters * s + (self.last_step - 1) * (e - s))
        return [g[self.param_name] * ratio for g in groups]


@PARAM_SCHEDULERS.register_module()
class PolyParamScheduler(_ParamScheduler):
    """Polynomial decay to ``eta_min`` at the last step of the window:
    ``(b - eta_min) * (1 - t / (end - begin - 1)) ** power + eta_min``.

    Args:
        optimizer: Optimizer or optim wrapper.
        param_name: Param-group key to schedule.
        eta_min: Value at the end. Defaults to 0.
        power: Power of the polynomial. Defaults to 1.
        begin, end, last_step, by_epoch, verbose: See :class:`_ParamScheduler`.
    """

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        eta_min: float = 0,
        power: float = 1.0,
        begin: int = 0,
        end: int = INF,
        last_step: int = -1,
        by_epoch: bool = True,
        verbose: bool = False,
    ) -> None:
        self.eta_min = eta_min
        self.power = power
        self.total_iters = end - begin - 1
        super().__init__(
            optimizer,
            param_name,
            begin=begin,
            end=end,
            last_step=last_step,
            by_epoch=by_epoch,
            verbose=verbose,
        )

    def _get_value(self) -> list:
        groups = self.optimizer.param_groups
        if self.last_step == 0:
            return [g[self.param_name] for g in groups]
        ratio = (1 - 1 / (self.total_iters - self.last_step + 1)) ** self.power
        return [(g[self.param_name] - self.eta_min) * ratio + self.eta_min for g in groups]


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
