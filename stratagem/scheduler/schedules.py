"""Schedules as pure functions of training progress (the fvcore/detectron2 design).

A :class:`Schedule` maps ``where`` in [0, 1) (the fraction of training done) to a
value, usually a multiplier of the base learning rate. Schedules hold no
optimizer and no step counter, so they need no state; :class:`LRMultiplier`
(in ``multiplier.py``) turns one into an optimizer scheduler.

Porting fvcore / detectron2 code: fvcore's ``XParamScheduler`` (``fvcore.common.
param_scheduler``) is ``XSchedule`` here, because mmengine owns the ``*ParamScheduler``
names (``stratagem.scheduler.StepParamScheduler`` is mmengine's optimizer scheduler, not
fvcore's schedule): ``ConstantParamScheduler`` → :class:`ConstantSchedule`,
``CosineParamScheduler`` → :class:`CosineSchedule`, ``StepParamScheduler`` →
:class:`StepSchedule`, ``MultiStepParamScheduler`` → :class:`MultiStepSchedule`, and so on
(``CompositeParamScheduler`` → :class:`CompositeSchedule`; detectron2's
``WarmupParamScheduler`` → :class:`WarmupSchedule`). Arguments and values are fvcore's,
and so are the exceptions a schedule evaluated outside its range raises, so ported code that
catches them keeps working: ``RuntimeError`` from the constant and multi-step schedules
(``where`` ≥ 1, resp. > 1), ``IndexError`` from the step schedules at their end (``where``
≥ 1: detectron2's guard against an ``LRMultiplier`` stepped past ``max_iter``). Both are
also ``ValueError`` and say what is wrong; nothing is clamped.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

__all__ = [
    'ScheduleRangeError',
    'ScheduleEndedError',
    'Schedule',
    'ConstantSchedule',
    'CosineSchedule',
    'ExponentialSchedule',
    'LinearSchedule',
    'MultiStepSchedule',
    'PolynomialDecaySchedule',
    'StepSchedule',
    'StepWithFixedGammaSchedule',
    'CompositeSchedule',
    'WarmupSchedule',
]


class ScheduleRangeError(ValueError, RuntimeError):
    """``where`` outside a schedule's range: the ``RuntimeError`` fvcore raises, and a
    ``ValueError``."""


class ScheduleEndedError(ValueError, IndexError):
    """A step schedule evaluated at or past its end: the ``IndexError`` fvcore's gives (its
    value list runs out), and a ``ValueError``."""


class Schedule:
    """A value as a function of progress ``where`` in [0, 1)."""

    # lets a boundary computed as k / n land on the right side despite rounding
    WHERE_EPSILON = 1e-6

    def __call__(self, where: float) -> float:
        raise NotImplementedError(f'{type(self).__name__} must implement __call__(where)')


class ConstantSchedule(Schedule):
    """Always ``value``."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, where: float) -> float:
        if where >= 1.0:
            raise ScheduleRangeError(f'ConstantSchedule: where must be in [0, 1), got {where}')
        return self.value


class CosineSchedule(Schedule):
    """Half cosine from ``start_value`` (where=0) to ``end_value`` (where=1)."""

    def __init__(self, start_value: float, end_value: float) -> None:
        self.start_value = start_value
        self.end_value = end_value

    def __call__(self, where: float) -> float:
        return self.end_value + 0.5 * (self.start_value - self.end_value) * (
            1 + math.cos(math.pi * where)
        )


class ExponentialSchedule(Schedule):
    """``start_value * decay ** where``."""

    def __init__(self, start_value: float, decay: float) -> None:
        self.start_value = start_value
        self.decay = decay

    def __call__(self, where: float) -> float:
        return self.start_value * self.decay**where


class LinearSchedule(Schedule):
    """Straight line from ``start_value`` (where=0) to ``end_value`` (where=1)."""

    def __init__(self, start_value: float, end_value: float) -> None:
        self.start_value = start_value
        self.end_value = end_value

    def __call__(self, where: float) -> float:
        return self.end_value * where + self.start_value * (1 - where)


class MultiStepSchedule(Schedule):
    """Piecewise constant: ``values[i]`` on the i-th range between milestones.

    Args:
        values: The value of each range; one more than the inner milestones.
        num_updates: Length of the whole schedule (same unit as milestones);
            None: the last entry of ``milestones``.
        milestones: Range boundaries (exclusive upper ends); None: split
            ``num_updates`` evenly. With ``num_updates`` given there are
            ``len(values) - 1`` of them, else ``len(values)``.

    ``MultiStepSchedule([1, .1, .01], num_updates=90, milestones=[30, 60])`` is 1
    for updates 0-29, 0.1 for 30-59 and 0.01 for 60-89.
    """

    def __init__(
        self,
        values: Sequence[float],
        num_updates: int | None = None,
        milestones: Sequence[int] | None = None,
    ) -> None:
        name = type(self).__name__
        if num_updates is None and milestones is None:
            raise ValueError(f'{name}: give num_updates or milestones (both are None)')
        if milestones is None:
            assert num_updates is not None  # both None raised above
            width = math.ceil(num_updates / float(len(values)))
            milestones = [width * (i + 1) for i in range(len(values) - 1)]
        else:
            want = len(values) - int(num_updates is not None)
            if len(milestones) != want:
                raise ValueError(
                    f'{name}: milestones must have {want} entries for '
                    f'{len(values)} values, got {list(milestones)}'
                )
            milestones = list(milestones)
        if num_updates is None:
            num_updates, milestones = milestones[-1], milestones[:-1]
        if num_updates < len(values):
            raise ValueError(
                f'{name}: num_updates ({num_updates}) must be at least the number '
                f'of values ({len(values)})'
            )
        start = 0
        for m in milestones:
            if m >= num_updates:
                raise ValueError(
                    f'{name}: milestone {m} must be smaller than num_updates ({num_updates})'
                )
            if m <= start:
                raise ValueError(
                    f'{name}: milestones must be increasing and positive, got {list(milestones)}'
                )
            start = m
        self.values = list(values)
        self.num_updates = num_updates
        self.milestones = milestones

    def __call__(self, where: float) -> float:
        if where > 1.0:
            raise ScheduleRangeError(f'{type(self).__name__}: where must be in [0, 1], got {where}')
        update = int((where + self.WHERE_EPSILON) * self.num_updates)
        return self.values[bisect.bisect_right(self.milestones, update)]


class PolynomialDecaySchedule(Schedule):
    """``base_value * (1 - where) ** power``."""

    def __init__(self, base_value: float, power: float) -> None:
        self.base_value = base_value
        self.power = power

    def __call__(self, where: float) -> float:
        return self.base_value * (1 - where) ** self.power


class StepSchedule(Schedule):
    """``values`` over equal slices of training: ``values[int(where * len(values))]``."""

    def __init__(self, num_updates: float, values: Sequence[float]) -> None:
        if num_updates <= 0:
            raise ValueError(f'StepSchedule: num_updates must be > 0, got {num_updates}')
        if not isinstance(values, Sequence) or len(values) == 0:
            raise ValueError(f'StepSchedule: values must be a non-empty list, got {values!r}')
        self.values = list(values)

    def __call__(self, where: float) -> float:
        index = int((where + self.WHERE_EPSILON) * len(self.values))
        if not 0 <= index < len(self.values):
            raise ScheduleEndedError(
                f'{type(self).__name__}: where must be in [0, 1), got {where}: the schedule '
                f'has {len(self.values)} values and ended (an LRMultiplier stepped past its '
                'max_iter? stop stepping at the last iteration or raise max_iter)'
            )
        return self.values[index]


class StepWithFixedGammaSchedule(Schedule):
    """``base_value`` decayed by ``gamma`` ``num_decays`` times at equal intervals.

    ``StepWithFixedGammaSchedule(0.1, num_decays=3, gamma=0.1, num_updates=120)``
    is 0.1, 0.01, 0.001, 0.0001 on quarters of training.
    """

    def __init__(self, base_value: float, num_decays: int, gamma: float, num_updates: int) -> None:
        name = type(self).__name__
        for arg, v in (('base_value', base_value), ('gamma', gamma)):
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f'{name}: {arg} must be a positive number, got {v!r}')
        for arg, v in (('num_decays', num_decays), ('num_updates', num_updates)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f'{name}: {arg} must be a positive int, got {v!r}')
        self.base_value, self.num_decays = base_value, num_decays
        self.gamma, self.num_updates = gamma, num_updates
        self._steps = StepSchedule(
            num_updates, [base_value * gamma**k for k in range(num_decays + 1)]
        )

    def __call__(self, where: float) -> float:
        try:
            return self._steps(where)
        except ScheduleEndedError as err:  # name this schedule, not its inner one
            raise ScheduleEndedError(
                str(err).replace('StepSchedule', type(self).__name__)
            ) from None


class CompositeSchedule(Schedule):
    """Schedules run one after another over fractions ``lengths`` of training.

    Args:
        schedulers: The schedules, in order.
        lengths: Fraction of training for each; they sum to 1.
        interval_scaling: Per schedule, ``'rescaled'`` (it sees its own
            progress, 0 to 1 over its slice) or ``'fixed'`` (it sees the global
            ``where``).
    """

    def __init__(
        self,
        schedulers: Sequence[Schedule],
        lengths: Sequence[float],
        interval_scaling: Sequence[str],
    ) -> None:
        name = type(self).__name__
        if len(schedulers) == 0:
            raise ValueError(f'{name}: schedulers is empty; give at least one schedule')
        if not len(schedulers) == len(lengths) == len(interval_scaling):
            raise ValueError(
                f'{name}: schedulers ({len(schedulers)}), lengths '
                f'({len(lengths)}) and interval_scaling ({len(interval_scaling)}) '
                'must have the same length'
            )
        if abs(sum(lengths) - 1.0) >= 1e-3:
            raise ValueError(
                f'{name}: lengths must sum to 1, got {list(lengths)} (sum {sum(lengths)})'
            )
        lengths = list(lengths)
        lengths[-1] = 1.0 - sum(lengths[:-1])  # absorb rounding in the last slice
        for s in interval_scaling:
            if s not in ('rescaled', 'fixed'):
                raise ValueError(
                    f"{name}: interval_scaling entries must be 'rescaled' or 'fixed', got {s!r}"
                )
        self.schedulers = list(schedulers)
        self.lengths = lengths
        self.interval_scaling = list(interval_scaling)

    def __call__(self, where: float) -> float:
        i = 0
        total = self.lengths[0]
        while where + self.WHERE_EPSILON > total and i < len(self.schedulers) - 1:
            i += 1
            total += self.lengths[i]
        local = where
        if self.interval_scaling[i] == 'rescaled':
            start = total - self.lengths[i]
            local = (where - start) / self.lengths[i]
        return self.schedulers[i](local)


class WarmupSchedule(CompositeSchedule):
    """Prefix ``scheduler`` with a warm-up over the first ``warmup_length`` of training.

    The warm-up starts at ``warmup_factor * scheduler(0)`` and, for
    ``'linear'``, ends at ``scheduler(warmup_length)`` (or ``scheduler(0)`` with
    ``rescale_interval``, where ``scheduler`` then runs over the remaining
    ``1 - warmup_length`` as if it were the whole of training).

    Args:
        scheduler: The schedule to warm up.
        warmup_factor: Start multiplier relative to ``scheduler(0)``, e.g. 0.001.
        warmup_length: Fraction of training spent warming up, in [0, 1].
        warmup_method: ``'linear'`` (default) or ``'constant'``.
        rescale_interval: Rescale ``scheduler`` to the post-warm-up interval.
            Defaults to False.
    """

    def __init__(
        self,
        scheduler: Schedule,
        warmup_factor: float,
        warmup_length: float,
        warmup_method: str = 'linear',
        rescale_interval: bool = False,
    ) -> None:
        end_value = scheduler(0.0) if rescale_interval else scheduler(warmup_length)
        start_value = warmup_factor * scheduler(0.0)
        if warmup_method == 'constant':
            warmup: Schedule = ConstantSchedule(start_value)
        elif warmup_method == 'linear':
            warmup = LinearSchedule(start_value, end_value)
        else:
            raise ValueError(
                f"WarmupSchedule: warmup_method must be 'linear' or 'constant', "
                f'got {warmup_method!r}'
            )
        super().__init__(
            [warmup, scheduler],
            lengths=[warmup_length, 1 - warmup_length],
            interval_scaling=['rescaled', 'rescaled' if rescale_interval else 'fixed'],
        )
