"""FSDPStrategy's keys beside ``model_wrapper``: ``state_dict_type`` / mmengine's
``state_dict_cfg``, and ``activation_checkpointing`` (module choices, mmengine's ``check_fn``
forms, ``checkpoint_wrapper_fn``), each mapped or refused naming the key."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from .config import parse_policy
from .wrap_policy import ModuleMatcher, resolve_name

__all__ = ['parse_state_dict_cfg', 'ActivationCheckpointing', 'parse_activation_checkpointing']

_SDC_KEYS = ('state_dict_type', 'state_dict_config', 'optim_state_dict_config')


def parse_state_dict_cfg(state_dict_type: str | None, state_dict_cfg: Any) -> str:
    """Ours (``'sharded'``/``'full'``) or mmengine's ``state_dict_cfg`` → ``'sharded'``/``'full'``.

    mmengine's dict without ``state_dict_type`` means ``'local'`` (its ``_init_state_dict_cfg``);
    its ``state_dict_config``/``optim_state_dict_config`` are accepted, and a full state dict
    is always gathered to CPU on rank 0."""
    mm = {
        'local': 'sharded',
        'sharded': 'sharded',
        'full': 'full',
        'LOCAL_STATE_DICT': 'sharded',
        'SHARDED_STATE_DICT': 'sharded',
        'FULL_STATE_DICT': 'full',
    }
    if state_dict_cfg is not None:
        raw = state_dict_cfg
        if isinstance(raw, Mapping):
            unknown = sorted(set(raw) - set(_SDC_KEYS))
            if unknown:
                raise ValueError(
                    f'FSDPStrategy: unknown state_dict_cfg key(s) {unknown}; '
                    f'valid: {list(_SDC_KEYS)}'
                )
            raw = dict(raw).get('state_dict_type', 'LOCAL_STATE_DICT')
            raw = getattr(raw, 'name', raw)
        if raw not in mm:
            raise ValueError(
                f'FSDPStrategy: state_dict_cfg={state_dict_cfg!r} is not supported; '
                f"use 'local' / 'full' or dict(state_dict_type='SHARDED_STATE_DICT' "
                f"| 'FULL_STATE_DICT'), or state_dict_type='sharded' | 'full'"
            )
        mapped = mm[raw]
        if state_dict_type is not None and state_dict_type != mapped:
            raise ValueError(
                f'FSDPStrategy: state_dict_type={state_dict_type!r} and '
                f'state_dict_cfg={state_dict_cfg!r} disagree; give one of them'
            )
        return mapped
    state_dict_type = state_dict_type or 'sharded'
    if state_dict_type not in ('sharded', 'full'):
        raise ValueError(
            f"FSDPStrategy: state_dict_type={state_dict_type!r}; use 'sharded' "
            f"(a directory of DCP shards) or 'full' (one consolidated file)"
        )
    return state_dict_type


@dataclass
class ActivationCheckpointing:
    """Validated ``activation_checkpointing``: which modules, and the wrapper to apply."""

    selector: Any  # select(model, ignored) -> modules, as an auto_wrap_policy's
    wrapper_fn: Callable | None  # torch's checkpoint_wrapper_fn; None: checkpoint_wrapper

    def apply(self, model: nn.Module, targets: list[nn.Module]) -> list[nn.Module]:
        """Wrap the chosen submodules; ``targets`` come back with a wrapped one replaced by
        its wrapper (so sharding takes the wrapper)."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            ActivationWrapper,
            apply_activation_checkpointing,
        )

        chosen = {id(m) for m in self.selector.select(model, set())}
        extra = {} if self.wrapper_fn is None else {'checkpoint_wrapper_fn': self.wrapper_fn}
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in chosen, **extra)
        outer = {
            id(m._checkpoint_wrapped_module): m  # noqa: SLF001 - torch: ActivationWrapper's only handle on its module
            for m in model.modules()
            if isinstance(m, ActivationWrapper)
        }
        return [outer.get(id(m), m) for m in targets]


def parse_activation_checkpointing(cfg: Any) -> ActivationCheckpointing | None:
    """Module class names / classes, a callable, or mmengine's ``dict(check_fn=...)``.

    ``check_fn``: as above, a function's name (mmengine's ``FUNCTIONS`` or a dotted path) or
    ``dict(type=<function or name>, **args)``: ``partial(function, **args)`` (mmengine binds
    the outer dict's other keys instead of ``args``, a bug; fixed here). The dict's other keys
    go to torch's ``apply_activation_checkpointing`` as in mmengine: ``checkpoint_wrapper_fn``
    (a callable or its name) and ``auto_wrap_policy`` (any ``auto_wrap_policy`` form, in
    place of ``check_fn``); ``module_classes`` is ours."""
    key = 'activation_checkpointing'
    if cfg is None or cfg is False:
        return None
    wrapper_fn = None
    if isinstance(cfg, Mapping):
        cfg = dict(cfg)
        allowed = ('check_fn', 'module_classes', 'auto_wrap_policy', 'checkpoint_wrapper_fn')
        unknown = sorted(set(cfg) - set(allowed))
        given = [k for k in allowed[:3] if cfg.get(k) is not None]
        if unknown or len(given) != 1:
            raise ValueError(
                f'FSDPStrategy: activation_checkpointing takes one of check_fn (a '
                f'callable module -> bool, its name, dict(type=..., **args) or module '
                f'class names), module_classes or auto_wrap_policy, and optionally '
                f'checkpoint_wrapper_fn; got {sorted(cfg)}'
            )
        wrapper_fn = cfg.get('checkpoint_wrapper_fn')
        if isinstance(wrapper_fn, str):
            wrapper_fn, why = resolve_name(wrapper_fn)
            if wrapper_fn is None:
                raise ValueError(
                    f'FSDPStrategy: {key}.checkpoint_wrapper_fn='
                    f'{cfg["checkpoint_wrapper_fn"]!r}: {why}; give the callable '
                    f'or its dotted import path'
                )
        elif wrapper_fn is not None and not callable(wrapper_fn):
            raise TypeError(
                f'FSDPStrategy: {key}.checkpoint_wrapper_fn={wrapper_fn!r} is not callable'
            )
        key = f'{key}.{given[0]}'
        cfg = cfg[given[0]]
        if given[0] == 'module_classes':
            return ActivationCheckpointing(ModuleMatcher(cfg, key), wrapper_fn)
    if isinstance(cfg, Mapping) and 'type' not in cfg:  # not read as a size policy here
        raise ValueError(
            f'FSDPStrategy: {key}={cfg!r} needs type: the function (or its name) '
            f"called as check_fn(module); the dict's other keys are its arguments"
        )
    return ActivationCheckpointing(parse_policy(cfg, key), wrapper_fn)
