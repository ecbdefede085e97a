"""``OptimWrapperDict``: several named optimizer wrappers (GANs, multi-part models).

mmengine-compatible (``mmengine.optim.OptimWrapperDict``, whose own unit tests pass against
this class). Each wrapper is updated on its own
(``optim_wrapper['generator'].update_params(loss_g)``): ``update_params``, ``backward``,
``step`` and ``optim_context`` raise ``NotImplementedError`` naming the wrappers to call
instead, as mmengine's do. The dict fans out ``zero_grad`` / ``initialize_count_status`` and
merges logging and state: ``get_lr()`` → ``{'<name>.lr': [...]}``, ``state_dict()`` →
``{name: wrapper state}``.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from stratagem.registry import OPTIM_WRAPPERS

from .base import BaseOptimWrapper

__all__ = ['OptimWrapperDict', 'OptimWrapperTypeError']


class OptimWrapperTypeError(TypeError, AssertionError):
    """A value that is not an optimizer wrapper. A ``TypeError``, and an ``AssertionError``
    too because mmengine checks it with ``assert`` (code written for mmengine catches that)."""


@OPTIM_WRAPPERS.register_module()
class OptimWrapperDict(BaseOptimWrapper):
    """A name → :class:`BaseOptimWrapper` mapping that acts on all of them at once.

    Args:
        **optim_wrappers: The wrappers, keyed by name (e.g. ``generator=..., discriminator=...``).
    """

    def __init__(self, **optim_wrappers: BaseOptimWrapper) -> None:
        for name, wrapper in optim_wrappers.items():
            if not isinstance(wrapper, BaseOptimWrapper):
                raise OptimWrapperTypeError(
                    f'`OptimWrapperDict` only accepts optimizer wrappers (BaseOptimWrapper), '
                    f'got {name}={type(wrapper).__name__}; wrap it first, e.g. '
                    f'OptimWrapper({name}_optimizer) or build_optim_wrapper(model.{name}, cfg)'
                )
        self.optim_wrappers: dict[str, BaseOptimWrapper] = dict(optim_wrappers)

    def _no_joint(self, what: str) -> NotImplementedError:
        first = next(iter(self.optim_wrappers), 'generator')
        return NotImplementedError(
            f'`{what}` should be called by each optimizer wrapper separately (OptimWrapperDict '
            f'has no joint {what}): e.g. optim_wrapper[{first!r}].{what}(...); names: '
            f'{", ".join(self.optim_wrappers)}'
        )

    def update_params(
        self, loss: torch.Tensor, step_kwargs: dict | None = None, zero_kwargs: dict | None = None
    ) -> None:
        """Not joint: raises, naming the wrappers to call instead."""
        raise self._no_joint('update_params')

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Not joint: raises, naming the wrappers to call instead."""
        raise self._no_joint('backward')

    def optim_context(self, model: nn.Module) -> AbstractContextManager:
        """Not joint: raises; enter ``optim_wrapper[name].optim_context(model.<name>)``."""
        raise self._no_joint('optim_context')

    def step(self, **kwargs: Any) -> None:
        """Not joint (as in mmengine): raises, naming the wrappers to call instead."""
        raise self._no_joint('step')

    def zero_grad(self, **kwargs: Any) -> None:
        """``zero_grad`` every wrapper."""
        for wrapper in self.optim_wrappers.values():
            wrapper.zero_grad(**kwargs)

    def initialize_count_status(self, model: nn.Module, init_counts: int, max_counts: int) -> None:
        """Forward to every wrapper (each checks ``model``)."""
        for wrapper in self.optim_wrappers.values():
            wrapper.initialize_count_status(model, init_counts, max_counts)  # type: ignore[attr-defined]

    @property
    def param_groups(self) -> dict[str, list[dict]]:  # type: ignore[override]
        """``{name: that wrapper's param_groups}``."""
        return {name: w.param_groups for name, w in self.optim_wrappers.items()}

    @property
    def defaults(self) -> dict[str, dict]:
        return {name: w.defaults for name, w in self.optim_wrappers.items()}

    def get_lr(self) -> dict[str, list]:
        """``{'<name>.lr': [...]}`` for each wrapper."""
        return {
            f'{name}.{k}': v
            for name, w in self.optim_wrappers.items()
            for k, v in w.get_lr().items()
        }

    def get_momentum(self) -> dict[str, list]:
        """``{'<name>.momentum': [...]}`` for each wrapper."""
        return {
            f'{name}.{k}': v
            for name, w in self.optim_wrappers.items()
            for k, v in w.get_momentum().items()
        }

    def state_dict(self) -> dict:
        """``{name: wrapper.state_dict()}``."""
        return {name: w.state_dict() for name, w in self.optim_wrappers.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``{name: state}``; every name must be one of this dict's wrappers."""
        unknown = [n for n in state_dict if n not in self.optim_wrappers]
        if unknown:
            raise KeyError(
                f'state_dict has wrapper name(s) {unknown} that this OptimWrapperDict '
                f'lacks; its names: {", ".join(self.optim_wrappers)}'
            )
        for name, sub_state in state_dict.items():
            self.optim_wrappers[name].load_state_dict(sub_state)

    def __getitem__(self, key: str) -> BaseOptimWrapper:
        if key not in self.optim_wrappers:
            raise KeyError(
                f'no optimizer wrapper named {key!r}; names: {", ".join(self.optim_wrappers)}'
            )
        return self.optim_wrappers[key]

    def __contains__(self, key: object) -> bool:
        return key in self.optim_wrappers

    def __len__(self) -> int:
        return len(self.optim_wrappers)

    def __iter__(self) -> Iterator[str]:
        return iter(self.optim_wrappers)

    def keys(self) -> KeysView[str]:
        return self.optim_wrappers.keys()

    def values(self) -> ValuesView[BaseOptimWrapper]:
        return self.optim_wrappers.values()

    def items(self) -> ItemsView[str, BaseOptimWrapper]:
        return self.optim_wrappers.items()

    def __repr__(self) -> str:
        """One ``name: <name>`` line, then the wrapper's repr, per wrapper (mmengine's form)."""
        body = ''.join(f'\nname: {name}\n{w!r}' for name, w in self.optim_wrappers.items())
        return f'{type(self).__name__}({body}\n)'
