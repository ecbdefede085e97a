"""FSDPStrategy's wrapping sequence, written once: ``FSDPStrategy._wrap_model`` shards through
it, and so does ``stratagem doctor``'s memory estimate (a model on the meta device, torch's
fake process group), so the estimate measures the model a run trains.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stratagem import env

if TYPE_CHECKING:
    from .config import WrapConfig
    from .mesh import MeshSpec
    from .options import ActivationCheckpointing
    from .tensor_parallel import TensorParallelPlan

__all__ = ['shard_model']


def shard_model(
    model: nn.Module,
    *,
    wrap_cfg: WrapConfig,
    mesh_spec: MeshSpec,
    device: torch.device,
    tp_plan: TensorParallelPlan | None = None,
    ac_check: ActivationCheckpointing | None = None,
    block_compile: Mapping | None = None,
    mesh: Any = None,
    blocks: list[nn.Module] | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> tuple[nn.Module, Any, list[nn.Module]]:
    """Shard ``model`` in place over a new device mesh; returns ``(model, device_mesh,
    blocks)``: the model, the ``DeviceMesh`` built from ``mesh_spec``, and the blocks sharded
    before the root (an activation-checkpointed block as its wrapper).

    1. A model with real tensors moves to ``device``; one on the meta device stays there (the
       caller allocates it afterwards: ``model.to_empty``).
    2. ``wrap_cfg``'s ``buffer_dtype`` casts the floating-point buffers; with
       ``sync_module_states`` every rank takes rank 0's parameters and buffers (real tensors).
    3. The blocks ``auto_wrap_policy`` picks (``blocks`` and ``ignored`` parameters when
       given: a pipeline stage's, picked on the whole model); ``tp_plan`` is checked against
       them before anything collective happens.
    4. The device mesh (``mesh_spec.build(device.type)``; a collective over the world), or
       ``mesh`` when given (a pipeline's stages share one).
    5. Tensor parallelism over ``mesh['tensor']`` first: it needs the original module names.
    6. Activation checkpointing (``ac_check``): a chosen block is replaced by its wrapper.
    7. ``block_compile`` (``torch.compile`` arguments): each block's ``compile`` (the root's
       when no block is chosen), before sharding.
    8. ``fully_shard`` of each block bottom-up (children before parents), the root last, over
       the data-parallel mesh (``(replicate, shard)`` for HSDP, else ``shard``); parameters
       of ``ignored_modules`` stay unsharded.
    """
    from torch.distributed.fsdp import fully_shard

    on_meta = any(p.is_meta for p in model.parameters())
    if not on_meta:
        model = model.to(device)
    wrap_cfg.cast_buffers(model)
    if wrap_cfg.sync_module_states and not on_meta:
        for tensor in list(model.parameters()) + list(model.buffers()):
            env.broadcast(tensor.data, 0)
    targets = wrap_cfg.targets(model) if blocks is None else blocks
    if ignored is None:
        ignored = wrap_cfg.ignored_params(model)
    if tp_plan is not None:  # every pattern checked before the mesh is built
        tp_plan.check(model, mesh_spec.tensor, targets)
    if mesh is None:
        mesh = mesh_spec.build(device.type)
    if tp_plan is not None:
        tp_plan.apply(model, mesh['tensor'], targets)
    if ac_check is not None:
        targets = ac_check.apply(model, targets)
    if block_compile is not None:
        for block in targets or [model]:
            block.compile(**block_compile)
    kwargs = wrap_cfg.shard_kwargs(mesh_spec.data_mesh(mesh), device)
    for block in reversed(targets):  # children before parents
        fully_shard(block, **kwargs, ignored_params=ignored & set(block.parameters()) or None)
    fully_shard(model, **kwargs, ignored_params=ignored or None)
    return model, mesh, targets
