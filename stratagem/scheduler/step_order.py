"""The optimizer-step watch behind the schedulers' step-order warning.

Owns the per-optimizer record (``_WATCHED``) of the steps taken since the newest scheduler
was built on it, the step post-hook that counts them (``_count_step``), the switch that
turns the check off while schedulers are replayed (``_ORDER_CHECK``), and the helpers
``_ParamScheduler._check_step_order`` reads them with. No scheduler class lives here.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

_ORDER_DOC = 'https://pytorch.org/docs/stable/optim.html#how-to-adjust-learning-rate'

# Optimizer -> what the newest scheduler built on it needs to tell whether it stepped before
# the scheduler's first step(): torch's step post-hook counts raw steps (no patching of
# optimizer.step), an optim wrapper's inner_count counts update_params calls (so a step that
# accumulates, or that AMP skips for inf grads, is not mistaken for a missing one).
_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_ORDER_CHECK = {'on': True}  # off while replay_schedulers steps without an optimizer


def _count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    entry = _WATCHED.get(optimizer)
    if entry is not None:
        entry['steps'] += 1
        # one step is all the check needs: the hook goes, so a run pays no call per step
        # (a scheduler built later registers it again)
        handle, entry['hook'] = entry.get('hook'), None
        if handle is not None:
            handle.remove()


def _step_func(optimizer: Any) -> Any:
    step = getattr(optimizer, 'step', None)
    return getattr(step, '__func__', step)
