"""stratagem's strategies under Lightning Fabric: ``Fabric(strategy=StratagemStrategy(cfg))``.

``cfg`` is any stratagem strategy config (``dict(type='DDPStrategy')``,
``dict(type='FSDPStrategy', mesh=dict(replicate=2, shard=2))``, DeepSpeed, fairscale), built
through ``stratagem.registry`` once Fabric has started the processes. Fabric then drives our
strategy:

1. ``fabric.launch()`` → :meth:`StratagemStrategy.setup_environment`: the device, then the
   process group from Fabric's cluster environment (its launcher's or torchrun's variables)
   and our strategy built on it. The host program's RNG state is kept (the strategy seeds
   only when the cfg names ``env_kwargs.randomness.seed``).
2. ``fabric.setup(model, optimizer)`` → :func:`setup_for_host` (the Trainer's adapter
   shares it): our wrapping (DDP, ``fully_shard``, DeepSpeed's engine, ...) and our optim
   wrapper around the optimizer (``optim_wrapper=`` of the constructor: accumulation,
   clipping, AMP), with ``prepare``'s post-steps: ``auto_scale_lr`` by the per-process batch
   (``micro_batch_size=``, else the first loader ``fabric.setup_dataloaders`` set up), the
   accumulation counters (``max_iters=``). A backend whose wrapping replaces the parameters
   (``capabilities.replaces_parameters``) gets a fresh optimizer of the same class and
   param groups over the wrapped ones; Fabric hands that one back.
3. ``fabric.backward(loss)`` → the optim wrapper's ``backward``; ``optimizer.step()`` → its
   ``step`` (clipping when configured); ``fabric.clip_gradients`` → its clip function
   (a sharded norm under FSDP), else torch's.
4. ``fabric.save(path, state)`` → our ``Checkpointer``: the atomic, verified checkpoint (a
   file, or a directory for sharded backends) exactly at ``path``, with a manifest and
   ``last_checkpoint`` in its directory. The model and optimizer go under our keys
   (``state_dict``, ``optimizer``), every other entry of ``state`` under its own key, plus
   ``meta`` and every rank's RNG state. A loader in ``state`` (torchdata's
   ``StatefulDataLoader``: :func:`is_loader`) is saved per rank, under ``loaders``.
5. ``fabric.load(path, state)`` → the same checkpoint verified and restored in place: model,
   optimizer, every other ``Stateful`` and plain value of ``state`` (``state['step']``),
   each rank's loader state (at another data-parallel size converted where it is a sample
   position, else refused naming the loader), RNG states last. Returns what ``state`` did
   not ask for, as Fabric does.

Importing this module imports lightning; nothing else of stratagem does but
``stratagem.integrations.lightning`` (``pip install "stratagem[lightning]"``).
"""

from __future__ import annotations

import inspect
import os
import os.path as osp
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

try:
    from lightning.fabric.accelerators import Accelerator
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
    from lightning.fabric.strategies import ParallelStrategy
    from lightning.fabric.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )
    from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl
    from lightning.fabric.utilities.rank_zero import rank_zero_only
except ImportError as err:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        'stratagem.integrations.fabric needs lightning: pip install "stratagem[lightning]"'
    ) from err
from typing_extensions import override

from stratagem import env
from stratagem.checkpoint import Stateful
from stratagem.strategies import BaseStrategy, build_strategy

__all__ = [
    'HostRun',
    'StratagemStrategy',
    'build_on_cluster',
    'grad_sync_off',
    'is_loader',
    'optimizer_cfg',
    'rebuild_optimizer',
    'reduce_tensor',
    'setup_for_host',
]


def build_on_cluster(
    cfg: Mapping[str, Any], cluster_environment: ClusterEnvironment | None
) -> BaseStrategy:
    """Build our strategy from ``cfg`` in a process Lightning started (its launcher, or
    torchrun's): ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` /
    ``MASTER_PORT`` from ``cluster_environment``, so our ``init_dist`` joins the same group
    (an initialised one is used as it is). The host's RNG state is put back unless the cfg
    names a seed (``env_kwargs.randomness.seed``)."""
    if not isinstance(cfg, Mapping):
        raise TypeError(
            f"StratagemStrategy takes a stratagem strategy cfg dict (dict(type='DDPStrategy', "
            f'...)), got {type(cfg).__name__}: {cfg!r}'
        )
    cfg = dict(cfg)
    env_kwargs = dict(cfg.get('env_kwargs') or {})
    if cluster_environment is not None and not torch.distributed.is_initialized():
        os.environ['MASTER_ADDR'] = cluster_environment.main_address
        os.environ['MASTER_PORT'] = str(cluster_environment.main_port)
        os.environ['RANK'] = str(cluster_environment.global_rank())
        os.environ['WORLD_SIZE'] = str(cluster_environment.world_size())
        os.environ['LOCAL_RANK'] = str(cluster_environment.local_rank())
        env_kwargs.setdefault('launcher', 'pytorch')
    cfg['env_kwargs'] = env_kwargs
    seeded = (env_kwargs.get('randomness') or {}).get('seed') is not None
    host_rng = None if seeded else env.get_rng_state()
    strategy = build_strategy(cfg)
    if host_rng is not None:  # the host program seeded (or not): its streams continue
        env.set_rng_state(host_rng)
    return strategy


def rebuild_optimizer(
    optimizer: Optimizer, names: Mapping[int, str], model: nn.Module
) -> Optimizer:
    """A fresh optimizer of ``optimizer``'s class and param groups over ``model``'s
    parameters of the same names (``names``: id of an old parameter → its name), for a
    backend whose wrapping replaced the parameters (FSDP's DTensors). Refused when the
    optimizer already holds state (it would be lost)."""
    if optimizer.state:
        raise ValueError(
            f'{type(optimizer).__name__} already holds state (a step or a load before '
            'fabric.setup); a sharding strategy rebuilds it over the sharded parameters, '
            'which would lose it: set up before stepping, and load checkpoints after setup'
        )
    params = dict(model.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        try:
            mine = [params[names[id(p)]] for p in group['params']]
        except KeyError as missing:
            raise ValueError(
                f"the optimizer holds a parameter ({missing}) that is not the model's: "
                'fabric.setup(model, optimizer) needs an optimizer over that model'
            ) from None
        groups.append({**{k: v for k, v in group.items() if k != 'params'}, 'params': mine})
    # defaults may hold keys the constructor does not take (AdamW's decoupled_weight_decay);
    # every group carries its own values anyway
    accepted = inspect.signature(type(optimizer)).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **kwargs)


def sampler_kwargs(ours: BaseStrategy | None, world_size: int, rank: int) -> dict[str, Any]:
    """``distributed_sampler_kwargs`` of either adapter: our strategy's data-parallel rank
    and size once it is built (FSDP's tensor and pipeline ranks read one batch), else every
    process of ``world_size`` its own."""
    if ours is not None:
        return {'num_replicas': ours.data_parallel_size, 'rank': ours.data_parallel_rank}
    return {'num_replicas': world_size, 'rank': rank}


def assign_world_ranks(strategy: Any) -> None:
    """The cluster environment's global rank and world size from the node and local rank,
    and ``rank_zero_only``'s rank (what Lightning's connectors call before a launch)."""
    environment = strategy.cluster_environment
    if environment is not None:
        environment.set_global_rank(
            strategy.node_rank * strategy.num_processes + strategy.local_rank
        )
        environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = strategy.global_rank  # type: ignore[attr-defined]


def reduce_tensor(tensor: Any, group: Any = None, reduce_op: Any = 'mean') -> Any:
    """``tensor`` reduced over ``group`` (``'mean'``/``'avg'``, ``'sum'``, ``'max'``,
    ``'min'`` or a ``ReduceOp``) as a new tensor; anything else, or no process group, as is."""
    dist = torch.distributed
    if not isinstance(tensor, Tensor) or not dist.is_initialized():
        return tensor
    name = 'mean' if reduce_op is None else str(reduce_op).lower().split('.')[-1]
    ops = {'sum': dist.ReduceOp.SUM, 'max': dist.ReduceOp.MAX, 'min': dist.ReduceOp.MIN}
    if name not in ('mean', 'avg', *ops):
        raise ValueError(f'unknown reduce_op {reduce_op!r}; valid: mean, avg, sum, max, min')
    tensor = tensor.clone()
    dist.all_reduce(tensor, op=ops.get(name, dist.ReduceOp.SUM), group=group)
    if name in ('mean', 'avg'):
        tensor = tensor / dist.get_world_size(group)
    return tensor


def optimizer_cfg(optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """``optimizer`` as a cfg (``type`` its class, its one param group's values), for a
    backend that builds the optimizer itself (fairscale's OSS). Refused for several param
    groups, for one that leaves out a trainable parameter, and for an optimizer with state."""
    groups = optimizer.param_groups
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    if len(groups) != 1 or optimizer.state or trainable - {id(p) for p in groups[0]['params']}:
        raise ValueError(
            'this strategy builds the optimizer itself, from a cfg: the '
            f'{type(optimizer).__name__} passed must have one param group over all '
            'trainable parameters and no state '
            f'(got {len(groups)} group(s)); use DDPStrategy or FSDPStrategy for param groups'
        )
    accepted = inspect.signature(type(optimizer)).parameters
    values = {k: v for k, v in groups[0].items() if k != 'params' and k in accepted}
    return dict(type=type(optimizer), **values)


@dataclass(frozen=True)
class HostRun:
    """What a host trainer knows of the run that ``prepare``'s post-steps need, and how its
    user supplies what it does not know (for the error when it is needed and missing).

    Attributes:
        micro_batch: the per-process batch size (``auto_scale_lr``'s real batch, DeepSpeed's
            ``train_micro_batch_size_per_gpu``); None: not known.
        max_iters: the run's length in backward calls (an accumulating optim wrapper sizes
            its last window with it); None: not known.
        how_micro_batch: how this host's user gives ``micro_batch``.
        how_max_iters: how this host's user gives ``max_iters``.
    """

    micro_batch: int | None
    max_iters: int | None
    how_micro_batch: str
    how_max_iters: str

    def dispatch_kwargs(self) -> dict[str, int]:
        """What is known, as ``prepare``'s ``dispatch_kwargs``."""
        known = (
            ('train_micro_batch_size_per_gpu', self.micro_batch),
            ('max_iters', self.max_iters),
        )
        return {key: int(value) for key, value in known if value is not None}


def setup_for_host(
    ours: BaseStrategy,
    cfg: Mapping[str, Any],
    module: nn.Module,
    optimizer: Optimizer,
    optim_wrapper: Mapping[str, Any],
    run: HostRun,
) -> tuple[nn.Module, Any]:
    """Both Lightning adapters' set-up of a module and the host's optimizer on our strategy
    ``ours`` (built from ``cfg``): ``(wrapped model, optim wrapper)``, the optim wrapper built
    from ``optim_wrapper`` (a cfg without ``optimizer``) around the optimizer that steps, and
    ``prepare``'s post-steps run on it (``auto_scale_lr`` with ``run.micro_batch``, the
    accumulation counters with ``run.max_iters``).

    What the backend declares decides (``ours.capabilities``): when wrapping replaces the
    parameters, the module is prepared first and the optimizer rebuilt over the wrapped
    parameters (same class, same groups), then attached (``attach_optim_wrapper``); when the
    backend builds its optimizer from a cfg, it gets the optimizer's class and values;
    otherwise the optimizer itself."""
    _check_host_run(cfg, optim_wrapper, run)
    dispatch = run.dispatch_kwargs()
    caps = ours.capabilities
    if caps.replaces_parameters:
        names = {id(p): name for name, p in module.named_parameters()}
        model = ours.prepare(module, dispatch_kwargs=dispatch)
        optimizer = rebuild_optimizer(optimizer, names, model)
        wrapper = ours.build_optim_wrapper({**optim_wrapper, 'optimizer': optimizer}, model)
        return model, ours.attach_optim_wrapper(wrapper)
    given: Any = optimizer_cfg(optimizer, module) if caps.optimizer_from_cfg else optimizer
    model, wrapper = ours.prepare(
        module, optim_wrapper={**optim_wrapper, 'optimizer': given}, dispatch_kwargs=dispatch
    )
    return model, wrapper


def _check_host_run(cfg: Mapping[str, Any], optim_wrapper: Mapping[str, Any], run: HostRun) -> None:
    """Refuse, before anything is built, a post-step that needs what the host does not
    know, saying how to give it."""
    scale = cfg.get('auto_scale_lr') or {}
    if isinstance(scale, Mapping) and scale.get('enable', False) and run.micro_batch is None:
        raise ValueError(
            f'StratagemStrategy: auto_scale_lr={dict(scale)} needs the per-process batch '
            f'size (real batch = data-parallel size x it x accumulative_counts), which is not '
            f'known: {run.how_micro_batch}'
        )
    counts = int(optim_wrapper.get('accumulative_counts', 1))
    if counts > 1 and run.max_iters is None:
        raise ValueError(
            f'StratagemStrategy: accumulative_counts={counts} needs the length of the run in '
            f'backward calls (the last window is averaged over its real length), which is not '
            f'known: {run.how_max_iters}'
        )


def is_loader(obj: Any) -> bool:
    """Whether an entry of Fabric's ``state`` is a data loader, whose state is each rank's
    own (saved per rank, ``parts.LoaderPart``): a torch ``DataLoader`` (torchdata's
    ``StatefulDataLoader``), or any other ``Stateful`` that is iterable (not a mapping, a
    module or an optimizer)."""
    if isinstance(obj, (nn.Module, Optimizer, Mapping)) or not isinstance(obj, Stateful):
        return False
    return isinstance(obj, DataLoader) or hasattr(type(obj), '__iter__')


class _PlainValue:
    """A plain entry of Fabric's state (``step``): saved as it is; loaded into
    ``restored[key]``, which ``fabric.load`` copies into the caller's dict."""

    def __init__(self, key: str, value: Any, restored: dict[str, Any]) -> None:
        self.key, self.value, self.restored = key, value, restored

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state_dict: Any) -> None:
        self.restored[self.key] = state_dict


def grad_sync_off(ours: BaseStrategy, model: nn.Module) -> AbstractContextManager:
    """Both adapters' gradient-sync skip, for a backward the host's loop accumulates: the
    wrapped model's ``no_sync`` (DDP's, fairscale's) when it has one; none where an engine
    steps (``capabilities.engine_steps``: DeepSpeed's engine reduces at its step once
    ``accumulative_counts`` tells it the window, and its ``no_sync`` refuses ZeRO-2)."""
    sync_off = getattr(model, 'no_sync', None)
    if ours.capabilities.engine_steps or not callable(sync_off):
        return nullcontext()
    return sync_off()


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: :func:`grad_sync_off` on our wrapped model."""

    def __init__(self, owner: StratagemStrategy) -> None:
        self.owner = owner

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        ours = self.owner.stratagem
        return grad_sync_off(ours, ours.model)


class StratagemStrategy(ParallelStrategy):
    """A Fabric strategy that runs a stratagem strategy (see the module doc).

    Args:
        cfg: a stratagem strategy config: ``type`` (a ``STRATEGIES`` name, e.g.
            ``'DDPStrategy'``, ``'FSDPStrategy'``, ``'DeepSpeedStrategy'``,
            ``'ShardedDDPStrategy'``) and its keys; built after Fabric launched the processes.
        optim_wrapper: the optim wrapper cfg around the optimizer Fabric sets up (its
            ``optimizer`` is filled in): ``type`` (default ``'OptimWrapper'``;
            ``'AmpOptimWrapper'``), ``clip_grad``, ``accumulative_counts``. Default: a plain
            ``OptimWrapper``.
        micro_batch_size: the per-process batch size, which ``auto_scale_lr`` (and
            DeepSpeed's ``train_micro_batch_size_per_gpu``) needs at ``fabric.setup``.
            Default: the batch size of the first loader ``fabric.setup_dataloaders`` set up
            before ``fabric.setup``; ``auto_scale_lr`` without either is an error naming this.
        max_iters: the run's length in backward calls, which ``accumulative_counts`` > 1
            needs (the last window is averaged over its real length).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision:
            Fabric's, as for its own strategies (Fabric fills them in).
    """

    def __init__(
        self,
        cfg: Mapping[str, Any],
        *,
        optim_wrapper: Mapping[str, Any] | None = None,
        micro_batch_size: int | None = None,
        max_iters: int | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        if not isinstance(cfg, Mapping) or not cfg.get('type'):
            raise TypeError(
                "StratagemStrategy(cfg): cfg must be a stratagem strategy cfg with a 'type', "
                f"e.g. dict(type='DDPStrategy'); got {cfg!r}"
            )
        wrapper = dict(optim_wrapper or {})
        if 'optimizer' in wrapper:
            raise ValueError(
                'StratagemStrategy(optim_wrapper=...) must not name an optimizer: the one '
                'passed to fabric.setup(model, optimizer) is used'
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        for name, value in (('micro_batch_size', micro_batch_size), ('max_iters', max_iters)):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(
                    f'StratagemStrategy({name}=...) must be an int >= 1, got {value!r}'
                )
        self.cfg = dict(cfg)
        self.optim_wrapper_cfg = wrapper
        self.micro_batch_size = micro_batch_size
        self.max_iters = max_iters
        self._loader_batch: int | None = None  # the first loader's, set up before fabric.setup
        self._num_nodes = 1
        self._stratagem: BaseStrategy | None = None
        self._backward_sync_control = _NoSync(self)

    # ------------------------------------------------------------------ our strategy
    @property
    def stratagem(self) -> BaseStrategy:
        """The stratagem strategy (built in ``setup_environment``, after the launch)."""
        if self._stratagem is None:
            raise RuntimeError(
                'the stratagem strategy is built when Fabric launches: call fabric.launch() '
                '(or fabric.run / fabric.setup) first'
            )
        return self._stratagem

    # ------------------------------------------------------------- processes, ranks
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel ranks: FSDP's tensor and pipeline ranks read one batch."""
        return sampler_kwargs(
            self._stratagem, self.num_nodes * self.num_processes, self.global_rank
        )

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(
            self.cluster_environment, self.num_processes, self.num_nodes
        )

    def _set_world_ranks(self) -> None:
        # Fabric's connector calls it (as for its DDPStrategy) before the launch
        assign_world_ranks(self)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if type(self.precision) is not Precision:
            raise ValueError(
                f'StratagemStrategy: Fabric precision {type(self.precision).__name__} is not '
                "supported; precision is the optim wrapper's: Fabric(precision='32-true') and "
                "StratagemStrategy(cfg, optim_wrapper=dict(type='AmpOptimWrapper', "
                "dtype='bfloat16'))"
            )
        if self._stratagem is None:
            self._set_world_ranks()
            self._stratagem = build_on_cluster(self.cfg, self.cluster_environment)

    # -------------------------------------------------------- module and optimizers
    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        ours = self.stratagem
        if len(optimizers) != 1:
            raise ValueError(
                f'StratagemStrategy: fabric.setup takes one optimizer, got {len(optimizers)}'
            )
        (optimizer,) = optimizers
        run = HostRun(
            micro_batch=self.micro_batch_size or self._loader_batch,
            max_iters=self.max_iters,
            how_micro_batch='pass StratagemStrategy(cfg, micro_batch_size=N), or call '
            'fabric.setup_dataloaders(loader) before fabric.setup(model, optimizer)',
            how_max_iters='pass StratagemStrategy(cfg, max_iters=N)',
        )
        model, wrapper = setup_for_host(
            ours, self.cfg, module, optimizer, self.optim_wrapper_cfg, run
        )
        return model, [wrapper.optimizer], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return self.stratagem.prepare(module)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Refused: ``prepare`` builds the optim wrapper over the wrapped (for FSDP,
        sharded) parameters, so the optimizer cannot be set up apart from its module."""
        raise RuntimeError(
            'StratagemStrategy sets up the module and its optimizer together (the optimizer '
            "must hold the wrapped module's parameters): "
            'model, optimizer = fabric.setup(model, optimizer), not fabric.setup_optimizers'
        )

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """The loader as it is; the first one's batch size is the per-process batch (unless
        ``micro_batch_size`` was given)."""
        batch = getattr(dataloader, 'batch_size', None)
        if self._loader_batch is None and isinstance(batch, int):
            self._loader_batch = batch
        return dataloader

    @override
    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    # -------------------------------------------------------------- the training step
    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """The optim wrapper's backward (DeepSpeed's engine's under DeepSpeedStrategy)."""
        self.precision.pre_backward(tensor, module)
        self.stratagem.optim_wrapper.backward(tensor, **kwargs)
        self.precision.post_backward(tensor, module)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The optim wrapper's step: clipping when configured, then the optimizer's."""
        return self.stratagem.optim_wrapper.step(**kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """The total norm before clipping; under a sharding backend its sharded norm."""
        clip: Callable[..., Tensor] | None = getattr(
            self.stratagem.optim_wrapper, 'clip_func', None
        )
        params = [p for group in optimizer.param_groups for p in group['params']]
        if clip is None:
            return torch.nn.utils.clip_grad_norm_(
                params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
            )
        return clip(params, max_norm=max_norm, norm_type=norm_type)

    # ------------------------------------------------------------------- collectives
    @override
    def all_reduce(self, tensor: Tensor | Any, group: Any = None, reduce_op: Any = 'mean') -> Any:
        return reduce_tensor(tensor, group, reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        env.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return env.broadcast_object(obj, src=src)

    # ------------------------------------------------------------------ checkpoints
    def _parts(
        self, state: Mapping[str, Any], restored: dict[str, Any], meta: Mapping | None = None
    ) -> dict[str, Stateful]:
        """Our strategy's parts: the model and optimizer of ``state`` under our keys
        (``state_dict``, ``optimizer``), its loaders (:func:`is_loader`) every rank's own
        under ``loaders``, every other entry under its own key (a plain value is put into
        ``restored`` on load), then ``meta`` and the RNG states."""
        ours = self.stratagem
        loaders = {key: obj for key, obj in state.items() if is_loader(obj)}
        own = ours.checkpoint_state(meta=meta, schedulers=False, loaders=loaders or None)
        model = ours.model
        parts: dict[str, Stateful] = {}
        for key, obj in state.items():
            if key in loaders:
                continue
            if obj is model or obj is getattr(model, 'module', None):
                parts['state_dict'] = own['state_dict']
            elif isinstance(obj, Optimizer) and obj is ours.optim_wrapper.optimizer:
                parts['optimizer'] = own['optimizer']
                parts['partial_grads'] = own['partial_grads']
            elif key in own:
                raise ValueError(
                    f"fabric.save/load: state key {key!r} is one of stratagem's checkpoint "
                    f'keys ({", ".join(own)}); rename it'
                )
            elif isinstance(obj, (nn.Module, Optimizer)):
                raise ValueError(
                    f'state[{key!r}] is a {type(obj).__name__} that fabric.setup did not set up '
                    'with this strategy; save the model and optimizer that it returned'
                )
            elif isinstance(obj, Stateful):
                parts[key] = obj
            else:
                parts[key] = _PlainValue(key, obj, restored)
        parts['meta'] = own['meta']
        if loaders:
            parts['loaders'] = own['loaders']
        parts['rng_states'] = own['rng_states']
        return parts

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Our checkpoint exactly at ``path`` (every rank calls it); an int ``state['step']``
        (or ``'iter'``) becomes ``meta['iter']``."""
        if storage_options is not None or filter:
            raise ValueError(
                'StratagemStrategy: fabric.save(..., filter=) and storage_options are not '
                'supported; a stratagem checkpoint holds the whole state'
            )
        step = state.get('step', state.get('iter'))
        meta = {'iter': step} if type(step) is int else None
        parts = self._parts(state, {}, meta)
        self.stratagem.checkpointer.save(osp.abspath(os.fspath(path)), parts)
        self.stratagem.wait_for_checkpoints()

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``state`` restored in place from our checkpoint at ``path`` (verified first; RNG
        states last); returns the entries ``state`` did not ask for. No ``state``: the whole
        checkpoint. ``strict=False``: keys of ``state`` the checkpoint lacks are left as
        they are."""
        ours = self.stratagem
        path = osp.abspath(os.fspath(path))
        if weights_only is False:
            raise ValueError(
                'StratagemStrategy: stratagem checkpoints load with weights_only=True only; '
                'allow-list a class with stratagem.checkpoint.add_safe_globals'
            )
        if not state:
            return ours.checkpointer.read(path)[1]
        if isinstance(state, (nn.Module, Optimizer)):
            raise ValueError(
                'StratagemStrategy: fabric.load(path, state) takes a dict of what to restore, '
                "e.g. {'model': model, 'optimizer': optimizer}; for raw weights use "
                'fabric.load_raw'
            )
        restored: dict[str, Any] = {}
        parts = self._parts(state, restored)

        def drop_absent(checkpoint: dict) -> None:
            if not strict:  # Fabric's strict=False: what the file lacks stays as it is
                for key in [k for k in parts if k not in checkpoint]:
                    del parts[key]

        context = ours.checkpointer.load(
            path,
            parts,
            map_location='cpu',
            optimizer='optimizer' in parts,
            callback=drop_absent,
        )
        state.update(restored)
        return {k: v for k, v in context.checkpoint.items() if k not in parts}
