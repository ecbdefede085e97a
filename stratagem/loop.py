"""The reference loop behind ``stratagem train``: small on purpose, not a framework.

It imports the config's ``custom_imports`` (``stratagem.config.imports``), reads ``model``,
``strategy``, ``optim_wrapper``, ``param_scheduler``, ``train_dataloader``, ``train_cfg``
and ``randomness`` from a config, lets the
strategy prepare everything, and runs iterations: forward under
``optim_context``, ``update_params``, schedulers (iteration-based ones every
iteration, epoch-based ones at epoch ends, as mmengine's ParamSchedulerHook
does), a progress bar on rank 0, and checkpoints every ``checkpoint_interval``
iterations and at the end. A resumed run continues from the same sample and the
same RNG state, so it ends where an uninterrupted run would.

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
from stratagem.schema import TRAIN_CFG_KEYS, TRAIN_DATALOADER_KEYS


def check_train_config(cfg: Config | Mapping, top_level: bool = True) -> tuple[dict, dict]:
    """The reference loop's checks of a config's keys, before anything is built (also
    ``stratagem doctor``'s and ``stratagem train --nproc``'s, before torchrun starts): the
    sections it needs, the top-level keys, the keys of ``train_cfg`` and ``train_dataloader``,
    and a run length.
    Returns copies of ``train_cfg`` and ``train_dataloader``; raises ``ConfigError`` /
    ``ValueError`` naming the key. ``top_level=False`` leaves the top-level keys to the
    caller (``doctor`` reports each one as a finding of its own)."""
    lacking = [k for k in ('model', 'optim_wrapper', 'train_dataloader') if k not in cfg]
    if lacking:
        filename = getattr(cfg, 'filename', None) or ''
        raise ConfigError(
            f'config {filename} has no {", ".join(lacking)}; '
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
    loader_cfg = dict(cfg['train_dataloader'])
    check_keys(loader_cfg, TRAIN_DATALOADER_KEYS, 'train_dataloader')
    if 'max_iters' not in train_cfg and 'max_epochs' not in train_cfg:
        raise ValueError(
            'train_cfg needs max_epochs or max_iters, e.g. train_cfg=dict(max_epochs=4)'
        )
    return train_cfg, loader_cfg


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


def _parse_loss(output: Any) -> torch.Tensor:
    """A tensor loss, or the sum of the ``loss*`` entries of a dict (mmengine's convention)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        losses = [
            v if isinstance(v, torch.Tensor) else sum(v) for k, v in output.items() if 'loss' in k
        ]
        if not losses:
            raise ValueError(
                f'the model returned a dict without a loss entry: keys '
                f'{sorted(output)}; return a tensor or a dict with a "loss" key'
            )
        return sum(losses)  # type: ignore[return-value, arg-type]
    raise TypeError(
        f'the model should return a loss tensor or a dict of losses in training, '
        f'got {type(output).__name__}'
    )


def _forward(model: torch.nn.Module, batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Mapping):
        return model(
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        )
    if isinstance(batch, (list, tuple)):
        return model(*[b.to(device) if isinstance(b, torch.Tensor) else b for b in batch])
    return model(batch.to(device))


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
    """Train from ``cfg``; returns ``{'strategy', 'losses' (per logged iteration), 'iter',
    'preempted'}`` (``preempted``: the signal that stopped the run early, else None)."""
    cfg = cfg if isinstance(cfg, Config) else Config(cfg)
    # a config given as a dict has not been through Config.fromfile: its own modules now
    import_custom_modules(cfg.get('custom_imports'), config_search_dirs(cfg))
    # mmengine's top-level load_from / resume, unless the caller (--load-from, --resume) says
    resume = resume or cfg.get('resume') or False
    load_from = load_from if load_from is not None else cfg.get('load_from')
    train_cfg, loader_cfg = check_train_config(cfg)
    # handlers from the start: a signal while the strategy is built is not lost (the loop
    # stops after its first iteration); restored however train() ends
    preempt_cfg = preemption_config(train_cfg.get('preemption', True))
    if preempt_cfg is None:
        return _train(cfg, train_cfg, loader_cfg, None, resume, load_from, progress)
    with Preemption.from_config(preempt_cfg) as preemption:
        return _train(cfg, train_cfg, loader_cfg, preemption, resume, load_from, progress)


def _train(
    cfg: Config,
    train_cfg: dict,
    loader_cfg: dict,
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
    sampler = ResumableSampler(
        len(dataset),  # type: ignore[arg-type]
        strategy.data_parallel_rank,  # the ranks of one tensor group read the same batch
        strategy.data_parallel_size,
        shuffle=loader_cfg.pop('shuffle', True),
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
        max_iters = int(strategy.dispatch_kwargs.get('max_iters') or max_iters)
    # the shuffle seed is the run's configured seed (the same on every rank, also under
    # diff_rank_seed), read after a resume has restored it
    data_seed = strategy.randomness['seed']
    sampler.seed = data_seed
    interval = int(train_cfg.get('checkpoint_interval', 0) or 0)
    max_keep = train_cfg.get('max_keep_ckpts')
    log_interval = max(1, int(train_cfg.get('log_interval', 10)))
    device = _model_device(model)
    main = strategy.rank == 0
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
    model.train()
    it = start_iter
    t0 = time.perf_counter()
    data_iter = None
    loss_sum = torch.zeros((), device=device)
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
            with optim_wrapper.optim_context(model):
                loss = _parse_loss(_forward(model, batch, device))
            optim_wrapper.update_params(loss)
            loss_sum.add_(loss.detach())  # in place, no host sync: read only when logging
            for s in scheduler_list:
                if not s.by_epoch:
                    s.step()
            it += 1
            if it % epoch_length == 0:
                for s in scheduler_list:
                    if s.by_epoch:
                        s.step()
            stop = preemption is not None and preemption.should_stop(it)
            if (interval and it % interval == 0) or it == max_iters or stop:
                watchdog.at(it, 'saving a checkpoint')
                meta = {'iter': it, 'epoch': it // epoch_length}
                t_save = time.perf_counter()
                path = strategy.save_checkpoint(f'iter_{it}.pth', extra_ckpt={'meta': meta})
                metrics.add_stall(time.perf_counter() - t_save)
                saved_at = it
                if main and max_keep:
                    protect = [strategy.resumed_from] if strategy.resumed_from else []
                    ckpt.apply_retention(strategy.work_dir, int(max_keep), protect=protect)
                log.debug('saved %s', path)
            if it % log_interval == 0 or it == max_iters or stop:
                # mean over the iterations since the last log: the one host sync
                value = float(loss_sum) / (it - last_logged)
                loss_sum.zero_()
                losses.append((it, value))
                lr0 = next(iter(optim_wrapper.get_lr().values()))[0]
                now = time.perf_counter()
                row = metrics.write(
                    it,
                    epoch,
                    value,
                    lr0,
                    getattr(first_wrapper, 'last_grad_norm', None),
                    it - last_logged,
                    now - t_logged,
                    device,
                )
                last_logged, t_logged = it, now
                if bar is not None:
                    bar.set_postfix(
                        loss=f'{value:.4f}',
                        lr=f'{lr0:.3g}',
                        epoch=epoch,
                        samples_s=f'{row["samples_per_s"]:.0f}',
                    )
                log.info(f'iter {it}/{max_iters} epoch {epoch} ' + format_row(row))
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
        protect = [strategy.resumed_from] if strategy.resumed_from else []
        ckpt.apply_retention(strategy.work_dir, int(max_keep), protect=protect)
    return {'strategy': strategy, 'losses': losses, 'iter': it, 'preempted': preempted}


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
