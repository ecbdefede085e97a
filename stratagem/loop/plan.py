"""The run plan: everything the reference loop reads from a config, read once, as typed values.

:func:`check_train_config` is every refusal a config can get before anything is built, in
``train``'s order (``stratagem doctor`` and ``stratagem train --nproc`` run it too, before
torchrun starts): the sections it needs, the top-level keys, the keys of ``train_cfg``,
``train_dataloader``, ``val_dataloader``, ``val_cfg`` and ``default_hooks``
(``stratagem.schema``), a run length, save_best's rule, ``train_cfg.preemption``,
``train_cfg.anomaly`` (``rollback`` without periodic checkpoints). What it
returns, a :class:`RunPlan`, is what the loop's collaborators are built from; the two
settings that need the epoch length (the run length in epochs, a checkpoint interval in
epochs) are methods of it, with their refusals.
"""

from __future__ import annotations

import logging
import os.path as osp
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stratagem.checkpoint.location import join
from stratagem.config import Config, ConfigError, ConfigErrors, check_keys
from stratagem.env.preemption import PreemptionConfig, preemption_config
from stratagem.metrics import check_metrics_cfg
from stratagem.schema import (
    CHECKPOINT_HOOK_KEYS,
    LOGGER_HOOK_KEYS,
    TRAIN_CFG_KEYS,
    TRAIN_DATALOADER_KEYS,
    TRAIN_LOOP_TYPES,
    VAL_CFG_KEYS,
    VAL_DATALOADER_KEYS,
)

from .anomaly import (
    AnomalyPlan,
    anomaly_config,
    check_anomaly_checkpoints,
    check_anomaly_strategy,
)
from .stragglers import StragglerConfig, straggler_config

__all__ = [
    'BestPlan',
    'CheckpointPlan',
    'DataPlan',
    'RunPlan',
    'NeedsRunnerError',
    'ValidationPlan',
    'check_top_level_keys',
    'check_train_config',
    'infer_rule',
    'join_host_registries',
    'run_work_dir',
    'strategy_config',
]


@dataclass(frozen=True)
class DataPlan:
    """``train_dataloader``: the dataset (a DATASETS cfg, a Dataset or a callable returning
    one), the per-rank batch size, whether to shuffle, the shuffling seed (mmengine's
    ``sampler.seed``; None: the run's) and the rest of torch's ``DataLoader`` arguments
    (``drop_last``, ``num_workers``, ``collate_fn``, ...)."""

    dataset: Any
    batch_size: int
    shuffle: bool
    seed: int | None
    loader_kwargs: dict

    @property
    def drop_last(self) -> bool:
        return bool(self.loader_kwargs.get('drop_last', False))


@dataclass(frozen=True)
class ValidationPlan:
    """``val_dataloader``, ``val_cfg`` and ``train_cfg.val_interval`` / ``val_begin`` (in
    epochs when the run is ``by_epoch``, else iterations); ``autocast``: ``val_cfg.fp16``."""

    dataset: Any
    batch_size: int
    shuffle: bool
    seed: int | None
    autocast: bool
    loader_kwargs: dict
    interval: int
    begin: int


@dataclass(frozen=True)
class BestPlan:
    """``default_hooks.checkpoint.save_best``: the validation value's name (or ``'auto'``:
    the first one), its rule (None: inferred from the keys once the name is known), and
    whether the file is named by epoch."""

    metric: str
    rule: str | None
    greater_keys: tuple
    less_keys: tuple
    by_epoch: bool


@dataclass(frozen=True)
class CheckpointPlan:
    """When to save and how many to keep: ``train_cfg.checkpoint_interval`` (iterations;
    None when not given), ``default_hooks.checkpoint.interval`` as ``(n, by_epoch)`` (None
    when not given), ``max_keep_ckpts`` (None or <= 0: keep all)."""

    interval: int | None = None
    hook_interval: tuple[int, bool] | None = None
    max_keep: int | None = None
    #: ``default_hooks.checkpoint.out_dir`` (a path or URL; None: the work_dir) and its store's
    #: ``backend_args``
    out_dir: str | None = None
    backend_args: dict | None = None
    #: ``default_hooks.checkpoint.peer_interval``: iterations between peer copies (0: none;
    #: ``checkpoint/peer.py``)
    peer_interval: int = 0

    def directory(self, work_dir: str) -> str:
        """Where the checkpoints go: ``out_dir/<work_dir's last component>`` (mmengine's
        CheckpointHook), else ``work_dir``."""
        if self.out_dir is None:
            return work_dir
        return join(self.out_dir, osp.basename(osp.abspath(work_dir).rstrip(osp.sep)))

    def every(self, epoch_length: int) -> int:
        """Iterations between saves (0: only at the end and at a preemption): the hook's
        interval in epochs when its ``by_epoch`` (<= 0: never), else ``checkpoint_interval``;
        a ValueError when both are given and differ."""
        interval = int(self.interval or 0)
        if self.hook_interval is None:
            return interval
        n, by_epoch = self.hook_interval
        iters = max(n, 0) * (epoch_length if by_epoch else 1)
        if self.interval is not None and iters != interval:
            raise ValueError(
                f'default_hooks.checkpoint.interval={n} ({"epochs" if by_epoch else "iterations"}'
                f', {iters} iterations) and train_cfg.checkpoint_interval={interval} '
                '(iterations) disagree: they are the same setting; keep one of them'
            )
        return iters


@dataclass(frozen=True)
class RunPlan:
    """What the reference loop reads from a config (see :func:`check_train_config`).

    ``model``, ``optim_wrapper``, ``param_scheduler`` and ``compile`` go to
    ``strategy.prepare`` as they are; ``by_epoch``: positions, validation and save_best's
    names count epochs; ``log_interval``: iterations per logged row (>= 1); ``metrics``:
    ``train_cfg.metrics``; ``preemption`` and ``straggler``: None when off; ``anomaly``:
    ``train_cfg.anomaly`` (None when off; ``loop/anomaly.py``); ``resume`` / ``load_from``: the
    config's top-level keys (the command line's win)."""

    model: Any
    optim_wrapper: Any
    param_scheduler: Any
    compile: Any
    data: DataPlan
    max_iters: int | None
    max_epochs: int | None
    by_epoch: bool
    log_interval: int
    refit_schedulers: bool
    metrics: Any
    preemption: PreemptionConfig | None
    straggler: StragglerConfig | None
    checkpoints: CheckpointPlan
    best: BestPlan | None
    validation: ValidationPlan | None
    resume: bool | str = False
    load_from: str | None = None
    anomaly: AnomalyPlan | None = None

    def run_length(self, epoch_length: int) -> tuple[int, int | None]:
        """``(max_iters, max_epochs)``: ``train_cfg.max_iters`` (max_epochs None), else
        ``max_epochs`` epochs of ``epoch_length`` iterations."""
        if self.max_iters is not None:
            return self.max_iters, None
        assert self.max_epochs is not None  # check_train_config: one of the two
        return self.max_epochs * epoch_length, self.max_epochs


def check_train_config(cfg: Config | Mapping, top_level: bool = True) -> RunPlan:
    """The reference loop's checks of a config, in :func:`stratagem.loop.train`'s order,
    before anything is built (also ``stratagem doctor``'s and ``stratagem train --nproc``'s,
    before torchrun starts): the sections it needs, the top-level keys, the keys of
    ``train_cfg`` (with mmengine's loop ``type``), ``train_dataloader``, ``val_dataloader``,
    ``val_cfg`` and ``default_hooks`` (``stratagem.schema``), a run length, save_best's rule,
    the preemption settings.

    Returns the :class:`RunPlan` (``default_hooks``' ``log_interval`` / ``max_keep_ckpts``
    merged with ``train_cfg``'s). Raises the one error found (ConfigError, ValueError or
    TypeError naming the key), or one :class:`~stratagem.config.ConfigErrors` listing every
    error of the config when there are several (its ``errors``: each one). A config that
    needs mmengine's runner is refused at once.
    ``top_level=False`` leaves the top-level keys to the caller (``doctor`` reports each one
    as a finding of its own)."""
    cfg = cfg if isinstance(cfg, Config) else Config(cfg)
    join_host_registries()
    problems = _Problems(f'config {cfg.filename or ""}'.rstrip())
    lacking = [k for k in ('model', 'optim_wrapper', 'train_dataloader') if k not in cfg]
    if lacking:
        problems.add(
            ConfigError(
                f'config {cfg.filename or ""} has no {", ".join(lacking)}; '
                'stratagem train needs model, optim_wrapper, train_dataloader and '
                'train_cfg'
                + (
                    ". mmcv's top-level optimizer=dict(...) goes in "
                    'optim_wrapper=dict(optimizer=dict(...))'
                    if 'optimizer' in cfg
                    else ''
                )
            )
        )
    if top_level:
        problems.attempt(check_top_level_keys, cfg)
    train_cfg = dict(cfg.get('train_cfg') or {})
    problems.attempt(check_keys, train_cfg, TRAIN_CFG_KEYS, 'train_cfg')
    problems.attempt(_read_loop_type, train_cfg)
    problems.attempt(check_metrics_cfg, train_cfg.get('metrics'))
    data = problems.attempt(_read_train_loader, cfg.get('train_dataloader') or {})
    if 'max_iters' not in train_cfg and 'max_epochs' not in train_cfg:
        problems.add(
            ValueError('train_cfg needs max_epochs or max_iters, e.g. train_cfg=dict(max_epochs=4)')
        )
    by_epoch = bool(train_cfg.get('by_epoch', 'max_iters' not in train_cfg))
    hooks = problems.attempt(_read_default_hooks, cfg.get('default_hooks'), train_cfg, by_epoch)
    checkpoints, best = hooks or (CheckpointPlan(), None)
    validation = problems.attempt(_read_validation, cfg, train_cfg, best)
    max_iters = problems.attempt(_run_length, train_cfg, 'max_iters')
    max_epochs = None
    if 'max_iters' not in train_cfg:  # max_iters wins
        max_epochs = problems.attempt(_run_length, train_cfg, 'max_epochs')
    preemption = problems.attempt(preemption_config, train_cfg.get('preemption', True))
    straggler = problems.attempt(straggler_config, train_cfg.get('straggler', True))
    anomaly = problems.attempt(anomaly_config, train_cfg.get('anomaly'))
    periodic = bool(checkpoints.interval) or bool(hooks and checkpoints.hook_interval
                                                  and checkpoints.hook_interval[0] > 0)  # fmt: skip
    problems.attempt(check_anomaly_checkpoints, anomaly, periodic)
    strategy_type = dict(cfg.get('strategy') or {}).get('type')
    problems.attempt(check_anomaly_strategy, anomaly, strategy_type)
    problems.attempt(
        check_peer_strategy, checkpoints.peer_interval, dict(cfg.get('strategy') or {})
    )
    problems.raise_any()
    return RunPlan(
        model=cfg.model,
        optim_wrapper=cfg.optim_wrapper,
        param_scheduler=cfg.get('param_scheduler'),
        compile=cfg.get('compile', False),
        data=data,
        max_iters=max_iters,
        max_epochs=max_epochs,
        by_epoch=by_epoch,
        log_interval=max(1, int(train_cfg.get('log_interval', 10))),
        refit_schedulers=bool(train_cfg.get('refit_schedulers', False)),
        metrics=train_cfg.get('metrics'),
        preemption=preemption,
        straggler=straggler,
        checkpoints=checkpoints,
        best=best,
        validation=validation,
        resume=cfg.get('resume') or False,
        load_from=cfg.get('load_from'),
        anomaly=anomaly,
    )


def join_host_registries() -> None:
    """One registry space for the reference loop too: once mmengine's registries are
    imported (a type can be registered there only then), stratagem's fall back to them
    (``stratagem.integrations.mmengine``), so a dataset or model registered in mmengine's
    builds here as under FlexibleRunner. Nothing is imported for a run that never loaded
    mmengine."""
    if 'mmengine.registry' in sys.modules:
        import stratagem.integrations.mmengine  # noqa: F401  (the fallbacks)


class _Problems:
    """The errors of one config's reading, gathered so that one run shows them all."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.errors: list[Exception] = []

    def add(self, err: Exception) -> None:
        self.errors.append(err)

    def attempt(self, read: Callable[..., Any], *args: Any) -> Any:
        """``read(*args)``, or None with its ValueError / TypeError kept."""
        try:
            return read(*args)
        except NeedsRunnerError:
            raise  # a routing question, not a mistake to list with others
        except (ValueError, TypeError) as err:  # ConfigError is a ValueError
            self.errors.append(err)
            return None

    def raise_any(self) -> None:
        """Raise the one error as it is, or a ConfigErrors listing several."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            prefix = f'{self.where}: '
            raise ConfigErrors(
                f'{self.where}: {len(self.errors)} errors:\n'
                + '\n'.join(f'  - {str(err).removeprefix(prefix)}' for err in self.errors),
                self.errors,
            )


class NeedsRunnerError(ConfigError):
    """A config whose keys only mmengine's runner reads, given to the reference loop."""


def _read_loop_type(train_cfg: dict) -> None:
    """mmengine's ``train_cfg.type`` (``schema.TRAIN_LOOP_TYPES``), popped: its ``by_epoch``
    set in ``train_cfg``; the other loop's run length, a disagreeing ``by_epoch`` or another
    loop is a ValueError naming the accepted ones."""
    kind = train_cfg.pop('type', None)
    if kind is None:
        return
    name = (
        kind[len('mmengine.') :] if isinstance(kind, str) and kind.startswith('mmengine.') else kind
    )
    if name not in TRAIN_LOOP_TYPES:
        raise ValueError(
            f"train_cfg.type={kind!r}: the reference loop runs as mmengine's "
            + ' or '.join(f'{n!r} ({length})' for n, (_, length) in TRAIN_LOOP_TYPES.items())
            + ", or without a type (train_cfg.by_epoch); other loops run under mmengine's "
            "runner (runner_type='FlexibleRunner')"
        )
    by_epoch, length = TRAIN_LOOP_TYPES[name]
    other = 'max_iters' if length == 'max_epochs' else 'max_epochs'
    if other in train_cfg:
        raise ValueError(
            f'train_cfg.type={kind!r} counts {"epochs" if by_epoch else "iterations"}: its run '
            f"length is {length}, not {other} (mmengine's {name} takes {length}); use "
            f'type={"IterBasedTrainLoop" if by_epoch else "EpochBasedTrainLoop"!r} for {other}'
        )
    if 'by_epoch' in train_cfg and bool(train_cfg['by_epoch']) != by_epoch:
        raise ValueError(
            f'train_cfg.type={kind!r} and train_cfg.by_epoch={train_cfg["by_epoch"]!r} '
            'disagree; keep one of them'
        )
    train_cfg['by_epoch'] = by_epoch
    train_cfg[_DEFAULT_VAL_INTERVAL] = _MMENGINE_VAL_INTERVAL[name]


# mmengine's loops differ in how often they validate when val_interval is not given:
# EpochBasedTrainLoop every epoch, IterBasedTrainLoop every 1000 iterations. A ported config
# that names its loop keeps that cadence; without a type, the reference loop's default is 1.
_MMENGINE_VAL_INTERVAL = {'EpochBasedTrainLoop': 1, 'IterBasedTrainLoop': 1000}
_DEFAULT_VAL_INTERVAL = '_default_val_interval'


def _run_length(train_cfg: dict, key: str) -> int | None:
    """``train_cfg[key]`` as an int (None when the key is not given); a ValueError naming it."""
    if key not in train_cfg:
        return None
    value = train_cfg[key]
    try:
        return int(value)
    except (TypeError, ValueError):
        unit = 'iterations' if key == 'max_iters' else 'epochs'
        raise ValueError(
            f'train_cfg.{key} must be a whole number of {unit}, got {value!r}'
        ) from None


def run_work_dir(cfg: Config | Mapping) -> str:
    """The run's work_dir as :func:`strategy_config` gives it to the strategy: the
    strategy's ``work_dir``, else the top level's (default ``work_dirs``)."""
    return str(dict(cfg.get('strategy') or {}).get('work_dir') or cfg.get('work_dir', 'work_dirs'))


def strategy_config(cfg: Config | Mapping) -> dict:
    """The strategy's cfg (``strategy``, default ``type='auto'``), with ``work_dir`` and
    ``randomness`` from the top level, and an mmengine config's top-level ``env_cfg``,
    ``launcher``, ``log_level``, ``experiment_name`` and ``auto_scale_lr`` as the strategy's
    defaults (see :func:`_mmengine_top_level_keys`). Built when the strategy is, not by
    :func:`check_train_config`: an ``env_cfg``'s backend is fitted to this machine, with a
    warning, only in the process that runs."""
    strategy_cfg = dict(cfg.get('strategy') or {'type': 'auto'})
    strategy_cfg.setdefault('work_dir', cfg.get('work_dir', 'work_dirs'))
    env_kwargs = dict(strategy_cfg.get('env_kwargs') or {})
    _mmengine_top_level_keys(cfg, strategy_cfg, env_kwargs)
    if cfg.get('randomness') is not None:
        env_kwargs.setdefault('randomness', dict(cfg['randomness']))
    strategy_cfg['env_kwargs'] = env_kwargs
    return strategy_cfg


def dist_timeout(strategy_cfg: Mapping) -> float:
    """The process group's timeout in seconds: ``env_kwargs.dist_cfg.timeout``, else torch's
    default (30 min)."""
    timeout = dict(dict(strategy_cfg.get('env_kwargs') or {}).get('dist_cfg') or {}).get('timeout')
    if timeout is None:
        return 1800.0
    return timeout.total_seconds() if hasattr(timeout, 'total_seconds') else float(timeout)


def _read_train_loader(loader: Any) -> DataPlan:
    """``train_dataloader``'s keys (``schema.TRAIN_DATALOADER_KEYS``), its sampler and its
    collate function checked."""
    loader = dict(loader)
    check_keys(loader, TRAIN_DATALOADER_KEYS, 'train_dataloader')
    shuffle, seed = _read_sampler(loader, 'train_dataloader', default_shuffle=True)
    _read_collate(loader, 'train_dataloader')
    return DataPlan(
        dataset=loader.pop('dataset', None),
        batch_size=int(loader.pop('batch_size', 1)),
        shuffle=shuffle,
        seed=seed,
        loader_kwargs=loader,
    )


# the names whose higher value is better, and lower (save_best's rule when none is given);
# the less list is tried first as a part of a name: 'heatmap_loss' is a loss
_GREATER_KEYS = ('acc', 'top', 'ar@', 'auc', 'precision', 'recall', 'f1', 'map', 'dice', 'iou')
_LESS_KEYS = ('loss', 'error')


def infer_rule(name: str, greater_keys: Any = _GREATER_KEYS, less_keys: Any = _LESS_KEYS) -> str:
    """``'greater'`` or ``'less'``: whether a higher or a lower value of the validation value
    ``name`` is better, as mmengine's CheckpointHook infers it: an exact (case-insensitive)
    match of a key first, then a key inside the name, loss-like keys before accuracy-like
    ones. Raises ValueError when no key matches."""
    low = name.lower()
    greater = [k.lower() for k in greater_keys]
    less = [k.lower() for k in less_keys]
    if low in greater or low in less:
        return 'greater' if low in greater else 'less'
    if any(k in low for k in less):
        return 'less'
    if any(k in low for k in greater):
        return 'greater'
    raise ValueError(
        f'cannot tell whether a higher or a lower {name!r} is better (no key of '
        f'greater_keys {list(greater_keys)} or less_keys {list(less_keys)} in it); set '
        "default_hooks.checkpoint.rule='greater' or 'less'"
    )


def _read_default_hooks(
    hooks_cfg: Any, train_cfg: dict, run_by_epoch: bool
) -> tuple[CheckpointPlan, BestPlan | None]:
    """What the loop takes from mmengine's ``default_hooks`` (``schema.CHECKPOINT_HOOK_KEYS``,
    ``LOGGER_HOOK_KEYS``): ``log_interval`` and ``max_keep_ckpts`` go into ``train_cfg`` (an
    error if both places give different values); returns when to save and the save_best
    settings. The other hooks are mmengine's (``schema.runner_reasons`` routes a config with
    them to its runner, and the loop refuses it before this); a key of these two entries the
    loop cannot honour is a warning naming it."""
    hooks = dict(hooks_cfg or {})
    ignored = []
    logger = hooks.get('logger')
    if isinstance(logger, Mapping):
        logger = dict(logger)
        _check_hook_type(logger, 'LoggerHook', 'logger')
        ignored += [f'default_hooks.logger.{k}' for k in logger if k not in LOGGER_HOOK_KEYS]
        if 'interval' in logger:
            _agree(train_cfg, 'log_interval', logger['interval'], 'default_hooks.logger.interval')
    hook_interval, best, out_dir, backend_args, peer_interval = None, None, None, None, 0
    ckpt_hook = hooks.get('checkpoint')
    if isinstance(ckpt_hook, Mapping):
        ckpt_hook = dict(ckpt_hook)
        ignored += [
            f'default_hooks.checkpoint.{k}'
            for k in ckpt_hook
            if k not in CHECKPOINT_HOOK_KEYS or (k == 'save_last' and not ckpt_hook[k])
        ]
        hook_interval, best = _read_checkpoint_hook(ckpt_hook, train_cfg, run_by_epoch)
        out_dir, backend_args = _read_out_dir(ckpt_hook)
        peer_interval = _read_peer_interval(ckpt_hook)
    if ignored:
        warnings.warn(
            f"stratagem train's reference loop does not honour {', '.join(ignored)}: it "
            'reads default_hooks.checkpoint (interval, by_epoch, max_keep_ckpts, save_best, '
            'rule, greater_keys, less_keys, out_dir, backend_args, peer_interval) and '
            'default_hooks.logger.interval; hooks run under '
            "mmengine's runner (runner_type='FlexibleRunner', the mmengine extra)",
            UserWarning,
            stacklevel=4,
        )
    explicit = train_cfg.get('checkpoint_interval')
    checkpoints = CheckpointPlan(
        interval=int(explicit or 0) if 'checkpoint_interval' in train_cfg else None,
        hook_interval=hook_interval,
        max_keep=train_cfg.get('max_keep_ckpts'),
        out_dir=out_dir,
        backend_args=backend_args,
        peer_interval=peer_interval,
    )
    return checkpoints, best


def _read_peer_interval(hook: dict) -> int:
    """``default_hooks.checkpoint.peer_interval``: iterations between peer copies (an int
    >= 0; 0, the default: none)."""
    n = hook.get('peer_interval', 0)
    if type(n) is not int or n < 0:
        raise ValueError(
            'default_hooks.checkpoint.peer_interval must be a number of iterations >= 0 '
            f'(0: no peer copies), got {n!r}'
        )
    return n


def check_peer_strategy(peer_interval: int, strategy_cfg: Mapping) -> None:
    """Peer copies hold what each rank captures: refused for a backend where that does not
    restore the rank (``Capabilities.peer_copies``; ``strategy.type``: a name, a class or
    'auto'),
    and with replica groups (``strategy.fault_tolerance``), whose groups share a work_dir and
    heal from a live peer's memory already."""
    from stratagem.strategies.capabilities import capabilities_of

    if peer_interval and strategy_cfg.get('fault_tolerance'):
        raise ValueError(
            f'default_hooks.checkpoint.peer_interval={peer_interval} with '
            "strategy.fault_tolerance: a replica group heals from a live group's memory "
            'already, and the groups share one work_dir (their copies would meet in one '
            '/dev/shm directory); remove peer_interval'
        )
    strategy_type = strategy_cfg.get('type')
    if peer_interval and not capabilities_of(strategy_type).peer_copies:
        name = (
            strategy_type
            if isinstance(strategy_type, str)
            else getattr(strategy_type, '__name__', repr(strategy_type))
        )
        raise ValueError(
            f'default_hooks.checkpoint.peer_interval={peer_interval}: peer copies keep what '
            f"each rank captures, and {name} keeps its state in an engine's files or "
            'consolidates it on one rank to save it; remove peer_interval, or train with '
            'DDPStrategy or FSDPStrategy'
        )


def _read_out_dir(hook: dict) -> tuple[str | None, dict | None]:
    """``default_hooks.checkpoint.out_dir`` and ``backend_args``, checked."""
    out_dir, backend_args = hook.get('out_dir'), hook.get('backend_args')
    if out_dir is not None and (not isinstance(out_dir, str) or not out_dir.strip()):
        raise TypeError(
            'default_hooks.checkpoint.out_dir must be a path or a URL (e.g. '
            f"'s3://bucket/checkpoints'), got {out_dir!r}"
        )
    if backend_args is not None and not isinstance(backend_args, Mapping):
        raise TypeError(
            "default_hooks.checkpoint.backend_args must be a dict of the store's options "
            f'(e.g. dict(endpoint_url=...)), got {backend_args!r}'
        )
    if isinstance(backend_args, Mapping) and 'backend' in backend_args:
        raise ValueError(
            f'default_hooks.checkpoint.backend_args.backend={backend_args["backend"]!r} is '
            "mmengine's file backend; here out_dir is an fsspec URL (s3://, gs://, ...) and "
            "backend_args are its filesystem's options (e.g. dict(endpoint_url=...)); remove "
            "'backend'"
        )
    if backend_args is not None and out_dir is None:
        raise ValueError(
            'default_hooks.checkpoint.backend_args is given without out_dir: they are the '
            "options of out_dir's store; set out_dir (e.g. 's3://bucket/checkpoints') too"
        )
    return out_dir, None if backend_args is None else dict(backend_args)


def _read_checkpoint_hook(
    hook: dict, train_cfg: dict, run_by_epoch: bool
) -> tuple[tuple[int, bool] | None, BestPlan | None]:
    """``default_hooks.checkpoint``: its interval as ``(n, by_epoch)`` (None when not given)
    and its save_best settings (None without ``save_best``); ``max_keep_ckpts`` goes into
    ``train_cfg``."""
    _check_hook_type(hook, 'CheckpointHook', 'checkpoint')
    if 'max_keep_ckpts' in hook:
        keep = hook['max_keep_ckpts']
        if type(keep) is not int:
            raise TypeError(
                f'default_hooks.checkpoint.max_keep_ckpts must be an int (-1 keeps all), '
                f'got {keep!r}'
            )
        _agree(train_cfg, 'max_keep_ckpts', keep, 'default_hooks.checkpoint.max_keep_ckpts')
    by_epoch = bool(hook.get('by_epoch', run_by_epoch))
    interval = None
    if 'interval' in hook:
        n = hook['interval']
        if type(n) is not int:
            raise TypeError(f'default_hooks.checkpoint.interval must be an int, got {n!r}')
        interval = (n, by_epoch)
    best, rule = hook.get('save_best'), hook.get('rule')
    if best is not None and not isinstance(best, str):
        raise TypeError(
            "default_hooks.checkpoint.save_best must be one validation value's name "
            f"(e.g. 'acc') or 'auto', got {best!r}"
        )
    if rule is not None and rule not in ('greater', 'less'):
        raise ValueError(f"default_hooks.checkpoint.rule must be 'greater' or 'less', got {rule!r}")
    greater_keys = tuple(hook.get('greater_keys') or _GREATER_KEYS)
    less_keys = tuple(hook.get('less_keys') or _LESS_KEYS)
    if best is None:
        return interval, None
    if best != 'auto' and rule is None:
        rule = infer_rule(best, greater_keys, less_keys)
    return interval, BestPlan(best, rule, greater_keys, less_keys, by_epoch)


def _check_hook_type(hook: dict, expected: str, name: str) -> None:
    if hook.get('type', expected) not in (expected, f'mmengine.{expected}'):
        raise ValueError(
            f'default_hooks.{name}.type={hook["type"]!r}: the reference loop does the work of '
            f"{expected} itself and runs no other; use type='{expected}', or run the config "
            "under mmengine's runner (runner_type='FlexibleRunner')"
        )


def _agree(train_cfg: dict, key: str, value: Any, where: str) -> None:
    """``train_cfg[key] = value`` unless ``train_cfg`` already has another value for it."""
    mine = train_cfg.get(key)
    same = mine == value or (key == 'max_keep_ckpts' and (mine or 0) <= 0 and value <= 0)
    if key in train_cfg and not same:
        raise ValueError(
            f'{where}={value!r} and train_cfg.{key}={mine!r} disagree: they are the same '
            'setting; keep one of them'
        )
    train_cfg[key] = value


def _read_validation(cfg: Any, train_cfg: dict, best: BestPlan | None) -> ValidationPlan | None:
    """``val_dataloader`` / ``val_cfg`` / ``train_cfg.val_interval``, ``val_begin`` checked
    (``schema.VAL_DATALOADER_KEYS``); None when the config has no validation."""
    default_interval = train_cfg.pop(_DEFAULT_VAL_INTERVAL, 1)
    val_cfg = _read_val_cfg(cfg.get('val_cfg'))
    loader = cfg.get('val_dataloader')
    if loader is None:
        _check_no_validation(val_cfg, train_cfg, best)
        return None
    loader = dict(loader)
    check_keys(loader, VAL_DATALOADER_KEYS, 'val_dataloader')
    if 'dataset' not in loader:
        raise ValueError('val_dataloader has no dataset: add val_dataloader.dataset')
    shuffle, seed = _read_sampler(loader, 'val_dataloader', default_shuffle=False)
    _read_collate(loader, 'val_dataloader')
    if loader.pop('drop_last', False):
        raise ValueError(
            'val_dataloader.drop_last=True would leave samples out of the validation means; '
            'validation reads every sample once: remove drop_last'
        )
    when = {}
    defaults = {'val_interval': default_interval, 'val_begin': 1}
    for key in ('val_interval', 'val_begin'):
        value = train_cfg.get(key, defaults[key])
        if type(value) is not int or value < (1 if key == 'val_interval' else 0):
            raise ValueError(
                f'train_cfg.{key} must be an int >= {1 if key == "val_interval" else 0}, '
                f'got {value!r}'
            )
        when[key] = value
    return ValidationPlan(
        dataset=loader.pop('dataset'),
        batch_size=int(loader.pop('batch_size', 1)),
        shuffle=bool(shuffle),
        seed=seed,
        autocast=bool((val_cfg or {}).get('fp16', False)),
        loader_kwargs=loader,
        interval=when['val_interval'],
        begin=when['val_begin'],
    )


def _read_val_cfg(val_cfg: Any) -> dict | None:
    """``val_cfg``'s keys (``schema.VAL_CFG_KEYS``): mmengine's ValLoop only, ``fp16`` a bool."""
    if val_cfg is None:
        return None
    val_cfg = dict(val_cfg)
    check_keys(val_cfg, VAL_CFG_KEYS, 'val_cfg')
    if val_cfg.get('type', 'ValLoop') != 'ValLoop':
        raise ValueError(
            f"val_cfg.type={val_cfg['type']!r}: the reference loop runs mmengine's ValLoop "
            "(val_cfg=dict(type='ValLoop') or {}); other loops run under mmengine's "
            "runner (runner_type='FlexibleRunner')"
        )
    if not isinstance(val_cfg.get('fp16', False), bool):
        raise ValueError(f'val_cfg.fp16 must be True or False, got {val_cfg["fp16"]!r}')
    return val_cfg


def _check_no_validation(val_cfg: dict | None, train_cfg: dict, best: BestPlan | None) -> None:
    """A config without ``val_dataloader``: ``val_cfg`` or ``save_best`` is an error, a
    validation interval a warning (it changes nothing)."""
    if val_cfg:
        raise ValueError('val_cfg is given but no val_dataloader: add val_dataloader')
    if best is not None:
        raise ValueError(
            f'default_hooks.checkpoint.save_best={best.metric!r} keeps the best '
            'checkpoint by a validation value, but the config has no val_dataloader; '
            'add one or remove save_best'
        )
    unused = [f'train_cfg.{k}' for k in ('val_interval', 'val_begin') if k in train_cfg]
    if unused:
        warnings.warn(
            f'{" and ".join(unused)} change nothing: the config has no val_dataloader, '
            'so nothing is validated',
            UserWarning,
            stacklevel=5,
        )


_SAMPLERS = ('DefaultSampler', 'InfiniteSampler')


def _read_sampler(loader: dict, where: str, default_shuffle: bool) -> tuple[bool, int | None]:
    """A dataloader cfg's ``shuffle`` and mmengine's ``sampler=dict(type='DefaultSampler' or
    'InfiniteSampler', shuffle=, seed=, round_up=)``, popped from ``loader``: whether to
    shuffle and the shuffling seed (None: the run's). The reference loop shards and resumes
    the data itself, with the sampler these two keys describe; a disagreeing pair, another
    sampler type or ``round_up=False`` is a ValueError naming the key."""
    shuffle = loader.pop('shuffle', None)
    sampler = loader.pop('sampler', None)
    if sampler is None:
        return (default_shuffle if shuffle is None else bool(shuffle)), None
    if not isinstance(sampler, Mapping):
        raise TypeError(
            f"{where}.sampler must be a dict like dict(type='DefaultSampler', shuffle=True), "
            f'got {type(sampler).__name__}'
        )
    sampler = dict(sampler)
    check_keys(sampler, {'type', 'shuffle', 'seed', 'round_up'}, f'{where}.sampler')
    kind = sampler.get('type', 'DefaultSampler')
    if kind not in _SAMPLERS and kind not in [f'mmengine.{k}' for k in _SAMPLERS]:
        raise ValueError(
            f'{where}.sampler.type={kind!r}: the reference loop shards, shuffles and resumes '
            "the data itself, as mmengine's DefaultSampler / InfiniteSampler do; use one of "
            'them (shuffle, seed) or run the config under FlexibleRunner '
            "(runner_type='FlexibleRunner')"
        )
    if sampler.get('round_up', True) is not True:
        raise ValueError(
            f'{where}.sampler.round_up={sampler["round_up"]!r}: the reference loop reads '
            + (
                'every validation sample exactly once (round_up has no effect there); '
                if where == 'val_dataloader'
                else 'the rounded-up epoch (as round_up=True); use drop_last=True to drop '
                'the uneven tail instead; '
            )
            + 'remove round_up'
        )
    if shuffle is not None and 'shuffle' in sampler and bool(sampler['shuffle']) != shuffle:
        raise ValueError(
            f'{where}.shuffle={shuffle!r} and {where}.sampler.shuffle={sampler["shuffle"]!r} '
            'disagree; keep one of them'
        )
    shuffle = sampler.get('shuffle', default_shuffle if shuffle is None else shuffle)
    seed = sampler.get('seed')
    if seed is not None and type(seed) is not int:
        raise ValueError(f'{where}.sampler.seed must be an int or None, got {seed!r}')
    return bool(shuffle), seed


def _read_collate(loader: dict, where: str) -> None:
    """mmengine's ``collate_fn=dict(type='default_collate')`` as torch's ``default_collate``,
    in place; a callable stays. mmengine's ``pseudo_collate`` (lists for a data
    preprocessor) is a ValueError: the reference loop hands batches to the model as they
    are collated."""
    collate = loader.get('collate_fn')
    if not isinstance(collate, Mapping):
        return
    kind = dict(collate).get('type')
    if set(collate) == {'type'} and kind in ('default_collate', 'mmengine.default_collate'):
        from torch.utils.data import default_collate

        loader['collate_fn'] = default_collate
        return
    raise ValueError(
        f'{where}.collate_fn={dict(collate)!r}: the reference loop takes '
        "collate_fn=dict(type='default_collate') or a function; mmengine's pseudo_collate "
        "feeds a model's data_preprocessor: run the config under FlexibleRunner "
        "(runner_type='FlexibleRunner')"
    )


def check_top_level_keys(cfg: Config | Mapping) -> None:
    """Refuse a config whose top level holds a key the reference loop does not read: one that
    only mmengine's runner reads (``stratagem.schema.runner_reasons``: run it under
    ``FlexibleRunner``, which ``stratagem train`` does by itself; a
    :class:`NeedsRunnerError`), or a known key's typo or an older config's key
    (``schema.read_top_level_keys``: a ConfigError naming each, with the closest valid key).
    The config file's helper variables (plain data nothing reads) are accepted, listed in
    one debug line; imported objects are no keys."""
    from stratagem.schema import LOOP_TOP_KEYS, read_top_level_keys, runner_reasons

    where = f'config {getattr(cfg, "filename", None) or ""}'.rstrip()
    reasons = runner_reasons(cfg)
    if reasons:
        raise NeedsRunnerError(
            f'{where}: {", ".join(reasons)} '
            "are read only by mmengine's runner, not by stratagem's reference loop: run "
            "`stratagem train CONFIG` (it runs such a config under mmengine's FlexibleRunner "
            "on stratagem's strategies), or in Python `import stratagem.integrations.mmengine` "
            'and `FlexibleRunner.from_cfg(cfg).train()`'
        )
    keys = read_top_level_keys(cfg, LOOP_TOP_KEYS)
    if keys.helpers:
        logging.getLogger('stratagem').debug(
            '%s: helper variables of the config file (nothing reads them): %s',
            where,
            ', '.join(keys.helpers),
        )
    if keys.unknown:
        raise ConfigError(
            f'{where}: unknown top-level key(s) '
            + '; '.join(f'{k!r} ({hint})' for k, hint in keys.unknown.items())
            + f'. valid: {", ".join(sorted(LOOP_TOP_KEYS))}'
        )


def _mmengine_top_level_keys(cfg: Any, strategy_cfg: dict, env_kwargs: dict) -> None:
    """An mmengine config as it is: its top-level ``env_cfg`` gives the strategy's
    ``env_kwargs`` defaults (a CUDA backend on a machine without CUDA becomes gloo, said once),
    ``launcher`` its launcher, ``log_level`` its log level and ``experiment_name`` its run
    name, and its top-level ``auto_scale_lr`` the strategy's, unless the strategy has its own
    (which wins, with a warning when they differ)."""
    if cfg.get('env_cfg'):
        from stratagem.env.backend import mmengine_env_kwargs

        for key, value in mmengine_env_kwargs(cfg['env_cfg']).items():
            env_kwargs.setdefault(key, value)
    if cfg.get('launcher') is not None:
        env_kwargs.setdefault('launcher', cfg['launcher'])
    if cfg.get('log_level') is not None:
        strategy_cfg['log_kwargs'] = {
            'log_level': cfg['log_level'],
            **dict(strategy_cfg.get('log_kwargs') or {}),
        }
    if cfg.get('experiment_name') is not None:
        strategy_cfg.setdefault('experiment_name', cfg['experiment_name'])
    top = cfg.get('auto_scale_lr')
    if top is None:
        return
    own = strategy_cfg.get('auto_scale_lr')
    if own is None:
        strategy_cfg['auto_scale_lr'] = dict(top)
    elif dict(own) != dict(top):
        warnings.warn(
            f'auto_scale_lr is given twice: at the top level ({dict(top)}) and in strategy '
            f"({dict(own)}); the strategy's is used. Keep one of them",
            UserWarning,
            stacklevel=3,
        )
