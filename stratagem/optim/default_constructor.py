"""``DefaultOptimWrapperConstructor``: model + config → optimizer wrapper.

mmengine-compatible (``mmengine.optim.DefaultOptimWrapperConstructor``): same arguments and
``paramwise_cfg`` options with the same precedence:

1. a ``custom_keys`` entry whose key is a substring of ``'<module prefix>.<param name>'``
   (longest key wins, then alphabetical) sets ``lr = base_lr * lr_mult`` and
   ``weight_decay = base_wd * decay_mult`` (and copies its other keys into the group);
   no other rule applies to that parameter;
2. otherwise ``bias_lr_mult`` (biases outside norm and deformable-conv layers),
   ``dcn_offset_lr_mult`` (a ``conv_offset`` conv inside a deformable conv), then the first
   matching decay rule of ``norm_decay_mult`` (norm layers), ``bias_decay_mult``,
   ``dwconv_decay_mult`` (``Conv2d`` with ``groups == in_channels``) and
   ``flat_decay_mult`` (1-d parameters).

Differences from mmengine, all deliberate:

* frozen parameters (``requires_grad=False``) are left out of the optimizer;
* a parameter reached twice (shared module, tied weights) raises naming both paths, unless
  ``bypass_duplicate=True`` keeps its first occurrence; without ``paramwise_cfg`` there is
  only one group and shared parameters are simply listed once, as ``model.parameters()`` does;
* after the per-parameter pass, groups with identical hyper-parameters are merged
  (:func:`~stratagem.optim.param_groups.reduce_param_groups`), so a ResNet-50 gets a handful
  of groups instead of one per tensor. ``paramwise_cfg=dict(reduce_param_groups=False)``
  keeps one group per parameter (e.g. to load an optimizer state saved by mmengine);
* unknown ``paramwise_cfg`` keys raise (subclasses add theirs to ``PARAMWISE_KEYS``);
* deformable convs are recognised by class name (``DeformConv2d``, ``ModulatedDeformConv2d``
  and subclasses), so mmcv is not imported.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stratagem._torch import BatchNormBase, InstanceNormBase
from stratagem.registry import OPTIM_WRAPPER_CONSTRUCTORS, OPTIM_WRAPPERS, OPTIMIZERS

from .base import BaseOptimWrapper
from .param_groups import reduce_param_groups

__all__ = ['DefaultOptimWrapperConstructor']

_NORM_TYPES = (BatchNormBase, InstanceNormBase, nn.GroupNorm, nn.LayerNorm)
_DCN_NAMES = ('DeformConv2d', 'ModulatedDeformConv2d')


def _is_dcn(module: nn.Module) -> bool:
    return any(cls.__name__ in _DCN_NAMES for cls in type(module).__mro__)


def resolve_optimizer_class(optimizer_type: Any, where: str = 'optim_wrapper.optimizer') -> type:
    """The optimizer class for a registered name or a class; raises the registry's error."""
    if isinstance(optimizer_type, str):
        cls = OPTIMIZERS.get(optimizer_type)
        if cls is None:
            err = OPTIMIZERS.unknown_name_error(optimizer_type)
            raise type(err)(f'{err} (in {where})')
        return cls
    if callable(optimizer_type):
        return optimizer_type
    raise TypeError(f"{where}['type'] must be an optimizer name or class, got {optimizer_type!r}")


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class DefaultOptimWrapperConstructor:
    """Builds an optimizer wrapper for a model from ``optim_wrapper_cfg``.

    Args:
        optim_wrapper_cfg: The wrapper config: ``optimizer`` (required; ``type`` a registered
            name or a class), optional ``type`` (default ``'OptimWrapper'``) and the wrapper's
            own arguments (``accumulative_counts``, ``clip_grad``, ``loss_scale``, ``dtype``).
        paramwise_cfg: Per-parameter options (see the module docstring); ``None``: one group.
    """

    PARAMWISE_KEYS = (
        'custom_keys',
        'bias_lr_mult',
        'bias_decay_mult',
        'norm_decay_mult',
        'dwconv_decay_mult',
        'flat_decay_mult',
        'dcn_offset_lr_mult',
        'bypass_duplicate',
        'reduce_param_groups',
    )

    def __init__(self, optim_wrapper_cfg: Mapping, paramwise_cfg: Mapping | None = None) -> None:
        if not isinstance(optim_wrapper_cfg, Mapping):
            raise TypeError(
                f'optim_wrapper_cfg must be a dict, got '
                f'{type(optim_wrapper_cfg).__name__}: {optim_wrapper_cfg!r}'
            )
        if 'optimizer' not in optim_wrapper_cfg:
            raise ValueError(
                f'optim_wrapper cfg {dict(optim_wrapper_cfg)!r} has no optimizer; '
                f"add e.g. optimizer=dict(type='SGD', lr=0.01)"
            )
        self.optim_wrapper_cfg = dict(optim_wrapper_cfg)
        self.optimizer_cfg = self.optim_wrapper_cfg.pop('optimizer')
        if not isinstance(self.optimizer_cfg, Mapping) or 'type' not in self.optimizer_cfg:
            raise TypeError(
                f"optim_wrapper.optimizer must be a dict with a 'type' key, got "
                f"{self.optimizer_cfg!r}; e.g. optimizer=dict(type='AdamW', lr=1e-3)"
            )
        if paramwise_cfg is not None and not isinstance(paramwise_cfg, Mapping):
            raise TypeError(f'paramwise_cfg must be None or a dict, got {paramwise_cfg!r}')
        self.paramwise_cfg: dict = dict(paramwise_cfg or {})
        self.base_lr = self.optimizer_cfg.get('lr', None)
        self.base_wd = self.optimizer_cfg.get('weight_decay', None)
        self._validate_cfg()

    def _validate_cfg(self) -> None:
        cfg = self.paramwise_cfg
        unknown = [k for k in cfg if k not in self.PARAMWISE_KEYS]
        if unknown:
            hints = [
                f"'{k}'"
                + (
                    f" (did you mean '{c[0]}'?)"
                    if (c := difflib.get_close_matches(k, self.PARAMWISE_KEYS, n=1))
                    else ''
                )
                for k in unknown
            ]
            raise ValueError(
                f'unknown paramwise_cfg key(s) {", ".join(hints)}; valid keys: '
                f'{", ".join(self.PARAMWISE_KEYS)}'
            )
        custom_keys = cfg.get('custom_keys', {})
        if not isinstance(custom_keys, Mapping):
            raise TypeError(
                f'paramwise_cfg.custom_keys must be a dict of {{key: dict(lr_mult=, '
                f'decay_mult=)}}, got {custom_keys!r}'
            )
        for key, opts in custom_keys.items():
            if not isinstance(opts, Mapping):
                raise TypeError(
                    f'paramwise_cfg.custom_keys[{key!r}] must be a dict such as '
                    f'dict(lr_mult=0.1, decay_mult=0.0), got {opts!r}'
                )
            if 'lr_mult' in opts and self.base_lr is None:
                raise ValueError(
                    f'paramwise_cfg.custom_keys[{key!r}] sets lr_mult but the '
                    f'optimizer cfg has no lr; add lr= to optim_wrapper.optimizer'
                )
            if 'decay_mult' in opts and self.base_wd is None:
                raise ValueError(
                    f'paramwise_cfg.custom_keys[{key!r}] sets decay_mult but the '
                    f'optimizer cfg has no weight_decay; add weight_decay= to '
                    f'optim_wrapper.optimizer'
                )
        for key in ('bias_decay_mult', 'norm_decay_mult', 'dwconv_decay_mult', 'flat_decay_mult'):
            if key in cfg and self.base_wd is None:
                raise ValueError(
                    f'paramwise_cfg.{key} needs a base weight decay but the '
                    f'optimizer cfg has no weight_decay; add weight_decay= to '
                    f'optim_wrapper.optimizer'
                )
        for key in ('bias_lr_mult', 'dcn_offset_lr_mult'):
            if key in cfg and self.base_lr is None:
                raise ValueError(
                    f'paramwise_cfg.{key} needs a base lr but the optimizer cfg '
                    f'has no lr; add lr= to optim_wrapper.optimizer'
                )

    def add_params(
        self,
        params: list[dict],
        module: nn.Module,
        prefix: str = '',
        is_dcn_module: bool | None = None,
        _seen: dict | None = None,
    ) -> None:
        """Append one ``{'params': [p], lr?, weight_decay?}`` group per trainable parameter.

        Args:
            params: The list to append to.
            module: The module to walk (recursively).
            prefix: ``module``'s dotted name in the model.
            is_dcn_module: Whether ``module``'s parent is a deformable conv.
        """
        seen = {} if _seen is None else _seen
        if _seen is None:  # seed with params already in ``params`` (a subclass may add some)
            for group in params:
                for p in group['params']:
                    seen.setdefault(id(p), '(added before)')
        for name, param in module.named_parameters(recurse=False):
            full_name = f'{prefix}.{name}' if prefix else name
            if param.requires_grad and self._claim(seen, param, full_name):
                params.append(self._param_group(module, prefix, name, param, is_dcn_module))

        child_is_dcn = _is_dcn(module)
        for child_name, child in module.named_children():
            child_prefix = f'{prefix}.{child_name}' if prefix else child_name
            self.add_params(
                params, child, prefix=child_prefix, is_dcn_module=child_is_dcn, _seen=seen
            )

    def _claim(self, seen: dict, param: nn.Parameter, full_name: str) -> bool:
        """Whether ``param`` gets a group: False for a tensor already in one under
        ``bypass_duplicate`` (warned), a ValueError without it; ``seen`` records it."""
        if id(param) not in seen:
            seen[id(param)] = full_name
            return True
        if self.paramwise_cfg.get('bypass_duplicate', False):
            warnings.warn(
                f'parameter {full_name!r} is the same tensor as '
                f'{seen[id(param)]!r}; skipped (bypass_duplicate=True)',
                stacklevel=3,
            )
            return False
        raise ValueError(
            f'parameter {full_name!r} is the same tensor as {seen[id(param)]!r} (a shared '
            f'module or tied weights), so it would be in two param groups; set '
            f'paramwise_cfg=dict(bypass_duplicate=True) to keep its first occurrence'
        )

    def _param_group(
        self,
        module: nn.Module,
        prefix: str,
        name: str,
        param: nn.Parameter,
        is_dcn_module: bool | None,
    ) -> dict[str, Any]:
        """``param``'s group: the options of the longest ``custom_keys`` key in its name
        (its ``lr_mult`` / ``decay_mult`` applied to the base values), else the multipliers
        of its kind (bias, norm, depthwise conv, flat, DCN offset)."""
        group: dict[str, Any] = {'params': [param]}
        custom_keys = self.paramwise_cfg.get('custom_keys', {})
        sorted_keys = sorted(sorted(custom_keys), key=len, reverse=True)
        custom_key = next((k for k in sorted_keys if k in f'{prefix}.{name}'), None)
        if custom_key is not None:
            opts = custom_keys[custom_key]
            if self.base_lr is not None:
                group['lr'] = self.base_lr * opts.get('lr_mult', 1.0)
            if self.base_wd is not None:
                group['weight_decay'] = self.base_wd * opts.get('decay_mult', 1.0)
            group.update(opts)
            return group
        cfg = self.paramwise_cfg
        bias_lr_mult = cfg.get('bias_lr_mult', None)
        dcn_offset_lr_mult = cfg.get('dcn_offset_lr_mult', None)
        is_norm = isinstance(module, _NORM_TYPES)
        if name == 'bias' and not (is_norm or is_dcn_module) and bias_lr_mult is not None:
            group['lr'] = self.base_lr * bias_lr_mult
        if (
            'conv_offset' in prefix
            and is_dcn_module
            and dcn_offset_lr_mult is not None
            and isinstance(module, nn.Conv2d)
        ):
            group['lr'] = self.base_lr * dcn_offset_lr_mult
        decay_mult = self._decay_mult(module, name, param, is_norm, is_dcn_module)
        if self.base_wd is not None and decay_mult is not None:
            group['weight_decay'] = self.base_wd * decay_mult
        return group

    def _decay_mult(
        self,
        module: nn.Module,
        name: str,
        param: nn.Parameter,
        is_norm: bool,
        is_dcn_module: bool | None,
    ) -> float | None:
        """The weight-decay multiplier of ``param``'s kind, the first that applies: norm,
        bias (not in a DCN), depthwise conv, flat (1-d, not in a DCN); None: none applies."""
        cfg = self.paramwise_cfg
        norm_decay_mult = cfg.get('norm_decay_mult', None)
        bias_decay_mult = cfg.get('bias_decay_mult', None)
        dwconv_decay_mult = cfg.get('dwconv_decay_mult', None)
        flat_decay_mult = cfg.get('flat_decay_mult', None)
        is_dwconv = isinstance(module, nn.Conv2d) and module.in_channels == module.groups
        if is_norm and norm_decay_mult is not None:
            return norm_decay_mult
        if name == 'bias' and not is_dcn_module and bias_decay_mult is not None:
            return bias_decay_mult
        if is_dwconv and dwconv_decay_mult is not None:
            return dwconv_decay_mult
        if param.ndim == 1 and not is_dcn_module and flat_decay_mult is not None:
            return flat_decay_mult
        return None

    def build_param_groups(self, model: nn.Module) -> list[dict] | list[torch.nn.Parameter]:
        """The ``params`` argument for the optimizer: a list of tensors or of groups."""
        if not self.paramwise_cfg:
            seen: set[int] = set()
            return [
                p
                for p in model.parameters()
                if p.requires_grad and not (id(p) in seen or seen.add(id(p)))  # type: ignore[func-returns-value]
            ]
        params: list[dict] = []
        self.add_params(params, model)
        if self.paramwise_cfg.get('reduce_param_groups', True):
            params = reduce_param_groups(params)
        return params

    def __call__(self, model: nn.Module) -> BaseOptimWrapper:
        """Build the optimizer over ``model``'s trainable parameters and wrap it."""
        if hasattr(model, 'module') and isinstance(model.module, nn.Module):
            model = model.module  # DDP and friends
        optimizer_cls = resolve_optimizer_class(self.optimizer_cfg['type'])
        first_arg = next(iter(inspect.signature(optimizer_cls).parameters))
        params = self.build_param_groups(model)
        if not params:
            raise ValueError(
                f'{type(model).__name__} has no trainable parameter '
                f'(requires_grad=True) to optimize'
            )
        optimizer_cfg = dict(self.optimizer_cfg)
        optimizer_cfg['type'] = optimizer_cls
        optimizer_cfg[first_arg] = params
        optimizer = OPTIMIZERS.build(optimizer_cfg)
        wrapper_cfg = dict(self.optim_wrapper_cfg)
        wrapper_cfg.setdefault('type', 'OptimWrapper')
        return OPTIM_WRAPPERS.build(wrapper_cfg, default_args={'optimizer': optimizer})
