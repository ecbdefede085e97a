"""Mixed-precision helpers of mmcv's ``fp16_utils`` (same names, arguments and behaviour).

* :func:`cast_tensor_type` casts the tensors of ``src_type`` found in nested inputs;
* :func:`auto_fp16` / :func:`force_fp32` decorate ``nn.Module`` methods: when the module's
  ``fp16_enabled`` is true they cast the named arguments (float32 → float16, resp. back) and
  run the method with autocast on (resp. off); otherwise they call the method unchanged;
* :func:`wrap_fp16_model` sets ``fp16_enabled`` on the modules that have the attribute
  (mmcv for torch >= 1.6); ``half=True`` also converts the model to float16 with norm layers
  kept in float32 (mmcv's classic path, for :class:`Fp16MasterWeightsOptimWrapper`);
* :class:`LossScaler` is mmcv's static/dynamic loss scaler.

Deliberate differences from mmcv: extra positional arguments (``*args``) are passed on
instead of dropped; autocast targets the module's device type (CPU included) instead of
CUDA only; namedtuples and ``defaultdict``s keep their type in :func:`cast_tensor_type`;
:meth:`LossScaler.has_overflow` checks the gradients in static mode too (an inf gradient
must never be applied) and does it with one host sync per device instead of one per tensor.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections import abc
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    'cast_tensor_type',
    'auto_fp16',
    'force_fp32',
    'wrap_fp16_model',
    'patch_norm_fp32',
    'patch_forward_method',
    'LossScaler',
]


def _is_ndarray(obj: Any) -> bool:
    np = sys.modules.get('numpy')
    return np is not None and isinstance(obj, np.ndarray)


def cast_tensor_type(inputs: Any, src_type: torch.dtype, dst_type: torch.dtype) -> Any:
    """Recursively cast the tensors of dtype ``src_type`` in ``inputs`` to ``dst_type``.

    Mappings and iterables (lists, tuples, namedtuples, sets) are rebuilt with the same type;
    tensors of other dtypes, strings, numpy arrays, modules and other objects pass through.
    """
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dst_type) if inputs.dtype == src_type else inputs
    if isinstance(inputs, (nn.Module, str, bytes)) or _is_ndarray(inputs):
        return inputs
    if isinstance(inputs, abc.Mapping):
        items = {k: cast_tensor_type(v, src_type, dst_type) for k, v in inputs.items()}
        if isinstance(inputs, dict):
            out = inputs.copy()  # keeps dict subclasses (OrderedDict, defaultdict) intact
            out.update(items)
            return out
        return type(inputs)(items)  # type: ignore[call-arg]
    if isinstance(inputs, tuple) and hasattr(inputs, '_fields'):  # namedtuple
        return type(inputs)(*(cast_tensor_type(v, src_type, dst_type) for v in inputs))
    if isinstance(inputs, (list, tuple, set, frozenset)):
        return type(inputs)(cast_tensor_type(v, src_type, dst_type) for v in inputs)
    return inputs


def _module_device_type(module: nn.Module) -> str:
    for p in module.parameters():
        return p.device.type
    return 'cuda' if torch.cuda.is_available() else 'cpu'


def _cast_args(
    func: Callable, apply_to: Iterable[str] | None, src: torch.dtype, dst: torch.dtype
) -> Callable[[tuple, dict], tuple[tuple, dict]]:
    arg_names = inspect.getfullargspec(func).args
    to_cast = set(arg_names if apply_to is None else apply_to)

    def cast(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        new_args = tuple(
            cast_tensor_type(a, src, dst) if i < len(arg_names) and arg_names[i] in to_cast else a
            for i, a in enumerate(args)
        )
        new_kwargs = {
            k: cast_tensor_type(v, src, dst) if k in to_cast else v for k, v in kwargs.items()
        }
        return new_args, new_kwargs

    return cast


def auto_fp16(
    apply_to: Iterable[str] | None = None,
    out_fp32: bool = False,
    supported_types: tuple[type, ...] = (nn.Module,),
) -> Callable:
    """Decorate a method to run in float16 when its module's ``fp16_enabled`` is true.

    Args:
        apply_to: Names of the arguments to cast float32 → float16 (``None``: all).
        out_fp32: Cast float16 outputs back to float32.
        supported_types: Classes whose methods may be decorated.
    """

    def wrapper(old_func: Callable) -> Callable:
        cast = _cast_args(old_func, apply_to, torch.float, torch.half)

        @functools.wraps(old_func)
        def new_func(*args: Any, **kwargs: Any) -> Any:
            if not args or not isinstance(args[0], supported_types):
                raise TypeError(
                    f'@auto_fp16 decorates methods of {supported_types}, but '
                    f'{old_func.__qualname__} was called on '
                    f'{type(args[0]).__name__ if args else "nothing"}'
                )
            if not getattr(args[0], 'fp16_enabled', False):
                return old_func(*args, **kwargs)
            new_args, new_kwargs = cast(args, kwargs)
            with torch.autocast(_module_device_type(args[0]), dtype=torch.half):  # type: ignore[arg-type]
                output = old_func(*new_args, **new_kwargs)
            if out_fp32:
                output = cast_tensor_type(output, torch.half, torch.float)
            return output

        return new_func

    return wrapper


def force_fp32(apply_to: Iterable[str] | None = None, out_fp16: bool = False) -> Callable:
    """Decorate a method to run in float32 when its module's ``fp16_enabled`` is true.

    Args:
        apply_to: Names of the arguments to cast float16 → float32 (``None``: all).
        out_fp16: Cast float32 outputs to float16.
    """

    def wrapper(old_func: Callable) -> Callable:
        cast = _cast_args(old_func, apply_to, torch.half, torch.float)

        @functools.wraps(old_func)
        def new_func(*args: Any, **kwargs: Any) -> Any:
            if not args or not isinstance(args[0], nn.Module):
                raise TypeError(
                    f'@force_fp32 decorates nn.Module methods, but '
                    f'{old_func.__qualname__} was called on '
                    f'{type(args[0]).__name__ if args else "nothing"}'
                )
            if not getattr(args[0], 'fp16_enabled', False):
                return old_func(*args, **kwargs)
            new_args, new_kwargs = cast(args, kwargs)
            with torch.autocast(_module_device_type(args[0]), enabled=False):
                output = old_func(*new_args, **new_kwargs)
            if out_fp16:
                output = cast_tensor_type(output, torch.float, torch.half)
            return output

        return new_func

    return wrapper


def patch_forward_method(
    func: Callable, src_type: torch.dtype, dst_type: torch.dtype, convert_output: bool = True
) -> Callable:
    """Wrap ``func`` to cast its ``src_type`` inputs to ``dst_type`` (and outputs back)."""

    def new_forward(*args: Any, **kwargs: Any) -> Any:
        output = func(
            *cast_tensor_type(args, src_type, dst_type),
            **cast_tensor_type(kwargs, src_type, dst_type),
        )
        if convert_output:
            output = cast_tensor_type(output, dst_type, src_type)
        return output

    return new_forward


def patch_norm_fp32(module: nn.Module) -> nn.Module:
    """Keep BatchNorm and GroupNorm layers (recursively) in float32 inside a float16 model.

    GroupNorm's forward is patched to take float16 input and return float16 output;
    BatchNorm accepts float16 input with float32 parameters natively.
    """
    if isinstance(module, (_BatchNorm, nn.GroupNorm)):
        module.float()
        if isinstance(module, nn.GroupNorm):
            module.forward = patch_forward_method(module.forward, torch.half, torch.float)  # type: ignore[method-assign]
    for child in module.children():
        patch_norm_fp32(child)
    return module


def wrap_fp16_model(model: nn.Module, half: bool = False) -> nn.Module:
    """Enable fp16 mode: set ``fp16_enabled = True`` on every module that has the attribute.

    Args:
        model: The model, changed in place (and returned).
        half: Also convert it to float16, norm layers kept in float32 (:func:`patch_norm_fp32`);
            for training with float32 master weights. Default ``False`` (autocast does the
            casting, as mmcv does with torch >= 1.6).
    """
    if half:
        model.half()
        patch_norm_fp32(model)
    for m in model.modules():
        if hasattr(m, 'fp16_enabled'):
            m.fp16_enabled = True  # type: ignore[assignment]
    return model


class LossScaler:
    """mmcv's loss scaler (static or dynamic) for float16 training.

    Args:
        init_scale: Initial scale (default ``2**32``).
        mode: ``'dynamic'`` (divide by ``scale_factor`` on overflow, multiply after
            ``scale_window`` clean iterations) or ``'static'`` (constant).
        scale_factor: Factor of the dynamic updates (default 2).
        scale_window: Clean iterations between dynamic increases (default 1000).
    """

    def __init__(
        self,
        init_scale: float = 2**32,
        mode: str = 'dynamic',
        scale_factor: float = 2.0,
        scale_window: int = 1000,
    ) -> None:
        if mode not in ('dynamic', 'static'):
            raise ValueError(f"LossScaler mode must be 'dynamic' or 'static', got {mode!r}")
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.mode = mode
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether any gradient of ``params`` holds inf or nan (one host sync per device)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        finite = [
            torch.stack(torch._foreach_norm(gs, math.inf)).isfinite().all()  # noqa: SLF001 - torch: no public fused norm of a tensor list before 2.6
            for gs in _by_device(grads).values()
        ]
        return not all(bool(f) for f in finite)

    def update_scale(self, overflow: bool) -> None:
        """Dynamic mode: downscale after an overflow, upscale after ``scale_window`` clean ones."""
        if self.mode != 'dynamic':
            return
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        """Plain values: ``cur_scale``, ``cur_iter``, ``mode``, ``last_overflow_iter``, ..."""
        return {
            'cur_scale': self.cur_scale,
            'cur_iter': self.cur_iter,
            'mode': self.mode,
            'last_overflow_iter': self.last_overflow_iter,
            'scale_factor': self.scale_factor,
            'scale_window': self.scale_window,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        for key in (
            'cur_scale',
            'cur_iter',
            'mode',
            'last_overflow_iter',
            'scale_factor',
            'scale_window',
        ):
            setattr(self, key, state_dict[key])

    def __repr__(self) -> str:
        return (
            f'LossScaler(cur_scale={self.cur_scale}, mode={self.mode!r}, '
            f'scale_factor={self.scale_factor}, scale_window={self.scale_window})'
        )


def _by_device(tensors: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups
