"""What a backend does, declared by it: ``BaseStrategy.capabilities``.

Code that must treat backends differently (the Lightning adapters, ``stratagem doctor``) asks
these, never the class's name, so a subclass of a backend takes its parent's path unless it
declares otherwise. A backend declares its own as a class attribute::

    class MyStrategy(BaseStrategy):
        capabilities = Capabilities(replaces_parameters=True)

``stratagem doctor`` works from a config, not an instance: :func:`capabilities_of` finds the
class through the ``STRATEGIES`` registry and reads its attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ['Capabilities', 'capabilities_of']


@dataclass(frozen=True)
class Capabilities:
    """What a strategy does that code outside it must know. Every field defaults to what a
    single-process, plain backend does (SingleDeviceStrategy).

    Attributes:
        replaces_parameters: wrapping the model replaces its parameters by new objects
            (FSDP's DTensors), so an optimizer must be built after wrapping, over the wrapped
            model; a host trainer's optimizer is rebuilt over them (same class, same groups).
        optimizer_from_cfg: the backend builds its optimizer itself, from a cfg
            (fairscale's ``OSS`` shards its state): a host trainer's optimizer is handed
            over as ``dict(type=<class>, **its one param group)``.
        engine_steps: an engine steps the optimizer (DeepSpeed's ``engine.step``: reduce,
            clip, update), so a host trainer's optimizer step goes through the optim
            wrapper's ``step``, never the torch optimizer's; the engine reduces the
            gradients itself, so a host's gradient-sync skip (``no_sync``) is not applied.
        gradient_buckets: the wrapper keeps a flat copy of the gradients for the all-reduce
            (DDP's reducer buckets, unless ``gradient_as_bucket_view``), even in one process.
        fully_shards: parameters, gradients and optimizer state are sharded block by block
            (``fully_shard`` of the modules ``model_wrapper``'s policy selects); its
            ``model_wrapper`` and ``activation_checkpointing`` keys are FSDP's forms
            (``strategies/fsdp/config.py``, ``options.py``).
        device_mesh: takes ``mesh=dict(pipeline=, replicate=, shard=, tensor=)`` and a
            ``tensor_parallel_plan`` (``strategies/fsdp/mesh.py``).
        pipeline: takes ``pipeline=`` (stages over the mesh's pipeline dimension;
            ``strategies/fsdp/pipeline.py``).
        deepspeed_config: its settings are a DeepSpeed config (``config=`` and the keyword
            sections: ``zero_optimization``, ``fp16``, ``bf16``, ...), read by
            ``strategies/deepspeed/config.py``; the ZeRO stage is the config's.
        zero_stage: the ZeRO partitioning the backend always does (fairscale's OSS +
            ShardedDataParallel: 2, optimizer state and gradients); 0 for none, or when a
            config decides (``deepspeed_config``).
        requires: the packages it imports (each an extra: ``pip install "stratagem[name]"``).
    """

    replaces_parameters: bool = False
    optimizer_from_cfg: bool = False
    engine_steps: bool = False
    gradient_buckets: bool = False
    fully_shards: bool = False
    device_mesh: bool = False
    pipeline: bool = False
    deepspeed_config: bool = False
    zero_stage: int = 0
    requires: tuple[str, ...] = ()

    @property
    def peer_copies(self) -> bool:
        """The content one rank captures for a checkpoint restores that rank alone, on the
        same world size and mesh: the whole state, or its DTensor shards (``fully_shards``:
        kept with their layout, ``checkpoint/peer.py``; under a pipeline, its stage's):
        what peer checkpoints (``default_hooks.checkpoint.peer_interval``) need. Not so
        where an engine's files
        hold the state (DeepSpeed: its model states are written by one rank, each rank's
        optimizer partition by the engine's own save) or where the optimizer state is
        consolidated on one rank to be saved (fairscale's OSS, ``zero_stage``)."""
        return not (self.zero_stage or self.engine_steps or self.deepspeed_config)

    @property
    def builds_optimizer(self) -> bool:
        """The optimizer a host trainer built is not the one that steps (it is rebuilt over
        the wrapped parameters, or from its cfg), so what holds the old one (a scheduler)
        must be moved onto the new one (``stratagem.scheduler.rebind``: the Trainer's
        adapter moves its schedulers), or it would drive nothing."""
        return self.replaces_parameters or self.optimizer_from_cfg


def capabilities_of(strategy_type: Any, nproc: int = 1) -> Capabilities:
    """The capabilities of a strategy cfg's ``type``: a ``STRATEGIES`` name (or a
    ``'package.module.Class'`` path), a class, or ``'auto'`` / None (DDPStrategy for
    ``nproc`` > 1 processes, else SingleDeviceStrategy, as ``build_strategy`` picks).
    A type that names no strategy class (unknown, or its module fails to import) has the
    defaults: what a plain backend does."""
    from stratagem.registry import STRATEGIES

    from .base import BaseStrategy

    if strategy_type in (None, 'auto'):
        strategy_type = 'DDPStrategy' if nproc > 1 else 'SingleDeviceStrategy'
    cls = strategy_type
    if isinstance(strategy_type, str):
        try:
            cls = STRATEGIES.get(strategy_type)
        except (ImportError, AttributeError):
            cls = None
    if isinstance(cls, type) and issubclass(cls, BaseStrategy):
        return cls.capabilities
    return Capabilities()
