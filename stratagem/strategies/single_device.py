"""SingleDeviceStrategy: one process, one device."""
from __future__ import annotations

import torch
from torch import nn

from stratagem.registry import STRATEGIES

from .base import BaseStrategy


def revert_sync_batchnorm(module: nn.Module) -> tuple[nn.Module, int]:
    """Replace every SyncBatchNorm in ``module`` by a BatchNorm with the same state.

    Returns the (possibly new) module and how many layers were reverted.
    """
    count = 0
    if isinstance(module, nn.SyncBatchNorm):
        # SyncBatchNorm accepts any input rank; BatchNorm1d/2d/3d check theirs, so the
        # generic _BatchNorm base (no rank check) keeps the module usable as it was.
        new = _AnyRankBatchNorm(module.num_features, module.eps, module.momentum,
                                module.affine, module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                new.weight = module.weight
                new.bias = module.bias
        new.running_mean = module.running_mean
        new.running_var = module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.training = module.training
        return new, 1
    for name, child in module.named_children():
        new_child, n = revert_sync_batchnorm(child)
        if new_child is not child:
            setattr(module, name, new_child)
        count += n
    return module, count


class _AnyRankBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over dim 1 for inputs of any rank >= 2 (what SyncBatchNorm accepts)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f'expected at least 2D input (got {input.dim()}D input)')


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

    def _unwrap_model(self) -> nn.Module:
        model = self.model
        # torch.compile wraps the module; its state dict keys must stay the plain ones
        return getattr(model, '_orig_mod', model)
