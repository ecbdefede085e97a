"""Synchronised batch norm: a CPU (gloo) SyncBatchNorm, and converting norms both ways.

torch's ``nn.SyncBatchNorm`` raises "SyncBatchNorm layers only work with GPU
modules" on CPU. :class:`CPUSyncBatchNorm` computes the same statistics —
batch mean and variance over every rank's samples — with a differentiable
all-reduce of (count, sum, sum of squares), so gradients flow through the
global statistics exactly as in torch's CUDA kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks, differentiable: each input's gradient is the sum of the ranks'
    output gradients (every rank's output depends on every rank's input)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def differentiable_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return _AllReduceSum.apply(tensor)


class AnyRankBatchNorm(nn.modules.batchnorm._BatchNorm):  # noqa: SLF001 - torch: no public base class of the batch norms
    """BatchNorm over dim 1 for inputs of any rank >= 2, as SyncBatchNorm accepts them."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f'expected at least 2D input (got {input.dim()}D input)')


class CPUSyncBatchNorm(AnyRankBatchNorm):
    """Batch norm whose training statistics span all ranks (any input rank >= 2, channels dim 1)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        # as torch's SyncBatchNorm: synchronise only in training (eval may run on one rank)
        if not self.training or not (dist.is_available() and dist.is_initialized()):
            return super().forward(input)
        dims = [0] + list(range(2, input.dim()))
        x = input.float()
        c = self.num_features
        count = torch.full((1,), input.numel() / c, dtype=torch.float32)
        # two passes (mean, then squared deviations) rather than E[x^2] - mean^2, which
        # cancels catastrophically in float32 when |mean| >> std
        first = differentiable_all_reduce(torch.cat([count, x.sum(dims)]))
        n = first[0]
        mean = first[1:] / n
        shape = [1, c] + [1] * (input.dim() - 2)
        centred = x - mean.view(shape)
        var = differentiable_all_reduce((centred * centred).sum(dims)) / n
        if self.track_running_stats:
            assert (
                self.num_batches_tracked is not None
                and self.running_mean is not None
                and self.running_var is not None
            )  # tracked: the buffers exist
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = (
                    1.0 / float(self.num_batches_tracked)
                    if self.momentum is None
                    else self.momentum
                )
                unbiased = var * (n / (n - 1).clamp_min(1))
                self.running_mean.mul_(1 - momentum).add_(mean * momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased * momentum)
        out = centred * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)


def convert_sync_batchnorm(module: nn.Module, device_type: str) -> tuple[nn.Module, int]:
    """BatchNorm layers → torch SyncBatchNorm on CUDA, :class:`CPUSyncBatchNorm` otherwise.

    Returns the converted module and the number of layers converted. State
    (affine parameters, running statistics) is carried over.
    """
    if device_type == 'cuda':
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(module)
        return converted, sum(isinstance(m, nn.SyncBatchNorm) for m in converted.modules())
    return replace_batchnorms(
        module, lambda m: not isinstance(m, (CPUSyncBatchNorm, nn.SyncBatchNorm)), CPUSyncBatchNorm
    )


def revert_sync_batchnorm(module: nn.Module) -> tuple[nn.Module, int]:
    """Every SyncBatchNorm (torch's or ours) → a BatchNorm with the same state, for one process.

    The replacement accepts any input rank >= 2, as SyncBatchNorm did.
    """
    return replace_batchnorms(
        module, lambda m: isinstance(m, (nn.SyncBatchNorm, CPUSyncBatchNorm)), AnyRankBatchNorm
    )


def replace_batchnorms(
    module: nn.Module,
    match: Callable[[nn.Module], bool],
    new_cls: type[nn.modules.batchnorm._BatchNorm],
) -> tuple[nn.Module, int]:
    """Replace each BatchNorm-like layer for which ``match`` holds by ``new_cls``, sharing state.

    Returns the (possibly new) root module and the number of layers replaced.
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and match(module):  # noqa: SLF001 - torch: no public base class of the batch norms
        new = new_cls(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        if module.track_running_stats:
            new.running_mean, new.running_var = module.running_mean, module.running_var
            new.num_batches_tracked = module.num_batches_tracked
        new.training = module.training
        return new, 1
    count = 0
    for name, child in module.named_children():
        new_child, n = replace_batchnorms(child, match, new_cls)
        if new_child is not child:
            setattr(module, name, new_child)
        count += n
    return module, count
