"""The 1cycle policy (Smith, "Super-Convergence"), mmengine's OneCycleParamScheduler semantics.

Not chainable: each step sets the value from the phase table, whatever other
schedulers did.
"""

from __future__ import annotations

import math
from typing import Any

from stratagem.registry import PARAM_SCHEDULERS

from .base import INF, SchedulerArgumentError, _ParamScheduler
from .helpers import per_group

__all__ = ['OneCycleParamScheduler']


def _anneal_cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def _anneal_linear(start: float, end: float, pct: float) -> float:
    return (end - start) * pct + start


_ANNEAL = {'cos': _anneal_cos, 'linear': _anneal_linear}


@PARAM_SCHEDULERS.register_module()
class OneCycleParamScheduler(_ParamScheduler):
    """Warm up from ``eta_max / div_factor`` to ``eta_max``, then anneal to
    ``eta_max / div_factor / final_div_factor``.

    The cycle length is, in order of precedence: ``total_steps``; ``epochs *
    steps_per_epoch``; ``end - begin``. Phase ends (in steps) are
    ``pct_start * total - 1`` and ``total - 1``; with ``three_phase`` the
    warm-up is mirrored (ending at ``2 * pct_start * total - 2``) before a final
    anneal. The base value written to ``initial_lr`` is ``eta_max / div_factor``.

    Args:
        optimizer: Optimizer or optim wrapper.
        param_name: Must be ``'lr'``.
        eta_max: Peak value, one for all groups or one per group. Defaults to 0.
        total_steps: Cycle length in steps. Defaults to None.
        pct_start: Fraction of the cycle spent warming up. Defaults to 0.3.
        anneal_strategy: ``'cos'`` (default) or ``'linear'``.
        div_factor: ``initial = eta_max / div_factor``. Defaults to 25.
        final_div_factor: ``min = initial / final_div_factor``. Defaults to 1e4.
        three_phase: Use the paper's three phases. Defaults to False.
        begin, end, last_step, by_epoch, verbose: See :class:`_ParamScheduler`.
        epochs, steps_per_epoch: Alternative to ``total_steps`` (older
            mmengine/torch argument pair). Default None.
    """

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        eta_max: float = 0,
        total_steps: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: str = 'cos',
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        begin: int = 0,
        end: int = INF,
        last_step: int = -1,
        by_epoch: bool = True,
        verbose: bool = False,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
    ) -> None:
        name = type(self).__name__
        if param_name != 'lr':
            raise SchedulerArgumentError(
                f"{name}: param_name must be 'lr' (1cycle schedules the learning "
                f'rate only), got {param_name!r}'
            )
        if total_steps is not None:
            if not isinstance(total_steps, int) or total_steps <= 0:
                raise ValueError(f'{name}: total_steps must be a positive int, got {total_steps!r}')
        elif epochs is not None or steps_per_epoch is not None:
            for arg, v in (('epochs', epochs), ('steps_per_epoch', steps_per_epoch)):
                if not isinstance(v, int) or v <= 0:
                    raise ValueError(
                        f'{name}: {arg} must be a positive int when total_steps '
                        f'is not given, got {v!r}'
                    )
            total_steps = epochs * steps_per_epoch  # type: ignore[operator]
        elif end == INF:
            raise ValueError(
                f'{name}: the cycle length is unknown; give total_steps, '
                'epochs and steps_per_epoch, or a finite end (the builder sets '
                'end to max_iters / max_epochs)'
            )
        else:
            total_steps = end - begin
        if not isinstance(pct_start, (int, float)) or not 0 <= pct_start <= 1:
            raise ValueError(f'{name}: pct_start must be a float in [0, 1], got {pct_start!r}')
        if anneal_strategy not in _ANNEAL:
            raise ValueError(
                f"{name}: anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}"
            )
        self.eta_max = eta_max
        self.div_factor = div_factor
        self.final_div_factor = final_div_factor
        self.total_steps = total_steps
        self.anneal_strategy = anneal_strategy
        p = param_name
        warm_end = float(pct_start * total_steps) - 1
        if three_phase:
            phases = [
                (warm_end, f'initial_{p}', f'max_{p}'),
                (float(2 * pct_start * total_steps) - 2, f'max_{p}', f'initial_{p}'),
                (total_steps - 1, f'initial_{p}', f'min_{p}'),
            ]
        else:
            phases = [
                (warm_end, f'initial_{p}', f'max_{p}'),
                (total_steps - 1, f'max_{p}', f'min_{p}'),
            ]
        # plain dicts of str/float, so the table travels in the state dict
        self._schedule_phases: list[dict[str, Any]] = [
            {'end_step': e, f'start_{p}': s, f'end_{p}': t} for e, s, t in phases
        ]
        check_groups = getattr(optimizer, 'param_groups', None)
        if last_step == -1 and check_groups is not None:
            max_values = per_group(eta_max, len(check_groups), name, 'eta_max')
            for group, max_value in zip(check_groups, max_values):
                # 1cycle owns the start value: it overrides whatever initial_lr was recorded
                group[f'initial_{p}'] = max_value / div_factor
                group[f'max_{p}'] = max_value
                group[f'min_{p}'] = group[f'initial_{p}'] / final_div_factor
        super().__init__(
            optimizer,
            param_name,
            begin=begin,
            end=end,
            last_step=last_step,
            by_epoch=by_epoch,
            verbose=verbose,
        )

    _epoch_args = ('total_steps',)

    def _rescale_derived(self, state: dict, ratio: Any) -> dict:
        # phase ends are pct * total_steps - 1 (and 2 * pct * total - 2): scale pct * total
        phases = [dict(ph) for ph in state['_schedule_phases']]
        warm = (phases[0]['end_step'] + 1) * ratio
        phases[0]['end_step'] = float(warm) - 1
        if len(phases) == 3:
            phases[1]['end_step'] = float(2 * warm) - 2
        phases[-1]['end_step'] = state['total_steps'] - 1
        return {**state, '_schedule_phases': phases}

    def _get_value(self) -> list:
        step = self.last_step
        if step > self.total_steps:
            raise ValueError(
                f'{type(self).__name__}: stepped {step + 1} times, more than '
                f'total_steps ({self.total_steps}); raise total_steps or set '
                'end to stop the scheduler'
            )
        anneal = _ANNEAL[self.anneal_strategy]
        p = self.param_name
        values = []
        for group in self.optimizer.param_groups:
            start_step = 0.0
            last = len(self._schedule_phases) - 1
            for i, phase in enumerate(self._schedule_phases):
                end_step = phase['end_step']
                if step <= end_step or i == last:
                    pct = (step - start_step) / (end_step - start_step)
                    values.append(anneal(group[phase[f'start_{p}']], group[phase[f'end_{p}']], pct))
                    break
                start_step = end_step
        return values
