"""Helpers shared by the scheduler classes: optimizer access and argument checks.

Owns the duck-typed optimizer check (``check_optimizer``: a torch Optimizer or an optim
wrapper, without importing ``stratagem.optim``), the raw optimizer behind a wrapper
(``raw_optimizer``), per-param-group arguments (``per_group``), the plain containers of a
state dict (``_plain``) and the small argument checks of the concrete schedulers
(``_check_factor``, ``_check_positive_int``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ['check_optimizer', 'raw_optimizer', 'per_group']


def check_optimizer(optimizer: Any, owner: str) -> None:
    """Raise TypeError unless ``optimizer`` is a torch Optimizer or an optim wrapper.

    An optim wrapper is recognised by duck typing (its ``.optimizer`` is a torch
    Optimizer and it has ``.param_groups``), so this package never imports
    ``stratagem.optim``.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return
    try:  # a dict of wrappers may raise something other than AttributeError here
        inner = getattr(optimizer, 'optimizer', None)
    except Exception:  # noqa: BLE001
        inner = None
    if isinstance(inner, torch.optim.Optimizer) and hasattr(optimizer, 'param_groups'):
        return
    raise TypeError(
        f'{owner}: optimizer should be an Optimizer (a torch.optim.Optimizer or an '
        'optim wrapper whose .optimizer is one), but got '
        f'{type(optimizer).__name__}: {optimizer!r:.80}'
    )


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch Optimizer behind ``optimizer`` (itself, or a wrapper's ``.optimizer``)."""
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer


def _plain(value: Any) -> Any:
    """``value`` with containers turned into plain list/dict (weights_only-loadable)."""
    if isinstance(value, dict):  # Counter, OrderedDict, ... become dict
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def per_group(value: Any, n_groups: int, owner: str, arg: str) -> list:
    """``value`` repeated per param group, or checked to have one entry per group."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n_groups:
            raise ValueError(
                f'{owner}: {arg} has {len(value)} values but the optimizer has '
                f'{n_groups} param groups; give one value or one per group'
            )
        return list(value)
    return [value] * n_groups


def _check_factor(owner: str, arg: str, value: float) -> None:
    if not 0 <= value <= 1:
        raise ValueError(f'{owner}: {arg} must be in [0, 1], got {value!r}')


def _check_positive_int(owner: str, arg: str, value: Any) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f'{owner}: {arg} must be a positive int, got {value!r}')
