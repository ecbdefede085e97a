"""The reference loop behind ``stratagem train``: small on purpose, not a framework.

It imports the config's ``custom_imports`` (``stratagem.config.imports``), reads ``model``,
``strategy``, ``optim_wrapper``, ``param_scheduler``, ``train_dataloader``, ``train_cfg``,
``randomness``, ``val_dataloader``, ``val_cfg`` and mmengine's ``default_hooks.checkpoint`` /
``default_hooks.logger`` from a config (``stratagem.schema``), lets the strategy prepare
everything, and runs iterations: forward under ``optim_context``, ``update_params``,
schedulers (iteration-based ones every
iteration, epoch-based ones at epoch ends, as mmengine's ParamSchedulerHook
does), a progress bar on rank 0, and checkpoints every ``checkpoint_interval``
iterations and at the end. A resumed run continues from the same sample and the
same RNG state, so it ends where an uninterrupted run would.

Validation (when ``val_dataloader`` is given), after every ``train_cfg.val_interval`` epochs
(``by_epoch``) or iterations and at the end: :func:`validate` averages every scalar of the
model's output over the whole set, across ranks, each sample once; logged as ``val/<name>``
(log line, ``metrics.csv``, TensorBoard); metric-driven schedulers (ReduceOnPlateau) step
with the values. ``save_best`` then keeps ``best_{name}_{epoch|iter}_{N}.pth``: a second
full checkpoint of that moment, excluded from ``max_keep_ckpts``' count and never deleted by
it; the previous best is deleted (``checkpoint.delete_checkpoint``) once the new one is
committed. Every checkpoint's ``meta['best']`` carries the best so far, for a resume.
Log lines show positions as mmengine does: ``Epoch(train) [1][16/64]`` (epochs 1-based).

Failures (``docs/architecture.md``, "Failures"): a preemption signal
(``train_cfg.preemption``, ``env/preemption.py``) stops every rank after the same
iteration, in one committed checkpoint; in a process group a watchdog
(``env/watchdog.py``) names a rank that stops answering and ends this one within the
process group's timeout (``dist_cfg.timeout``) + 10 s.
"""

from __future__ import annotations

import contextlib
import math
import os.path as osp
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from stratagem import checkpoint as ckpt
from stratagem.config import (
    Config,
    ConfigError,
    check_keys,
    config_search_dirs,
    import_custom_modules,
)
from stratagem.env.preemption import Preemption, clear_marker, preemption_config
from stratagem.env.watchdog import Watchdog
from stratagem.metrics import RunMetrics, format_row
from stratagem.registry import DATASETS
from stratagem.schema import (
    CHECKPOINT_HOOK_KEYS,
    LOGGER_HOOK_KEYS,
    TRAIN_CFG_KEYS,
    TRAIN_DATALOADER_KEYS,
    VAL_CFG_KEYS,
    VAL_DATALOADER_KEYS,
)
from stratagem.strategies.model_api import call_model


def check_train_config(
    cfg: Config | Mapping, top_level: bool = True
) -> tuple[dict, dict, dict, dict | None]:
    """The reference loop's checks of a config, in :func:`train`'s order, before anything is
    built (also ``stratagem doctor``'s and ``stratagem train --nproc``'s, before torchrun
    starts): the sections it needs, the top-level keys, the keys of ``train_cfg``,
    ``train_dataloader``, ``val_dataloader``, ``val_cfg`` and ``default_hooks``
    (``stratagem.schema``), a run length, save_best's rule.

    Returns ``(train_cfg, train_dataloader, hooks, validation)``: copies, with
    ``default_hooks``' ``log_interval`` / ``max_keep_ckpts`` in ``train_cfg``; ``hooks``
    holds the checkpoint interval in the hook's unit and the save_best settings;
    ``validation`` is None without a ``val_dataloader``. Raises ConfigError, ValueError or
    TypeError naming the key. ``top_level=False`` leaves the top-level keys to the caller
    (``doctor`` reports each one as a finding of its own)."""
    cfg = cfg if isinstance(cfg, Config) else Config(cfg)
    lacking = [k for k in ('model', 'optim_wrapper', 'train_dataloader') if k not in cfg]
    if lacking:
        raise ConfigError(
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
    if top_level:
        _check_top_level_keys(cfg)
    train_cfg = dict(cfg.get('train_cfg') or {})
    check_keys(train_cfg, TRAIN_CFG_KEYS, 'train_cfg')
    loader_cfg = dict(cfg.train_dataloader)
    check_keys(loader_cfg, TRAIN_DATALOADER_KEYS, 'train_dataloader')
    shuffle, seed = _read_sampler(loader_cfg, 'train_dataloader', default_shuffle=True)
    loader_cfg.update(shuffle=shuffle, seed=seed)
    _read_collate(loader_cfg, 'train_dataloader')
    if 'max_iters' not in train_cfg and 'max_epochs' not in train_cfg:
        raise ValueError(
            'train_cfg needs max_epochs or max_iters, e.g. train_cfg=dict(max_epochs=4)'
        )
    hooks = _read_default_hooks(cfg.get('default_hooks'), train_cfg)
    val = _read_validation(cfg, train_cfg, hooks)
    return train_cfg, loader_cfg, hooks, val


def build_dataset(cfg: Any) -> Dataset:
    """A Dataset instance as is, a DATASETS cfg, or a zero-argument callable returning one."""
    if isinstance(cfg, Mapping):
        return DATASETS.build(cfg)
    if isinstance(cfg, Dataset):
        return cfg
    if callable(cfg):
        return cfg()
    raise TypeError(
        'train_dataloader.dataset should be a DATASETS cfg dict, a Dataset or a '
        f'callable returning one; got {type(cfg).__name__}'
    )


def epoch_length_from_config(cfg: Mapping, world_size: int = 1) -> int | None:
    """Iterations per epoch of ``cfg.train_dataloader`` (building its dataset), or None."""
    loader = cfg.get('train_dataloader')
    if not isinstance(loader, Mapping) or 'dataset' not in loader:
        return None
    n = len(build_dataset(loader['dataset']))  # type: ignore[arg-type]
    per_rank = n // world_size if loader.get('drop_last') else math.ceil(n / world_size)
    batch = int(loader.get('batch_size', 1))
    return per_rank // batch if loader.get('drop_last') else math.ceil(per_rank / batch)


def pipeline_loss_fn(strategy: Any, model: torch.nn.Module, val_loader: Any) -> Any:
    """Under a pipeline (FSDPStrategy's ``mesh.pipeline``): the model's ``loss(outputs,
    targets)``, the ``loss_fn`` of ``strategy.train_step`` (a stage returns outputs, not a
    loss); None without one. Validation is refused: the reference loop runs it on whole
    models. ``stratagem doctor`` runs the same check."""
    if getattr(strategy, 'pipeline_spec', None) is None:
        return None
    loss = getattr(model, 'loss', None)
    if not callable(loss):
        raise ValueError(
            f"under a pipeline stratagem train needs the model's loss as a method: "
            f'{type(model).__name__}.loss(outputs, targets) -> the mean loss (each stage '
            "returns its outputs; the last stage's go to loss). Or train it in your own "
            'loop with strategy.train_step(inputs, targets, loss_fn)'
        )
    if val_loader is not None:
        raise ValueError(
            "stratagem train's validation runs whole models, and under a pipeline each rank "
            'holds its stages only: leave out val_dataloader (and val_cfg), or validate the '
            'checkpoints in another run without a pipeline'
        )
    return loss


def pipeline_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a loader's batch, which a pipeline's schedule splits into
    microbatches; refuses another form (``stratagem doctor`` runs the same check)."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        'under a pipeline a batch is (inputs, targets), which the schedule splits into '
        f'microbatches; the dataset gave {type(batch).__name__}'
        + (f' of {len(batch)}' if isinstance(batch, (list, tuple)) else '')
    )


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device('cpu')


def train(
    cfg: Config | Mapping,
    *,
    resume: bool | str = False,
    load_from: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train from ``cfg``; returns ``{'strategy', 'losses' (per logged iteration), 'val'
    (``(iter, {name: mean})`` per validation), 'best' (``save_best``'s metric, rule, score
    and checkpoint file name, else None), 'iter', 'preempted'}`` (``preempted``: the signal
    that stopped the run early, else None)."""
    cfg = cfg if isinstance(cfg, Config) else Config(cfg)
    # a config given as a dict has not been through Config.fromfile: its own modules now
    import_custom_modules(cfg.get('custom_imports'), config_search_dirs(cfg))
    # mmengine's top-level load_from / resume, unless the caller (--load-from, --resume) says
    resume = resume or cfg.get('resume') or False
    load_from = load_from if load_from is not None else cfg.get('load_from')
    train_cfg, loader_cfg, hooks, val = check_train_config(cfg)
    # handlers from the start: a signal while the strategy is built is not lost (the loop
    # stops after its first iteration); restored however train() ends
    preempt_cfg = preemption_config(train_cfg.get('preemption', True))
    if preempt_cfg is None:
        return _train(cfg, train_cfg, loader_cfg, hooks, val, None, resume, load_from, progress)
    with Preemption.from_config(preempt_cfg) as preemption:
        return _train(
            cfg, train_cfg, loader_cfg, hooks, val, preemption, resume, load_from, progress
        )


def _train(
    cfg: Config,
    train_cfg: dict,
    loader_cfg: dict,
    hooks: dict,
    val: dict | None,
    preemption: Preemption | None,
    resume: bool | str,
    load_from: str | None,
    progress: bool,
) -> dict[str, Any]:
    from stratagem.data import ResumableSampler
    from stratagem.strategies import build_strategy

    strategy_cfg = dict(cfg.get('strategy') or {'type': 'auto'})
    strategy_cfg.setdefault('work_dir', cfg.get('work_dir', 'work_dirs'))
    env_kwargs = dict(strategy_cfg.get('env_kwargs') or {})
    _mmengine_top_level_keys(cfg, strategy_cfg, env_kwargs)
    if cfg.get('randomness') is not None:
        env_kwargs.setdefault('randomness', dict(cfg.randomness))
    strategy_cfg['env_kwargs'] = env_kwargs
    strategy = build_strategy(strategy_cfg)
    log = strategy.logger

    dataset = build_dataset(loader_cfg.pop('dataset'))
    batch_size = int(loader_cfg.pop('batch_size', 1))
    sampler_seed = loader_cfg.pop('seed')  # mmengine's sampler.seed, else the run's
    sampler = ResumableSampler(
        len(dataset),  # type: ignore[arg-type]
        strategy.data_parallel_rank,  # the ranks of one tensor group read the same batch
        strategy.data_parallel_size,
        shuffle=loader_cfg.pop('shuffle'),
        drop_last=loader_cfg.get('drop_last', False),
    )
    # a private generator: creating a loader iterator must not draw from the global RNG,
    # or a resumed run's random stream would drift from an uninterrupted one
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator(), **loader_cfg
    )
    epoch_length = len(loader)
    if epoch_length == 0:
        raise ValueError(
            f'train_dataloader yields no batch per epoch: {len(dataset)} samples '  # type: ignore[arg-type]
            f'over {strategy.data_parallel_size} data-parallel rank(s) with '
            f'batch_size={batch_size} '
            f'and drop_last={loader_cfg.get("drop_last", False)}; use a smaller '
            'batch_size or drop_last=False'
        )
    if 'max_iters' in train_cfg:
        max_iters = int(train_cfg['max_iters'])
        max_epochs = None
    elif 'max_epochs' in train_cfg:
        max_epochs = int(train_cfg['max_epochs'])
        max_iters = max_epochs * epoch_length
    else:
        raise ValueError(
            'train_cfg needs max_epochs or max_iters, e.g. train_cfg=dict(max_epochs=4)'
        )
    prepared = strategy.prepare(
        cfg.model,
        optim_wrapper=cfg.optim_wrapper,
        param_scheduler=cfg.get('param_scheduler'),
        compile=cfg.get('compile', False),
        dispatch_kwargs=dict(
            max_iters=max_iters,
            max_epochs=max_epochs,
            epoch_length=epoch_length,
            train_micro_batch_size_per_gpu=batch_size,
        ),
    )
    model, optim_wrapper = prepared[0], prepared[1]
    schedulers = prepared[2] if len(prepared) > 2 else []
    scheduler_list = _flatten(schedulers)

    start_iter = 0
    checkpoint = strategy.load_or_resume(
        load_from=load_from,
        resume=resume,
        refit_schedulers=bool(train_cfg.get('refit_schedulers', False)),
    )
    if checkpoint is not None and resume:
        # in this run's units: a resume at another world size converts the position (and an
        # iteration-counted max_iters) so that exactly the samples left are read
        start_iter = int((checkpoint.get('meta') or {}).get('iter', 0))
        change = (checkpoint.get('meta') or {}).get('world_size_change') or {}
        max_iters = int((change.get('max_iters') or (None, max_iters))[1])
    # the shuffle seed is the run's configured seed (the same on every rank, also under
    # diff_rank_seed), read after a resume has restored it
    data_seed = strategy.randomness['seed'] if sampler_seed is None else int(sampler_seed)
    sampler.seed = data_seed
    interval = _checkpoint_interval(train_cfg, hooks, epoch_length)
    max_keep = train_cfg.get('max_keep_ckpts')
    log_interval = max(1, int(train_cfg.get('log_interval', 10)))
    by_epoch = bool(train_cfg.get('by_epoch', 'max_iters' not in train_cfg))
    device = _model_device(model)
    main = strategy.rank == 0
    best = _BestCheckpoint(hooks) if hooks.get('save_best') is not None else None
    if best is not None and checkpoint is not None and resume:
        best.restore(checkpoint.get('meta') or {})
    val_loader, val_weights = None, []
    if val is not None:
        from stratagem.data import validation_batches

        val_set = build_dataset(val['dataset'])
        batches = validation_batches(
            len(val_set),  # type: ignore[arg-type]
            strategy.data_parallel_rank,
            strategy.data_parallel_size,
            val['batch_size'],
            shuffle=val['shuffle'],
            seed=data_seed if val['seed'] is None else int(val['seed']),
        )
        val_loader = DataLoader(
            val_set, batch_sampler=[b for b, _ in batches], **val['loader_kwargs']
        )
        val_weights = [w for _, w in batches]
    if preemption is not None:
        # ranks drift apart by at most one accumulation window between two collectives
        wrappers = getattr(optim_wrapper, 'values', lambda: [optim_wrapper])()
        preemption.lead = max(getattr(w, 'accumulative_counts', 1) for w in wrappers) + 1
        if main:
            clear_marker(strategy.work_dir)
    preempted: str | None = None
    saved_at = -1
    bar = None
    if progress and main:
        # a bar on a terminal; whole lines every 30 s when stderr is a file or a pipe
        from stratagem.progress import progress_bar

        bar = progress_bar(max_iters, start_iter, file=sys.stderr)
    losses: list[tuple[int, float]] = []
    val_history: list[tuple[int, dict[str, float]]] = []
    val_lines: list[str] = []
    model.train()
    pipeline_loss = pipeline_loss_fn(strategy, model, val_loader)
    it = start_iter
    t0 = time.perf_counter()
    data_iter = None
    loss_sum = torch.zeros((), device=device)
    # the model's other training scalars (acc, ...): sums and counts since the last log
    extra_sums: dict[str, torch.Tensor] = {}
    extra_counts: dict[str, int] = {}
    last_logged = start_iter
    stack = contextlib.ExitStack()
    if bar is not None:
        from stratagem.progress import logging_above

        stack.enter_context(logging_above(bar, log))  # logs print above a bar
        stack.callback(bar.close)
    # a signal while a peer is dead (torchrun tearing the group down): end now, no save
    signalled = preemption.pending if preemption is not None else None
    watchdog = stack.enter_context(Watchdog(_dist_timeout(strategy_cfg), signalled=signalled))
    metrics = RunMetrics(
        strategy.log_dir,
        strategy.data_parallel_size * batch_size,
        enabled=main,
        cfg=train_cfg.get('metrics'),
        logger=log,
    )
    stack.callback(metrics.close)
    first_wrapper = next(iter(getattr(optim_wrapper, 'values', lambda: [optim_wrapper])()))
    t_logged = t0

    def protected() -> list[str]:
        kept = [strategy.resumed_from] if strategy.resumed_from else []
        if best is not None and best.filename:
            kept.append(osp.join(strategy.work_dir, best.filename))
        return kept

    with stack:  # closes the bar and the log redirection however the loop ends
        while it < max_iters:
            epoch, pos = divmod(it, epoch_length)
            watchdog.at(it + 1, 'loading data')
            if data_iter is None or pos == 0:
                sampler.set_epoch(epoch)
                sampler.skip(pos * batch_size)
                # worker seeds come from this generator: fix them per epoch, so a resumed
                # epoch's workers are seeded as the uninterrupted run's were
                loader.generator.manual_seed(data_seed + epoch)
                data_iter = iter(loader)
            batch = next(data_iter)
            if metrics.tokens is None:
                metrics.saw_batch(batch)
            watchdog.at(it + 1, 'forward, backward, update')
            if pipeline_loss is not None:  # the schedule runs the microbatches
                output = None
                loss = strategy.train_step(*pipeline_batch(batch), pipeline_loss)
            else:
                outputs: list = []
                loss = strategy.train_step(batch, outputs=outputs)
                output = outputs[0]
            loss_sum.add_(loss)  # in place, no host sync: read only when logging
            if isinstance(output, Mapping):
                for name, value in _scalars(output).items():
                    if name != 'loss':
                        _accumulate(extra_sums, name, value, device)
                        extra_counts[name] = extra_counts.get(name, 0) + 1
            for s in scheduler_list:
                if not s.by_epoch:
                    s.step()
            it += 1
            if it % epoch_length == 0:
                for s in scheduler_list:
                    if s.by_epoch:
                        s.step()
            epoch1 = (it - 1) // epoch_length + 1  # the 1-based epoch of this iteration
            stop = preemption is not None and preemption.should_stop(it)
            if val is not None and _validation_due(it, epoch_length, max_iters, by_epoch, val):
                watchdog.at(it, 'validating')
                values = validate(model, val_loader, val_weights, device, autocast=val['autocast'])
                val_history.append((it, values))
                for s in scheduler_list:
                    if getattr(s, 'need_val_args', False):
                        s.step(values)
                # logged after this iteration's train row, as mmengine does
                n = len(val_weights)
                where = f'Epoch(val) [{epoch1}][{n}/{n}]' if by_epoch else f'Iter(val) [{n}/{n}]'
                val_lines = [
                    f'{where} iter {it}/{max_iters}'
                    + ''.join(f' val/{k} {v:.4f}' for k, v in values.items())
                ]
                if best is not None and best.improved(values):
                    watchdog.at(it, 'saving the best checkpoint')
                    previous, best.score = best.filename, values[best.metric]
                    best.filename = best.name_for(it, epoch_length)
                    meta = {'iter': it, 'epoch': it // epoch_length, **best.meta()}
                    t_save = time.perf_counter()
                    strategy.save_checkpoint(best.filename, extra_ckpt={'meta': meta})
                    metrics.add_stall(time.perf_counter() - t_save)
                    val_lines.append(f'best {best.metric} {best.score:.4f}: {best.filename}')
                    if previous and previous != best.filename:
                        strategy.wait_for_checkpoints()  # the new best committed first
                        if main:
                            ckpt.delete_checkpoint(
                                osp.join(strategy.work_dir, previous), protect=protected()
                            )
            if (interval and it % interval == 0) or it == max_iters or stop:
                watchdog.at(it, 'saving a checkpoint')
                meta = {'iter': it, 'epoch': it // epoch_length}
                if best is not None:
                    meta.update(best.meta())
                t_save = time.perf_counter()
                path = strategy.save_checkpoint(f'iter_{it}.pth', extra_ckpt={'meta': meta})
                metrics.add_stall(time.perf_counter() - t_save)
                saved_at = it
                if main and max_keep:
                    ckpt.apply_retention(
                        strategy.work_dir, int(max_keep), protect=protected(), pattern='iter_*'
                    )
                log.debug('saved %s', path)
            if it % log_interval == 0 or it == max_iters or stop:
                # means over the iterations since the last log: the one host sync
                sums = torch.stack([loss_sum.float(), *(v.float() for v in extra_sums.values())])
                value, *extra_values = sums.tolist()
                value /= it - last_logged
                extras = {
                    name: v / extra_counts[name]
                    for name, v in zip(extra_sums, extra_values)
                    if extra_counts.get(name)
                }
                loss_sum.zero_()
                for total in extra_sums.values():
                    total.zero_()
                extra_counts.clear()
                losses.append((it, value))
                lr0 = next(iter(optim_wrapper.get_lr().values()))[0]
                now = time.perf_counter()
                row = metrics.write(
                    it,
                    epoch1,
                    value,
                    lr0,
                    getattr(first_wrapper, 'last_grad_norm', None),
                    it - last_logged,
                    now - t_logged,
                    device,
                    extras,
                )
                last_logged, t_logged = it, now
                if bar is not None:
                    bar.set_postfix(
                        loss=f'{value:.4f}',
                        lr=f'{lr0:.3g}',
                        epoch=epoch1,
                        samples_s=f'{row["samples_per_s"]:.0f}',
                    )
                log.info(_position(it, epoch_length, max_iters, by_epoch) + ' ' + format_row(row))
            if val_lines:
                metrics.write_val(it, epoch1, val_history[-1][1])
                for line in val_lines:
                    log.info(line)
                val_lines = []
            if bar is not None:
                bar.update(1)
            if stop and it < max_iters:
                assert preemption is not None and saved_at == it
                preempted = preemption.received
                log.warning(f'preemption ({preempted}): stopping after iteration {it}/{max_iters}')
                break
        watchdog.at(it, 'waiting for the last checkpoint')
        strategy.wait_for_checkpoints()  # async saves: the last one committed, or its error
    if preempted is not None:
        assert preemption is not None
        preemption.finish(strategy.work_dir, osp.join(strategy.work_dir, f'iter_{it}.pth'),
                          strategy.rank)  # fmt: skip
        log.warning(
            f'preempted by {preempted}: checkpoint iter_{it}.pth committed; exit status '
            f'{preemption.exit_code}'
        )
    if main and max_keep and strategy.async_checkpoint:  # the retention the last save missed
        ckpt.apply_retention(
            strategy.work_dir, int(max_keep), protect=protected(), pattern='iter_*'
        )
    return {
        'strategy': strategy,
        'losses': losses,
        'val': val_history,
        'best': None if best is None or best.filename is None else best.meta()['best'],
        'iter': it,
        'preempted': preempted,
    }


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


def _read_default_hooks(hooks_cfg: Any, train_cfg: dict) -> dict:
    """What the loop takes from mmengine's ``default_hooks`` (``schema.CHECKPOINT_HOOK_KEYS``,
    ``LOGGER_HOOK_KEYS``): ``log_interval`` and ``max_keep_ckpts`` go into ``train_cfg`` (an
    error if both places give different values); returns the checkpoint interval (in the
    hook's unit, converted once the epoch length is known) and the save_best settings.
    The other hooks are mmengine's (``schema.runner_reasons`` routes a config with them to
    its runner, and the loop refuses it before this); a key of these two entries the loop
    cannot honour is a warning naming it."""
    out: dict[str, Any] = {'interval': None, 'save_best': None, 'rule': None}
    hooks = dict(hooks_cfg or {})
    run_by_epoch = bool(train_cfg.get('by_epoch', 'max_iters' not in train_cfg))
    ignored = []

    logger = hooks.get('logger')
    if isinstance(logger, Mapping):
        logger = dict(logger)
        _check_hook_type(logger, 'LoggerHook', 'logger')
        ignored += [f'default_hooks.logger.{k}' for k in logger if k not in LOGGER_HOOK_KEYS]
        if 'interval' in logger:
            _agree(train_cfg, 'log_interval', logger['interval'], 'default_hooks.logger.interval')

    ckpt_hook = hooks.get('checkpoint')
    if isinstance(ckpt_hook, Mapping):
        ckpt_hook = dict(ckpt_hook)
        _check_hook_type(ckpt_hook, 'CheckpointHook', 'checkpoint')
        ignored += [
            f'default_hooks.checkpoint.{k}'
            for k in ckpt_hook
            if k not in CHECKPOINT_HOOK_KEYS or (k == 'save_last' and not ckpt_hook[k])
        ]
        if 'max_keep_ckpts' in ckpt_hook:
            keep = ckpt_hook['max_keep_ckpts']
            if type(keep) is not int:
                raise TypeError(
                    f'default_hooks.checkpoint.max_keep_ckpts must be an int (-1 keeps all), '
                    f'got {keep!r}'
                )
            _agree(train_cfg, 'max_keep_ckpts', keep, 'default_hooks.checkpoint.max_keep_ckpts')
        if 'interval' in ckpt_hook:
            n = ckpt_hook['interval']
            if type(n) is not int:
                raise TypeError(f'default_hooks.checkpoint.interval must be an int, got {n!r}')
            out['interval'] = (n, bool(ckpt_hook.get('by_epoch', run_by_epoch)))
        out['by_epoch'] = bool(ckpt_hook.get('by_epoch', run_by_epoch))
        best, rule = ckpt_hook.get('save_best'), ckpt_hook.get('rule')
        if best is not None and not isinstance(best, str):
            raise TypeError(
                "default_hooks.checkpoint.save_best must be one validation value's name "
                f"(e.g. 'acc') or 'auto', got {best!r}"
            )
        if rule is not None and rule not in ('greater', 'less'):
            raise ValueError(
                f"default_hooks.checkpoint.rule must be 'greater' or 'less', got {rule!r}"
            )
        out['greater_keys'] = tuple(ckpt_hook.get('greater_keys') or _GREATER_KEYS)
        out['less_keys'] = tuple(ckpt_hook.get('less_keys') or _LESS_KEYS)
        if best is not None and best != 'auto' and rule is None:
            rule = infer_rule(best, out['greater_keys'], out['less_keys'])
        out['save_best'], out['rule'] = best, rule
    if ignored:
        import warnings

        warnings.warn(
            f"stratagem train's reference loop does not honour {', '.join(ignored)}: it "
            'reads default_hooks.checkpoint (interval, by_epoch, max_keep_ckpts, save_best, '
            'rule, greater_keys, less_keys) and default_hooks.logger.interval; hooks run under '
            "mmengine's runner (runner_type='FlexibleRunner', the mmengine extra)",
            UserWarning,
            stacklevel=3,
        )
    return out


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


def _read_validation(cfg: Any, train_cfg: dict, hooks: dict) -> dict | None:
    """``val_dataloader`` / ``val_cfg`` / ``train_cfg.val_interval``, ``val_begin`` checked
    (``schema.VAL_DATALOADER_KEYS``); None when the config has no validation."""
    val_cfg = cfg.get('val_cfg')
    if val_cfg is not None:
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
    loader = cfg.get('val_dataloader')
    if loader is None:
        if val_cfg:
            raise ValueError('val_cfg is given but no val_dataloader: add val_dataloader')
        if hooks.get('save_best') is not None:
            raise ValueError(
                f'default_hooks.checkpoint.save_best={hooks["save_best"]!r} keeps the best '
                'checkpoint by a validation value, but the config has no val_dataloader; '
                'add one or remove save_best'
            )
        unused = [f'train_cfg.{k}' for k in ('val_interval', 'val_begin') if k in train_cfg]
        if unused:
            import warnings

            warnings.warn(
                f'{" and ".join(unused)} change nothing: the config has no val_dataloader, '
                'so nothing is validated',
                UserWarning,
                stacklevel=3,
            )
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
    for key in ('val_interval', 'val_begin'):
        value = train_cfg.get(key, 1)
        if type(value) is not int or value < (1 if key == 'val_interval' else 0):
            raise ValueError(
                f'train_cfg.{key} must be an int >= {1 if key == "val_interval" else 0}, '
                f'got {value!r}'
            )
        when[key] = value
    return {
        'dataset': loader.pop('dataset'),
        'batch_size': int(loader.pop('batch_size', 1)),
        'shuffle': bool(shuffle),
        'seed': seed,
        'autocast': bool((val_cfg or {}).get('fp16', False)),
        'loader_kwargs': loader,
        'interval': when['val_interval'],
        'begin': when['val_begin'],
    }


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


def _scalars(output: Any) -> dict[str, Any]:
    """The scalars of a model's output: a dict's one-element tensors and numbers, in its
    order; a bare one-element tensor is ``loss``."""
    if isinstance(output, torch.Tensor):
        return {'loss': output} if output.numel() == 1 else {}
    if not isinstance(output, Mapping):
        return {}
    return {
        str(k): v
        for k, v in output.items()
        if (isinstance(v, torch.Tensor) and v.numel() == 1)
        or (isinstance(v, (int, float)) and not isinstance(v, bool))
    }


def validate(
    model: torch.nn.Module,
    loader: Any,
    weights: list[int],
    device: torch.device,
    autocast: bool = False,
) -> dict[str, float]:
    """Means of every scalar the model returns over the whole validation set, on every rank.

    ``loader`` yields this rank's batches and ``weights`` their sample counts
    (``data.validation_batches``: 0 for a filler batch). Each scalar is taken as its batch's
    mean: the sums of mean × count are added over the ranks (one ``all_reduce``) and divided
    by the total count, so every sample weighs the same, whatever the shard and batch sizes.
    The model runs in eval mode under ``torch.no_grad`` and is put back in train mode;
    ``autocast`` (``val_cfg.fp16``): under ``torch.autocast``, float16 on CUDA, else bfloat16.
    """
    from stratagem import env

    dtype = torch.float32 if device.type == 'mps' else torch.float64
    sums: dict[str, torch.Tensor] = {}
    model.eval()
    try:
        half = torch.float16 if device.type == 'cuda' else torch.bfloat16
        with torch.no_grad(), torch.autocast(device.type, dtype=half, enabled=autocast):
            for batch, weight in zip(loader, weights):
                values = _scalars(call_model(model, batch, device))
                if not values:
                    raise ValueError(
                        'the model returned no scalar in validation (a loss tensor or a dict '
                        'of scalars such as loss and acc is averaged and logged)'
                    )
                for name, value in values.items():
                    total = sums.setdefault(name, torch.zeros((), dtype=dtype, device=device))
                    total.add_(torch.as_tensor(value, device=device).to(dtype), alpha=weight)
    finally:
        model.train()
    count = torch.tensor(float(sum(weights)), dtype=dtype, device=device)
    reduced = env.all_reduce(torch.stack([*sums.values(), count]))
    means = (reduced[:-1] / reduced[-1]).tolist()
    return dict(zip(sums, means))


class _BestCheckpoint:
    """``default_hooks.checkpoint.save_best``: the best validation value so far, its rule and
    its file (restored on resume from the checkpoint's ``meta['best']``)."""

    def __init__(self, hooks: dict) -> None:
        self.metric: str = hooks['save_best']
        self.rule: str | None = hooks['rule']
        self.keys = (hooks['greater_keys'], hooks['less_keys'])
        self.by_epoch: bool = hooks['by_epoch']
        self.score: float | None = None
        self.filename: str | None = None

    def restore(self, meta: Mapping) -> None:
        saved = meta.get('best')
        if isinstance(saved, Mapping) and self.metric in ('auto', saved.get('metric')):
            self.metric, self.rule = saved['metric'], saved['rule']
            self.score, self.filename = saved['score'], saved['checkpoint']

    def improved(self, values: Mapping[str, float]) -> bool:
        if self.metric == 'auto':
            self.metric = next(iter(values))
        if self.metric not in values:
            raise ValueError(
                f'default_hooks.checkpoint.save_best={self.metric!r} is not a validation '
                f"value: the model's validation output has {list(values)}"
            )
        if self.rule is None:
            self.rule = infer_rule(self.metric, *self.keys)
        value = values[self.metric]
        if math.isnan(value):
            return False
        if self.score is None:
            return True
        return value > self.score if self.rule == 'greater' else value < self.score

    def name_for(self, it: int, epoch_length: int) -> str:
        """mmengine's ``best_{metric}_{epoch|iter}_{N}.pth``."""
        metric = self.metric.replace('/', '_')
        if self.by_epoch and it % epoch_length == 0:
            return f'best_{metric}_epoch_{it // epoch_length}.pth'
        return f'best_{metric}_iter_{it}.pth'

    def meta(self) -> dict:
        if self.score is None:
            return {}
        return {
            'best': {
                'metric': self.metric,
                'rule': self.rule,
                'score': self.score,
                'checkpoint': self.filename,
            }
        }


def _position(it: int, epoch_length: int, max_iters: int, by_epoch: bool) -> str:
    """mmengine's ``Epoch(train) [2][4/6]`` (1-based epoch) or ``Iter(train) [10/24]``, with
    the run's iteration (or epoch) after it."""
    epoch = (it - 1) // epoch_length + 1
    if by_epoch:
        at = it - (epoch - 1) * epoch_length
        return f'Epoch(train) [{epoch}][{at}/{epoch_length}] iter {it}/{max_iters}'
    return f'Iter(train) [{it}/{max_iters}] epoch {epoch}'


def _accumulate(sums: dict[str, torch.Tensor], name: str, value: Any, device: Any) -> None:
    """``sums[name] += value`` in place (no host sync for a tensor)."""
    total = sums.get(name)
    if total is None:
        total = sums[name] = torch.zeros((), device=device)
    total.add_(value.detach() if isinstance(value, torch.Tensor) else float(value))


def _validation_due(it: int, epoch_length: int, max_iters: int, by_epoch: bool, val: dict) -> bool:
    """After iteration ``it``: every ``val_interval`` epochs (``by_epoch``) or iterations
    from ``val_begin`` on, and at the end, as mmengine's train loops."""
    if it == max_iters:
        return True
    if by_epoch:
        if it % epoch_length:
            return False
        it //= epoch_length
    return it >= val['begin'] and it % val['interval'] == 0


def _checkpoint_interval(train_cfg: Mapping, hooks: Mapping, epoch_length: int) -> int:
    """Iterations between saves: ``train_cfg.checkpoint_interval`` or
    ``default_hooks.checkpoint.interval`` (in epochs when its ``by_epoch``; <= 0: never but
    at the end); an error when both are given and differ."""
    interval = int(train_cfg.get('checkpoint_interval', 0) or 0)
    if hooks.get('interval') is None:
        return interval
    n, by_epoch = hooks['interval']
    iters = max(n, 0) * (epoch_length if by_epoch else 1)
    if 'checkpoint_interval' in train_cfg and iters != interval:
        raise ValueError(
            f'default_hooks.checkpoint.interval={n} ({"epochs" if by_epoch else "iterations"}'
            f', {iters} iterations) and train_cfg.checkpoint_interval={interval} (iterations) '
            'disagree: they are the same setting; keep one of them'
        )
    return iters


def _dist_timeout(strategy_cfg: Mapping) -> float:
    """The process group's timeout in seconds: ``env_kwargs.dist_cfg.timeout``, else torch's
    default (30 min)."""
    timeout = dict(dict(strategy_cfg.get('env_kwargs') or {}).get('dist_cfg') or {}).get('timeout')
    if timeout is None:
        return 1800.0
    return timeout.total_seconds() if hasattr(timeout, 'total_seconds') else float(timeout)


def _check_top_level_keys(cfg: Config | Mapping) -> None:
    """Refuse a config whose top level holds a key the reference loop does not read: one that
    only mmengine's runner reads (``stratagem.schema.runner_reasons``: run it under
    ``FlexibleRunner``, which ``stratagem train`` does by itself), or one nothing reads
    (named, with the closest valid key). Raises ConfigError."""
    from stratagem.schema import LOOP_TOP_KEYS, runner_reasons, unread_top_level_keys

    reasons = runner_reasons(cfg)
    if reasons:
        raise ConfigError(
            f'config {getattr(cfg, "filename", None) or ""}: {", ".join(reasons)} '
            "are read only by mmengine's runner, not by stratagem's reference loop: run "
            "`stratagem train CONFIG` (it runs such a config under mmengine's FlexibleRunner "
            "on stratagem's strategies), or in Python `import stratagem.integrations.mmengine` "
            'and `FlexibleRunner.from_cfg(cfg).train()`'
        )
    unread = unread_top_level_keys(cfg, LOOP_TOP_KEYS)
    if unread:
        raise ConfigError(
            f'config {getattr(cfg, "filename", None) or ""}: unknown top-level key(s) '
            + '; '.join(f'{k!r} ({hint})' for k, hint in unread.items())
            + f'. Nothing reads them. valid: {", ".join(sorted(LOOP_TOP_KEYS))}'
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
        import warnings

        warnings.warn(
            f'auto_scale_lr is given twice: at the top level ({dict(top)}) and in strategy '
            f"({dict(own)}); the strategy's is used. Keep one of them",
            UserWarning,
            stacklevel=3,
        )


def _flatten(schedulers: Any) -> list:
    if isinstance(schedulers, Mapping):
        return [s for v in schedulers.values() for s in v]
    return list(schedulers or [])
