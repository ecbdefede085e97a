"""Training strategies behind ``BaseStrategy``, built by ``build_strategy``: one file per small
backend (``single_device.py``, ``ddp.py``), one folder per large one (``fsdp/``, ``deepspeed/``,
``fairscale/``). A backend that is cheap to import registers itself (``@STRATEGIES.
register_module()``) and is imported here; one that is slow to import (FSDP, DeepSpeed) is
registered here in one line, ``STRATEGIES.register_lazy``, which also makes it a name of this
package, imported on first use."""

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

# imported on first use: torch.distributed.fsdp and DeepSpeed (an optional extra) are slow
_LAZY = {
    'FSDPStrategy': 'stratagem.strategies.fsdp:FSDPStrategy',
    'DeepSpeedStrategy': 'stratagem.strategies.deepspeed:DeepSpeedStrategy',
}
for _name, _target in _LAZY.items():
    STRATEGIES.register_lazy(_name, _target)

__all__ = [
    'BaseStrategy',
    'SingleDeviceStrategy',
    'DDPStrategy',
    'ShardedDDPStrategy',
    *_LAZY,
    'build_strategy',
]


def _is_zero(path: Path) -> bool:
    from .deepspeed.files import is_zero_checkpoint

    return is_zero_checkpoint(path)


def _read_zero(path: Path, progress: Callable[[int, int], None] | None) -> dict:
    from .deepspeed.files import read_zero_checkpoint  # DeepSpeed: only for its shards

    return read_zero_checkpoint(path)


# DeepSpeedStrategy's directories: read by every strategy's load_checkpoint and by convert
register_format('zero', _is_zero, _read_zero)


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # imported only when used
        return STRATEGIES.get(name)
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
