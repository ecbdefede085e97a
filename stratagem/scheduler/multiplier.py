"""The thin optimizer adapter for :mod:`.schedules`, and detectron2's solver builder.

:class:`LRMultiplier` sets every group's lr to ``initial_lr * schedule(iter /
max_iter)``; its state is two plain values. :func:`build_lr_scheduler` reads a
detectron2-style ``SOLVER`` dict and returns one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .helpers import check_optimizer
from .schedules import (
    CosineSchedule,
    MultiStepSchedule,
    Schedule,
    StepWithFixedGammaSchedule,
    WarmupSchedule,
)

__all__ = ['LRMultiplier', 'build_lr_scheduler']

logger = logging.getLogger(__name__)


class LRMultiplier:
    """Learning rate = base lr of each group × ``multiplier(iter / max_iter)``.

    Works like a torch LR scheduler (``step()`` after each iteration; the first
    step is taken at construction), and like a :class:`_ParamScheduler` for
    loops that handle both (``by_epoch`` is False, :meth:`get_last_value`).

    Args:
        optimizer: Optimizer or optim wrapper.
        multiplier: A :class:`Schedule` (any callable of ``where`` in [0, 1)).
        max_iter: Total training iterations; ``where = iter / max_iter``.
        last_iter: Index of the last iteration done; -1 (default) for a fresh
            start. Resuming from another value needs ``initial_lr`` in the groups.
    """

    by_epoch = False

    def __init__(
        self, optimizer: Any, multiplier: Schedule, max_iter: int, last_iter: int = -1
    ) -> None:
        check_optimizer(optimizer, 'LRMultiplier')
        if not callable(multiplier):
            raise TypeError(
                'LRMultiplier: multiplier must be a Schedule (a callable of '
                f'progress in [0, 1)), got {type(multiplier).__name__}'
            )
        if not isinstance(max_iter, int) or max_iter <= 0:
            raise ValueError(f'LRMultiplier: max_iter must be a positive int, got {max_iter!r}')
        self.optimizer = optimizer
        self._multiplier = multiplier
        self._max_iter = max_iter
        for i, group in enumerate(optimizer.param_groups):
            if last_iter == -1:
                group.setdefault('initial_lr', group['lr'])
            elif 'initial_lr' not in group:
                raise KeyError(
                    f"LRMultiplier: param_groups[{i}] has no 'initial_lr', which "
                    f'resuming with last_iter={last_iter} needs'
                )
        self.base_lrs = [group['initial_lr'] for group in optimizer.param_groups]
        # torch's name for the iteration counter, kept so detectron2 states load as they are
        self.last_epoch = last_iter
        self.step()

    @property
    def last_iter(self) -> int:
        """Index of the last iteration whose lr was set."""
        return self.last_epoch

    def step(self) -> None:
        """Advance one iteration and set each group's lr."""
        self.last_epoch += 1
        m = self._multiplier(self.last_epoch / self._max_iter)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group['lr'] = base * m
        self._last_lr = [group['lr'] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list:
        """The lr of each group after the last :meth:`step`."""
        return self._last_lr

    get_last_value = get_last_lr

    def state_dict(self) -> dict:
        """``base_lrs`` and ``last_epoch``: schedules are stateless."""
        return {'base_lrs': list(self.base_lrs), 'last_epoch': self.last_epoch}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.base_lrs = list(state_dict['base_lrs'])
        self.last_epoch = state_dict['last_epoch']


_SOLVER_DEFAULTS = {  # detectron2's defaults for the keys read here
    'LR_SCHEDULER_NAME': 'WarmupMultiStepLR',
    'STEPS': (30000,),
    'GAMMA': 0.1,
    'BASE_LR': 0.001,
    'BASE_LR_END': 0.0,
    'WARMUP_FACTOR': 1.0 / 1000,
    'WARMUP_ITERS': 1000,
    'WARMUP_METHOD': 'linear',
    'RESCALE_INTERVAL': False,
    'NUM_DECAYS': 3,
}
_NAMES = ('WarmupMultiStepLR', 'WarmupCosineLR', 'WarmupStepWithFixedGammaLR')


def build_lr_scheduler(solver: Mapping[str, Any], optimizer: Any) -> LRMultiplier:
    """Build detectron2's iteration-based lr schedule from a ``SOLVER`` mapping.

    Args:
        solver: detectron2 ``cfg.SOLVER`` keys: ``LR_SCHEDULER_NAME`` (one of
            WarmupMultiStepLR, WarmupCosineLR, WarmupStepWithFixedGammaLR),
            ``MAX_ITER`` (required), ``STEPS``, ``GAMMA``, ``BASE_LR``,
            ``BASE_LR_END``, ``WARMUP_FACTOR``, ``WARMUP_ITERS``,
            ``WARMUP_METHOD``, ``RESCALE_INTERVAL``, ``NUM_DECAYS``; missing keys
            take detectron2's defaults. ``STEPS`` beyond ``MAX_ITER`` are dropped
            with a warning.
        optimizer: Optimizer or optim wrapper whose lrs are the base lrs.

    Returns:
        An :class:`LRMultiplier`; call ``step()`` after every iteration.
    """
    # a whole SOLVER node may be given: keys this builder does not read are ignored
    cfg = {**_SOLVER_DEFAULTS, **dict(solver.items())}
    if 'MAX_ITER' not in solver:
        raise KeyError('build_lr_scheduler: SOLVER.MAX_ITER is required (total iterations)')
    max_iter = solver['MAX_ITER']
    name = cfg['LR_SCHEDULER_NAME']
    if name == 'WarmupMultiStepLR':
        steps = [x for x in cfg['STEPS'] if x <= max_iter]
        if len(steps) != len(cfg['STEPS']):
            logger.warning(
                'SOLVER.STEPS %s has values larger than SOLVER.MAX_ITER (%d); they are ignored.',
                list(cfg['STEPS']),
                max_iter,
            )
        if steps != sorted(steps):
            raise ValueError(
                f'build_lr_scheduler: SOLVER.STEPS must be increasing, got {list(cfg["STEPS"])}'
            )
        values = [cfg['GAMMA'] ** k for k in range(len(steps) + 1)]
        sched: Schedule = MultiStepSchedule(values=values, milestones=steps, num_updates=max_iter)
    elif name == 'WarmupCosineLR':
        end_value = cfg['BASE_LR_END'] / cfg['BASE_LR']
        if not 0.0 <= end_value <= 1.0:
            raise ValueError(
                'build_lr_scheduler: SOLVER.BASE_LR_END / SOLVER.BASE_LR must be in '
                f'[0, 1], got {cfg["BASE_LR_END"]} / {cfg["BASE_LR"]}'
            )
        sched = CosineSchedule(1, end_value)
    elif name == 'WarmupStepWithFixedGammaLR':
        sched = StepWithFixedGammaSchedule(
            base_value=1.0, gamma=cfg['GAMMA'], num_decays=cfg['NUM_DECAYS'], num_updates=max_iter
        )
    else:
        raise ValueError(
            f'build_lr_scheduler: unknown SOLVER.LR_SCHEDULER_NAME {name!r}; '
            f'valid: {", ".join(_NAMES)}'
        )
    sched = WarmupSchedule(
        sched,
        cfg['WARMUP_FACTOR'],
        min(cfg['WARMUP_ITERS'] / max_iter, 1.0),
        cfg['WARMUP_METHOD'],
        cfg['RESCALE_INTERVAL'],
    )
    return LRMultiplier(optimizer, multiplier=sched, max_iter=max_iter)
