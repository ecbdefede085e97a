"""BaseStrategy: the sequence around a training loop that is not the model's maths.

mmengine's ``BaseStrategy`` API (``mmengine._strategy``) is the contract; the
work is done by ``env/``, ``optim/``, ``scheduler/`` and ``checkpoint/``.

Construction
    1. ``_setup_env``: launcher → distributed init (an existing process group is
       used, not re-created), multiprocessing settings, file-descriptor limit,
       randomness (seed agreed across ranks), timestamp agreed across ranks.
    2. the logger (rank-aware; a log file under ``log_dir``).
    3. the ``Checkpointer`` over the backend's storage (``_checkpoint_storage``).

``prepare(model, optim_wrapper=, param_scheduler=, compile=, dispatch_kwargs=)``, written
once for every backend:
    1. ``_check_prepare_args``: what is refused before anything is built; records
       ``dispatch_kwargs``.
    2. ``build_model``: a registry cfg or an ``nn.Module``.
    3. ``_init_model_weights``: ``model.init_weights()`` when the model has one.
    4. ``setup_module_and_optimizers(model, optim_wrapper, compile)`` — **backend hook**:
       the wrapped model and the optim wrapper over its parameters. Default:
       ``_wrap_model`` (placement and wrapping: DDP, ``fully_shard``, ...; the wrapper
       gets the inner module's ``train_step`` / ``val_step`` / ``test_step``,
       ``integrations.model_api``), ``compile_model``, ``build_optim_wrapper``. A backend
       that wraps model and optimizer together (DeepSpeed's engine, fairscale's
       ShardedDataParallel) overrides this hook, never ``prepare``.
    5. ``_scale_lr`` once (never again on resume).
    6. ``initialize_count_status`` when accumulating (needs ``max_iters``).
    7. ``build_param_scheduler`` (default ``end`` from ``max_epochs``/``max_iters``).

Backend hooks (what a backend overrides)
    - ``_wrap_model(model)`` (abstract): placement and wrapping, above.
    - ``setup_module_and_optimizers``: above.
    - ``_unwrap_model()``: the plain module behind the wrapper (default: through
      DDP / DataParallel / ``torch.compile``).
    - ``model_state_dict()`` / ``load_model_state_dict()``: the model's state.
    - ``optim_state_dict()`` / ``load_optim_state_dict()``: the optimizer's state.
    - ``pending_grads()`` / ``set_pending_grads()``: this rank's gradients inside an
      accumulation window, by parameter name.
    - ``checkpoint_meta()``: extra ``meta`` keys.
    - ``_checkpoint_storage()``: where a checkpoint goes (``checkpoint/storage.py``;
      default: one file written by rank 0).
    The no-sync context belongs to the optim wrapper (``optim_context``), which
    uses the wrapped model's ``no_sync`` when it has one.

Checkpoints: the state is explicit. ``checkpoint_state()`` names the parts (model,
optimizer, partial gradients, loop position, schedulers, RNG states), each a ``Stateful``
built from this class's public state-dict methods; ``save_checkpoint`` / ``resume`` hand
them to the ``Checkpointer`` (``checkpoint/checkpointer.py``), which holds no strategy.
"""

from __future__ import annotations

import functools
import logging
import os.path as osp
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.checkpoint.checkpointer import Checkpointer, LoadContext, Stateful, StatePart
from stratagem.checkpoint.errors import CheckpointCorruptError
from stratagem.checkpoint.huggingface import model_config_json
from stratagem.checkpoint.state_dict import describe_keys, find_model_weights, unwrap_model
from stratagem.checkpoint.storage import CheckpointStorage
from stratagem.config import check_keys
from stratagem.env.backend import fit_runner_env_kwargs
from stratagem.integrations.model_api import call_model, expose_model_api, parse_loss
from stratagem.schema import ENV_KEYS as _ENV_KEYS
from stratagem.schema import RANDOMNESS_KEYS as _RANDOMNESS_KEYS

from .capabilities import Capabilities
from .environment import (
    build_module,
    check_prepare_args,
    compile_module,
    distributed_env_kwargs,
    initialize_accumulation,
    open_run_logger,
    scale_lr,
    setup_environment,
)
from .resume_checks import (
    check_model_fits,
    check_optimizer_fits,
    check_scheduler_count,
    previous_run_traces,
    resume_newest,
)
from .world_change import WorldSizeChange, plan_world_size_change

__all__ = ['BaseStrategy', 'CHECKPOINT_FORMAT_VERSION']

#: ``meta['format_version']`` of the checkpoints this version writes. 2: ``partial_grads``
#: is a list over ranks of ``{parameter name: gradient}`` in every backend (1, unversioned:
#: per rank and wrapper by optimizer index, FSDP's ``partial_grads_fqn``; still read).
CHECKPOINT_FORMAT_VERSION = 2


def _read_only(attr: str) -> Any:
    """A property returning ``self.<attr>``."""
    return property(lambda self: getattr(self, attr))


class BaseStrategy(ABC):
    """Owns environment, components and checkpoints around any training loop.

    Args:
        work_dir: Where logs and checkpoints go. Defaults to ``'work_dirs'``.
        experiment_name: Name of the run; defaults to the (rank-agreed) timestamp.
        env_kwargs: ``launcher`` ('none' | 'pytorch' | 'slurm' | 'mpi'; default:
            inferred from the environment), ``cudnn_benchmark`` (bool),
            ``mp_cfg`` (``setup_multi_processing`` kwargs), ``dist_cfg``
            (``init_dist`` kwargs, e.g. ``backend``, ``timeout`` in seconds),
            ``resource_limit`` (RLIMIT_NOFILE soft limit to raise to; default
            4096), ``randomness`` (``seed``, ``deterministic``, ``diff_rank_seed``).
        log_kwargs: ``get_logger`` kwargs (``log_level``, ``file_mode``, ...).
        auto_scale_lr: ``dict(enable=True, base_batch_size=N)`` scales every
            param group's lr by real batch / N once, at ``prepare``. The real
            batch is world_size × micro batch × accumulative_counts — unlike
            mmengine, which ignores gradient accumulation.
        async_checkpoint: ``save_checkpoint`` returns once every tensor is copied to
            reused CPU buffers (the checkpoint is the state at the call); a background
            thread writes and commits the copy (``Checkpointer``). Default False.
        checkpoint_timeout: seconds a rank may show no sign of life during a
            distributed save before the others give up on it, naming it, without
            committing. Default 600.
    """

    model: nn.Module
    optim_wrapper: Any
    param_schedulers: Any
    #: what this backend does that code outside it asks (``capabilities.py``); each backend
    #: declares its own, a subclass inherits its parent's
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(
        self,
        *,
        work_dir: str = 'work_dirs',
        experiment_name: str | None = None,
        env_kwargs: Mapping | None = None,
        log_kwargs: Mapping | None = None,
        auto_scale_lr: Mapping | None = None,
        async_checkpoint: bool = False,
        checkpoint_timeout: float = 600.0,
    ) -> None:
        # mmengine's FlexibleRunner default env_cfg (nccl) fitted to a machine without CUDA
        env_kwargs = fit_runner_env_kwargs(env_kwargs, log_kwargs)
        check_keys(env_kwargs, _ENV_KEYS, 'env_kwargs')
        randomness = dict(env_kwargs.get('randomness') or {})
        check_keys(randomness, _RANDOMNESS_KEYS, 'env_kwargs.randomness')
        if auto_scale_lr is not None:
            auto_scale_lr = dict(auto_scale_lr)
            check_keys(auto_scale_lr, {'enable', 'base_batch_size'}, 'auto_scale_lr')
        # checked before anything is set up; the storage is the backend's
        self.checkpointer = Checkpointer(
            None, async_checkpoint=async_checkpoint, timeout=checkpoint_timeout
        )
        self._work_dir = osp.abspath(work_dir)
        self._env_kwargs = env_kwargs
        self._randomness = randomness
        self._auto_scale_lr = auto_scale_lr
        self._lr_scaled = False
        self._prepared = False
        self._refit_schedulers = False  # resume(refit_schedulers=), read on restore
        self.dispatch_kwargs: dict[str, Any] = {}
        self.resumed_from: str | None = None
        self._setup_env(**env_kwargs)
        self._experiment_name = experiment_name or self._timestamp
        self._log_dir = osp.join(self._work_dir, self._timestamp)
        self.logger = self._build_logger(**dict(log_kwargs or {}))
        self.checkpointer.storage = self._checkpoint_storage()

    # ---------------------------------------------------------------- environment
    def _setup_env(
        self,
        *,
        launcher: str | None = None,
        cudnn_benchmark: bool = False,
        mp_cfg: Mapping | None = None,
        dist_cfg: Mapping | None = None,
        resource_limit: int = 4096,
        randomness: Mapping | None = None,
    ) -> None:
        """Launcher, distributed init, processes/threads, rlimit, seed and timestamp."""
        self._launcher, self._distributed = setup_environment(
            launcher=launcher,
            cudnn_benchmark=cudnn_benchmark,
            mp_cfg=mp_cfg,
            dist_cfg=dist_cfg,
            resource_limit=resource_limit,
        )
        self._set_randomness(**self._randomness)
        self._timestamp = env.broadcast_object(time.strftime('%Y%m%d_%H%M%S'))

    # a backend that needs several processes: the launcher it runs under (environment.py)
    _distributed_env_kwargs = staticmethod(distributed_env_kwargs)

    def _set_randomness(
        self, seed: int | None = None, deterministic: bool = False, diff_rank_seed: bool = False
    ) -> None:
        """Seed every RNG; ``seed`` (this rank's, as mmengine's) includes the rank under
        ``diff_rank_seed``, ``randomness['seed']`` stays the configured, rank-agreed one."""
        self._seed = env.set_random_seed(
            seed, deterministic=deterministic, diff_rank_seed=diff_rank_seed
        )
        base = self._seed - env.get_rank() if diff_rank_seed else self._seed
        self._randomness.update(seed=base)

    def _build_logger(self, **log_kwargs: Any) -> logging.Logger:
        """The 'stratagem' logger, writing to ``log_dir/<timestamp>.log`` for this run."""
        logger = open_run_logger(log_kwargs, osp.join(self._log_dir, f'{self._timestamp}.log'))
        logger.info(
            f'{type(self).__name__}: launcher {self._launcher}, world size '
            f'{env.get_world_size()}, seed {self._seed}, work_dir {self._work_dir}'
        )
        return logger

    # ------------------------------------------------------------------ properties
    @property
    def work_dir(self) -> str:
        return self._work_dir

    # read-only views of what __init__ set up
    log_dir: str = _read_only('_log_dir')
    experiment_name: str = _read_only('_experiment_name')
    launcher: str = _read_only('_launcher')
    distributed: bool = _read_only('_distributed')
    seed: int = _read_only('_seed')

    @property
    def rank(self) -> int:
        return env.get_rank()

    @property
    def world_size(self) -> int:
        return env.get_world_size()

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different batches (FSDP's tensor groups read one)."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        """Which batch this rank reads, 0 .. data_parallel_size - 1."""
        return self.rank

    timestamp: str = _read_only('_timestamp')

    @property
    def randomness(self) -> dict:
        return dict(self._randomness)

    # --------------------------------------------------------------------- prepare
    def prepare(
        self,
        model: nn.Module | Mapping,
        *,
        optim_wrapper: Any = None,
        param_scheduler: Any = None,
        compile: bool | Mapping = False,
        dispatch_kwargs: Mapping | None = None,
    ) -> Any:
        """Build and wrap the components; see the module docstring for the sequence.

        Returns the model alone, ``[model, optim_wrapper]``, or
        ``[model, optim_wrapper, param_schedulers]`` (mmengine's shapes), and
        keeps them as ``self.model`` / ``self.optim_wrapper`` /
        ``self.param_schedulers``. A second call returns what the first built.

        ``dispatch_kwargs``: ``max_iters`` / ``max_epochs`` / ``epoch_length``
        (iterations per epoch) for schedulers and accumulation;
        ``train_micro_batch_size_per_gpu`` for ``auto_scale_lr``.
        """
        if self._prepared:
            return self._prepared_components()
        self._check_prepare_args(optim_wrapper, param_scheduler, dispatch_kwargs, compile)
        model = self._init_model_weights(self.build_model(model))
        self.model, wrapper = self.setup_module_and_optimizers(model, optim_wrapper, compile)
        if wrapper is not None:
            self.attach_optim_wrapper(wrapper)
        if param_scheduler is not None:
            self.param_schedulers = self.build_param_scheduler(param_scheduler, wrapper)
        self._prepared = True
        return self._prepared_components()

    def _check_prepare_args(
        self,
        optim_wrapper: Any,
        param_scheduler: Any,
        dispatch_kwargs: Mapping | None,
        compile: bool | Mapping,
    ) -> None:
        """Backend hook: what ``prepare`` refuses before anything is built (schedulers
        without an optimizer; a backend adds its own); records ``dispatch_kwargs``."""
        check_prepare_args(optim_wrapper, param_scheduler)
        self.dispatch_kwargs.update(dispatch_kwargs or {})

    def setup_module_and_optimizers(
        self, model: nn.Module, optim_wrapper: Any, compile: bool | Mapping = False
    ) -> tuple[nn.Module, Any]:
        """Backend hook: ``(wrapped model, optim wrapper or None)``. Default: ``_wrap_model``
        (the wrapper gets the inner module's model API), ``compile_model``, then the optim
        wrapper over the wrapped model's parameters."""
        model = self._wrap_model(model)
        expose_model_api(model, unwrap_model(model))
        model = self.compile_model(model, compile=compile)
        wrapper = None if optim_wrapper is None else self.build_optim_wrapper(optim_wrapper, model)
        return model, wrapper

    def attach_optim_wrapper(self, optim_wrapper: Any) -> Any:
        """Prepare's post-steps (steps 5 and 6: ``auto_scale_lr`` once, the accumulation
        counters) for an optim wrapper built outside ``prepare``, e.g. by a host trainer over
        the wrapped parameters; returns it."""
        self.optim_wrapper = optim_wrapper
        self._scale_lr()
        self._initialize_accumulation()
        return optim_wrapper

    def _prepared_components(self) -> Any:
        names = ('optim_wrapper', 'param_schedulers')
        parts = [self.model, *(getattr(self, a) for a in names if hasattr(self, a))]
        return parts[0] if len(parts) == 1 else parts

    def build_model(self, model: nn.Module | Mapping) -> nn.Module:
        """An ``nn.Module`` as is, or one built from a MODELS cfg."""
        return build_module(model)

    def _init_model_weights(self, model: nn.Module) -> nn.Module:
        """Call ``model.init_weights()`` when it has one (mmengine's BaseModule, pretrained
        ``init_cfg``). Under DDP the wrapper then gives every rank rank 0's weights."""
        init = getattr(model, 'init_weights', None)
        if callable(init):
            init()
        return model

    @property
    def device(self) -> torch.device:
        """This process's device: the one chosen at construction (SingleDeviceStrategy's
        ``device``), else :func:`stratagem.env.default_device`."""
        chosen = getattr(self, '_device', None)
        return chosen or env.default_device()

    @abstractmethod
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        """Backend hook: place and wrap ``model``; return what the loop will call."""

    def _unwrap_model(self) -> nn.Module:
        """Backend hook: the plain module behind DDP / DataParallel / ``torch.compile``."""
        return unwrap_model(self.model)

    def compile_model(self, model: nn.Module, compile: bool | Mapping = False) -> nn.Module:
        """``torch.compile`` the model (``compile=True``) or, with ``compile=dict(target=
        'forward', **kwargs)``, a method of it in place (mmengine's semantics)."""
        return compile_module(model, compile)

    def build_optim_wrapper(self, optim_wrapper: Any, model: nn.Module | None = None) -> Any:
        """An optim wrapper as is, or one built from a cfg over ``model``'s parameters."""
        from stratagem.optim import BaseOptimWrapper, OptimWrapperDict, build_optim_wrapper

        if isinstance(optim_wrapper, (BaseOptimWrapper, OptimWrapperDict)):
            return optim_wrapper
        if not isinstance(optim_wrapper, Mapping):
            raise TypeError(
                'optim_wrapper should be an optim wrapper or a cfg dict, got '
                f'{type(optim_wrapper).__name__}'
            )
        model = self.model if model is None else model
        # no deep copy: the builder never mutates the cfg, and a cfg may hold a built
        # optimizer whose parameters must stay the model's
        return build_optim_wrapper(model, optim_wrapper)

    def _wrappers(self) -> list[Any]:
        from stratagem.optim import OptimWrapperDict

        ow = self.optim_wrapper
        return list(ow.values()) if isinstance(ow, OptimWrapperDict) else [ow]

    # ------------------------------------------------------------------------- the step
    def train_step(
        self,
        inputs: Any,
        targets: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        outputs: list | None = None,
    ) -> torch.Tensor:
        """One training step on this data-parallel rank's batch: forward, loss, backward and
        the optim wrapper's update (accumulation, clipping, AMP as configured); returns the
        loss, detached.

        ``inputs``: a tensor (``model(inputs)``), a tuple or list (``model(*inputs)``) or a
        dict (``model(**inputs)``); tensors are moved to :attr:`device`. With ``loss_fn``,
        the loss is ``loss_fn(outputs, targets)`` (a mean over the batch); without it,
        ``targets`` (when given) is passed to the model after ``inputs`` and the model
        returns the loss, or a dict whose ``loss*`` entries are summed (mmengine's
        convention). ``outputs``: a list the model's outputs are appended to.

        It is ``with optim_wrapper.optim_context(model): ...`` then
        ``optim_wrapper.update_params(loss)``, which a loop may still write itself, except
        under a pipeline (FSDPStrategy's ``mesh.pipeline``), where only this method runs a
        step: the schedule runs the microbatches.
        """
        wrapper = self._step_wrapper()
        if loss_fn is None and targets is not None:
            inputs = _with_targets(inputs, targets)
        with wrapper.optim_context(self.model):
            out = call_model(self.model, inputs, self.device)
            if outputs is not None:
                outputs.append(out)
            loss = (
                parse_loss(out)
                if loss_fn is None
                else loss_fn(out, _to_device(targets, self.device))
            )
        wrapper.update_params(loss)
        return loss.detach()

    def _step_wrapper(self) -> Any:
        """The one optim wrapper ``train_step`` updates."""
        from stratagem.optim import OptimWrapperDict

        wrapper = getattr(self, 'optim_wrapper', None)
        if wrapper is None:
            raise RuntimeError(
                'train_step: no optim wrapper; call strategy.prepare(model, '
                'optim_wrapper=dict(optimizer=dict(type=...))) first'
            )
        if isinstance(wrapper, OptimWrapperDict):
            raise TypeError(
                f'train_step updates one optim wrapper; this run has several '
                f'({", ".join(wrapper)}): step each with '
                "optim_wrapper['name'].update_params(loss) in your loop"
            )
        return wrapper

    def _scale_lr(self) -> None:
        """Scale every lr by real batch / ``base_batch_size`` once (``auto_scale_lr``,
        ``environment.scale_lr``); a resumed optimizer state already holds the scaled lr."""
        cfg = self._auto_scale_lr
        if self._lr_scaled or not cfg or not cfg.get('enable', False):
            return
        scale_lr(
            self._wrappers(),
            cfg,
            world_size=self.data_parallel_size,
            micro_batch=self.dispatch_kwargs.get('train_micro_batch_size_per_gpu'),
        )
        self._lr_scaled = True

    def _initialize_accumulation(self, done_iters: int | None = 0) -> None:
        """Tell accumulating wrappers where training stands and where it ends (this run's
        ``max_iters``, which wins over a resumed checkpoint's, so a run can be extended)."""
        initialize_accumulation(self._wrappers(), self.model, done_iters, self.dispatch_kwargs)

    def build_param_scheduler(self, scheduler: Any, optim_wrapper: Any) -> Any:
        """A list of schedulers (a dict of lists for an OptimWrapperDict) from cfgs.

        A scheduler cfg without ``end`` ends at ``max_epochs`` (by epoch) or
        ``max_iters`` (by iteration) from ``dispatch_kwargs``.
        """
        from stratagem.scheduler import build_param_schedulers

        d = self.dispatch_kwargs
        return build_param_schedulers(
            scheduler,
            optim_wrapper,
            epoch_length=d.get('epoch_length'),
            max_epochs=d.get('max_epochs'),
            max_iters=d.get('max_iters'),
        )

    def collect_env(self) -> tuple[dict, dict]:
        """``(system_env, runtime_env)`` as mmengine returns them (this run's launcher,
        distribution, seed and determinism in the second)."""
        runtime = {
            'launcher': self._launcher,
            'distributed': self._distributed,
            'world_size': self.world_size,
            'seed': self._seed,
            'deterministic': self._randomness.get('deterministic', False),
        }
        return dict(env.collect_env()), runtime

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_storage(self) -> CheckpointStorage:
        """Backend hook: where a checkpoint goes (default: one file, written by rank 0)."""
        return CheckpointStorage(self._manifest_fields)

    def _manifest_fields(self) -> dict:
        """What a checkpoint's manifest records of this run."""
        return {'world_size': self.world_size, 'strategy': type(self).__name__}

    @property
    def async_checkpoint(self) -> bool:
        """Whether saves are written on a background thread (the constructor's option; may
        be switched between saves)."""
        return self.checkpointer.async_checkpoint

    @async_checkpoint.setter
    def async_checkpoint(self, value: bool) -> None:
        if type(value) is not bool:
            raise TypeError(f'async_checkpoint must be True or False, got {value!r}')
        self.checkpointer.async_checkpoint = value

    @property
    def checkpoint_timeout(self) -> float:
        """Seconds a rank may show no sign of life during a distributed save."""
        return self.checkpointer.timeout

    def checkpoint_state(
        self,
        *,
        meta: Mapping | None = None,
        optimizer: bool = True,
        schedulers: bool = True,
    ) -> dict[str, Stateful]:
        """The parts of a checkpoint, in the order a resume restores them: the model
        (``state_dict``), the optimizer (with its counters and scaler), every rank's partial
        gradients (``partial_grads``, inside an accumulation window), the loop's position
        (``meta``, with ``meta`` merged in on save), the schedulers, every rank's RNG state
        last. ``optimizer`` / ``schedulers``: include them (when prepared)."""
        parts: dict[str, Stateful] = {
            'state_dict': StatePart(
                self.model_state_dict, self._restore_model, check=self._check_model
            )
        }
        if optimizer and hasattr(self, 'optim_wrapper'):
            parts['optimizer'] = StatePart(
                self.optim_state_dict, self._restore_optimizer, check=self._check_optimizer
            )
            parts['partial_grads'] = StatePart(
                self._gather_pending_grads, self._restore_pending_grads, required=False
            )
        parts['meta'] = StatePart(
            lambda: self.checkpoint_meta(meta),
            self._restore_position,
            check=self._plan_position,
            required=False,
        )
        if schedulers and hasattr(self, 'param_schedulers'):
            parts['param_schedulers'] = StatePart(
                self.scheduler_state_dict, self._restore_schedulers, check=self._check_schedulers
            )
        parts['rng_states'] = StatePart(
            lambda: env.all_gather_object(env.get_rng_state()),
            self._restore_randomness,
            check=self._check_randomness,
            required=False,
        )
        return parts

    def save_checkpoint(
        self,
        filename: str,
        *,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        extra_ckpt: Mapping | None = None,
        callback: Callable[[dict], None] | None = None,
    ) -> str:
        """Save model (+ optimizer, schedulers, RNG states) atomically; every rank calls it.

        ``filename`` is a path; relative paths are under ``work_dir``.
        ``extra_ckpt['meta']`` (e.g. ``iter``/``epoch``) merges into ``meta``;
        other ``extra_ckpt`` keys are stored as they are (tensors and plain values
        only). ``callback(checkpoint)`` may edit the dict before it is written.
        Returns the final path (with ``async_checkpoint``, where the checkpoint will
        be once committed; ``wait_for_checkpoints`` waits for that). The sequence:
        :class:`~stratagem.checkpoint.Checkpointer`.
        """
        extra = dict(extra_ckpt or {})
        path = filename if osp.isabs(filename) else osp.join(self.work_dir, filename)
        state = self.checkpoint_state(
            meta=extra.pop('meta', None),
            optimizer=save_optimizer,
            schedulers=save_param_scheduler,
        )
        return self.checkpointer.save(path, state, extra=extra, callback=callback)

    def wait_for_checkpoints(self) -> None:
        """Block until every pending (asynchronous) save is committed; raise its error if it
        failed, on every rank. A no-op when nothing is pending. ``save_checkpoint``,
        ``resume``, ``load_checkpoint`` and ``load_or_resume`` call it first."""
        self.checkpointer.wait()

    def checkpoint_meta(self, extra_meta: Mapping | None = None) -> dict:
        """A checkpoint's ``meta``: seed, time, experiment, world size, strategy, versions,
        what a resume at another world size needs, then ``extra_meta`` (e.g. ``iter``)."""
        from stratagem.version import __version__

        meta = {
            'seed': self._randomness['seed'],
            'time': time.strftime('%Y%m%d_%H%M%S'),
            'experiment_name': self._experiment_name,
            'world_size': self.world_size,
            'data_parallel_size': self.data_parallel_size,
            'strategy': type(self).__name__,
            'format_version': CHECKPOINT_FORMAT_VERSION,
            'stratagem_version': __version__,
            'torch_version': str(torch.__version__),
            'auto_scale_lr_applied': self._lr_scaled,
        }
        for key in ('train_micro_batch_size_per_gpu', 'epoch_length'):
            if self.dispatch_kwargs.get(key) is not None:
                meta[key] = int(self.dispatch_kwargs[key])
        config = model_config_json(self._unwrap_model())  # a PreTrainedModel's, for --to hf
        if config is not None:
            meta['hf_config'] = config
        meta.update(extra_meta or {})
        return meta

    # ----------------------------------------------------------------- state dicts
    def model_state_dict(self) -> dict:
        """The unwrapped model's state dict (tensors kept on their device)."""
        return self._unwrap_model().state_dict()

    def optim_state_dict(self) -> dict:
        """The optim wrapper's state dict (optimizer, counters, scaler)."""
        return self.optim_wrapper.state_dict()

    def scheduler_state_dict(self) -> list | dict:
        """Each scheduler's state dict, in the shape ``param_schedulers`` has."""
        scheds = self.param_schedulers
        if isinstance(scheds, Mapping):
            return {k: [s.state_dict() for s in v] for k, v in scheds.items()}
        return [s.state_dict() for s in scheds]

    def load_model_state_dict(
        self,
        state_dict: Mapping,
        *,
        strict: bool = False,
        revise_keys: Sequence[tuple[str, str]] = ((r'^module\.', ''),),
    ) -> Any:
        """Load weights into the unwrapped model; mismatches reported in one message."""
        state_dict = ckpt.revise_keys(state_dict, list(revise_keys))
        return ckpt.load_state_dict(
            self._unwrap_model(), state_dict, strict=strict, logger=self.logger
        )

    def load_optim_state_dict(self, state_dict: Mapping) -> None:
        self.optim_wrapper.load_state_dict(state_dict)

    def load_scheduler_state_dict(self, state_dict: list | dict) -> None:
        scheds = self.param_schedulers
        if isinstance(scheds, Mapping):
            for name, states in state_dict.items():  # type: ignore[union-attr]
                self._load_scheduler_list(scheds[name], states)
        else:
            self._load_scheduler_list(scheds, state_dict)  # type: ignore[arg-type]

    @staticmethod
    def _load_scheduler_list(scheds: Sequence, states: Sequence) -> None:
        if len(scheds) != len(states):
            raise ValueError(
                f'checkpoint holds {len(states)} param scheduler state(s) but '
                f'{len(scheds)} scheduler(s) were built; the param_scheduler config '
                'changed since the checkpoint was saved'
            )
        for sched, state in zip(scheds, states):
            sched.load_state_dict(state)

    def pending_grads(self) -> dict[str, torch.Tensor] | None:
        """Backend hook: this rank's gradients inside an accumulation window, by parameter
        name (references, on their device); None between windows."""
        named = self._parameter_names()
        grads: dict[str, torch.Tensor] = {}
        open_window = False
        for wrapper in self._wrappers():
            if not hasattr(wrapper, 'grad_state_dict') or wrapper.should_update():
                continue
            open_window = True
            holders = wrapper.grad_holders()
            for index, grad in wrapper.grad_state_dict()['grads'].items():
                grads[named[id(holders[index])]] = grad
        return grads if open_window else None

    def set_pending_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Backend hook: put back gradients read by :meth:`pending_grads` (each wrapper keeps
        its counters and loss scale, restored with the optimizer state first)."""
        named = self._parameter_names()
        for wrapper in self._wrappers():
            if not hasattr(wrapper, 'grad_state_dict'):
                continue
            state = wrapper.grad_state_dict()
            state['grads'] = {
                i: grads[named[id(p)]]
                for i, p in enumerate(wrapper.grad_holders())
                if named.get(id(p)) in grads
            }
            wrapper.load_grad_state_dict(state)

    def _parameter_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self._unwrap_model().named_parameters()}

    def _holder_names(self, saved_order: Sequence[str] | None = None) -> list[list[str]]:
        """Per optim wrapper, the names of the parameters its gradient indices count. With an
        OptimWrapperDict, ``saved_order`` (the saved optimizer state's keys) orders them as
        the saving run did, so a resume whose cfg lists them in another order pairs each
        saved wrapper with its namesake."""
        named = self._parameter_names()
        wrappers = self._wrappers()
        keys = list(getattr(self.optim_wrapper, 'keys', lambda: [])())
        if saved_order is not None and keys and sorted(saved_order) == sorted(keys):
            wrappers = [self.optim_wrapper[k] for k in saved_order]
        return [
            [named[id(p)] for p in w.grad_holders()] if hasattr(w, 'grad_holders') else []
            for w in wrappers
        ]

    # ------------------------------------------------------------- the parts' steps
    def _check_model(self, state_dict: Any, context: LoadContext) -> None:
        check_model_fits(self._unwrap_model(), state_dict, context.path)

    def _restore_model(self, state_dict: Any, context: LoadContext) -> None:
        """Non-strict, as mmengine (mismatches in one warning)."""
        self._load_weights({'state_dict': state_dict}, context.path, strict=False)

    def _check_optimizer(self, state: Any, context: LoadContext) -> None:
        check_optimizer_fits(self.optim_wrapper, state, context.path)

    def _restore_optimizer(self, state: Any, context: LoadContext) -> None:
        self.load_optim_state_dict(state)

    def _gather_pending_grads(self) -> list | dict | None:
        """Every rank's :meth:`pending_grads` (on CPU), when several ranks accumulate each
        their own inside a window (collective; the window is open on all ranks alike). One
        process: None, the optimizer state holds them."""
        if self.world_size == 1:
            return None
        mine = self.pending_grads()
        if mine is None:
            return None
        return env.all_gather_object({k: g.cpu() for k, g in mine.items()})

    def _restore_pending_grads(self, per_rank: Any, context: LoadContext) -> None:
        """This rank's partial gradients; at another world size the mean of the saved
        ranks' (what DDP would have averaged at the window's end)."""
        per_rank = upgrade_partial_grads(
            per_rank,
            context.checkpoint.get('partial_grads_fqn'),
            lambda: self._holder_names(_saved_wrapper_order(context.checkpoint.get('optimizer'))),
        )
        if not per_rank:
            return
        world = int(context.meta.get('world_size', len(per_rank)))
        if world == self.world_size:
            mine = per_rank[self.rank]
        else:
            mine = {k: sum(g[k] for g in per_rank) / len(per_rank) for k in per_rank[0]}
        self.set_pending_grads(mine)
        if world != self.world_size:
            env.warn_rank_zero(
                f'the checkpoint was taken mid accumulation window with world '
                f'size {world}; this run has {self.world_size}, so every rank '
                f"continues the window from the mean of the {world} ranks' "
                'partial gradients',
                stacklevel=3,
            )

    def _plan_position(self, meta: Any, context: LoadContext) -> None:
        """A world-size change: positions converted in samples, or refused naming both
        world sizes, before anything is loaded (``context.notes['world_size_change']``)."""
        accumulation = 1
        if hasattr(self, 'optim_wrapper'):
            accumulation = max(getattr(w, 'accumulative_counts', 1) for w in self._wrappers())
        context.notes['world_size_change'] = plan_world_size_change(
            meta or {},
            self.dispatch_kwargs,
            self.world_size,
            accumulation,
            context.path,
            self.data_parallel_size,
        )

    def _restore_position(self, meta: Any, context: LoadContext) -> None:
        """Where training stands: the accumulation counters (and, converted to this world
        size, ``max_iters``)."""
        change: WorldSizeChange | None = context.notes.get('world_size_change')
        done = (meta or {}).get('iter')
        if change is not None and change.new_iter is not None:
            done = change.new_iter
            if change.max_iters is not None:
                self.dispatch_kwargs['max_iters'] = change.max_iters[1]
        if hasattr(self, 'optim_wrapper'):
            self._initialize_accumulation(done)

    def _check_schedulers(self, states: Any, context: LoadContext) -> None:
        """The same number of schedulers; at another world size their counts converted."""
        check_scheduler_count(self.scheduler_state_dict(), states, context.path)
        change: WorldSizeChange | None = context.notes.get('world_size_change')
        if change is not None and change.new_iter is not None:
            context.replace(
                'param_schedulers',
                change.rescale_schedulers(
                    self.param_schedulers,
                    states,
                    self.dispatch_kwargs.get('epoch_length'),
                    context.path,
                ),
            )

    def _restore_schedulers(self, states: Any, context: LoadContext) -> None:
        """The saved schedulers; those whose ``end`` was fitted to the saving run's length
        (a cfg without ``end``) and this run's differs: kept as saved with one warning, or,
        with ``resume(refit_schedulers=True)``, as this run built them, replayed from the
        first iteration to the resumed one (the values a fresh run of this length has)."""
        from stratagem.scheduler.replay import fitted_length_changes, replay_schedulers

        change: WorldSizeChange | None = context.notes.get('world_size_change')
        epoch_length = self.dispatch_kwargs.get('epoch_length')
        scheds = self.param_schedulers
        lists = list(scheds.values()) if isinstance(scheds, Mapping) else [scheds]
        saved = [states.get(k, []) for k in scheds] if isinstance(scheds, Mapping) else [states]
        refit = [c for own, st in zip(lists, saved) for c in fitted_length_changes(own, st)]
        if refit and self._refit_schedulers:
            done = (context.meta or {}).get('iter') or 0
            if change is not None and change.new_iter is not None:
                done = change.new_iter
            for own in lists:
                replay_schedulers(own, int(done), epoch_length)
            if self.rank == 0:
                self.logger.info('param schedulers refitted to this run: ' + '; '.join(refit))
            return
        self.load_scheduler_state_dict(states)
        if refit and self.rank == 0:  # the same on every rank: said once
            warnings.warn(
                f'resuming {context.path} into a run of another length: '
                + '; '.join(refit)
                + '. These schedulers keep the saved length (their value stops changing '
                'after it); to refit them to this run, resume with '
                'train_cfg.refit_schedulers=True (--cfg-options '
                'train_cfg.refit_schedulers=True; API: strategy.resume(..., '
                'refit_schedulers=True))',
                UserWarning,
                stacklevel=2,
            )
        if change is not None and change.new_iter is not None:
            change.replay_schedulers(self.param_schedulers, epoch_length)

    def _check_randomness(self, states: Any, context: LoadContext) -> None:
        """The RNG state this rank will restore is one: tried here, before anything loads,
        and this process's own put back (a state the manifest's digests cannot vouch for,
        e.g. one written wrong, is a named error, not numpy's or torch's)."""
        world = context.meta.get('world_size', 1)
        if not states or world != self.world_size:
            return  # re-seeded from the saved seed
        own = env.get_rng_state()
        try:
            env.set_rng_state(states[self.rank])
        except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as err:
            raise CheckpointCorruptError(
                f'{context.path}: rng_states[{self.rank}] is not an RNG state this run can '
                f'restore ({type(err).__name__}: {err}); nothing was loaded. Resume it with '
                'another checkpoint, or load its weights only (load_checkpoint)'
            ) from None
        finally:
            env.set_rng_state(own)

    def _restore_randomness(self, states: Any, context: LoadContext) -> None:
        """Every rank's RNG state (same world size), else a re-seed from the saved seed."""
        meta = context.meta
        world = meta.get('world_size', 1)
        base = meta.get('seed', self._seed)  # rank 0's seed: the configured one
        if states and world == self.world_size:
            self._seed = base + self.rank if self._randomness.get('diff_rank_seed') else base
            self._randomness.update(seed=base)
            env.set_rng_state(states[self.rank])
            return
        if states:
            env.warn_rank_zero(
                f'{context.path} was saved with world size {world}, this run has '
                f'{self.world_size}: per-rank RNG streams cannot be restored, so '
                f'every rank is re-seeded from seed {base}',
                stacklevel=3,
            )
        self._set_randomness(**{**self._randomness, 'seed': base})

    # ------------------------------------------------------------------- loading
    def load_checkpoint(
        self,
        filename: str,
        *,
        map_location: Any = 'cpu',
        strict: bool = False,
        revise_keys: Sequence[tuple[str, str]] = ((r'^module\.', ''),),
        callback: Callable[[dict], None] | None = None,
    ) -> dict:
        """Load model weights from ``filename``; returns the whole checkpoint dict.

        ``callback(checkpoint)`` runs after reading and before loading, and may
        edit the dict in place. Foreign layouts are recognised: the weights are taken
        from ``state_dict``, ``model_state_dict``, ``model`` or ``module``, else the
        file is read as a bare state dict (``module.`` prefixes are stripped by the
        default ``revise_keys``). A file whose weights match none of the model's keys
        is an error even when not ``strict`` (mmengine loads nothing and goes on); a
        failed load leaves the model unchanged.
        """
        path, checkpoint = self.checkpointer.read(filename, self._map_location(map_location))
        if callback is not None:
            callback(checkpoint)
        self._load_weights(checkpoint, path, strict=strict, revise_keys=revise_keys)
        return checkpoint

    def _map_location(self, map_location: Any) -> Any:
        """mmengine's ``'default'``: this strategy's device (CUDA's current one, else cpu)."""
        return str(self.device) if map_location == 'default' else map_location

    # below this share of the model's tensors found in the file, a load warns loudly
    MIN_LOADED_SHARE = 0.5

    def _load_weights(
        self,
        checkpoint: Mapping,
        filename: str,
        *,
        strict: bool,
        revise_keys: Sequence[tuple[str, str]] = ((r'^module\.', ''),),
    ) -> None:
        """Find the weights (``state_dict``, or a foreign layout: ``model_state_dict``,
        ``model``, ``module``, a bare state dict) and load them; nothing changes on an error.

        No layout found, no key matching, or a strict mismatch raises
        ``StateDictMismatchError`` naming the file and what it holds; fewer than
        ``MIN_LOADED_SHARE`` of the model's tensors loaded warns ``PartialLoadWarning``.
        """
        where = None
        try:
            state_dict, where = find_model_weights(checkpoint)
            report = self.load_model_state_dict(state_dict, strict=strict, revise_keys=revise_keys)
        except ckpt.StateDictMismatchError as err:
            raise ckpt.StateDictMismatchError(
                f'{filename} {err}'
                if where is None
                else f'{filename} ({where}): {err}\nthe file holds {describe_keys(checkpoint)}'
            ) from None
        counts = ''
        if isinstance(report, ckpt.LoadReport) and report.total:
            counts = f', {report.loaded} of {report.total} tensors'
            if report.loaded < self.MIN_LOADED_SHARE * report.total:
                left_out = report.missing_keys + [
                    k for k, *_ in report.shape_mismatches + report.type_mismatches
                ]
                env.warn_rank_zero(  # every rank loads the same file: said once
                    f'{filename} ({where}): only {report.loaded} of the {report.total} '
                    f'tensors of {type(self._unwrap_model()).__name__} were found and '
                    f'loaded; not loaded: {", ".join(left_out[:10])}'
                    f'{", ..." if len(left_out) > 10 else ""}. The file holds '
                    f'{describe_keys(checkpoint)}. Fine for a partial (e.g. backbone) '
                    'load; otherwise check the checkpoint and revise_keys',
                    ckpt.PartialLoadWarning,
                    stacklevel=4,
                )
        self.logger.info(f'loaded weights from {filename} ({where}{counts})')

    def resume(
        self,
        filename: str,
        *,
        resume_optimizer: bool = True,
        resume_param_scheduler: bool = True,
        map_location: Any = 'default',
        callback: Callable[[dict], None] | None = None,
        refit_schedulers: bool = False,
    ) -> dict:
        """Continue exactly where ``filename`` stopped; returns the checkpoint (``meta`` has iter).

        Restores model, optimizer (with counters, scaler, partial gradients),
        schedulers, then every rank's RNG state last; every check runs before anything is
        loaded, so a refused resume changes nothing. Call after ``prepare``. A world-size
        change puts ``world_size_change`` and the converted ``iter`` into the returned
        ``meta``. The sequence: :meth:`~stratagem.checkpoint.Checkpointer.load`.

        A scheduler whose ``end`` was fitted to the saving run's length (its cfg has no
        ``end``: it got ``max_epochs`` / ``max_iters``) keeps the saved length, as mmengine's
        resume does, with one warning naming it when this run's length differs;
        ``refit_schedulers=True`` gives it this run's length instead (``T_max`` and other
        lengths derived from ``end`` follow), its values replayed from the first iteration
        to the resumed one, so they are those of a fresh run of this length.
        """
        if not self._prepared:
            raise RuntimeError(
                'resume() needs the prepared components: call strategy.prepare('
                'model, optim_wrapper=..., param_scheduler=...) first'
            )
        want_optim = resume_optimizer and hasattr(self, 'optim_wrapper')
        self._refit_schedulers = refit_schedulers
        state = self.checkpoint_state(optimizer=resume_optimizer, schedulers=resume_param_scheduler)
        context = self.checkpointer.load(
            filename,
            state,
            map_location=self._map_location(map_location),
            optimizer=want_optim,
            callback=callback,
        )
        path, checkpoint = context.path, context.checkpoint
        meta = context.meta
        change: WorldSizeChange | None = context.notes.get('world_size_change')
        if change is not None:
            done = change.new_iter if change.new_iter is not None else meta.get('iter')
            checkpoint['meta'] = meta = {
                **meta,
                'iter': done,
                'world_size_change': change.as_meta(),
            }
            if self.rank == 0:  # the same on every rank: said once
                enabled = bool((self._auto_scale_lr or {}).get('enable'))
                self.logger.warning(change.describe(path, auto_scale_lr=enabled))
        check_same_step(meta.get('iter'), path)
        self.resumed_from = osp.abspath(path)
        self.logger.info(f'resumed from {path} (iter {meta.get("iter")})')
        return checkpoint

    def load_or_resume(
        self,
        load_from: str | None = None,
        resume: bool | str = False,
        *,
        refit_schedulers: bool = False,
    ) -> dict | None:
        """mmengine's runner logic: resume (latest in work_dir, or a path) or just load weights.

        ``resume=True`` with no ``load_from`` resumes from the newest committed
        checkpoint in ``work_dir`` (none, in a work dir that never held one: starts fresh,
        with a log line; none, in a work dir whose pointer or checkpoint files show an
        earlier run: ``FileNotFoundError``, before anything is written; one this world
        size cannot continue from exactly: the newest that it can, with a warning);
        ``resume='path'`` or ``resume=True`` with ``load_from`` resumes from that
        file; ``load_from`` alone loads weights only. Returns the checkpoint or None.
        ``refit_schedulers``: see :meth:`resume`.
        """
        resume_fn = functools.partial(self.resume, refit_schedulers=refit_schedulers)
        self.wait_for_checkpoints()
        if self.rank == 0:  # debris of a killed run: its orphan manifests and temp entries
            ckpt.sweep_debris(self.work_dir)
        if isinstance(resume, str):
            return resume_fn(resume)
        if resume and load_from is None:
            # rank 0 decides (other ranks may not see this work_dir, or see another one);
            # resume() then checks every rank reads that same checkpoint
            work_dir = self.work_dir
            latest = ckpt.find_latest_checkpoint(work_dir) if self.rank == 0 else None
            latest = env.broadcast_object(None if latest is None else str(latest))
            if latest is None:
                # a previous run left traces but nothing resumable: starting fresh would
                # overwrite its files, so stop before anything is written
                traces = env.broadcast_object(
                    previous_run_traces(work_dir) if self.rank == 0 else None
                )
                if traces:
                    raise FileNotFoundError(
                        f'cannot resume from work_dir {work_dir}: {traces}, but no '
                        'committed checkpoint there verifies; nothing was changed. Resume '
                        'from a file with --resume PATH (API: resume=PATH), or start from '
                        f'scratch in a new --work-dir (or after removing {ckpt.POINTER_NAME})'
                    )
                self.logger.info(
                    f'no checkpoint in {work_dir} to resume from; training starts from scratch'
                )
                return None
            return resume_newest(resume_fn, str(latest), work_dir, self.logger)
        if resume and load_from is not None:  # resume=True with a file: that file
            return resume_fn(load_from)
        if load_from is not None:
            return self.load_checkpoint(load_from)
        return None

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}(work_dir={self._work_dir!r}, launcher={self._launcher!r}, '
            f'world_size={self.world_size}, seed={self._seed})'
        )


def _with_targets(inputs: Any, targets: Any) -> Any:
    """``inputs`` with ``targets`` after them, for ``model(*inputs, targets)``."""
    if isinstance(inputs, Mapping):
        raise TypeError(
            'train_step: inputs is a dict, so the model takes keyword arguments; put the '
            'targets in the dict, or pass loss_fn=... to compute the loss from the outputs'
        )
    return (*inputs, targets) if isinstance(inputs, (list, tuple)) else (inputs, targets)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, Mapping):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def check_same_step(step: Any, filename: str) -> None:
    """After a resume every rank must stand at the same iteration (collective)."""
    keys = env.all_gather_keys([env.key_of(step)])
    if any(key != keys[0] for key in keys):  # the steps themselves only to report them
        steps = env.all_gather_object(step)
        raise RuntimeError(
            f'after resuming {filename} the ranks disagree on the iteration: '
            f'{steps} (rank order); every rank must resume the same checkpoint'
        )


def _saved_wrapper_order(optimizer_state: Any) -> list[str] | None:
    """An OptimWrapperDict's state: its wrappers' names in the saving run's order."""
    if isinstance(optimizer_state, Mapping) and not {'state', 'param_groups'} & set(
        optimizer_state
    ):
        return [str(k) for k in optimizer_state]
    return None


def upgrade_partial_grads(
    per_rank: Any, fsdp_v1: Any, holder_names: Callable[[], list[list[str]]]
) -> list | None:
    """``partial_grads`` in this version's form (a list over ranks of ``{name: gradient}``)
    from any version's: FSDP's ``partial_grads_fqn`` (format 1, already by name), or the
    other backends' per rank and wrapper ``{'grads': {optimizer index: gradient}, ...}``
    (format 1), named by ``holder_names()`` (per wrapper, the names its indices count; the
    resume checks made sure the optimizer's parameters are the saved ones)."""
    if not per_rank:
        return fsdp_v1 or None
    if all(isinstance(entry, Mapping) for entry in per_rank):
        return list(per_rank)
    names = holder_names()
    upgraded = []
    for entry in per_rank:
        named: dict[str, torch.Tensor] = {}
        for wrapper_names, state in zip(names, entry):
            if state is not None:
                named.update({wrapper_names[i]: g for i, g in state['grads'].items()})
        upgraded.append(named)
    return upgraded
