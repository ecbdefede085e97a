"""Optimizer wrappers, constructors, param groups and mixed precision (mmengine's ``optim``).

Importing this package registers the wrappers (``OPTIM_WRAPPERS``), the constructors
(``OPTIM_WRAPPER_CONSTRUCTORS``) and the torch optimizers (``OPTIMIZERS``). The entry
point is :func:`build_optim_wrapper`.
"""

from stratagem.registry import OPTIM_WRAPPERS

from . import optimizers  # noqa: F401  (registers torch.optim in OPTIMIZERS)
from .amp_optim_wrapper import AmpOptimWrapper
from .base import BaseOptimWrapper
from .builder import MultiOptimWrapperConstructor, build_optim_wrapper
from .default_constructor import DefaultOptimWrapperConstructor
from .fp16 import (
    LossScaler,
    auto_fp16,
    cast_tensor_type,
    force_fp32,
    patch_forward_method,
    patch_norm_fp32,
    wrap_fp16_model,
)
from .fp16_optim_wrapper import Fp16MasterWeightsOptimWrapper
from .optim_wrapper import OptimWrapper
from .optim_wrapper_dict import OptimWrapperDict
from .param_groups import get_default_optimizer_params, reduce_param_groups

# the DeepSpeed backend's wrapper, registered by name; built only with DeepSpeedStrategy
OPTIM_WRAPPERS.register_lazy(
    'DeepSpeedOptimWrapper', 'stratagem.strategies.deepspeed.optim_wrapper:DeepSpeedOptimWrapper'
)

__all__ = [
    'BaseOptimWrapper',
    'OptimWrapper',
    'AmpOptimWrapper',
    'OptimWrapperDict',
    'Fp16MasterWeightsOptimWrapper',
    'DeepSpeedOptimWrapper',
    'build_optim_wrapper',
    'DefaultOptimWrapperConstructor',
    'MultiOptimWrapperConstructor',
    'get_default_optimizer_params',
    'reduce_param_groups',
    'ZeroRedundancyOptimizer',
    'cast_tensor_type',
    'auto_fp16',
    'force_fp32',
    'wrap_fp16_model',
    'patch_norm_fp32',
    'patch_forward_method',
    'LossScaler',
]


def __getattr__(name: str):
    if name == 'DeepSpeedOptimWrapper':  # lives with its backend; mmengine's import path
        from stratagem.registry import OPTIM_WRAPPERS

        return OPTIM_WRAPPERS.get('DeepSpeedOptimWrapper')
    if name == 'ZeroRedundancyOptimizer':  # imports torch.distributed.optim: only on demand
        from .zero import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
