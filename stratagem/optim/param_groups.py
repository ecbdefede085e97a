"""Per-parameter hyper-parameters and the merging of equal groups (detectron2's solver build).

``get_default_optimizer_params`` follows ``detectron2.solver.build`` (same arguments and
result). ``reduce_param_groups`` merges groups whose hyper-parameters are equal, so a model
with one group per tensor ends up with a handful of groups: multi-tensor (foreach/fused)
optimizers launch one kernel set per group, so fewer groups means faster steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ['NORM_TYPES', 'get_default_optimizer_params', 'reduce_param_groups']

# detectron2's norm list (NaiveSyncBatchNorm subclasses BatchNorm2d).
NORM_TYPES = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.GroupNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
    nn.LocalResponseNorm,
)


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_hashable(v) for v in value))
    if isinstance(value, Mapping):
        return ('dict', tuple(sorted((k, _hashable(v)) for k, v in value.items())))
    if isinstance(value, torch.Tensor):  # e.g. a tensor lr: equal only to itself
        return ('tensor', id(value))
    try:
        hash(value)
    except TypeError:
        return ('id', id(value))
    return (type(value).__name__, value)


def reduce_param_groups(params: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Merge parameter groups whose hyper-parameters (all keys but ``params``) are equal.

    Groups are expanded to one entry per parameter first; a parameter listed again later
    takes the later group's settings (detectron2's rule). The result keeps the order in which
    each distinct setting first appears, and parameters keep their relative order, so the
    output is deterministic. A ``param_names`` list, when present, is merged alongside.
    """
    per_param: dict[int, dict[str, Any]] = {}
    group: Mapping[str, Any] | None
    for group in params:
        if 'params' not in group:
            raise ValueError(f"a param group needs a 'params' key, got keys {sorted(group)}")
        settings = {k: v for k, v in group.items() if k not in ('params', 'param_names')}
        group_params = list(group['params'])
        names = group.get('param_names')
        for i, p in enumerate(group_params):
            entry = per_param.setdefault(id(p), {'params': [p]})
            entry.update(settings)
            if names is not None:
                entry['param_names'] = [names[i]]
    merged: dict[tuple, dict[str, Any]] = {}
    for entry in per_param.values():
        settings = {k: v for k, v in entry.items() if k not in ('params', 'param_names')}
        key = tuple(sorted((k, _hashable(v)) for k, v in settings.items()))
        group = merged.get(key)
        if group is None:
            group = merged[key] = {**settings, 'params': []}
            if 'param_names' in entry:
                group['param_names'] = []
        group['params'].extend(entry['params'])
        if 'param_names' in group and 'param_names' in entry:
            group['param_names'].extend(entry['param_names'])
    return list(merged.values())


def get_default_optimizer_params(
    model: nn.Module,
    base_lr: float | None = None,
    weight_decay: float | None = None,
    weight_decay_norm: float | None = None,
    bias_lr_factor: float | None = 1.0,
    weight_decay_bias: float | None = None,
    lr_factor_func: Callable[[str], float] | None = None,
    overrides: dict[str, dict[str, float]] | None = None,
) -> list[dict[str, Any]]:
    """Parameter groups with detectron2's defaults, already merged by :func:`reduce_param_groups`.

    Args:
        model: The model; frozen and duplicate (shared) parameters are skipped.
        base_lr: Learning rate of every group (``None``: the optimizer's default).
        weight_decay: Weight decay of every group (``None``: the optimizer's default).
        weight_decay_norm: Weight decay of norm-layer parameters (:data:`NORM_TYPES`).
        bias_lr_factor: ``lr = base_lr * bias_lr_factor`` for parameters named ``bias``.
        weight_decay_bias: Weight decay of parameters named ``bias``.
        lr_factor_func: ``f('module.param') -> factor``; multiplies ``base_lr``.
        overrides: ``{param name (e.g. 'pos_embed'): {'lr': ..., 'weight_decay': ...}}``.
    """
    overrides = dict(overrides or {})
    defaults: dict[str, Any] = {}
    if base_lr is not None:
        defaults['lr'] = base_lr
    if weight_decay is not None:
        defaults['weight_decay'] = weight_decay
    bias_overrides: dict[str, Any] = {}
    if bias_lr_factor is not None and bias_lr_factor != 1.0:
        if base_lr is None:
            raise ValueError(
                f'bias_lr_factor={bias_lr_factor} needs base_lr (lr = base_lr * '
                f'bias_lr_factor); pass base_lr'
            )
        bias_overrides['lr'] = base_lr * bias_lr_factor
    if weight_decay_bias is not None:
        bias_overrides['weight_decay'] = weight_decay_bias
    if bias_overrides:
        if 'bias' in overrides:
            raise ValueError(
                f"overrides['bias']={overrides['bias']!r} conflicts with "
                f'bias_lr_factor/weight_decay_bias; set only one of them'
            )
        overrides['bias'] = bias_overrides
    if lr_factor_func is not None and base_lr is None:
        raise ValueError('lr_factor_func needs base_lr (lr = base_lr * factor); pass base_lr')

    params: list[dict[str, Any]] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, value in module.named_parameters(recurse=False):
            if not value.requires_grad or id(value) in seen:
                continue
            seen.add(id(value))
            hyperparams = copy.copy(defaults)
            if isinstance(module, NORM_TYPES) and weight_decay_norm is not None:
                hyperparams['weight_decay'] = weight_decay_norm
            if lr_factor_func is not None:
                hyperparams['lr'] *= lr_factor_func(f'{module_name}.{param_name}')
            hyperparams.update(overrides.get(param_name, {}))
            params.append({'params': [value], **hyperparams})
    return reduce_param_groups(params)
