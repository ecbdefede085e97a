"""BaseStrategy: the sequence around a training loop that is not the model's maths.

mmengine's ``BaseStrategy`` API (``mmengine._strategy``) is the contract; the
work is done by ``env/``, ``optim/``, ``scheduler/`` and ``checkpoint/``.

Construction
    1. ``_setup_env``: launcher → distributed init (an existing process group is
       used, not re-created), multiprocessing settings, file-descriptor limit,
       randomness (seed agreed across ranks), timestamp agreed across ranks.
    2. the logger (rank-aware; a log file under ``log_dir``).

``prepare(model, optim_wrapper=, param_scheduler=, compile=, dispatch_kwargs=)``
    1. ``build_model``: a registry cfg or an ``nn.Module``.
    2. ``_init_model_weights``: ``model.init_weights()`` when the model has one.
    3. ``_wrap_model``  — **backend hook**: move to the device, convert norms,
       wrap (DDP, FSDP, ...). Returns the model the loop calls.
       A wrapper gets the inner module's ``train_step`` / ``val_step`` /
       ``test_step`` (``integrations.model_api``), as a host trainer's loop
       (mmengine's) calls them on ``strategy.model``.
    4. ``compile_model``: ``torch.compile`` of the model or one of its methods.
    5. ``build_optim_wrapper`` over the wrapped model's parameters (a backend may wrap
       the model here instead, ShardedDDP: the new wrapper gets the model API too), then
       ``_scale_lr`` once (never again on resume).
    6. ``initialize_count_status`` when accumulating (needs ``max_iters``).
    7. ``build_param_scheduler`` (default ``end`` from ``max_epochs``/``max_iters``).

Backend hooks (what a backend overrides)
    - ``_wrap_model(model)`` (abstract): placement and wrapping, above.
    - ``_unwrap_model()``: the plain module behind the wrapper (default: through
      DDP / DataParallel / ``torch.compile``).
    - ``model_state_dict()`` / ``load_model_state_dict()``: the model's state.
    - ``optim_state_dict()`` / ``load_optim_state_dict()``: the optimizer's state.
    - ``_checkpoint_layout()``: the layout a save writes, a ``CheckpointLayout``
      (``layout.py``; default: one file written by rank 0 through
      ``checkpoint.save_checkpoint``); ``_partial_grad_states()``: what a save mid
      accumulation window keeps of the gradients.
    - ``_load_checkpoint_files(filename, map_location)``: the on-disk layout, read.
    The no-sync context belongs to the optim wrapper (``optim_context``), which
    uses the wrapped model's ``no_sync`` when it has one.

Checkpoints: every sequence (save, async save, resume, load, load_or_resume) is the
strategy's ``Checkpointer`` (``checkpointer.py``, composed, not mixed in), over the layout
the backend supplies (``layout.py``). The state it reads and the public checkpoint API
are ``CheckpointState`` (``checkpoint_state.py``), BaseStrategy's second half.
"""

from __future__ import annotations

import logging
import os.path as osp
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.config import check_keys
from stratagem.integrations.model_api import expose_model_api
from stratagem.schema import ENV_KEYS as _ENV_KEYS
from stratagem.schema import RANDOMNESS_KEYS as _RANDOMNESS_KEYS

from .checkpoint_state import CheckpointState
from .checkpointer import Checkpointer
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
from .layout import CheckpointLayout

__all__ = ['BaseStrategy']


def _read_only(attr: str) -> Any:
    """A property returning ``self.<attr>``."""
    return property(lambda self: getattr(self, attr))


class BaseStrategy(CheckpointState, ABC):
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
        env_kwargs = dict(env_kwargs or {})
        check_keys(env_kwargs, _ENV_KEYS, 'env_kwargs')
        randomness = dict(env_kwargs.get('randomness') or {})
        check_keys(randomness, _RANDOMNESS_KEYS, 'env_kwargs.randomness')
        if auto_scale_lr is not None:
            auto_scale_lr = dict(auto_scale_lr)
            check_keys(auto_scale_lr, {'enable', 'base_batch_size'}, 'auto_scale_lr')
        self.checkpointer = Checkpointer(
            self, async_checkpoint=async_checkpoint, timeout=checkpoint_timeout
        )
        self._work_dir = osp.abspath(work_dir)
        self._env_kwargs = env_kwargs
        self._randomness = randomness
        self._auto_scale_lr = auto_scale_lr
        self._lr_scaled = False
        self._prepared = False
        self.dispatch_kwargs: dict[str, Any] = {}
        self.resumed_from: str | None = None
        self._setup_env(**env_kwargs)
        self._experiment_name = experiment_name or self._timestamp
        self._log_dir = osp.join(self._work_dir, self._timestamp)
        self.logger = self._build_logger(**dict(log_kwargs or {}))

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
        self._check_prepare_args(optim_wrapper, param_scheduler, dispatch_kwargs)
        model = self.build_model(model)
        model = self._init_model_weights(model)
        model = self._wrap_model(model)
        expose_model_api(model, ckpt.unwrap_model(model))
        model = self.compile_model(model, compile=compile)
        self.model = model
        if optim_wrapper is not None:
            self.optim_wrapper = self.build_optim_wrapper(optim_wrapper, model)
            if self.model is not model:
                # a backend that wraps once the optimizer exists (ShardedDDP) replaced the
                # model: the host's loop calls train_step on the new wrapper, which must
                # forward through it (else its gradient hooks never run; see model_api)
                expose_model_api(self.model, self._unwrap_model())
            self._scale_lr()
            self._initialize_accumulation()
        if param_scheduler is not None:
            self.param_schedulers = self.build_param_scheduler(param_scheduler, self.optim_wrapper)
        self._prepared = True
        return self._prepared_components()

    def _check_prepare_args(
        self, optim_wrapper: Any, param_scheduler: Any, dispatch_kwargs: Mapping | None
    ) -> None:
        """What every backend's ``prepare`` checks first; records ``dispatch_kwargs``."""
        check_prepare_args(optim_wrapper, param_scheduler)
        self.dispatch_kwargs.update(dispatch_kwargs or {})

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
        """Backend hook: this process's device (default: chosen at construction, else
        ``cuda`` when available, else ``cpu``)."""
        chosen = getattr(self, '_device', None)
        return chosen or torch.device('cuda' if torch.cuda.is_available() else 'cpu')

    @abstractmethod
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        """Backend hook: place and wrap ``model``; return what the loop will call."""

    def _unwrap_model(self) -> nn.Module:
        """Backend hook: the plain module behind DDP / DataParallel / ``torch.compile``."""
        return ckpt.unwrap_model(self.model)

    def compile_model(self, model: nn.Module, compile: bool | Mapping = False) -> nn.Module:
        """``torch.compile`` the model (``compile=True``) or, with ``compile=dict(target=
        'forward', **kwargs)``, a method of it in place (mmengine's semantics)."""
        return compile_module(model, compile)

    def _checkpoint_layout(self) -> CheckpointLayout:
        """Backend hook: the layout a save writes (default: one file, written by rank 0)."""
        return CheckpointLayout(self)

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

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}(work_dir={self._work_dir!r}, launcher={self._launcher!r}, '
            f'world_size={self.world_size}, seed={self._seed})'
        )
