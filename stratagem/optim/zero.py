"""``ZeroRedundancyOptimizer``: torch's ZeRO-1 optimizer, buildable from a config.

mmengine-compatible (``mmengine.optim.ZeroRedundancyOptimizer``): the wrapped optimizer is
given by name, ``optimizer_type='AdamW'`` (any name registered in ``OPTIMIZERS``, or a
class); torch's own ``optimizer_class`` argument is accepted too. Param groups (from
``paramwise_cfg``) are supported. ``state_dict()`` consolidates the shards on rank 0 (a
collective: every rank must call it) and returns ``{}`` on the other ranks, as mmengine does.
Needs an initialised process group; use it under DDP.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

with warnings.catch_warnings():  # torch.distributed.optim uses the deprecated torch.jit API
    warnings.filterwarnings('ignore', category=DeprecationWarning, message=r'`torch\.jit')
    from torch.distributed.optim import ZeroRedundancyOptimizer as _TorchZeRO

__all__ = ['ZeroRedundancyOptimizer']


class ZeroRedundancyOptimizer(_TorchZeRO):
    """Shard optimizer states across ranks (torch's ``ZeroRedundancyOptimizer``).

    Args:
        params: Parameters or param groups.
        optimizer_type: The local optimizer: a registered name (``'AdamW'``) or a class.
        **kwargs: torch ``ZeroRedundancyOptimizer`` arguments and the local optimizer's
            (``lr``, ``weight_decay``, ...).
    """

    def __init__(
        self, params: Any, optimizer_type: str | type | None = None, **kwargs: Any
    ) -> None:
        optimizer_class = kwargs.pop('optimizer_class', None)
        if (optimizer_type is None) == (optimizer_class is None):
            raise ValueError(
                "ZeroRedundancyOptimizer needs exactly one of optimizer_type='AdamW' "
                f'(a registered name or class) or optimizer_class=<class>, got '
                f'optimizer_type={optimizer_type!r}, optimizer_class={optimizer_class!r}'
            )
        optimizer_type = optimizer_class if optimizer_type is None else optimizer_type
        if isinstance(optimizer_type, str):
            from stratagem.registry import OPTIMIZERS

            cls = OPTIMIZERS.get(optimizer_type)
            if cls is None:
                raise OPTIMIZERS.unknown_name_error(optimizer_type)
            optimizer_type = cls
        if not (
            isinstance(optimizer_type, type) and issubclass(optimizer_type, torch.optim.Optimizer)
        ):
            raise TypeError(
                f'optimizer_type must name a torch.optim.Optimizer subclass, got {optimizer_type!r}'
            )
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            raise RuntimeError(
                'ZeroRedundancyOptimizer shards state across ranks and needs an '
                'initialised process group; launch with torchrun and a DDP '
                'strategy, or use a plain optimizer'
            )
        super().__init__(params, optimizer_type, **kwargs)

    def state_dict(self) -> dict:
        """Consolidated state on rank 0, ``{}`` elsewhere (call it on every rank)."""
        self.consolidate_state_dict()
        return super().state_dict() if torch.distributed.get_rank() == 0 else {}
