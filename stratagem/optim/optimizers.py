"""Register every ``torch.optim`` optimizer (and ZeroRedundancyOptimizer, OSS) in OPTIMIZERS.

``ZeroRedundancyOptimizer`` is :class:`stratagem.optim.zero.ZeroRedundancyOptimizer`
(mmengine's signature: ``optimizer_type='AdamW'``), imported on first use; ``OSS`` is
:class:`stratagem.strategies.fairscale.oss.OSS` (fairscale's, ``optim='AdamW'``), which
imports fairscale only when first built.

Imported by the OPTIMIZERS registry on its first lookup, so ``import stratagem``
stays cheap.
"""

from __future__ import annotations

import inspect

import torch

from stratagem.registry import OPTIMIZERS


def register_torch_optimizers() -> list[str]:
    """Register each ``torch.optim.Optimizer`` subclass under its class name; return the names."""
    names = []
    for name in dir(torch.optim):
        if name.startswith('_'):
            continue
        obj = getattr(torch.optim, name)
        if (
            inspect.isclass(obj)
            and issubclass(obj, torch.optim.Optimizer)
            and obj is not torch.optim.Optimizer
        ):
            OPTIMIZERS.register_module(name=name, module=obj, force=True)
            names.append(name)
    return names


TORCH_OPTIMIZERS = register_torch_optimizers()
OPTIMIZERS.register_lazy(
    'ZeroRedundancyOptimizer', 'stratagem.optim.zero:ZeroRedundancyOptimizer', force=True
)
OPTIMIZERS.register_lazy('OSS', 'stratagem.strategies.fairscale.oss:OSS', force=True)
