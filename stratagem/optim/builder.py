"""``build_optim_wrapper``: the one entry point from a config to an optimizer wrapper.

``cfg`` is read, never mutated. It is one of:

1. a built wrapper: returned as is;
2. a wrapper cfg whose ``optimizer`` is a built ``torch.optim.Optimizer``: built directly
   from ``OPTIM_WRAPPERS`` (``type`` defaults to ``'OptimWrapper'``);
3. a wrapper cfg with ``optimizer`` (a dict) and/or ``constructor``: the constructor
   (default ``'DefaultOptimWrapperConstructor'``) is built from ``OPTIM_WRAPPER_CONSTRUCTORS``
   with ``optim_wrapper_cfg`` = cfg minus ``constructor``/``paramwise_cfg`` and
   ``paramwise_cfg``, then called with ``model`` (mmengine's ``build_optim_wrapper``);
4. a dict of named wrapper cfgs (no ``type``, ``optimizer`` or ``constructor`` on top):
   :class:`MultiOptimWrapperConstructor` builds each for ``model.get_submodule(name)`` into an
   :class:`~stratagem.optim.OptimWrapperDict` (values may also be built wrappers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stratagem.registry import OPTIM_WRAPPER_CONSTRUCTORS, OPTIM_WRAPPERS

from .base import BaseOptimWrapper
from .optim_wrapper_dict import OptimWrapperDict

__all__ = ['build_optim_wrapper', 'MultiOptimWrapperConstructor']

_SINGLE_KEYS = ('type', 'optimizer', 'constructor')


def build_optim_wrapper(
    model: nn.Module, cfg: Mapping[str, Any] | BaseOptimWrapper
) -> BaseOptimWrapper:
    """Build an optimizer wrapper (or an ``OptimWrapperDict``) for ``model`` from ``cfg``.

    Args:
        model: The model whose trainable parameters are optimized (a DDP-style wrapper's
            ``.module`` is used).
        cfg: See the module docstring; e.g. ``dict(optimizer=dict(type='AdamW', lr=1e-3),
            clip_grad=dict(max_norm=1.0), paramwise_cfg=dict(norm_decay_mult=0.))``.
    """
    if isinstance(cfg, BaseOptimWrapper):
        return cfg
    if not isinstance(cfg, Mapping):
        raise TypeError(
            f'optim_wrapper cfg must be a dict, got {type(cfg).__name__}: {cfg!r}; '
            f"e.g. dict(optimizer=dict(type='SGD', lr=0.01))"
        )
    cfg = dict(cfg)
    optimizer = cfg.get('optimizer')
    if isinstance(optimizer, torch.optim.Optimizer):
        cfg.setdefault('type', 'OptimWrapper')
        if cfg.pop('paramwise_cfg', None):
            raise ValueError(
                'optim_wrapper.paramwise_cfg needs optimizer as a cfg dict, but '
                'optimizer is an already-built optimizer; pass a dict instead'
            )
        return OPTIM_WRAPPERS.build(cfg)
    if any(k in cfg for k in _SINGLE_KEYS):
        constructor_type = cfg.pop('constructor', 'DefaultOptimWrapperConstructor')
        paramwise_cfg = cfg.pop('paramwise_cfg', None)
        constructor = OPTIM_WRAPPER_CONSTRUCTORS.build(
            {'type': constructor_type, 'optim_wrapper_cfg': cfg, 'paramwise_cfg': paramwise_cfg}
        )
        return constructor(model)
    if not cfg:
        raise ValueError(
            "optim_wrapper cfg is empty; give optimizer=dict(type='SGD', lr=0.01) "
            'or named cfgs such as generator=dict(optimizer=...)'
        )
    return MultiOptimWrapperConstructor(cfg)(model)


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class MultiOptimWrapperConstructor:
    """Builds an :class:`OptimWrapperDict`: one wrapper per named submodule.

    Args:
        optim_wrapper_cfg: ``{submodule name: wrapper cfg or built wrapper}``; names are
            dotted paths for ``model.get_submodule`` (e.g. ``'generator'``).
        paramwise_cfg: Default ``paramwise_cfg`` for the cfgs that have none.
    """

    def __init__(
        self, optim_wrapper_cfg: Mapping[str, Any], paramwise_cfg: Mapping | None = None
    ) -> None:
        if not isinstance(optim_wrapper_cfg, Mapping) or not optim_wrapper_cfg:
            raise TypeError(
                f'optim_wrapper_cfg must be a non-empty dict of named wrapper cfgs, '
                f'got {optim_wrapper_cfg!r}'
            )
        for name, sub in optim_wrapper_cfg.items():
            if isinstance(sub, BaseOptimWrapper):
                continue
            if not isinstance(sub, Mapping) or not any(k in sub for k in _SINGLE_KEYS):
                raise ValueError(
                    f'optim_wrapper.{name}={sub!r}: with several optimizers each entry must be '
                    f"a wrapper cfg, e.g. {name}=dict(optimizer=dict(type='Adam', lr=1e-4)); "
                    f'a single optimizer goes at the top: optim_wrapper=dict(optimizer=...)'
                )
        self.optim_wrapper_cfg = dict(optim_wrapper_cfg)
        self.paramwise_cfg = paramwise_cfg

    def __call__(self, model: nn.Module) -> OptimWrapperDict:
        if hasattr(model, 'module') and isinstance(model.module, nn.Module):
            model = model.module
        wrappers = {}
        for name, sub in self.optim_wrapper_cfg.items():
            if isinstance(sub, BaseOptimWrapper):
                wrappers[name] = sub
                continue
            try:
                submodule = model.get_submodule(name)
            except AttributeError:
                children = ', '.join(n for n, _ in model.named_children()) or '(none)'
                raise ValueError(
                    f'optim_wrapper has a cfg named {name!r} but '
                    f'{type(model).__name__} has no submodule {name!r}; name each '
                    f'cfg after a submodule: {children}'
                ) from None
            sub = dict(sub)
            if self.paramwise_cfg is not None:
                sub.setdefault('paramwise_cfg', self.paramwise_cfg)
            wrappers[name] = build_optim_wrapper(submodule, sub)
        return OptimWrapperDict(**wrappers)
