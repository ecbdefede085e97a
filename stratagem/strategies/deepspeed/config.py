"""DeepSpeedStrategy's config at the boundary: parsed, checked, reconciled with the wrapper.

Every check here runs before DeepSpeed starts or the environment changes, so a bad value
fails with the key, the values and the fix, and nothing is half set up.
"""

from __future__ import annotations

import copy
import json
import os
import os.path as osp
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ['CONFIG_KEYWORDS', 'parse_config', 'check_config', 'agree']

#: the DeepSpeed config sections DeepSpeedStrategy also takes as keywords (mmengine's arguments)
CONFIG_KEYWORDS = (
    'zero_optimization',
    'gradient_clipping',
    'fp16',
    'bf16',
    'amp',
    'activation_checkpointing',
    'aio',
    'train_micro_batch_size_per_gpu',
    'gradient_accumulation_steps',
)


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get('enabled', False))


def agree(cfg: dict, key: str, value: float, source: str) -> None:
    given = cfg.get(key)
    if given is not None and float(given) != float(value):
        raise ValueError(
            f'DeepSpeed {key}={given!r} disagrees with {source}={value!r}: stratagem derives '
            f"DeepSpeed's {key} from the optim wrapper (one source of truth); remove {key} from "
            f'the strategy / DeepSpeed config, or set the optim wrapper to match'
        )
    cfg[key] = type(value)(value)


def parse_config(config: str | Mapping | None) -> dict:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        if not osp.isfile(config):
            raise FileNotFoundError(
                f'DeepSpeedStrategy: config file {config!r} does not exist; '
                'pass a DeepSpeed config dict or the path of a JSON file'
            )
        try:
            with open(config) as file:
                loaded = json.load(file)
        except ValueError as err:
            raise ValueError(
                f'DeepSpeedStrategy: config file {config!r} is not valid JSON: {err}'
            ) from None
        if not isinstance(loaded, dict):
            raise ValueError(
                f'DeepSpeedStrategy: config file {config!r} holds a '
                f'{type(loaded).__name__}, not a JSON object'
            )
        return loaded
    raise TypeError(
        f'DeepSpeedStrategy: config must be a dict, a JSON file path or None, '
        f'got {type(config).__name__}'
    )


def check_config(cfg: dict) -> None:
    for key, use in (
        ('optimizer', "optim_wrapper=dict(optimizer=dict(type='AdamW', ...))"),
        ('scheduler', 'param_scheduler=[...]'),
    ):
        if key in cfg:
            raise ValueError(
                f'DeepSpeedStrategy: the DeepSpeed config has a {key!r} section '
                f'({cfg[key]!r}); stratagem builds it from {use} (one source of '
                f'truth, and torch optimizers need no JIT build): remove it'
            )
    if cfg.get('managed_gradient_accumulation', False) is not False:
        raise ValueError(
            'DeepSpeedStrategy: managed_gradient_accumulation must not be set: '
            'the optim wrapper owns the accumulation boundary (it is set to false)'
        )
    if (cfg.get('checkpoint') or {}).get('checkpoint_serialization', True) is False:
        raise ValueError(
            'DeepSpeedStrategy: checkpoint.checkpoint_serialization=false asks for '
            "torch's legacy (pre-1.6) file format, which stratagem does not write: "
            "it writes DeepSpeed's files itself, in torch's zip format, hashed as "
            'written (every torch since 1.6 reads them); remove the key'
        )
    if _enabled(cfg.get('fp16')) and not torch.cuda.is_available():
        raise ValueError(
            "DeepSpeedStrategy: fp16=dict(enabled=True) needs CUDA (DeepSpeed's "
            'CPU accelerator refuses fp16); use bf16=dict(enabled=True) on CPU'
        )
    if _enabled(cfg.get('fp16')) and _enabled(cfg.get('bf16')):
        raise ValueError('DeepSpeedStrategy: fp16 and bf16 are both enabled; enable one')
    stage = (cfg.get('zero_optimization') or {}).get('stage', 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f'DeepSpeedStrategy: zero_optimization.stage={stage!r}; valid: 0-3')
