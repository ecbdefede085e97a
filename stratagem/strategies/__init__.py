"""Training strategies behind ``BaseStrategy``, built by ``build_strategy``: one file per small
backend (``single_device.py``, ``ddp.py``), one folder per large one (``fsdp/``, ``deepspeed/``,
``fairscale/``), each registered here in one line."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stratagem.checkpoint.formats import register_format
from stratagem.registry import STRATEGIES

from .base import BaseStrategy
from .ddp import DDPStrategy
from .fairscale import ShardedDDPStrategy
from .single_device import SingleDeviceStrategy

__all__ = [
    'BaseStrategy',
    'SingleDeviceStrategy',
    'DDPStrategy',
    'ShardedDDPStrategy',
    'FSDPStrategy',
    'DeepSpeedStrategy',
    'build_strategy',
]

STRATEGIES.register_lazy('FSDPStrategy', 'stratagem.strategies.fsdp:FSDPStrategy')
# imported on first use: DeepSpeed is an optional extra and slow to import
STRATEGIES.register_lazy('DeepSpeedStrategy', 'stratagem.strategies.deepspeed:DeepSpeedStrategy')


def _is_zero(path: Path) -> bool:
    from .deepspeed.files import is_zero_checkpoint

    return is_zero_checkpoint(path)


def _read_zero(path: Path, progress: Callable[[int, int], None] | None) -> dict:
    from .deepspeed.files import read_zero_checkpoint  # DeepSpeed: only for its shards

    return read_zero_checkpoint(path)


# DeepSpeedStrategy's directories: read by every strategy's load_checkpoint and by convert
register_format('zero', _is_zero, _read_zero)


def __getattr__(name: str) -> Any:
    if name == 'FSDPStrategy':  # torch.distributed.fsdp is imported only when used
        from .fsdp import FSDPStrategy

        return FSDPStrategy
    if name == 'DeepSpeedStrategy':
        from .deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def build_strategy(cfg: Mapping | BaseStrategy) -> BaseStrategy:
    """Build a strategy from ``cfg`` (``type`` a STRATEGIES name, a class, or ``'auto'``).

    ``type='auto'`` (also the default when ``type`` is missing) picks
    SingleDeviceStrategy for a single process and DDPStrategy when the launch
    environment (``env_kwargs.launcher`` or the inferred launcher) is distributed.
    The caller's cfg is not mutated.
    """
    if isinstance(cfg, BaseStrategy):
        return cfg
    if not isinstance(cfg, Mapping):
        raise TypeError(f'strategy cfg should be a dict, got {type(cfg).__name__}: {cfg!r}')
    cfg = copy.deepcopy(dict(cfg))
    if cfg.get('type', 'auto') == 'auto':
        cfg['type'] = _auto_strategy(cfg)
    return STRATEGIES.build(cfg)


def _auto_strategy(cfg: Mapping[str, Any]) -> str:
    from stratagem.env import infer_launcher, is_distributed

    launcher = (cfg.get('env_kwargs') or {}).get('launcher') or infer_launcher()
    if launcher == 'none' and not is_distributed():
        return 'SingleDeviceStrategy'
    return 'DDPStrategy'
