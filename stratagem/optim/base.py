"""``BaseOptimWrapper``: the interface every optimizer wrapper offers a training loop.

A loop (or a strategy) only talks to this interface:

1. ``with optim_wrapper.optim_context(model):`` forward and loss,
2. ``optim_wrapper.update_params(loss)`` (backward; step and zero_grad when due),
3. ``get_lr()`` / ``get_momentum()`` for logging, ``state_dict()`` / ``load_state_dict()``
   for checkpoints.

Names follow ``mmengine.optim.BaseOptimWrapper``. Unlike mmengine, no placeholder group
(``base_param_settings``) is appended to ``param_groups``: schedulers see exactly the
optimizer's groups. A ``base_param_settings`` key in a loaded mmengine state_dict is ignored.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

__all__ = ['BaseOptimWrapper', 'check_optimizer']

_OPTIMIZER_METHODS = ('step', 'zero_grad', 'state_dict', 'load_state_dict')


def check_optimizer(optimizer: Any, owner: str) -> None:
    """Raise TypeError unless ``optimizer`` looks like a ``torch.optim.Optimizer``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return
    missing = [m for m in _OPTIMIZER_METHODS if not callable(getattr(optimizer, m, None))]
    if missing or not hasattr(optimizer, 'param_groups'):
        raise TypeError(
            f'{owner} needs a torch.optim.Optimizer (or an object with param_groups, '
            f'{", ".join(_OPTIMIZER_METHODS)}), got {type(optimizer).__name__}: {optimizer!r}; '
            f'build one first, e.g. torch.optim.SGD(model.parameters(), lr=0.01), or pass a '
            f"config such as optimizer=dict(type='SGD', lr=0.01) to build_optim_wrapper"
        )


class BaseOptimWrapper(metaclass=ABCMeta):
    """Abstract optimizer wrapper around ``optimizer`` (a ``torch.optim.Optimizer``).

    Subclasses implement :meth:`update_params`, :meth:`backward`, :meth:`step`,
    :meth:`zero_grad` and :meth:`optim_context`; the optimizer-facing accessors live here.
    """

    #: mmengine appends a placeholder group holding the optimizer's defaults to
    #: ``param_groups`` when there are several groups, and names it here; stratagem appends
    #: none (schedulers see exactly the optimizer's groups), so this is always None.
    base_param_settings: dict | None = None

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        check_optimizer(optimizer, type(self).__name__)
        self.optimizer = optimizer

    @abstractmethod
    def update_params(
        self, loss: torch.Tensor, step_kwargs: dict | None = None, zero_kwargs: dict | None = None
    ) -> None:
        """Backward ``loss``, then step and zero the gradients when an update is due."""

    @abstractmethod
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Compute gradients of ``loss`` (``kwargs`` go to ``Tensor.backward``)."""

    @abstractmethod
    def step(self, **kwargs: Any) -> None:
        """Update the parameters (``kwargs`` go to ``optimizer.step``)."""

    @abstractmethod
    def zero_grad(self, **kwargs: Any) -> None:
        """Clear the gradients (``kwargs`` go to ``optimizer.zero_grad``)."""

    @abstractmethod
    def optim_context(self, model: nn.Module) -> AbstractContextManager:
        """Context for the forward pass (gradient-sync control, autocast)."""

    def state_dict(self) -> dict:
        """The optimizer's state_dict (subclasses add their own keys)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict made by :meth:`state_dict` (or by mmengine)."""
        self.optimizer.load_state_dict(state_dict)

    @property
    def param_groups(self) -> list[dict]:
        """The optimizer's ``param_groups`` (the same list; schedulers edit it in place)."""
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict:
        """The optimizer's ``defaults``."""
        return self.optimizer.defaults

    def get_lr(self) -> dict[str, list]:
        """``{'lr': [lr of each param group]}``."""
        return {'lr': [group['lr'] for group in self.param_groups]}

    def get_momentum(self) -> dict[str, list]:
        """``{'momentum': [...]}``: ``momentum``, else ``betas[0]`` (Adam family), else 0."""
        momentum = []
        for group in self.param_groups:
            if 'momentum' in group:
                momentum.append(group['momentum'])
            elif 'betas' in group:
                momentum.append(group['betas'][0])
            else:
                momentum.append(0)
        return {'momentum': momentum}

    def __repr__(self) -> str:
        return f'{type(self).__name__}(\noptimizer: \n{self.optimizer!r}\n)'
