"""SingleDeviceStrategy: one process, one device."""
from __future__ import annotations

import torch
from torch import nn

from stratagem.registry import STRATEGIES

from .base import BaseStrategy
from .sync_bn import revert_sync_batchnorm


@STRATEGIES.register_module()
class SingleDeviceStrategy(BaseStrategy):
    """Train on one device: ``device`` if given, else ``cuda`` when available, else ``cpu``.

    SyncBatchNorm layers (meaningless in one process, and they fail without a
    process group) are reverted to BatchNorm, with a log line.
    """

    def __init__(self, *, device: str | torch.device | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        if device is None:
            device = 'cuda' if torch.cuda.is_available() else 'cpu'
        self.device = torch.device(device)

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        model, reverted = revert_sync_batchnorm(model)
        if reverted:
            self.logger.info(f'SingleDeviceStrategy: reverted {reverted} SyncBatchNorm layer(s) '
                             'to BatchNorm (one process has nothing to sync)')
        return model.to(self.device)
