"""``*LR`` and ``*Momentum`` schedulers: the generic ones with ``param_name`` fixed.

``FooLR`` schedules ``lr``; ``FooMomentum`` schedules ``momentum`` (SGD, RMSprop)
or ``betas[0]`` (the Adam family), mirrored into a ``momentum`` key so that the
chainable forms can read it. Names match mmengine's, so its configs build here.
"""

from __future__ import annotations

import inspect
from typing import Any

from stratagem.registry import PARAM_SCHEDULERS

from .cosine import CosineAnnealingParamScheduler, CosineRestartParamScheduler
from .helpers import check_optimizer, raw_optimizer
from .one_cycle import OneCycleParamScheduler
from .param_scheduler import (
    ConstantParamScheduler,
    ExponentialParamScheduler,
    LinearParamScheduler,
    MultiStepParamScheduler,
    PolyParamScheduler,
    StepParamScheduler,
)
from .plateau import ReduceOnPlateauParamScheduler

_GENERIC = {
    'Constant': ConstantParamScheduler,
    'CosineAnnealing': CosineAnnealingParamScheduler,
    'CosineRestart': CosineRestartParamScheduler,
    'Exponential': ExponentialParamScheduler,
    'Linear': LinearParamScheduler,
    'MultiStep': MultiStepParamScheduler,
    'Poly': PolyParamScheduler,
    'Step': StepParamScheduler,
    'ReduceOnPlateau': ReduceOnPlateauParamScheduler,
    'OneCycle': OneCycleParamScheduler,
}


class LRSchedulerMixin:
    """Fixes ``param_name='lr'``."""

    def __init__(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, 'lr', *args, **kwargs)  # type: ignore[call-arg]


class MomentumSchedulerMixin:
    """Fixes ``param_name='momentum'``; for optimizers with ``betas`` it drives ``betas[0]``."""

    def __init__(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        check_optimizer(optimizer, name)
        defaults = raw_optimizer(optimizer).defaults
        self.use_betas = False
        if 'momentum' not in defaults:
            if 'betas' not in defaults:
                raise ValueError(
                    f'{name}: the optimizer has neither momentum nor betas to '
                    f'schedule ({type(raw_optimizer(optimizer)).__name__}): '
                    'optimizer must support momentum when using momentum scheduler; '
                    'use one with momentum (SGD, RMSprop) or betas (Adam family)'
                )
            self.use_betas = True
            for group in optimizer.param_groups:
                if 'betas' in group:
                    # the chainable forms read and write 'momentum'; betas[0] mirrors it
                    group['momentum'] = group['betas'][0]
        super().__init__(optimizer, 'momentum', *args, **kwargs)  # type: ignore[call-arg]

    def _sync_betas(self) -> None:
        if self.use_betas:
            for group in self.optimizer.param_groups:  # type: ignore[attr-defined]
                if 'betas' in group:
                    group['betas'] = (group['momentum'], group['betas'][1])

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the schedule, then copy ``momentum`` into ``betas[0]`` where used."""
        super().step(*args, **kwargs)  # type: ignore[misc]
        self._sync_betas()


def _variant(mixin: type, kind: str, suffix: str, what: str) -> type:
    """``<kind><suffix>``: ``mixin`` + the generic scheduler ``kind``, registered."""
    base = _GENERIC[kind]
    sig = inspect.signature(base)
    params = [p for n, p in sig.parameters.items() if n not in ('self', 'param_name')]
    doc = (
        f'{base.__name__} applied to {what}; arguments as there, without '
        f'``param_name``.\n\n{inspect.getdoc(base)}'
    )
    cls = type(
        f'{kind}{suffix}',
        (mixin, base),
        {
            '__doc__': doc,
            '__module__': __name__,
            # the registry checks cfg keys against this (typos get a "did you mean")
            '__signature__': sig.replace(parameters=params),
        },
    )
    PARAM_SCHEDULERS.register_module(module=cls)
    return cls


_LR = 'the learning rate'
_MOM = 'the momentum (betas[0] for Adam-family optimizers)'
ConstantLR = _variant(LRSchedulerMixin, 'Constant', 'LR', _LR)
CosineAnnealingLR = _variant(LRSchedulerMixin, 'CosineAnnealing', 'LR', _LR)
CosineRestartLR = _variant(LRSchedulerMixin, 'CosineRestart', 'LR', _LR)
ExponentialLR = _variant(LRSchedulerMixin, 'Exponential', 'LR', _LR)
LinearLR = _variant(LRSchedulerMixin, 'Linear', 'LR', _LR)
MultiStepLR = _variant(LRSchedulerMixin, 'MultiStep', 'LR', _LR)
OneCycleLR = _variant(LRSchedulerMixin, 'OneCycle', 'LR', _LR)
PolyLR = _variant(LRSchedulerMixin, 'Poly', 'LR', _LR)
ReduceOnPlateauLR = _variant(LRSchedulerMixin, 'ReduceOnPlateau', 'LR', _LR)
StepLR = _variant(LRSchedulerMixin, 'Step', 'LR', _LR)

ConstantMomentum = _variant(MomentumSchedulerMixin, 'Constant', 'Momentum', _MOM)
CosineAnnealingMomentum = _variant(MomentumSchedulerMixin, 'CosineAnnealing', 'Momentum', _MOM)
CosineRestartMomentum = _variant(MomentumSchedulerMixin, 'CosineRestart', 'Momentum', _MOM)
ExponentialMomentum = _variant(MomentumSchedulerMixin, 'Exponential', 'Momentum', _MOM)
LinearMomentum = _variant(MomentumSchedulerMixin, 'Linear', 'Momentum', _MOM)
MultiStepMomentum = _variant(MomentumSchedulerMixin, 'MultiStep', 'Momentum', _MOM)
PolyMomentum = _variant(MomentumSchedulerMixin, 'Poly', 'Momentum', _MOM)
ReduceOnPlateauMomentum = _variant(MomentumSchedulerMixin, 'ReduceOnPlateau', 'Momentum', _MOM)
StepMomentum = _variant(MomentumSchedulerMixin, 'Step', 'Momentum', _MOM)

__all__ = [
    'LRSchedulerMixin',
    'MomentumSchedulerMixin',
    'ConstantLR',
    'CosineAnnealingLR',
    'CosineRestartLR',
    'ExponentialLR',
    'LinearLR',
    'MultiStepLR',
    'OneCycleLR',
    'PolyLR',
    'ReduceOnPlateauLR',
    'StepLR',
    'ConstantMomentum',
    'CosineAnnealingMomentum',
    'CosineRestartMomentum',
    'ExponentialMomentum',
    'LinearMomentum',
    'MultiStepMomentum',
    'PolyMomentum',
    'ReduceOnPlateauMomentum',
    'StepMomentum',
]
