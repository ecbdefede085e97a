"""Parameter schedulers (mmengine-compatible), progress schedules (fvcore-style), previews.

Importing this package registers every scheduler in ``PARAM_SCHEDULERS`` (the
registry imports it on its first lookup). matplotlib is imported only by
``stratagem.scheduler.plot`` when a PNG is drawn.
"""

from .base import INF, SchedulerArgumentError, _ParamScheduler
from .builder import (
    build_param_scheduler,
    build_param_scheduler_dict,
    build_param_schedulers,
    build_scheduler_from_cfg,
)
from .cosine import CosineAnnealingParamScheduler, CosineRestartParamScheduler
from .multiplier import LRMultiplier, build_lr_scheduler
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
from .schedules import (
    CompositeSchedule,
    ConstantSchedule,
    CosineSchedule,
    ExponentialSchedule,
    LinearSchedule,
    MultiStepSchedule,
    PolynomialDecaySchedule,
    Schedule,
    ScheduleEndedError,
    ScheduleRangeError,
    StepSchedule,
    StepWithFixedGammaSchedule,
    WarmupSchedule,
)
from .simulate import ScheduleTrace, simulate
from .variants import (
    ConstantLR,
    ConstantMomentum,
    CosineAnnealingLR,
    CosineAnnealingMomentum,
    CosineRestartLR,
    CosineRestartMomentum,
    ExponentialLR,
    ExponentialMomentum,
    LinearLR,
    LinearMomentum,
    LRSchedulerMixin,
    MomentumSchedulerMixin,
    MultiStepLR,
    MultiStepMomentum,
    OneCycleLR,
    PolyLR,
    PolyMomentum,
    ReduceOnPlateauLR,
    ReduceOnPlateauMomentum,
    StepLR,
    StepMomentum,
)

__all__ = [
    'INF',
    '_ParamScheduler',
    'SchedulerArgumentError',
    # generic
    'ConstantParamScheduler',
    'CosineAnnealingParamScheduler',
    'CosineRestartParamScheduler',
    'ExponentialParamScheduler',
    'LinearParamScheduler',
    'MultiStepParamScheduler',
    'OneCycleParamScheduler',
    'PolyParamScheduler',
    'ReduceOnPlateauParamScheduler',
    'StepParamScheduler',
    # lr
    'LRSchedulerMixin',
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
    # momentum
    'MomentumSchedulerMixin',
    'ConstantMomentum',
    'CosineAnnealingMomentum',
    'CosineRestartMomentum',
    'ExponentialMomentum',
    'LinearMomentum',
    'MultiStepMomentum',
    'PolyMomentum',
    'ReduceOnPlateauMomentum',
    'StepMomentum',
    # progress schedules and their adapter
    'Schedule',
    'ScheduleRangeError',
    'ScheduleEndedError',
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
    'LRMultiplier',
    'build_lr_scheduler',
    # building and previewing
    'build_scheduler_from_cfg',
    'build_param_scheduler',
    'build_param_schedulers',
    'build_param_scheduler_dict',
    'simulate',
    'ScheduleTrace',
]
