"""DDPStrategy: torch DistributedDataParallel over gloo (CPU) or nccl (CUDA)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from stratagem.registry import STRATEGIES

from .base import BaseStrategy
from .capabilities import Capabilities
from .environment import distributed_env_kwargs
from .replica_groups import FaultTolerance, ReplicaGroup
from .sync_bn import convert_sync_batchnorm

_MM_WRAPPER = 'MMDistributedDataParallel'
_NO_FORWARD_BUFFER_SYNC = (
    'forward_sync_buffers'
    if 'forward_sync_buffers' in inspect.signature(DistributedDataParallel.__init__).parameters
    else 'broadcast_buffers'
)


@STRATEGIES.register_module()
class DDPStrategy(BaseStrategy):
    """Data-parallel training with torch ``DistributedDataParallel``.

    Works on a CPU-only machine (gloo, no CUDA call) — mmengine's DDPStrategy
    calls ``torch.cuda.set_device`` and fails there.

    Args:
        model_wrapper: kwargs for ``DistributedDataParallel``
            (``find_unused_parameters``, ``broadcast_buffers`` / ``forward_sync_buffers``
            — default False, as mmengine's runner sets it —, ``bucket_cap_mb``,
            ``gradient_as_bucket_view``, ``static_graph``, ...). ``type`` may be
            ``'DistributedDataParallel'`` or left
            out; mmengine's ``MMDistributedDataParallel`` (which adds train_step/val_step
            to the model) is refused with a message. ``device_ids`` is set for you on
            CUDA and must not be given on CPU. A model that is already wrapped in DDP
            (by a host trainer) is used as it is.
        sync_bn: ``'torch'`` converts BatchNorm layers to torch's SyncBatchNorm on
            CUDA and to :class:`~stratagem.strategies.sync_bn.CPUSyncBatchNorm` on CPU
            (torch's refuses CPU tensors).
        fault_tolerance: ``dict(min_replicas=1, replica_id=, lighthouse=, timeout=,
            quorum_timeout=, connect_timeout=)`` (or True): this run is one replica group
            of a fault-tolerant job over torchft (``replica_groups.py``; the ``torchft``
            extra): DDP inside the group, the gradients averaged over the live groups each
            step, a group that starts behind healing from a live peer. ``replica_group``
            is its ``replica_groups.ReplicaGroup`` (None
            without). Its logs go to ``work_dir/<timestamp>_replica<I>``.
        **kwargs: BaseStrategy's (``work_dir``, ``env_kwargs``, ...). The launcher
            defaults to the inferred one, else ``'pytorch'``.
    """

    capabilities = Capabilities(gradient_buckets=True)

    def __init__(
        self,
        *,
        model_wrapper: Mapping | None = None,
        sync_bn: str | None = None,
        fault_tolerance: Mapping | bool | None = None,
        **kwargs: Any,
    ) -> None:
        wrapper = dict(model_wrapper or {})
        wrapper_type = wrapper.pop('type', 'DistributedDataParallel')
        if wrapper_type in (_MM_WRAPPER, DistributedDataParallel):
            wrapper_type = (
                'DistributedDataParallel'
                if wrapper_type is DistributedDataParallel
                else wrapper_type
            )
        if wrapper_type != 'DistributedDataParallel':
            extra = (
                " (it adds mmengine's train_step/val_step model API, which stratagem "
                'leaves to your loop)'
                if wrapper_type == _MM_WRAPPER
                else ''
            )
            raise ValueError(
                f'DDPStrategy: model_wrapper type {wrapper_type!r} is not '
                f"supported{extra}; use type='DistributedDataParallel' or leave "
                'type out'
            )
        if 'broadcast_buffers' not in wrapper and 'forward_sync_buffers' not in wrapper:
            # mmengine's runner default: buffers are not re-broadcast every forward (newer
            # torch spells it forward_sync_buffers and deprecates broadcast_buffers)
            wrapper[_NO_FORWARD_BUFFER_SYNC] = False
        if sync_bn not in (None, 'torch'):
            raise ValueError(
                f"DDPStrategy: sync_bn={sync_bn!r} is not supported; use 'torch' or None"
            )
        self.model_wrapper = wrapper
        self.sync_bn = sync_bn
        # checked, its id and lighthouse resolved, before the process group is set up
        self._fault_tolerance = FaultTolerance.option(fault_tolerance)
        env_kwargs = distributed_env_kwargs(kwargs, 'DDPStrategy')
        super().__init__(env_kwargs=env_kwargs, **kwargs)
        if self._fault_tolerance is not None:
            self.replica_group = ReplicaGroup(self._fault_tolerance, self.logger)

    @override
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        if isinstance(model, DistributedDataParallel):
            self.logger.info(
                'DDPStrategy: the model is already wrapped in '
                'DistributedDataParallel; using it as it is'
            )
            return model
        if self.sync_bn == 'torch':
            model, n = convert_sync_batchnorm(model, self.device.type)
            self.logger.info(
                f'DDPStrategy: {n} BatchNorm layer(s) synchronised across ranks'
                + ('' if self.device.type == 'cuda' else ' (CPUSyncBatchNorm)')
            )
        model = model.to(self.device)
        kwargs = dict(self.model_wrapper)
        if self.device.type == 'cuda':
            kwargs.setdefault('device_ids', [self.device.index])
        elif kwargs.get('device_ids'):
            raise ValueError(
                f'DDPStrategy: model_wrapper.device_ids={kwargs["device_ids"]} '
                'only applies to CUDA; remove it on CPU'
            )
        return DistributedDataParallel(model, **kwargs)
