"""Replaying the schedulers from scratch to an iteration (resume at another world size).

Owns :func:`replay_schedulers`: the schedulers are reset to their first step and stepped as
a training loop steps them, with the step-order warning off (``step_order._ORDER_CHECK``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .step_order import _ORDER_CHECK

if TYPE_CHECKING:
    from .base import _ParamScheduler

__all__ = ['fitted_length_changes', 'replay_schedulers']


def fitted_length_changes(schedulers: Sequence[Any], states: Sequence[Any]) -> list[str]:
    """One line per scheduler whose ``end`` was fitted to the run's length
    (``end_fitted``: its config gave none) and whose saved ``end`` differs from the one
    this run built, e.g. ``'CosineAnnealingLR: end=64 from the checkpoint; this run has
    128 iterations'``. ``states``: the saved state dicts, in the same order."""
    out = []
    for sched, state in zip(schedulers, states):
        if not getattr(sched, 'end_fitted', False) or not isinstance(state, Mapping):
            continue
        saved, own = state.get('end'), getattr(sched, 'end', None)
        if saved is None or saved == own:
            continue
        unit = 'epochs' if getattr(sched, 'by_epoch', False) else 'iterations'
        out.append(
            f'{type(sched).__name__}: end={saved} from the checkpoint; this run has {own} {unit}'
        )
    return out


def replay_schedulers(
    schedulers: Sequence[_ParamScheduler], num_iters: int, epoch_length: int | None = None
) -> None:
    """Recompute the scheduled values from scratch up to ``num_iters`` iterations done.

    Every scheduled parameter of every param group goes back to its ``initial_<param>``,
    each scheduler back to its first step, and then the schedulers are stepped as a training
    loop steps them (mmengine's ParamSchedulerHook): iteration-based ones after every
    iteration, epoch-based ones after every ``epoch_length`` iterations, in list order. Their
    lengths (``begin``, ``end``, ``T_max`` ...) are kept, so after a world-size change (each
    converted by :meth:`_ParamScheduler.rescaled_state_dict`) the values are exactly those
    of a run that used the new units from its start, and the chainable forms continue from
    them consistently to the schedule's end.
    """
    if epoch_length is None and any(s.by_epoch for s in schedulers):
        raise ValueError(
            'replaying epoch-based schedulers needs epoch_length (iterations per epoch)'
        )
    for sched in schedulers:
        for group in sched.optimizer.param_groups:
            group[sched.param_name] = group[f'initial_{sched.param_name}']
    _ORDER_CHECK['on'] = False  # no optimizer steps here, by design: no order warning
    try:
        for sched in schedulers:
            sched.restart()
            sched.step()  # the step a scheduler takes when it is built
        for it in range(1, num_iters + 1):
            for sched in schedulers:
                if not sched.by_epoch:
                    sched.step()
            if epoch_length and it % epoch_length == 0:
                for sched in schedulers:
                    if sched.by_epoch:
                        sched.step()
    finally:
        _ORDER_CHECK['on'] = True
