"""Pieces FSDPStrategy composes around an FSDP2 model: the no-sync context that the optim
wrapper drives, an optim wrapper adapted to sharded gradients, and the pending (unsynced)
gradients of an open accumulation window, read for a checkpoint and put back on resume.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stratagem._torch import WRAPPER_PREFIXES, fsdp_params, unsharded_param


def clean_name(name: str) -> str:
    """A parameter's FQN without the wrappers' prefixes (activation checkpointing, compile)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, '')
    return name


class NoSync:
    """``model.no_sync()`` for FSDP2, so the optim wrapper's ``optim_context`` skips the
    reduce-scatter on non-update iterations. FSDP2 reads its flag during backward, which runs
    after the context exits, so the flag stays off until the next forward outside a
    ``no_sync`` block turns it back on (a forward pre-hook on the root)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._inside = False
        self._synced = True
        model.register_forward_pre_hook(self._pre_forward)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not self._inside and not self._synced:
            self._model.set_requires_gradient_sync(True)  # type: ignore[operator]
            self._synced = True

    @contextlib.contextmanager
    def __call__(self) -> Any:
        if self._synced:
            self._model.set_requires_gradient_sync(False)  # type: ignore[operator]
            self._synced = False
        self._inside = True
        try:
            yield
        finally:
            self._inside = False


def with_no_sync(model: nn.Module) -> nn.Module:
    """Give an FSDP2 model a ``no_sync()`` context (once)."""
    if not hasattr(model, 'no_sync'):
        object.__setattr__(model, 'no_sync', NoSync(model))
    return model


def adapt_optim_wrapper(
    wrapper: Any, model: nn.Module, mixed_precision: bool, stages: int = 1
) -> None:
    """Fit an optim wrapper to a sharded model, through its public seams.

    - Gradient-sync control: the model's :class:`NoSync` (``set_grad_sync``).
    - With ``mixed_precision`` set in ``model_wrapper``, precision is FSDP's: an
      AmpOptimWrapper does not autocast again (``autocast = False``). Without it, an
      AmpOptimWrapper autocasts its steps as it does under mmengine (FSDP then gathers
      float32 parameters). Its GradScaler (float16 only) works either way: ``unscale_`` on
      DTensor gradients reduces ``found_inf`` over the mesh, so every rank skips the same
      steps.
    - Clipping over a mix of sharded and plain parameters (``ignored_modules``) or of
      several meshes (tensor parallelism), which torch's clip functions refuse, goes through
      ``optim.sharded_clip`` (``set_clip_func``), and so does every clip when the
      parameters are split over ``stages`` > 1 pipeline ranks (the norm is reduced over the
      stages too).
    """
    if hasattr(wrapper, 'set_grad_sync'):  # an OptimWrapper (a custom wrapper: its own)
        # under a pipeline the schedule reduces the gradients at the end of every step
        # (PipelineStage's reduce-grad action): nothing to hold back
        wrapper.set_grad_sync(contextlib.nullcontext if stages > 1 else with_no_sync(model).no_sync)
    if hasattr(wrapper, 'cast_dtype') and mixed_precision:
        wrapper.autocast = False
    func = getattr(wrapper, 'clip_func', None)
    if func is None:
        return
    from torch.distributed.tensor import DTensor

    params = [p for g in wrapper.optimizer.param_groups for p in g['params']]
    kinds = {isinstance(p, DTensor) for p in params}
    meshes = {id(p.device_mesh) for p in params if isinstance(p, DTensor)}
    if len(kinds) == 2 or len(meshes) > 1 or stages > 1:
        from stratagem.optim.sharded_clip import clip_grad_norm_mixed, clip_grad_value_mixed

        wrapper.set_clip_func(
            functools.partial(clip_grad_norm_mixed, stages=stages)
            if func is torch.nn.utils.clip_grad_norm_
            else clip_grad_value_mixed
        )


def _fsdp_params(model: nn.Module) -> list[tuple[str, Any]]:
    """(clean FQN, FSDPParam) of every sharded parameter."""
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    return [
        (names[id(fp.sharded_param)], fp)
        for module in model.modules()
        for fp in fsdp_params(module)
    ]


def pending_grads(model: nn.Module) -> dict:
    """This rank's gradients accumulated with sync off (FSDP2 keeps them unsharded), as
    plain tensors: on a tensor-parallel mesh a gradient is a DTensor, of which this rank's
    slice is its own (a DTensor's storage is none that ``torch.save`` or a size estimate
    can read)."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, fp in _fsdp_params(model):
        g = fp.unsharded_accumulated_grad
        param = unsharded_param(fp)
        if g is None and param is not None:
            g = param.grad
        if g is not None:
            g = g.to_local() if isinstance(g, DTensor) else g
            grads[name] = g.detach().clone()
    return grads


def set_pending_grads(model: nn.Module, grads: Mapping) -> None:
    """Put back gradients read by :func:`pending_grads` (by FQN), as FSDP2 keeps them."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if any(unsharded_param(fp) is None for _, fp in _fsdp_params(model)):
        for module in model.modules():  # FSDP2 creates the unsharded parameters lazily
            if isinstance(module, FSDPModule):
                module.unshard()
                module.reshard()
    for name, fp in _fsdp_params(model):
        g = grads.get(name)
        if g is None:
            continue
        param = unsharded_param(fp)
        assert param is not None  # created above
        accumulated = fp.reduce_dtype is not None and fp.reduce_dtype != param.dtype
        g = g.to(param.device, fp.reduce_dtype if accumulated else param.dtype, copy=True)
        if isinstance(param, DTensor):  # this rank's slice of a tensor-parallel gradient
            g = DTensor.from_local(g, param.device_mesh, param.placements, run_check=False)
        if accumulated:
            fp.unsharded_accumulated_grad = g
        else:
            param.grad = g


@contextlib.contextmanager
def keep_fresh(optimizers: list) -> Any:
    """torch's ``get_*state_dict`` creates a missing optimizer state by a zero-lr step, which
    leaves Adam's step count at 1 (a wrong bias correction for the first real step, e.g.
    after loading pretrained weights into a fresh run): an optimizer that had no state gets
    none back afterwards."""
    fresh = [o for o in optimizers if not o.state]
    try:
        yield
    finally:
        for optimizer in fresh:
            optimizer.state.clear()
