"""The generic chainable schedulers of any param-group value (mmengine semantics).

Every ``_get_value`` computes the next value from the *current* one, so that
overlapping schedulers compose; when a scheduler is alone, its values are the
closed forms given in each docstring (``b`` is the base value, ``t`` the step
counted from ``begin``).

This module owns the step, multi-step, constant, exponential, linear and polynomial
schedulers; the cosine family (annealing, restarts) is ``stratagem.scheduler.cosine``'s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from stratagem.registry import PARAM_SCHEDULERS

from .base import INF, _ParamScheduler
from .helpers import _check_factor, _check_positive_int

__all__ = [
    'StepParamScheduler',
    'MultiStepParamScheduler',
    'ConstantParamScheduler',
    'ExponentialParamScheduler',
    'LinearParamScheduler',
    'PolyParamScheduler',
]


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
