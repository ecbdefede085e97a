"""What ``OptimWrapper`` checks and parses: clip_grad configs, counters, no_sync, BatchNorm.

Owns the ``clip_grad`` parsing (:func:`parse_clip_grad` and its table of clip types), the
detection of a model's ``no_sync`` (:func:`has_no_sync`), the check of the accumulation
counters (``_check_count``) and the warning that gradient accumulation does not change
what BatchNorm's running statistics see (``_warn_batchnorm_accumulation``). The wrapper
itself lives in ``stratagem.optim.optim_wrapper``, which re-exports these names.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stratagem._torch import BatchNormBase

__all__ = ['parse_clip_grad', 'has_no_sync']

# type -> (function, log name, required keys, optional keys)
_CLIP_TYPES = {
    'norm': (
        torch.nn.utils.clip_grad_norm_,
        'grad_norm',
        ('max_norm',),
        ('norm_type', 'error_if_nonfinite', 'foreach'),
    ),
    'value': (torch.nn.utils.clip_grad_value_, 'grad_value', ('clip_value',), ('foreach',)),
}


def parse_clip_grad(clip_grad: Mapping | None) -> tuple[Any, str, dict]:
    """Validate ``clip_grad`` → ``(clip function or None, log name, kwargs)``; never mutates it."""
    if clip_grad is None:
        return None, 'grad_norm', {}
    if not isinstance(clip_grad, Mapping) or not clip_grad:
        raise TypeError(
            f'clip_grad must be None or a non-empty dict, got {clip_grad!r}; use '
            f"dict(type='norm', max_norm=1.0[, norm_type=2]) or dict(type='value', clip_value=1.0)"
        )
    kwargs = dict(clip_grad)
    clip_type = kwargs.pop('type', 'norm')
    if clip_type not in _CLIP_TYPES:
        raise ValueError(
            f'clip_grad type {clip_type!r} is unknown (clip_grad={dict(clip_grad)!r}); type must '
            f"be 'norm' (torch.nn.utils.clip_grad_norm_, needs max_norm) or 'value' "
            f'(torch.nn.utils.clip_grad_value_, needs clip_value)'
        )
    func, name, required, optional = _CLIP_TYPES[clip_type]
    missing = [k for k in required if k not in kwargs]
    unexpected = [k for k in kwargs if k not in required + optional]
    if missing or unexpected:
        raise ValueError(
            f"clip_grad={dict(clip_grad)!r}: type '{clip_type}' takes "
            f'{", ".join(required + optional)} ({", ".join(required)} required); '
            + (
                f'missing {", ".join(missing)}'
                if missing
                else f'unexpected {", ".join(unexpected)}'
            )
        )
    for key in required:
        value = kwargs[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(
                f'clip_grad={dict(clip_grad)!r}: {key} must be a positive number, got {value!r}'
            )
    return func, name, kwargs


def has_no_sync(model: nn.Module) -> bool:
    """Whether ``model`` has a ``no_sync`` method (DDP, FSDP), without ``hasattr(model, ...)``:
    a missing attribute on an ``nn.Module`` goes through ``Module.__getattr__``, which builds
    an error message, ~1 µs per accumulation step."""
    return hasattr(type(model), 'no_sync') or 'no_sync' in vars(model)


def _check_count(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f'{name} must be an int >= {minimum}, got {value!r}')
    return value


def _warn_batchnorm_accumulation(model: nn.Module, accumulative_counts: int) -> None:
    """Warn (at the caller of ``initialize_count_status``) when accumulating over BatchNorm."""
    if accumulative_counts > 1 and any(isinstance(m, BatchNormBase) for m in model.modules()):
        warnings.warn(
            'gradient accumulation with BatchNorm layers: the running statistics '
            'see micro-batches, not the accumulated batch',
            stacklevel=3,
        )
