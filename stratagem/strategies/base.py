"""BaseStrategy: the sequence around a training loop that is not the model's maths.

mmengine's ``BaseStrategy`` API (``mmengine._strategy``) is the contract; the
work is done by ``env/``, ``optim/``, ``scheduler/`` and ``checkpoint/``, and by the pieces
composed here: the run environment (``environment.RunEnvironment``), the checkpoint parts
(``parts.py``) and loading (``loading.py``).

Construction
    1. ``_setup_env``: the run environment (``environment.RunEnvironment``): launcher →
       distributed init (``_setup_distributed``; an existing process group is used, not
       re-created), multiprocessing settings, file-descriptor limit, randomness
       (``_set_randomness``: seed agreed across ranks), timestamp agreed across ranks.
    2. the logger (``_build_logger``: rank-aware; a log file under ``log_dir``).
    3. the ``Checkpointer`` over the backend's storage (``checkpoint_storage``).

``prepare(model, optim_wrapper=, param_scheduler=, compile=, dispatch_kwargs=)``, written
once for every backend:
    1. ``check_prepare_args``: what is refused before anything is built; records
       ``dispatch_kwargs``.
    2. ``build_model``: a registry cfg or an ``nn.Module``.
    3. ``_init_model_weights``: ``model.init_weights()`` when the model has one.
    4. ``setup_module_and_optimizers(model, optim_wrapper, compile)`` — **backend hook**:
       the wrapped model and the optim wrapper over its parameters. Default:
       ``_wrap_model`` (placement and wrapping: DDP, ``fully_shard``, ...),
       ``compile_model``, ``build_optim_wrapper``. A backend that wraps model and optimizer
       together (DeepSpeed's engine, fairscale's ShardedDataParallel) overrides this hook,
       never ``prepare``. Then a ``replica_group`` (``fault_tolerance=``) is started on
       the wrapped model, ``unwrap_model()`` and the optim wrapper.
    5. ``expose_model_api`` (``model_api.py``): the wrapper gets the inner module's
       (``unwrap_model()``) ``train_step`` / ``val_step`` / ``test_step``; then a
       ``compile`` whose target is one of them.
    6. ``attach_optim_wrapper(optim_wrapper)``: ``_scale_lr`` (once: a resumed optimizer
       state holds the scaled lr), then ``initialize_count_status`` when accumulating
       (needs ``max_iters``). Public: a wrapper built outside ``prepare`` (a host
       trainer's) gets the same steps.
    7. ``build_param_scheduler`` (default ``end`` from ``max_epochs``/``max_iters``).

What a backend may override: :data:`OVERRIDABLE`, nothing else (``tests/strategies/
test_override_surface.py`` holds every registered backend to it):
    - ``capabilities``: what the backend does (``capabilities.py``), a class attribute.
    - ``_wrap_model(model)`` (abstract): placement and wrapping, above.
    - ``setup_module_and_optimizers``, ``check_prepare_args``, ``build_model``,
      ``build_optim_wrapper``: the steps above.
    - ``unwrap_model()``: the plain module behind the wrapper (default: through DDP /
      DataParallel / ``torch.compile``).
    - ``train_step``: one step; ``eval_step``: one batch's loss, forward only (FSDP's
      pipeline runs its schedule for both).
    - ``data_parallel_size`` / ``data_parallel_rank``: the ranks that read different
      batches (a mesh's tensor groups read one).
    - ``model_state_dict()`` / ``load_model_state_dict()``, ``optim_state_dict()`` /
      ``load_optim_state_dict()``: the model's and the optimizer's state.
    - ``checkpoint_meta()``: extra ``meta`` keys.
    - ``checkpoint_storage()``: where a checkpoint goes (``checkpoint/storage.py``;
      default: one file written by rank 0).
    - ``model_part()``, ``optimizer_part()``, ``pending_grads_part()``: the checkpoint
      parts whose check or restore differs (a subclass of ``parts.ModelPart``,
      ``OptimizerPart``, ``PendingGradsPart``: FSDP's in ``fsdp/parts.py``).
    - mmengine's protected hooks, kept for its subclassers: ``_setup_env``,
      ``_setup_distributed``, ``_set_randomness``, ``_build_logger``,
      ``_init_model_weights``.
    The no-sync context belongs to the optim wrapper (``optim_context``), which
    uses the wrapped model's ``no_sync`` when it has one. The rest of the public API
    (``prepare``, ``attach_optim_wrapper``, ``save_checkpoint``, ``checkpoint_state``,
    ``resume``, ``load_checkpoint``, ``load_or_resume``, ...) is written once, here.

Checkpoints: the state is explicit. ``checkpoint_state()`` names the parts (model,
optimizer, partial gradients, loop position, schedulers, the caller's loaders, RNG states),
each a class of ``parts.py`` that owns its state, its check and its restore; ``save_checkpoint`` /
``resume`` hand them to the ``Checkpointer`` (``checkpoint/checkpointer.py``), which holds
no strategy. Loading is ``loading.py``.
"""

from __future__ import annotations

import logging
import os.path as osp
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.checkpoint.checkpointer import Checkpointer, Stateful
from stratagem.checkpoint.huggingface import model_config_json
from stratagem.checkpoint.location import is_url
from stratagem.checkpoint.peer import PeerCopies
from stratagem.checkpoint.state_dict import unwrap_model as unwrap_module
from stratagem.checkpoint.storage import CheckpointStorage
from stratagem.config import check_keys
from stratagem.env.backend import fit_runner_env_kwargs
from stratagem.schema import ENV_KEYS as _ENV_KEYS
from stratagem.schema import RANDOMNESS_KEYS as _RANDOMNESS_KEYS

from . import loading
from .capabilities import Capabilities
from .environment import (
    RunEnvironment,
    build_module,
    check_prepare_args,
    compile_module,
    initialize_accumulation,
    open_run_logger,
    scale_lr,
)
from .model_api import call_model, expose_model_api, parse_loss, split_compile
from .parts import (
    LoaderPart,
    ModelPart,
    OptimizerPart,
    PendingGradsPart,
    PositionPart,
    RandomnessPart,
    SchedulersPart,
    wrappers_of,
)

__all__ = ['BaseStrategy', 'CHECKPOINT_FORMAT_VERSION', 'OVERRIDABLE']

#: ``meta['format_version']`` of the checkpoints this version writes. 2: ``partial_grads``
#: is a list over ranks of ``{parameter name: gradient}`` in every backend (1, unversioned:
#: per rank and wrapper by optimizer index, FSDP's ``partial_grads_fqn``; still read).
CHECKPOINT_FORMAT_VERSION = 2

#: The members of :class:`BaseStrategy` a backend may override (see the module doc); a
#: backend that overrides any other fails ``tests/strategies/test_override_surface.py``.
OVERRIDABLE: frozenset[str] = frozenset(
    {
        # what the backend does, asked by integrations and doctor (capabilities.py)
        'capabilities',
        # prepare's steps
        '_wrap_model',
        'setup_module_and_optimizers',
        'check_prepare_args',
        'build_model',
        'build_optim_wrapper',
        'unwrap_model',
        # the step and the data split
        'train_step',
        'eval_step',
        'data_parallel_size',
        'data_parallel_rank',
        # the state and where it goes
        'model_state_dict',
        'load_model_state_dict',
        'optim_state_dict',
        'load_optim_state_dict',
        'checkpoint_meta',
        'checkpoint_storage',
        'model_part',
        'optimizer_part',
        'pending_grads_part',
        # mmengine's protected hooks, kept for its subclassers
        '_setup_env',
        '_setup_distributed',
        '_set_randomness',
        '_build_logger',
        '_init_model_weights',
    }
)


def _from_environment(name: str, doc: str) -> Any:
    """A read-only property: the run environment's ``name``."""
    return property(lambda self: getattr(self.environment, name), doc=doc)


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
            param group's lr by real batch / N once, when the optim wrapper is attached
            (``prepare``, ``attach_optim_wrapper``). The real batch is world_size × micro
            batch × accumulative_counts — unlike mmengine, which ignores gradient
            accumulation.
        async_checkpoint: ``save_checkpoint`` returns once every tensor is copied to
            reused CPU buffers (the checkpoint is the state at the call); a background
            thread writes and commits the copy (``Checkpointer``). Default False.
        checkpoint_timeout: seconds a rank may show no sign of life during a
            distributed save before the others give up on it, naming it, without
            committing. Default 600.

    ``model``, ``optim_wrapper`` and ``param_schedulers`` are what ``prepare`` built
    (``optim_wrapper`` / ``param_schedulers``: None until built); ``prepared`` says
    whether ``prepare`` ran.
    """

    model: nn.Module
    optim_wrapper: Any
    param_schedulers: Any
    #: what this backend does that code outside it asks (``capabilities.py``); each backend
    #: declares its own, a subclass inherits its parent's
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: this run's part in a fault-tolerant job (``replica_groups.ReplicaGroup``), else None:
    #: a backend that takes ``fault_tolerance=`` sets it; ``prepare`` starts it (step 4) and
    #: ``checkpoint_meta`` keeps its ``position()``
    replica_group: Any = None
    #: its checked ``replica_groups.FaultTolerance`` (None without one), set before the
    #: environment is: the group's log folder is named after its replica id
    _fault_tolerance: Any = None

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
        self.environment = RunEnvironment(work_dir, randomness)
        self._auto_scale_lr = auto_scale_lr
        self._prepared = False
        self.optim_wrapper = None
        self.param_schedulers = None
        self.dispatch_kwargs: dict[str, Any] = {}
        self.resumed_from: str | None = None
        self._setup_env(**env_kwargs)
        self.environment.name(experiment_name)
        self.logger = self._build_logger(**dict(log_kwargs or {}))
        self.checkpointer.storage = self.checkpoint_storage()

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
        """Launcher, distributed init, processes/threads, rlimit, seed and timestamp
        (``self.environment``, in that order)."""
        self.environment.set_up(
            launcher=launcher,
            cudnn_benchmark=cudnn_benchmark,
            mp_cfg=mp_cfg,
            dist_cfg=dist_cfg,
            resource_limit=resource_limit,
            init_dist=self._setup_distributed,
        )
        self._set_randomness(**self.environment.randomness)
        self.environment.agree_on_timestamp()
        if self._fault_tolerance is not None:
            # the groups of a job share the work_dir; each logs in its own folder
            run = self.environment
            run.timestamp = f'{run.timestamp}_replica{self._fault_tolerance.replica_id}'

    def _setup_distributed(self, launcher: str, **dist_cfg: Any) -> None:
        """Initialise the process group (``env.init_dist``; an initialised one is used)."""
        env.init_dist(launcher, **dist_cfg)

    def _set_randomness(
        self, seed: int | None = None, deterministic: bool = False, diff_rank_seed: bool = False
    ) -> None:
        """Seed every RNG; ``seed`` (this rank's, as mmengine's) includes the rank under
        ``diff_rank_seed``, ``randomness['seed']`` stays the configured, rank-agreed one."""
        self.environment.set_randomness(
            seed, deterministic=deterministic, diff_rank_seed=diff_rank_seed
        )

    def _build_logger(self, **log_kwargs: Any) -> logging.Logger:
        """The 'stratagem' logger, writing to ``log_dir/<timestamp>.log`` for this run."""
        run = self.environment
        logger = open_run_logger(log_kwargs, osp.join(run.log_dir, f'{run.timestamp}.log'))
        logger.info(
            f'{type(self).__name__}: launcher {run.launcher}, world size '
            f'{env.get_world_size()}, seed {run.seed}, work_dir {run.work_dir}'
        )
        return logger

    # ------------------------------------------------------------------ properties
    work_dir: str = _from_environment('work_dir', 'Where logs and checkpoints go.')
    log_dir: str = _from_environment('log_dir', "``work_dir/<timestamp>``: this run's logs.")
    experiment_name: str = _from_environment('experiment_name', 'The run; default: timestamp.')
    launcher: str = _from_environment('launcher', "'none' | 'pytorch' | 'slurm' | 'mpi'.")
    distributed: bool = _from_environment('distributed', 'Whether a process group runs.')
    seed: int = _from_environment('seed', "This rank's seed (the rank added under diff_rank_seed).")
    timestamp: str = _from_environment('timestamp', "The run's start, agreed across ranks.")
    randomness: dict = _from_environment(
        'randomness', 'The randomness settings; ``seed`` the configured, rank-agreed one.'
    )

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

    @property
    def prepared(self) -> bool:
        """Whether ``prepare`` ran (a second call returns what the first built)."""
        return self._prepared

    @property
    def auto_scale_lr(self) -> dict | None:
        """The ``auto_scale_lr`` setting (a copy), or None."""
        return None if self._auto_scale_lr is None else dict(self._auto_scale_lr)

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
        self.check_prepare_args(optim_wrapper, param_scheduler, dispatch_kwargs, compile)
        model = self._init_model_weights(self.build_model(model))
        compile, compile_api = split_compile(compile)
        self.model, wrapper = self.setup_module_and_optimizers(model, optim_wrapper, compile)
        if self.replica_group is not None:  # the job joined once the update's parts exist
            self.replica_group.start(self.model, self.unwrap_model(), wrapper)
        expose_model_api(self.model, self.unwrap_model())
        self.model = self.compile_model(self.model, compile_api)
        if wrapper is not None:
            self.attach_optim_wrapper(wrapper)
        if param_scheduler is not None:
            self.param_schedulers = self.build_param_scheduler(param_scheduler, wrapper)
        self._prepared = True
        return self._prepared_components()

    def attach_optim_wrapper(self, optim_wrapper: Any) -> Any:
        """Make ``optim_wrapper`` this strategy's and run ``prepare``'s steps after it is
        built: every lr scaled once (``auto_scale_lr``), the accumulation counters set
        (``max_iters`` from ``dispatch_kwargs``). ``prepare`` calls it; call it yourself
        for a wrapper built outside ``prepare`` (a host trainer's optimizer, over the
        parameters ``prepare(model)`` returned). Attaching the wrapper already attached
        changes nothing (its lr is scaled once). Returns ``optim_wrapper``."""
        if optim_wrapper is self.optim_wrapper:
            return optim_wrapper
        self.optim_wrapper = optim_wrapper
        self._scale_lr()
        initialize_accumulation(wrappers_of(optim_wrapper), self.model, 0, self.dispatch_kwargs)
        return optim_wrapper

    def check_prepare_args(
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
        """Backend hook: ``(wrapped model, optim wrapper or None)``. Default: ``_wrap_model``,
        ``compile_model``, then the optim wrapper over the wrapped model's parameters."""
        model = self._wrap_model(model)
        model = self.compile_model(model, compile=compile)
        wrapper = None if optim_wrapper is None else self.build_optim_wrapper(optim_wrapper, model)
        return model, wrapper

    def _prepared_components(self) -> Any:
        built = (self.optim_wrapper, self.param_schedulers)
        parts = [self.model, *(part for part in built if part is not None)]
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

    def unwrap_model(self) -> nn.Module:
        """Backend hook: the plain module behind DDP / DataParallel / ``torch.compile``."""
        return unwrap_module(self.model)

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

    def eval_step(
        self,
        inputs: Any,
        targets: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One batch's loss without a step: the model's forward under ``torch.no_grad`` and
        ``loss_fn(outputs, targets)`` (a mean over the batch), or without ``loss_fn`` the
        model's own loss, as :meth:`train_step` takes them; returns it, detached. The
        model's mode is the caller's (``model.eval()`` first for dropout and batch norm).
        Under a pipeline (FSDPStrategy's ``mesh.pipeline``) the schedule runs the stages
        forward only and the last stage's loss reaches every pipeline rank."""
        if loss_fn is None and targets is not None:
            inputs = _with_targets(inputs, targets)
        with torch.no_grad():
            out = call_model(self.model, inputs, self.device)
            loss = (
                parse_loss(out)
                if loss_fn is None
                else loss_fn(out, _to_device(targets, self.device))
            )
        return loss.detach()

    def _step_wrapper(self) -> Any:
        """The one optim wrapper ``train_step`` updates."""
        from stratagem.optim import OptimWrapperDict

        wrapper = self.optim_wrapper
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
        """Scale every lr of the attached optim wrapper by real batch / ``base_batch_size``
        (``auto_scale_lr``, ``environment.scale_lr``); ``attach_optim_wrapper`` runs it once
        per wrapper, and a resumed optimizer state already holds the scaled lr."""
        cfg = self._auto_scale_lr
        if not cfg or not cfg.get('enable', False):
            return
        scale_lr(
            wrappers_of(self.optim_wrapper),
            cfg,
            world_size=self.data_parallel_size,
            micro_batch=self.dispatch_kwargs.get('train_micro_batch_size_per_gpu'),
        )

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
            'launcher': self.launcher,
            'distributed': self.distributed,
            'world_size': self.world_size,
            'seed': self.seed,
            'deterministic': self.randomness.get('deterministic', False),
        }
        return dict(env.collect_env()), runtime

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_storage(self) -> CheckpointStorage:
        """Backend hook: where a checkpoint goes (default: one file, written by rank 0;
        its manifest records the world size and the strategy)."""
        return CheckpointStorage(
            lambda: {'world_size': self.world_size, 'strategy': type(self).__name__}
        )

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
        refit_schedulers: bool = False,
        loaders: Mapping[str, Any] | None = None,
    ) -> dict[str, Stateful]:
        """The parts of a checkpoint (``parts.py``), in the order a resume restores them: the
        model (``state_dict``), the optimizer (with its counters and scaler), every rank's
        partial gradients (``partial_grads``, inside an accumulation window), the loop's
        position (``meta``, with ``meta`` merged in on save), the schedulers, every rank's
        state of ``loaders`` (``{name: loader}``: see :meth:`save_checkpoint`), every rank's
        RNG state last. ``optimizer`` / ``schedulers``: include them (when built);
        ``refit_schedulers``: see :meth:`resume`."""
        parts: dict[str, Stateful] = {'state_dict': self.model_part()}
        if optimizer and self.optim_wrapper is not None:
            parts['optimizer'] = self.optimizer_part()
            parts['partial_grads'] = self.pending_grads_part()
        parts['meta'] = PositionPart(
            lambda: self.checkpoint_meta(meta),
            dispatch_kwargs=self.dispatch_kwargs,
            optim_wrapper=self.optim_wrapper,
            model=self.model,
            world_size=self.world_size,
            data_parallel_size=self.data_parallel_size,
        )
        if schedulers and self.param_schedulers is not None:
            parts['param_schedulers'] = SchedulersPart(
                self.param_schedulers,
                self.scheduler_state_dict,
                self.load_scheduler_state_dict,
                epoch_length=self.dispatch_kwargs.get('epoch_length'),
                refit=refit_schedulers,
                logger=self.logger,
            )
        if loaders:
            parts['loaders'] = LoaderPart(
                loaders, world_size=self.world_size, data_parallel_size=self.data_parallel_size
            )
        parts['rng_states'] = RandomnessPart(
            self.environment, lambda seed: self._set_randomness(**{**self.randomness, 'seed': seed})
        )
        return parts

    def model_part(self) -> ModelPart:
        """Backend hook: the model's part (weights loaded non-strictly, one report)."""
        return ModelPart(
            self.model_state_dict,
            lambda state_dict, path: loading.load_weights(
                self, {'state_dict': state_dict}, path, strict=False
            ),
            self.unwrap_model,
        )

    def optimizer_part(self) -> OptimizerPart:
        """Backend hook: the optimizer's part (its groups checked against the built ones)."""
        return OptimizerPart(self.optim_wrapper, self.optim_state_dict, self.load_optim_state_dict)

    def pending_grads_part(self) -> PendingGradsPart:
        """Backend hook: the accumulation window's gradients (``partial_grads``), by
        parameter name, as the optim wrappers hold them."""
        return PendingGradsPart(self.optim_wrapper, self.unwrap_model)

    def save_checkpoint(
        self,
        filename: str,
        *,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        extra_ckpt: Mapping | None = None,
        callback: Callable[[dict], None] | None = None,
        loaders: Mapping[str, Any] | None = None,
    ) -> str:
        """Save model (+ optimizer, schedulers, RNG states) atomically; every rank calls it.

        ``filename`` is a path (relative paths are under ``work_dir``) or an fsspec URL
        (``s3://bucket/prefix/iter_3.pth``, ``gs://``, ``memory://``; the s3 / gcs extras):
        committed locally, then uploaded in the order that makes it committed on a store
        without rename (``checkpoint/location.py``); ``checkpointer.backend_args`` are the
        store's options (default: the client library reads the environment).
        ``extra_ckpt['meta']`` (e.g. ``iter``/``epoch``) merges into ``meta``;
        other ``extra_ckpt`` keys are stored as they are (tensors and plain values
        only). ``callback(checkpoint)`` may edit the dict before it is written.
        ``loaders``: ``{name: loader}``, each with ``state_dict`` / ``load_state_dict``
        (torchdata's ``StatefulDataLoader``): every rank's state is saved under
        ``loaders``, and ``resume(..., loaders=)`` puts each rank's back (``LoaderPart``).
        Returns the final path (with ``async_checkpoint``, where the checkpoint will
        be once committed; ``wait_for_checkpoints`` waits for that). The sequence:
        :class:`~stratagem.checkpoint.Checkpointer`.
        """
        extra = dict(extra_ckpt or {})
        path = (
            filename
            if is_url(filename) or osp.isabs(filename) or filename.lower().startswith('file://')
            else osp.join(self.work_dir, filename)
        )
        state = self.checkpoint_state(
            meta=extra.pop('meta', None),
            optimizer=save_optimizer,
            schedulers=save_param_scheduler,
            loaders=loaders,
        )
        return self.checkpointer.save(path, state, extra=extra, callback=callback)

    def save_peer_copy(
        self, peer: PeerCopies, *, extra_ckpt: Mapping | None = None, loaders: Mapping | None = None
    ) -> str | None:
        """Commit each rank's state (what ``save_checkpoint`` holds for it, captured by the
        same parts) as a peer copy: in this node's ``/dev/shm`` and at its holder rank
        (``checkpoint/peer.py``); every rank calls it at the same iteration,
        ``extra_ckpt['meta']['iter']``. Returns this rank's own copy (None: ``/dev/shm``
        refused it, with a warning; the run goes on; a background ``peer``: where it will
        be once committed). ``resume=True`` of
        ``load_or_resume(..., peer=)`` prefers it to an older storage checkpoint. Sharded
        state is this rank's shards and their layout, whatever ``save_checkpoint`` gathers.
        Refused (ValueError) where a rank's content does not restore it
        (``Capabilities.peer_copies``)."""
        if not self.capabilities.peer_copies:
            raise ValueError(
                f'peer checkpoints (default_hooks.checkpoint.peer_interval) keep what each '
                f"rank captures, and {type(self).__name__} keeps its state in an engine's "
                'files or consolidates it on one rank to save it; remove peer_interval, or '
                'train with DDPStrategy or FSDPStrategy'
            )
        extra = dict(extra_ckpt or {})
        state = self.checkpoint_state(meta=extra.pop('meta', None), loaders=loaders)
        return self.checkpointer.save_peer(peer, state, extra=extra)

    def wait_for_checkpoints(self) -> None:
        """Block until every pending (asynchronous) save is committed; raise its error if it
        failed, on every rank. A no-op when nothing is pending. ``save_checkpoint``,
        ``resume``, ``load_checkpoint`` and ``load_or_resume`` call it first."""
        self.checkpointer.wait()

    def checkpoint_meta(self, extra_meta: Mapping | None = None) -> dict:
        """A checkpoint's ``meta``: seed, time, experiment, world size, strategy, versions,
        what a resume at another world size needs, then ``extra_meta`` (e.g. ``iter``), and
        a replica group's ``replica_group`` (the job's step and committed batches)."""
        from stratagem.version import __version__

        scaling = bool((self._auto_scale_lr or {}).get('enable'))
        meta = {
            'seed': self.randomness['seed'],
            'time': time.strftime('%Y%m%d_%H%M%S'),
            'experiment_name': self.experiment_name,
            'world_size': self.world_size,
            'data_parallel_size': self.data_parallel_size,
            'strategy': type(self).__name__,
            'format_version': CHECKPOINT_FORMAT_VERSION,
            'stratagem_version': __version__,
            'torch_version': str(torch.__version__),
            # attach_optim_wrapper scales every wrapper it attaches, once
            'auto_scale_lr_applied': scaling and self.optim_wrapper is not None,
        }
        for key in ('train_micro_batch_size_per_gpu', 'epoch_length'):
            if self.dispatch_kwargs.get(key) is not None:
                meta[key] = int(self.dispatch_kwargs[key])
        config = model_config_json(self.unwrap_model())  # a PreTrainedModel's, for --to hf
        if config is not None:
            meta['hf_config'] = config
        meta.update(extra_meta or {})
        if self.replica_group is not None:
            meta['replica_group'] = self.replica_group.position()
        return meta

    # ----------------------------------------------------------------- state dicts
    def model_state_dict(self) -> dict:
        """The unwrapped model's state dict (tensors kept on their device)."""
        return self.unwrap_model().state_dict()

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
            self.unwrap_model(), state_dict, strict=strict, logger=self.logger
        )

    def load_optim_state_dict(self, state_dict: Mapping) -> None:
        self.optim_wrapper.load_state_dict(state_dict)

    def load_scheduler_state_dict(self, state_dict: list | dict) -> None:
        scheds = self.param_schedulers
        if isinstance(scheds, Mapping):
            for name, states in state_dict.items():  # type: ignore[union-attr]
                _load_scheduler_list(scheds[name], states)
        else:
            _load_scheduler_list(scheds, state_dict)  # type: ignore[arg-type]

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
        """Load model weights from ``filename``; returns the whole checkpoint dict
        (:func:`.loading.load_checkpoint`)."""
        return loading.load_checkpoint(
            self,
            filename,
            map_location=map_location,
            strict=strict,
            revise_keys=revise_keys,
            callback=callback,
        )

    def resume(
        self,
        filename: str,
        *,
        resume_optimizer: bool = True,
        resume_param_scheduler: bool = True,
        map_location: Any = 'default',
        callback: Callable[[dict], None] | None = None,
        refit_schedulers: bool = False,
        loaders: Mapping[str, Any] | None = None,
    ) -> dict:
        """Continue exactly where ``filename`` stopped; returns the checkpoint (``meta`` has
        iter, and ``world_size_change`` after one): :func:`.loading.resume`."""
        return loading.resume(
            self,
            filename,
            resume_optimizer=resume_optimizer,
            resume_param_scheduler=resume_param_scheduler,
            map_location=map_location,
            callback=callback,
            refit_schedulers=refit_schedulers,
            loaders=loaders,
        )

    def load_or_resume(
        self,
        load_from: str | None = None,
        resume: bool | str = False,
        *,
        refit_schedulers: bool = False,
        loaders: Mapping[str, Any] | None = None,
        checkpoint_dir: str | None = None,
        peer: PeerCopies | None = None,
    ) -> dict | None:
        """mmengine's runner logic: resume (latest in work_dir, or ``checkpoint_dir``: a path
        or URL where the run's checkpoints go, or a path) or just load weights; returns the
        checkpoint or None (:func:`.loading.load_or_resume`). ``peer``: the run's peer
        copies (``save_peer_copy``): ``resume=True`` loads them when they are at least as
        new as the newest storage checkpoint and verify, else storage."""
        return loading.load_or_resume(
            self,
            load_from,
            resume,
            refit_schedulers=refit_schedulers,
            loaders=loaders,
            checkpoint_dir=checkpoint_dir,
            peer=peer,
        )

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}(work_dir={self.work_dir!r}, launcher={self.launcher!r}, '
            f'world_size={self.world_size}, seed={self.seed})'
        )


def _load_scheduler_list(scheds: Sequence, states: Sequence) -> None:
    if len(scheds) != len(states):
        raise ValueError(
            f'checkpoint holds {len(states)} param scheduler state(s) but '
            f'{len(scheds)} scheduler(s) were built; the param_scheduler config '
            'changed since the checkpoint was saved'
        )
    for sched, state in zip(scheds, states):
        sched.load_state_dict(state)


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
