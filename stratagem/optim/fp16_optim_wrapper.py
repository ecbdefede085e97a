"""``Fp16MasterWeightsOptimWrapper``: float16 model, float32 master weights (mmcv's classic
``Fp16OptimizerHook`` as an optimizer wrapper).

Use: build the wrapper while the model is still float32 (the master copies are then exact),
then make the model float16, e.g. ``wrap_fp16_model(model, half=True)`` (norm layers stay
float32); ``model.half()`` keeps the parameter objects, so the wrapper still sees them.

Construction replaces the optimizer's parameters by float32 copies (the masters; optimizer
state moves along), remembering which model parameter each belongs to (by identity, not by
position as mmcv did). Per update:

1. ``backward``: ``(loss * loss_scale).backward()`` into the model's float16 gradients;
2. ``step``: copy the gradients to the masters in float32, check them for inf/nan and
   unscale them in one fused pass (one host sync, as mmcv and GradScaler need to decide);
   on overflow skip the update (``skipped_steps += 1``); otherwise clip (if configured),
   ``optimizer.step()`` on the masters and copy them back into the model;
3. ``loss_scaler.update_scale(overflow)``;
4. ``zero_grad``: the masters' and the model's gradients.

``state_dict()`` = :class:`OptimWrapper`'s + ``'fp32_master_weights'`` (``{flat index:
tensor}``), ``'loss_scaler'`` (plain values) and ``'skipped_steps'``. Pending gradients of an
open accumulation window are the model's (float16) ones.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from stratagem._torch import unscale_and_check_
from stratagem.registry import OPTIM_WRAPPERS

from .fp16 import LossScaler, _by_device
from .optim_wrapper import OptimWrapper

__all__ = ['Fp16MasterWeightsOptimWrapper']


def _build_loss_scaler(loss_scale: str | float | dict) -> LossScaler:
    if loss_scale == 'dynamic':
        return LossScaler(mode='dynamic')
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return LossScaler(init_scale=float(loss_scale), mode='static')
    if isinstance(loss_scale, Mapping):
        return LossScaler(**loss_scale)
    raise TypeError(
        f"loss_scale must be 'dynamic', a float (static scale) or a dict of "
        f'LossScaler arguments (init_scale, mode, scale_factor, scale_window), '
        f'got {loss_scale!r}'
    )


@OPTIM_WRAPPERS.register_module()
class Fp16MasterWeightsOptimWrapper(OptimWrapper):
    """Float16 training with float32 master weights and a loss scaler.

    Args:
        optimizer: Optimizer built over the model's parameters.
        loss_scale: ``512.`` (default, static, as mmcv), ``'dynamic'`` or a dict of
            :class:`~stratagem.optim.fp16.LossScaler` arguments.
        accumulative_counts: As :class:`OptimWrapper`.
        clip_grad: As :class:`OptimWrapper`; applied to the unscaled float32 gradients.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        loss_scale: str | float | dict = 512.0,
        accumulative_counts: int = 1,
        clip_grad: dict | None = None,
    ) -> None:
        super().__init__(optimizer, accumulative_counts, clip_grad)
        self.loss_scaler = _build_loss_scaler(loss_scale)
        self.skipped_steps = 0
        self._model_params: list[torch.Tensor] = []
        self._master_params: list[torch.Tensor] = []
        state = optimizer.state
        new_state: defaultdict = defaultdict(dict)  # torch optimizers expect this type
        for group in optimizer.param_groups:
            masters = []
            for p in group['params']:
                master = torch.nn.Parameter(
                    p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad
                )
                if p in state:
                    new_state[master] = state[p]
                self._model_params.append(p)
                masters.append(master)
            group['params'] = masters
            self._master_params.extend(masters)
        optimizer.state = new_state

    def grad_holders(self) -> list[torch.Tensor]:
        return self._model_params

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward ``loss * loss_scale`` and count the micro-batch."""
        (loss * self.loss_scaler.loss_scale).backward(**kwargs)
        self._inner_count += 1

    def step(self, **kwargs: Any) -> None:
        """Copy grads to the masters, skip on overflow, else step and copy the masters back."""
        grads = []
        for p, master in zip(self._model_params, self._master_params):
            if p.grad is None:
                master.grad = None
                continue
            master.grad = p.grad.detach().to(torch.float32, copy=True)
            grads.append(master.grad)
        overflow = False
        if grads:
            inv_scale = 1.0 / self.loss_scaler.loss_scale
            found = []
            for (device, _), gs in _by_device(grads).items():
                found_inf = torch.zeros(1, device=device)
                unscale_and_check_(gs, found_inf, torch.full((1,), inv_scale, device=device))
                found.append(found_inf)
            overflow = any(bool(f) for f in found)
        if overflow:
            self.skipped_steps += 1
        else:
            if self._clip_func is not None:
                self._clip_grad()
            self.optimizer.step(**kwargs)
            with torch.no_grad():
                for p, master in zip(self._model_params, self._master_params):
                    p.copy_(master)
        self.loss_scaler.update_scale(overflow)

    def zero_grad(self, **kwargs: Any) -> None:
        """Clear the masters' gradients (``optimizer.zero_grad``) and the model's."""
        self.optimizer.zero_grad(**kwargs)
        set_to_none = kwargs.get('set_to_none', True)
        for p in self._model_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The float32 master parameters, in the optimizer's flat order."""
        return self._master_params

    def state_dict(self) -> dict:
        """:class:`OptimWrapper` state + master weights, loss scaler and skipped steps."""
        state_dict = super().state_dict()
        state_dict['fp32_master_weights'] = {
            i: m.detach() for i, m in enumerate(self._master_params)
        }
        state_dict['loss_scaler'] = self.loss_scaler.state_dict()
        state_dict['skipped_steps'] = self.skipped_steps
        return state_dict

    def load_state_dict(
        self, state_dict: dict, *, load_optimizer: Callable[[dict], None] | None = None
    ) -> None:
        """Load :meth:`state_dict` output; the model's parameters get the masters' values
        (``load_optimizer``: :meth:`OptimWrapper.load_state_dict`'s)."""
        state_dict = dict(state_dict)
        masters = state_dict.pop('fp32_master_weights', None)
        scaler_state = state_dict.pop('loss_scaler', None)
        self.skipped_steps = int(state_dict.pop('skipped_steps', self.skipped_steps))
        if scaler_state is not None:
            self.loss_scaler.load_state_dict(scaler_state)
        if masters is not None:
            if sorted(masters) != list(range(len(self._master_params))):
                raise ValueError(
                    f'fp32_master_weights has {len(masters)} entries but the '
                    f'optimizer has {len(self._master_params)} parameters; the '
                    f'state_dict was saved for another model/optimizer'
                )
            with torch.no_grad():
                for i, (p, master) in enumerate(zip(self._model_params, self._master_params)):
                    master.copy_(masters[i])
                    p.copy_(master)
        super().load_state_dict(state_dict, load_optimizer=load_optimizer)
