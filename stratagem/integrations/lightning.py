"""stratagem's strategies under Lightning's Trainer: ``Trainer(strategy=StratagemStrategy(cfg))``.

``cfg`` is any stratagem strategy config (``dict(type='DDPStrategy')``,
``dict(type='FSDPStrategy', mesh=dict(replicate=2, shard=2))``, ...), built through
``stratagem.registry`` once the Trainer has started the processes (its launcher, or
torchrun's). The Trainer keeps its loops, callbacks, precision plugin, gradient clipping and
accumulation; our strategy does the rest:

1. ``setup_environment``: the device, the process group from the Trainer's cluster
   environment and our strategy built on it (the host's RNG state kept, then Lightning's
   ``reset_seed`` as its DDP does).
2. ``setup``: ``fabric.setup_for_host`` (Fabric's adapter shares it): our
   ``strategy.prepare`` wraps the LightningModule and puts our optim wrapper around the
   optimizer of ``configure_optimizers`` (a backend whose wrapping replaces the parameters
   gets a fresh optimizer of the same class and groups over the wrapped ones), with
   ``prepare``'s post-steps: ``auto_scale_lr`` by the train loader's batch size and
   ``accumulate_grad_batches`` (the wrapper's ``accumulative_counts``). Where the backend
   steps an optimizer it builds (``capabilities.builds_optimizer``: FSDP's, fairscale's
   ``OSS``), the lr schedulers of ``configure_optimizers`` are moved onto it with their
   state (``stratagem.scheduler.rebind``), and their ``interval``, ``frequency`` and
   ``monitor`` stay Lightning's; DeepSpeed's engine steps the optimizer they were built
   over. ``auto_scale_lr`` with a scheduler is refused: the scheduler's base lr is the
   unscaled one, so its next step would undo the scaling.
3. Each step: Lightning's closure and precision plugin; the backward is the optim wrapper's
   (under DeepSpeedStrategy the step too: ``engine.step``).
   ``is_distributed`` is True, so the Trainer gives every data-parallel rank its own
   ``DistributedSampler`` shard (``distributed_sampler_kwargs``: FSDP's tensor groups read
   one).
4. ``trainer.save_checkpoint`` and ``ModelCheckpoint`` write our atomic, verified
   checkpoint exactly at the path they name: our parts (``state_dict``, ``optimizer``,
   ``meta`` with ``iter`` = ``global_step``, RNG states) plus Lightning's own entries
   (loops, callbacks, ``lr_schedulers``, hyper-parameters, ...). Lightning's objects in them
   (``AttributeDict``) are allow-listed for ``torch.load(weights_only=True)``.
5. ``ckpt_path=`` resumes through ``strategy.resume`` after ``setup`` (model, optimizer,
   RNG states; Lightning then restores its loops, callbacks and schedulers).
6. ``ModelCheckpoint``'s removal of an old checkpoint is our deletion
   (``stratagem.checkpoint.delete_checkpoint``: the file or directory and its manifest; a
   ``last_checkpoint`` pointer naming it is moved to the newest remaining checkpoint, or
   removed). A path that is not a stratagem checkpoint (a ``save_last='link'`` link) goes
   to Lightning's ``CheckpointIO``.

Importing this module imports lightning (``pip install "stratagem[lightning]"``).
"""

from __future__ import annotations

import copyreg
import os
import os.path as osp
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.fabric.utilities.data import AttributeDict
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
    from lightning.pytorch.strategies.strategy import TBroadcast
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.parsing import AttributeDict as PLAttributeDict
except ImportError as err:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        'stratagem.integrations.lightning needs lightning: pip install "stratagem[lightning]"'
    ) from err
from typing_extensions import override

from stratagem import env
from stratagem.checkpoint import add_safe_globals, delete_checkpoint, list_checkpoints
from stratagem.checkpoint.latest import POINTER_NAME, read_pointer, update_pointer
from stratagem.scheduler.rebind import rebind_schedulers, unmovable
from stratagem.strategies import BaseStrategy

from .fabric import (
    HostRun,
    assign_world_ranks,
    build_on_cluster,
    grad_sync_off,
    reduce_tensor,
    sampler_kwargs,
    setup_for_host,
)

__all__ = ['StratagemStrategy', 'lightning_safe_globals']

# what the Trainer's checkpoint holds that we write under our own keys
_OURS = ('state_dict', 'optimizer_states')


def lightning_safe_globals() -> list:
    """Lightning's classes that a Trainer checkpoint holds (``hyper_parameters``)."""
    return [AttributeDict, PLAttributeDict]


def _reduce_attribute_dict(value: AttributeDict) -> tuple:
    # the weights-only unpickler sets items of a plain dict only: the class called with one
    return type(value), (dict(value),)


for _cls in lightning_safe_globals():
    copyreg.pickle(_cls, _reduce_attribute_dict)
add_safe_globals(lightning_safe_globals())


def _trainer_run(trainer: pl.Trainer, counts: int) -> HostRun:
    """What the Trainer knows of the run: the train loader's batch size (the per-process
    batch: each rank reads its own sampler shard) and, when accumulating, the run's length
    in batches (optimizer steps × ``accumulate_grad_batches``). The train loader is loaded
    now, as ``estimated_stepping_batches`` does for ``configure_optimizers``; the fit loop
    then keeps it."""
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    steps = trainer.estimated_stepping_batches
    loader = trainer.train_dataloader
    batch = getattr(loader, 'batch_size', None)
    finite = steps not in (float('inf'), None) and steps >= 1
    return HostRun(
        micro_batch=batch if isinstance(batch, int) else None,
        max_iters=int(steps) * counts if counts > 1 and finite else None,
        how_micro_batch='the train dataloader has no batch_size (a batch_sampler?); give '
        'it a DataLoader with batch_size=N',
        how_max_iters=f'accumulate_grad_batches={counts} with no end: set max_steps or max_epochs',
    )


def _refuse_scaling_under(schedulers: list[Any], cfg: Mapping[str, Any]) -> None:
    """``auto_scale_lr`` scales the optimizer's lr once ``configure_optimizers`` has built
    its schedulers, which took the unscaled lr as their base: their next step would undo
    the scaling, so the two are refused together."""
    scale = cfg.get('auto_scale_lr') or {}
    if schedulers and isinstance(scale, Mapping) and scale.get('enable', False):
        names = ', '.join(sorted({type(s).__name__ for s in schedulers}))
        raise ValueError(
            f'StratagemStrategy: auto_scale_lr={dict(scale)} scales the lr after '
            f'configure_optimizers built its lr scheduler(s) ({names}), which keep the '
            'unscaled lr as their base, so their next step would undo the scaling; scale the '
            'lr in configure_optimizers (x self.trainer.world_size x the batch size x '
            'accumulate_grad_batches / base_batch_size) and drop auto_scale_lr, or return '
            'no scheduler'
        )


class StratagemStrategy(ParallelStrategy):
    """A Trainer strategy that runs a stratagem strategy (see the module doc).

    Args:
        cfg: a stratagem strategy config: ``type`` (a ``STRATEGIES`` name, e.g.
            ``'DDPStrategy'``, ``'FSDPStrategy'``, ``'ShardedDDPStrategy'``) and its keys.
        accelerator, parallel_devices, cluster_environment, checkpoint_io,
            precision_plugin: the Trainer's, as for its own strategies (it fills them in).
    """

    strategy_name = 'stratagem'

    def __init__(
        self,
        cfg: Mapping[str, Any],
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        if not isinstance(cfg, Mapping) or not cfg.get('type'):
            raise TypeError(
                "StratagemStrategy(cfg): cfg must be a stratagem strategy cfg with a 'type', "
                f"e.g. dict(type='DDPStrategy'); got {cfg!r}"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.cfg = dict(cfg)
        self._num_nodes = 1
        self._stratagem: BaseStrategy | None = None
        self._fitting = False

    @property
    def stratagem(self) -> BaseStrategy:
        """The stratagem strategy (built in ``setup_environment``, after the launch)."""
        if self._stratagem is None:
            raise RuntimeError('the stratagem strategy is built when the Trainer starts to run')
        return self._stratagem

    # ------------------------------------------------------------- processes, ranks
    @property
    def is_distributed(self) -> bool:
        """True: the Trainer then gives each rank its ``DistributedSampler`` shard."""
        return True

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
        return sampler_kwargs(
            self._stratagem, self.num_nodes * self.num_processes, self.global_rank
        )

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(
            self.cluster_environment, self.num_processes, self.num_nodes
        )

    def set_world_ranks(self) -> None:
        """The cluster environment's rank and world size (the Trainer's connector calls it)."""
        assign_world_ranks(self)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._stratagem is None:
            self.set_world_ranks()
            self._stratagem = build_on_cluster(self.cfg, self.cluster_environment)
        reset_seed()  # as Lightning's DDP: the seed of seed_everything, if any, on every rank

    # -------------------------------------------------------- module and optimizers
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        ours = self.stratagem
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._fitting = trainer.state.fn == TrainerFn.FITTING
        if self._fitting:
            self.setup_optimizers(trainer)
            self.model, self.optimizers = self._prepare(trainer, ours, self.model, self.optimizers)
        else:
            self.model = ours.prepare(self.model)
        self.setup_precision_plugin()

    def _prepare(
        self,
        trainer: pl.Trainer,
        ours: BaseStrategy,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
    ) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
        if len(optimizers) != 1:
            raise ValueError(
                'StratagemStrategy: configure_optimizers must return one optimizer, got '
                f'{len(optimizers)}'
            )
        (optimizer,) = optimizers
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        _refuse_scaling_under(schedulers, self.cfg)
        # the backend steps an optimizer it builds: the schedulers are moved onto it; one
        # that cannot be is refused before anything is wrapped
        moved = schedulers if ours.capabilities.builds_optimizer else []
        for scheduler in moved:
            why = unmovable(scheduler, optimizer)
            if why:
                raise ValueError(
                    f'StratagemStrategy: {type(ours).__name__} steps an optimizer it builds '
                    '(over the sharded parameters, or from its cfg), onto which the lr '
                    f'schedulers of configure_optimizers are moved, but {why}; keep it as '
                    "an attribute, as torch's schedulers do (self.optimizer), or use "
                    'DDPStrategy or DeepSpeedStrategy, which step the optimizer '
                    'configure_optimizers returns'
                )
        # Lightning accumulates (it divides the loss and steps every k batches); the optim
        # wrapper is told the window, so the real batch of auto_scale_lr counts it and
        # DeepSpeed's engine reduces once per window
        counts = int(trainer.accumulate_grad_batches)
        wrapper_cfg = {'accumulative_counts': counts} if counts > 1 else {}
        model, wrapper = setup_for_host(
            ours, self.cfg, module, optimizer, wrapper_cfg, _trainer_run(trainer, counts)
        )
        if moved:
            rebind_schedulers(moved, optimizer, wrapper.optimizer)
        return model, [wrapper.optimizer]

    @contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's gradient-sync skip on the batches it accumulates, as Fabric's
        ``no_backward_sync`` (:func:`~stratagem.integrations.fabric.grad_sync_off`)."""
        assert self.model is not None
        with grad_sync_off(self.stratagem, self.model):
            yield

    def _step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        # through the wrapped model's __call__ even when it is the LightningModule itself
        # (FSDP2 shards in place: its hooks unshard the parameters around forward)
        assert self.model is not None and self.lightning_module is not None
        return self._forward_redirection(self.model, self.lightning_module, name, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._step('training_step', *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step('validation_step', *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step('test_step', *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step('predict_step', *args, **kwargs)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def backward(
        self,
        closure_loss: Tensor,
        optimizer: torch.optim.Optimizer | None,
        *args: Any,
        **kwargs: Any,
    ) -> Tensor:
        """The precision plugin's loss scaling around the optim wrapper's backward."""
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.stratagem.optim_wrapper.backward(closure_loss, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning's precision plugin steps the optimizer, but DeepSpeed's engine must: there
        the closure (forward, backward) runs, then the optim wrapper's step (``engine.step``:
        reduce, clip by the engine's ``gradient_clipping``, update)."""
        if not self.stratagem.capabilities.engine_steps:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        result = closure()
        self.stratagem.optim_wrapper.step(**kwargs)
        return result

    # ------------------------------------------------------------------- collectives
    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = 'mean'
    ) -> Tensor | Any:
        return reduce_tensor(tensor, group, reduce_op)

    @override
    def barrier(self, name: str | None = None) -> None:
        env.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return env.broadcast_object(obj, src=src)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """True: ``ckpt_path`` is resumed into the prepared (wrapped) model and optimizer."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """False: our resume restores the optimizer."""
        return False

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
        """Nothing: our checkpoint holds the optimizer under ``optimizer``, saved by our
        strategy (a sharded optimizer's consolidation included)."""
        return {}

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Our checkpoint exactly at ``filepath`` (every rank calls it)."""
        if storage_options is not None:
            raise ValueError('StratagemStrategy: storage_options are not supported')
        extra = {k: v for k, v in checkpoint.items() if k not in _OURS}
        extra['meta'] = {'iter': checkpoint.get('global_step'), 'epoch': checkpoint.get('epoch')}
        ours = self.stratagem
        ours.save_checkpoint(
            osp.abspath(os.fspath(filepath)),
            save_optimizer='optimizer_states' in checkpoint,
            extra_ckpt=extra,
        )
        ours.wait_for_checkpoints()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """Fitting: ``strategy.resume`` (model, optimizer, RNG states); else the weights."""
        if weights_only is False:
            raise ValueError(
                'StratagemStrategy: stratagem checkpoints load with weights_only=True only; '
                'allow-list a class with stratagem.checkpoint.add_safe_globals'
            )
        ours = self.stratagem
        path = osp.abspath(os.fspath(checkpoint_path))
        if self._fitting:
            checkpoint = ours.resume(path)
            # what the Trainer checks for before restoring its schedulers (in memory only)
            checkpoint['optimizer_states'] = [checkpoint.get('optimizer')]
            return checkpoint
        return ours.load_checkpoint(path)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Done by ``load_checkpoint``."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Done by ``load_checkpoint``."""

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Our deletion (file or directory, then its manifest; a pointer naming it moves
        to the newest remaining checkpoint, or goes); rank 0."""
        if not self.is_global_zero:
            return
        path = Path(os.fspath(filepath)).absolute()
        if not any(info.path == path for info in list_checkpoints(path.parent)):
            self.checkpoint_io.remove_checkpoint(filepath)  # not ours: a link, a foreign file
            return
        try:
            pointed = read_pointer(path.parent)
        except (ValueError, OSError):
            pointed = None
        if pointed is not None and pointed.absolute() == path:
            others = [i.path for i in list_checkpoints(path.parent) if i.path != path]
            if others:
                update_pointer(path.parent, others[0])
            else:
                (path.parent / POINTER_NAME).unlink(missing_ok=True)
        delete_checkpoint(path)

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None:
            self.model = self.lightning_module
        super().teardown()
