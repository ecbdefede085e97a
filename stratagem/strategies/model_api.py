"""A wrapped model keeps the model API a host trainer's loop calls on it.

mmengine's loops call ``runner.model.train_step(data, optim_wrapper=...)``, ``val_step`` and
``test_step``. mmengine gives its backend wrappers these methods (``MMDistributedDataParallel``,
``MMFullyShardedDataParallel``, ...); stratagem's backends wrap with the backend's own class
(torch ``DistributedDataParallel``, FSDP, DeepSpeed's engine), so
:func:`expose_model_api` adds them to the wrapper instance when the inner module has them;
``BaseStrategy.prepare`` calls it once, for every backend, on the model its
``setup_module_and_optimizers`` returned.
The methods mirror mmengine's wrappers: ``train_step`` runs the inner module's data
preprocessor and loss parsing around a forward *through the wrapper* (so gradient sync and
sharding hooks run) and calls ``optim_wrapper.update_params``; ``val_step`` / ``test_step``
call the inner module's. Nothing here imports mmengine: it is duck-typed on the module.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stratagem._torch import compiled_inner

__all__ = ['call_model', 'expose_model_api', 'parse_loss', 'split_compile']

_API = ('train_step', 'val_step', 'test_step')


def parse_loss(output: Any) -> torch.Tensor:
    """A tensor loss, or the sum of the ``loss*`` entries of a dict (mmengine's convention)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        losses = [
            v if isinstance(v, torch.Tensor) else sum(v) for k, v in output.items() if 'loss' in k
        ]
        if not losses:
            raise ValueError(
                f'the model returned a dict without a loss entry: keys '
                f'{sorted(output)}; return a tensor or a dict with a "loss" key'
            )
        return sum(losses)  # type: ignore[return-value, arg-type]
    raise TypeError(
        f'the model should return a loss tensor or a dict of losses in training, '
        f'got {type(output).__name__}'
    )


def call_model(model: nn.Module, batch: Any, device: torch.device | None = None) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a list or tuple, else
    ``model(batch)``; tensors moved to ``device`` first (when given)."""
    if isinstance(batch, Mapping):
        return model(
            **{k: _to(v, device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        )
    if isinstance(batch, (list, tuple)):
        return model(*[_to(b, device) if isinstance(b, torch.Tensor) else b for b in batch])
    return model(_to(batch, device))


def _to(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    return tensor if device is None else tensor.to(device)


def expose_model_api(wrapped: nn.Module, module: nn.Module) -> list[str]:
    """Give ``wrapped`` (a backend's wrapper around ``module``) the model API ``module``
    has and the wrapper lacks; returns the names added (none when ``wrapped is module``).

    A ``torch.compile`` wrapper around the backend's (``compile=True``) is looked through:
    the API goes on the backend's wrapper, which the compiled one forwards attribute reads
    to, so on one device (no backend wrapper) the module's own ``train_step`` stays the one
    called."""
    wrapped = compiled_inner(wrapped) or wrapped
    if wrapped is module:
        return []
    added = []
    for name in _API:
        if (
            callable(getattr(module, name, None))
            and not hasattr(type(wrapped), name)
            and name not in wrapped.__dict__
        ):
            step = _train_step if name == 'train_step' else _delegate(name)
            # an instance attribute, not a class change: the wrapper stays the backend's class
            object.__setattr__(wrapped, name, types.MethodType(step, wrapped))
            added.append(name)
    return added


def split_compile(compile: bool | Mapping) -> tuple[bool | Mapping, bool | Mapping]:
    """``(compile while setting up, compile after the API is exposed)``: a ``compile`` whose
    ``target`` is a model-API method (mmengine's runner compiles ``train_step``) names the
    wrapper's method, which exists only once :func:`expose_model_api` ran; any other
    ``compile`` is the set-up's."""
    if isinstance(compile, Mapping) and compile.get('target') in _API:
        return False, compile
    return compile, False


def _inner(wrapped: nn.Module) -> nn.Module:
    return getattr(wrapped, 'module', wrapped)


def _train_step(self: nn.Module, data: Any, optim_wrapper: Any) -> dict:
    """Preprocess, forward through the wrapper in ``mode='loss'``, parse the losses, update
    the parameters; returns the log variables (mmengine's ``train_step`` contract)."""
    module = _inner(self)
    with optim_wrapper.optim_context(self):
        data = module.data_preprocessor(data, training=True)  # type: ignore[operator]
        losses = _run_forward(self, data, 'loss')
    parsed_loss, log_vars = module.parse_losses(losses)  # type: ignore[operator]
    optim_wrapper.update_params(parsed_loss)
    return log_vars


def _run_forward(model: nn.Module, data: Any, mode: str) -> Any:
    if isinstance(data, dict):
        return model(**data, mode=mode)
    if isinstance(data, (list, tuple)):
        return model(*data, mode=mode)
    raise TypeError(
        f'the data preprocessor should return a dict, list or tuple, got {type(data).__name__}'
    )


def _delegate(name: str):
    def step(self: nn.Module, data: Any) -> Any:
        return getattr(_inner(self), name)(data)

    step.__name__ = step.__qualname__ = name
    step.__doc__ = f'``module.{name}(data)`` of the module inside the wrapper.'
    return step
