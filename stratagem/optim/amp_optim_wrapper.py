"""``AmpOptimWrapper``: automatic mixed precision (``torch.autocast`` + ``GradScaler``).

mmengine-compatible (``mmengine.optim.AmpOptimWrapper``) with these differences:

* any device type with autocast works, CPU included; the device is that of the optimizer's
  parameters (and, in ``optim_context``, of the model's first parameter);
* ``dtype=None`` means the device's autocast default (float16 on CUDA, bfloat16 on CPU);
* bfloat16 uses **no** GradScaler: bf16 has float32's exponent range, so loss scaling only
  costs a host sync per step (mmengine kept a scaler under bf16, see its PR #1553). A
  ``loss_scale`` given with bf16 is ignored with a warning;
* steps skipped by the scaler because of inf/nan gradients are counted in
  :attr:`AmpOptimWrapper.skipped_steps`, kept as a tensor until read (no extra host sync).

Call sequence of :meth:`AmpOptimWrapper.step`: ``unscale_`` (only when clipping) → clip →
``scaler.step`` (skips the update on inf/nan; parameters stay untouched) → count skipped →
``scaler.update``. ``state_dict()`` adds ``'loss_scaler'`` (GradScaler's plain-value state,
as mmengine does) and ``'skipped_steps'`` (int) to :class:`OptimWrapper`'s.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from stratagem._torch import grad_scaler_found_inf
from stratagem.registry import OPTIM_WRAPPERS

from .optim_wrapper import OptimWrapper

__all__ = ['AmpOptimWrapper', 'resolve_dtype']

_DTYPES = {
    'float16': torch.float16,
    'half': torch.float16,
    'fp16': torch.float16,
    'bfloat16': torch.bfloat16,
    'bf16': torch.bfloat16,
    'float32': torch.float32,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``'float16'``/``'bfloat16'``/a ``torch.dtype``/``None`` → ``torch.dtype`` or ``None``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(
        f"dtype {dtype!r} is not supported; use 'float16', 'bfloat16', "
        f"a torch.dtype or None (the device's autocast default)"
    )


def _params_device_type(params: Iterator[torch.Tensor], default: str) -> str:
    for p in params:
        return p.device.type
    return default


@contextlib.contextmanager
def _nested(
    outer: contextlib.AbstractContextManager, inner: contextlib.AbstractContextManager
) -> Iterator[None]:
    with outer, inner:
        yield


@OPTIM_WRAPPERS.register_module()
class AmpOptimWrapper(OptimWrapper):
    """Optimizer wrapper for automatic mixed precision training.

    Args:
        loss_scale: ``'dynamic'`` (default; GradScaler defaults), a float (static scale,
            never updated) or a dict of ``torch.amp.GradScaler`` kwargs. Used for float16.
        dtype: Autocast dtype: ``'float16'``, ``'bfloat16'``, a ``torch.dtype``, or ``None``
            (the device's autocast default).
        use_fsdp: mmengine's flag for an FSDP model (it picks FSDP1's ``ShardedGradScaler``
            there). Accepted and kept: under ``FSDPStrategy`` (FSDP2) torch's GradScaler
            already unscales the sharded (DTensor) gradients across the mesh.
        **kwargs: :class:`OptimWrapper` arguments (``optimizer``, ``accumulative_counts``,
            ``clip_grad``).
    """

    def __init__(
        self,
        loss_scale: str | float | dict = 'dynamic',
        dtype: str | torch.dtype | None = None,
        use_fsdp: bool = False,
        **kwargs: Any,
    ) -> None:
        # mmengine's use_fsdp picks FSDP1's ShardedGradScaler; FSDPStrategy shards with FSDP2,
        # whose DTensor gradients torch's GradScaler already unscales across the mesh
        self.use_fsdp = bool(use_fsdp)
        if not (
            loss_scale == 'dynamic'
            or isinstance(loss_scale, Mapping)
            or (
                isinstance(loss_scale, (int, float))
                and not isinstance(loss_scale, bool)
                and loss_scale > 0
            )
        ):
            raise TypeError(
                f"loss_scale must be 'dynamic', a positive float (static scale) or "
                f'a dict of torch.amp.GradScaler arguments, got {loss_scale!r}'
            )
        super().__init__(**kwargs)
        self.device_type = _params_device_type(
            (p for g in self.optimizer.param_groups for p in g['params']),
            'cuda' if torch.cuda.is_available() else 'cpu',
        )
        dtype = resolve_dtype(dtype)
        self.cast_dtype = dtype if dtype is not None else torch.get_autocast_dtype(self.device_type)
        # False when the model wrapper supplies the precision (FSDP's MixedPrecisionPolicy):
        # the steps then run without a second autocast
        self.autocast = True
        self._scale_update_param: float | None = None
        self.loss_scaler: torch.amp.GradScaler | None = None
        if self.cast_dtype == torch.float16:
            self.loss_scaler = self._build_scaler(loss_scale)
        elif loss_scale != 'dynamic':
            warnings.warn(
                f'loss_scale={loss_scale!r} is ignored with dtype {self.cast_dtype}: '
                f'only float16 needs loss scaling',
                stacklevel=2,
            )
        # float32 like GradScaler's found_inf, so counting is one in-place add per step
        self._skipped = torch.zeros((), dtype=torch.float32)

    def _build_scaler(self, loss_scale: str | float | dict) -> torch.amp.GradScaler:
        if loss_scale == 'dynamic':
            return torch.amp.GradScaler(self.device_type)
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            self._scale_update_param = float(loss_scale)
            return torch.amp.GradScaler(self.device_type, init_scale=float(loss_scale))
        if isinstance(loss_scale, Mapping):
            return torch.amp.GradScaler(self.device_type, **loss_scale)
        raise TypeError(
            f"loss_scale must be 'dynamic', a float (static scale) or a dict of "
            f'torch.amp.GradScaler arguments, got {loss_scale!r}'
        )

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward the (scaled, for float16) loss and count the micro-batch."""
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        super().backward(loss, **kwargs)

    def step(self, **kwargs: Any) -> None:
        """Unscale and clip (if configured), step unless grads are inf/nan, update the scale."""
        scaler = self.loss_scaler
        if scaler is None:
            super().step(**kwargs)
            return
        if self._clip_func is not None:
            scaler.unscale_(self.optimizer)
            self._clip_grad()
        scaler.step(self.optimizer, **kwargs)
        self._count_skipped(scaler)
        scaler.update(self._scale_update_param)

    def _count_skipped(self, scaler: torch.amp.GradScaler) -> None:
        # GradScaler keeps found_inf per optimizer until update(); summing it on device
        # avoids a second host sync.
        for v in grad_scaler_found_inf(scaler, self.optimizer):
            if self._skipped.device != v.device:
                self._skipped = self._skipped.to(v.device)
            self._skipped.add_(v)

    @property
    def skipped_steps(self) -> int:
        """Updates skipped because of inf/nan gradients (reading it syncs with the device)."""
        return int(self._skipped)

    def _grad_scale(self) -> float:
        return float(self.loss_scaler.get_scale()) if self.loss_scaler is not None else 1.0

    def optim_context(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Gradient-sync control of :class:`OptimWrapper` plus ``torch.autocast``."""
        self._stale_grads = None  # the step starts: release the last update's gradients
        device_type = _params_device_type(model.parameters(), self.device_type)
        if not self.autocast:
            return super().optim_context(model)
        autocast = torch.autocast(device_type, dtype=self.cast_dtype)
        if not self.should_sync():
            return _nested(self._sync_off(model), autocast)
        return autocast

    def state_dict(self) -> dict:
        """:class:`OptimWrapper` state + ``'loss_scaler'`` (float16) + ``'skipped_steps'``."""
        state_dict = super().state_dict()
        if self.loss_scaler is not None:
            state_dict['loss_scaler'] = self.loss_scaler.state_dict()
        state_dict['skipped_steps'] = self.skipped_steps
        return state_dict

    def load_state_dict(
        self, state_dict: dict, *, load_optimizer: Callable[[dict], None] | None = None
    ) -> None:
        """Load :meth:`state_dict` output (mmengine's AmpOptimWrapper state_dict too);
        ``load_optimizer``: :meth:`OptimWrapper.load_state_dict`'s."""
        state_dict = dict(state_dict)
        scaler_state = state_dict.pop('loss_scaler', None)
        skipped = state_dict.pop('skipped_steps', None)
        if scaler_state is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler_state)
        if skipped is not None:
            self._skipped = torch.tensor(
                float(int(skipped)), dtype=torch.float32, device=self._skipped.device
            )
        super().load_state_dict(state_dict, load_optimizer=load_optimizer)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f', dtype={self.cast_dtype})'
