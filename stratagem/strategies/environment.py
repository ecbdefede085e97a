"""The run environment a strategy is set up in (:class:`RunEnvironment`: launcher, process
group, randomness, the rank-agreed timestamp, where the run's files go), and the steps of
``prepare`` that are plain functions of their inputs: the launcher a multi-process backend
needs, the run's log file, a model from its cfg, ``torch.compile`` of a model or one of its
methods, the LR auto-scaling by batch size, and the accumulation counters. ``BaseStrategy``
calls them in its numbered sequence (``base.py``) and keeps what they return."""

from __future__ import annotations

import logging
import os.path as osp
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from stratagem import env
from stratagem.env.logging import remove_file_handlers
from stratagem.registry import MODELS

__all__ = [
    'RunEnvironment',
    'setup_environment',
    'distributed_env_kwargs',
    'open_run_logger',
    'compile_module',
    'scale_lr',
    'initialize_accumulation',
    'max_iters',
    'build_module',
    'check_prepare_args',
]


class RunEnvironment:
    """Where and how this process runs: set up once, at the strategy's construction, then
    read (the strategy's ``work_dir``, ``log_dir``, ``experiment_name``, ``launcher``,
    ``distributed``, ``seed``, ``timestamp`` and ``randomness`` are its values).

    The set-up, in order (``BaseStrategy._setup_env`` calls it): :meth:`set_up` (launcher,
    distributed init, processes, limits), :meth:`set_randomness`, :meth:`agree_on_timestamp`,
    :meth:`name` (the experiment; the log directory under ``work_dir``).

    Args:
        work_dir: where logs and checkpoints go (made absolute).
        randomness: the configured ``seed`` (None: drawn, then agreed across ranks),
            ``deterministic``, ``diff_rank_seed``.
    """

    def __init__(self, work_dir: str, randomness: Mapping | None = None) -> None:
        self.work_dir = osp.abspath(work_dir)
        self._randomness = dict(randomness or {})
        self.launcher = 'none'
        self.distributed = False
        self.seed: int = 0  # this rank's, once set_randomness ran
        self.timestamp = ''
        self.experiment_name = ''

    @property
    def randomness(self) -> dict:
        """The settings, ``seed`` the configured, rank-agreed one (a copy)."""
        return dict(self._randomness)

    @property
    def log_dir(self) -> str:
        """``work_dir/<timestamp>``: this run's logs."""
        return osp.join(self.work_dir, self.timestamp)

    def set_up(
        self,
        *,
        launcher: str | None = None,
        cudnn_benchmark: bool = False,
        mp_cfg: Mapping | None = None,
        dist_cfg: Mapping | None = None,
        resource_limit: int = 4096,
        init_dist: Callable[..., None] | None = None,
    ) -> None:
        """Launcher, distributed init (``init_dist(launcher, **dist_cfg)``, default
        ``env.init_dist``), processes and threads, file-descriptor limit
        (:func:`setup_environment`)."""
        self.launcher, self.distributed = setup_environment(
            launcher=launcher,
            cudnn_benchmark=cudnn_benchmark,
            mp_cfg=mp_cfg,
            dist_cfg=dist_cfg,
            resource_limit=resource_limit,
            init_dist=init_dist,
        )

    def set_randomness(
        self, seed: int | None = None, deterministic: bool = False, diff_rank_seed: bool = False
    ) -> int:
        """Seed every RNG; :attr:`seed` (this rank's, as mmengine's) includes the rank under
        ``diff_rank_seed``, ``randomness['seed']`` stays the configured, rank-agreed one.
        Returns this rank's seed."""
        self.seed = env.set_random_seed(
            seed, deterministic=deterministic, diff_rank_seed=diff_rank_seed
        )
        self._randomness.update(seed=self.seed - env.get_rank() if diff_rank_seed else self.seed)
        return self.seed

    def adopt_seed(self, base: int) -> None:
        """Record ``base`` as the configured seed (and this rank's from it) without seeding:
        the RNG states a resume restores were drawn from it."""
        self.seed = base + env.get_rank() if self._randomness.get('diff_rank_seed') else base
        self._randomness.update(seed=base)

    def agree_on_timestamp(self) -> str:
        """Rank 0's time, on every rank (collective): ``%Y%m%d_%H%M%S``, with ``_1``, ``_2``, ...
        where a run of the same second already holds that log folder in work_dir (a quick
        restart would otherwise write into, and truncate, the earlier run's log)."""
        stamp = time.strftime('%Y%m%d_%H%M%S')
        if env.get_rank() == 0:
            taken, n = stamp, 0
            while osp.exists(osp.join(self.work_dir, taken)):
                n += 1
                taken = f'{stamp}_{n}'
            stamp = taken
        self.timestamp = env.broadcast_object(stamp)
        return self.timestamp

    def name(self, experiment_name: str | None) -> None:
        """The experiment's name: ``experiment_name``, else the timestamp."""
        self.experiment_name = experiment_name or self.timestamp


def setup_environment(
    *,
    launcher: str | None,
    cudnn_benchmark: bool,
    mp_cfg: Mapping | None,
    dist_cfg: Mapping | None,
    resource_limit: int,
    init_dist: Callable[..., None] | None = None,
) -> tuple[str, bool]:
    """Launcher (given or inferred), distributed init (``init_dist``, default
    ``env.init_dist``: an initialised process group is used, not re-created),
    multiprocessing settings, file-descriptor limit. Returns (launcher, distributed)."""
    launcher = launcher or env.infer_launcher()
    if launcher != 'none' or env.is_distributed():
        (init_dist or env.init_dist)(launcher, **dict(dist_cfg or {}))
    distributed = env.is_distributed()
    if cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    env.setup_multi_processing(**dict(mp_cfg or {}), distributed=distributed)
    env.set_resource_limit(resource_limit)
    return launcher, distributed


def distributed_env_kwargs(kwargs: dict, name: str, hint: str = '') -> dict:
    """``kwargs['env_kwargs']`` (popped) with the launcher a multi-process backend needs:
    the given one, else the inferred one; none at all (and no process group) is an error
    saying how to launch. An initialised process group (a host trainer's) is used."""
    env_kwargs = dict(kwargs.pop('env_kwargs', None) or {})
    if env_kwargs.get('launcher') in (None, 'none') and not env.is_distributed():
        inferred = env.infer_launcher()
        if inferred == 'none':
            raise RuntimeError(
                f'{name} needs a distributed launch: start with torchrun (or `stratagem '
                'train CONFIG --nproc N`), slurm or mpirun, or initialise torch.distributed '
                f'yourself before building the strategy{hint}'
            )
        env_kwargs['launcher'] = inferred
    return env_kwargs


def open_run_logger(log_kwargs: dict, log_file: str) -> logging.Logger:
    """The 'stratagem' logger, writing to ``log_file`` unless ``log_kwargs`` names one: one
    run, one file, so a previous strategy's file handler in this process goes."""
    if 'log_file' not in log_kwargs:
        log_kwargs['log_file'] = log_file
        remove_file_handlers(logging.getLogger('stratagem'))
    return env.get_logger('stratagem', **log_kwargs)


def compile_module(model: nn.Module, compile: bool | Mapping = False) -> nn.Module:
    """``torch.compile`` the model (``compile=True``) or a method of it.

    ``compile=dict(target='forward', **torch.compile kwargs)`` compiles ``model.<target>``
    in place (mmengine's semantics); ``False`` does nothing.
    """
    if not compile:
        return model
    kwargs = {} if compile is True else dict(compile)
    target = kwargs.pop('target', None)
    if target is None:
        return torch.compile(model, **kwargs)  # type: ignore[return-value]
    func = getattr(model, target, None)
    if func is None or not callable(func):
        raise ValueError(f'compile target {target!r} is not a method of {type(model).__name__}')
    setattr(model, target, torch.compile(func, **kwargs))
    return model


def scale_lr(
    wrappers: Iterable[Any], cfg: Mapping, *, world_size: int, micro_batch: int | None
) -> None:
    """Scale every param group's lr by real batch / ``cfg['base_batch_size']``, the real
    batch being world size × ``micro_batch`` × the wrapper's accumulative_counts (mmengine
    leaves accumulation out, which under-scales an accumulating run)."""
    if 'base_batch_size' not in cfg:
        raise ValueError(
            "auto_scale_lr needs 'base_batch_size' (the batch the lr was tuned "
            'for), e.g. auto_scale_lr=dict(enable=True, base_batch_size=256)'
        )
    if micro_batch is None:
        raise ValueError(
            "auto_scale_lr needs dispatch_kwargs['train_micro_batch_size_per_gpu']"
            ' (the per-process batch size) to compute the real batch size'
        )
    for wrapper in wrappers:
        acc = getattr(wrapper, 'accumulative_counts', 1)
        ratio = world_size * micro_batch * acc / cfg['base_batch_size']
        for group in wrapper.param_groups:
            group['lr'] = group['lr'] * ratio


def max_iters(dispatch_kwargs: Mapping) -> int | None:
    """The run's length in iterations: ``max_iters``, or ``max_epochs`` × ``epoch_length``."""
    d = dispatch_kwargs
    if d.get('max_iters') is not None:
        return int(d['max_iters'])
    if d.get('max_epochs') is not None and d.get('epoch_length') is not None:
        return int(d['max_epochs']) * int(d['epoch_length'])
    return None


def initialize_accumulation(
    wrappers: Iterable[Any], model: nn.Module, done_iters: int | None, dispatch_kwargs: Mapping
) -> None:
    """Tell accumulating wrappers where training stands (``done_iters``; None: their own
    count) and where it ends (the run's ``max_iters``)."""
    for wrapper in wrappers:
        if getattr(wrapper, 'accumulative_counts', 1) > 1:
            total = max_iters(dispatch_kwargs)
            if total is None:
                raise ValueError(
                    'accumulative_counts > 1 needs the training length to average the last '
                    'window: pass dispatch_kwargs=dict(max_iters=N) (or max_epochs and '
                    'epoch_length)'
                )
            done = wrapper.inner_count if done_iters is None else done_iters
            wrapper.initialize_count_status(model, done, total)


def build_module(model: nn.Module | Mapping) -> nn.Module:
    """An ``nn.Module`` as is, or one built from a MODELS cfg (anything else: an error)."""
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, Mapping):
        built = MODELS.build(model)
        if not isinstance(built, nn.Module):
            raise TypeError(
                f'model cfg {dict(model)!r} built a {type(built).__name__}, not an nn.Module'
            )
        return built
    raise TypeError(
        f'model should be an nn.Module or a MODELS cfg dict, got {type(model).__name__}'
    )


def check_prepare_args(optim_wrapper: Any, param_scheduler: Any) -> None:
    """Schedulers drive an optimizer's param groups: refused without an optim wrapper."""
    if param_scheduler is not None and optim_wrapper is None:
        raise ValueError(
            'param_scheduler was given without optim_wrapper: schedulers drive '
            "an optimizer's param groups; pass optim_wrapper=dict(optimizer=...)"
        )
