"""SingleDeviceStrategy: one process, one device."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override

from stratagem.registry import STRATEGIES

from .base import BaseStrategy
from .capabilities import Capabilities
from .sync_bn import revert_sync_batchnorm


@STRATEGIES.register_module()
class SingleDeviceStrategy(BaseStrategy):
    """Train on one device: ``device`` if given, else :func:`stratagem.env.default_device`
    (the current CUDA device when there is one, else ``cpu``).

    A device this machine does not have (``'gpu'``, ``'cuda'`` without CUDA, ``'cuda:3'``
    with two GPUs) is a ``ValueError`` listing the devices that are, raised before anything
    is set up.

    SyncBatchNorm layers (meaningless in one process, and they fail without a
    process group) are reverted to BatchNorm, with a log line.
    """

    capabilities = Capabilities()

    def __init__(self, *, device: str | torch.device | None = None, **kwargs) -> None:
        # checked before the environment or any file is set up; BaseStrategy.device reads it
        self._device = None if device is None else check_device(device)
        super().__init__(**kwargs)

    @override
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        model, reverted = revert_sync_batchnorm(model)
        if reverted:
            self.logger.info(
                f'SingleDeviceStrategy: reverted {reverted} SyncBatchNorm layer(s) '
                'to BatchNorm (one process has nothing to sync)'
            )
        return model.to(self.device)


def available_devices() -> list[str]:
    """The device strings this machine can run on: ``cpu``, each ``cuda:N``, ``mps``."""
    found = ['cpu'] + [f'cuda:{i}' for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, 'mps', None)
    if mps is not None and mps.is_available():
        found.append('mps')
    return found


def check_device(device: str | torch.device) -> torch.device:
    """``torch.device(device)``, refusing what torch cannot parse or this machine lacks."""
    here = available_devices()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        hint = " (did you mean 'cuda'?)" if str(device).lower().startswith('gpu') else ''
        raise ValueError(
            f'strategy device={device!r} is not a device name{hint}: use '
            f"'cpu', 'cuda', 'cuda:N' or 'mps'; this machine has: "
            f'{", ".join(here)}'
        ) from None
    if dev.type == 'cuda':
        if not torch.cuda.is_available():
            why = (
                'this torch was built without CUDA'
                if torch.version.cuda is None
                else f'torch (CUDA {torch.version.cuda}) sees no GPU'
            )
            raise ValueError(
                f"strategy device={device!r}, but {why}; use device='cpu', or "
                f'leave device unset to pick cuda when there is one. This machine '
                f'has: {", ".join(here)}'
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f'strategy device={device!r}: there are only '
                f'{torch.cuda.device_count()} GPU(s) (cuda:0 to '
                f'cuda:{torch.cuda.device_count() - 1}) visible'
            )
    if dev.type == 'mps' and 'mps' not in here:
        raise ValueError(
            f'strategy device={device!r}, but MPS is not available here; this '
            f'machine has: {", ".join(here)}'
        )
    return dev
