"""Check 4 of ``stratagem doctor``: the sharding settings, read by the
strategies' own parsers so that the doctor and a real run agree.

- FSDP: ``model_wrapper`` (``auto_wrap_policy`` in every form ``wrap_policy.py`` accepts: a
  list of class names or classes, a name, a dict ``transformer_layer_cls`` / ``module_classes``
  / ``size_based``, a callable, an FSDP1 policy; ``ignored_modules``; ``sharding_strategy``,
  ``mixed_precision``, ...), ``activation_checkpointing`` (``options.py``'s forms),
  ``state_dict_cfg``; then the modules each choice selects on the meta-device model, as
  ``FSDPStrategy._wrap_model`` selects them; then the mesh (``mesh.py``).
- DeepSpeed: ``config`` (a dict or a JSON file) merged with the keyword sections and checked
  by ``deepspeed/config.py``; ``gradient_clipping`` against the optim wrapper's ``clip_grad``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .mesh import mesh_findings

if TYPE_CHECKING:
    from torch import nn

__all__ = ['sharding_findings', 'deepspeed_config']


def deepspeed_config(strategy: Mapping) -> tuple[dict, str | None]:
    """(the DeepSpeed config a run would use, why it cannot be read or None): ``config`` (a
    dict or a JSON file path) with the strategy's keyword sections merged in."""
    from stratagem.strategies.deepspeed.config import CONFIG_KEYWORDS, parse_config

    try:
        cfg = parse_config(strategy.get('config'))
    except (OSError, TypeError, ValueError) as err:
        return {}, str(err)
    for key in CONFIG_KEYWORDS:
        value = strategy.get(key)
        if value is None or (key == 'activation_checkpointing' and not isinstance(value, Mapping)):
            continue
        if key in cfg and cfg[key] != value:
            return cfg, (
                f"DeepSpeedStrategy: {key}={value!r} disagrees with the DeepSpeed config's "
                f'{key}={cfg[key]!r}; give it once'
            )
        cfg[key] = value
    return cfg, None


def sharding_findings(
    strategy: Mapping, optim_wrapper: Any, nproc: int, model: nn.Module | None
) -> list[tuple[str, str, str]]:
    """(where, problem, fix) for the strategy's sharding settings."""
    from stratagem.strategies.capabilities import capabilities_of

    caps = capabilities_of(strategy.get('type'), nproc)
    if caps.deepspeed_config:
        return _deepspeed(strategy, optim_wrapper)
    out: list[tuple[str, str, str]] = []
    wrapper = strategy.get('model_wrapper') or {}
    fsdp_like = caps.fully_shards or (
        isinstance(wrapper, Mapping) and 'auto_wrap_policy' in wrapper
    )
    if fsdp_like or strategy.get('activation_checkpointing'):
        out += _fsdp(strategy, model, fsdp_like)
    return out + mesh_findings(strategy, nproc, model)


def _fsdp(strategy: Mapping, model: nn.Module | None, wraps: bool) -> list[tuple[str, str, str]]:
    from stratagem.strategies.fsdp.config import parse_model_wrapper
    from stratagem.strategies.fsdp.options import (
        parse_activation_checkpointing,
        parse_state_dict_cfg,
    )

    out: list[tuple[str, str, str]] = []
    fix = 'change the value as the message says (the run refuses it the same way)'
    wrap = ac = None
    if wraps:
        try:
            wrap = parse_model_wrapper(strategy.get('model_wrapper'))
        except (TypeError, ValueError) as err:
            out.append((_where(str(err), 'strategy.model_wrapper'), str(err), fix))
    try:
        ac = parse_activation_checkpointing(strategy.get('activation_checkpointing'))
    except (TypeError, ValueError) as err:
        out.append(('strategy.activation_checkpointing', str(err), fix))
    try:
        parse_state_dict_cfg(strategy.get('state_dict_type'), strategy.get('state_dict_cfg'))
    except (TypeError, ValueError) as err:
        out.append(('strategy.state_dict_cfg', str(err), fix))
    if ac is not None and (wrap is None or wrap.policy is None) and not out:
        out.append(
            (
                'strategy.activation_checkpointing',
                'activation checkpointing without an auto_wrap_policy: FSDP wraps the whole '
                'model as one unit, so nothing is sharded per layer',
                "add model_wrapper.auto_wrap_policy (e.g. ['Block'], the block class names)",
            )
        )
    if model is None:
        return out
    if wrap is not None:
        try:
            if wrap.policy is not None and not wrap.targets(model):
                out.append(
                    (
                        'strategy.model_wrapper.auto_wrap_policy',
                        'the policy selects no submodule of the model: FSDP shards it as one '
                        'unit (the whole model is gathered in every forward)',
                        'name the block classes (the repeated layers) of the model',
                    )
                )
        except (TypeError, ValueError) as err:
            out.append(
                (_where(str(err), 'strategy.model_wrapper'), str(err), _classes(model, str(err)))
            )
    if ac is not None:
        try:
            ac.selector.select(model, set())
        except (TypeError, ValueError) as err:
            out.append(('strategy.activation_checkpointing', str(err), _classes(model, str(err))))
    return out


def _deepspeed(strategy: Mapping, optim_wrapper: Any) -> list[tuple[str, str, str]]:
    from stratagem.strategies.deepspeed.config import agree, check_config

    cfg, why = deepspeed_config(strategy)
    if why is not None:
        return [('strategy.config', why, 'give each DeepSpeed setting once, in a readable file')]
    try:
        check_config(cfg)
    except (TypeError, ValueError) as err:
        return [('strategy.config', str(err), 'change the config as the message says')]
    ow = optim_wrapper if isinstance(optim_wrapper, Mapping) else {}
    clip = ow.get('clip_grad') or {}
    max_norm = float(clip.get('max_norm', 0) or 0) if isinstance(clip, Mapping) else 0.0
    try:
        agree(dict(cfg), 'gradient_clipping', max_norm, 'optim_wrapper.clip_grad.max_norm')
    except ValueError as err:
        return [('strategy.gradient_clipping', str(err), f'set it to {max_norm:g} or remove it')]
    return []


def _where(message: str, default: str) -> str:
    """The config key a strategy's message starts with (``model_wrapper.ignored_modules: ...``)."""
    head = message.split(':', 1)[0].strip()
    if head.startswith('model_wrapper.'):
        return 'strategy.' + head.split('=')[0].split(' ')[0]
    for key in ('auto_wrap_policy', 'ignored_modules', 'sharding_strategy', 'mixed_precision'):
        if f'model_wrapper.{key}' in message:
            return f'{default}.{key}'
    return default


def _classes(model: nn.Module, message: str) -> str:
    """The fix for a name that matches nothing: the closest class name, and all of them."""
    import difflib
    import re

    names = sorted({type(m).__name__ for m in model.modules()})
    given = re.search(r"\[?'([^']+)'", message)
    close = difflib.get_close_matches(given.group(1), names, n=1) if given else []
    return (f'did you mean {close[0]!r}? ' if close else '') + (
        f'module classes of the model: {", ".join(names)}'
    )
