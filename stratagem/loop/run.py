"""``train``: the run plan read once, the collaborators built from it, then the loop, which
calls them in one fixed order after each iteration (see the package's docstring)."""

from __future__ import annotations

import contextlib
import os.path as osp
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stratagem.checkpoint.location import is_url, join
from stratagem.checkpoint.peer import PeerCopies, peer_root
from stratagem.checkpoint.store_debris import probe_writable
from stratagem.config import Config, config_search_dirs, import_custom_modules
from stratagem.env.logging import run_end_logged
from stratagem.env.preemption import Preemption, PreemptionConfig, clear_marker
from stratagem.env.watchdog import Watchdog

from .anomaly import Anomalies
from .batches import Batches
from .checkpoints import Checkpoints
from .meter import Meter
from .plan import RunPlan, check_train_config, dist_timeout, strategy_config
from .replicas import Replicas
from .schedulers import Schedulers
from .step import Step, build_step
from .stragglers import Stragglers
from .validation import BestCheckpoint, Validation

__all__ = ['train']


def train(
    cfg: Config | Mapping,
    *,
    resume: bool | str = False,
    load_from: str | None = None,
    progress: bool = True,
    on_checkpoint: Callable[[str, int], None] | None = None,
    preemption: Callable[[PreemptionConfig], Preemption] | None = None,
) -> dict[str, Any]:
    """Train from ``cfg``; returns ``{'strategy', 'losses' (per logged iteration), 'val'
    (``(iter, {name: mean})`` per validation), 'best' (``save_best``'s metric, rule, score
    and checkpoint file name, else None), 'iter', 'preempted', 'stragglers'}``
    (``preempted``: the signal that stopped the run early, else None; ``stragglers``: on rank
    0, ``{iter, rank, ratio, host, data, forward, backward}`` each interval a rank was named,
    ``loop/stragglers.py``).

    For a host that runs the loop (``stratagem.integrations.ray``): ``on_checkpoint(path,
    iteration)`` is called on every rank once each checkpoint the loop saves is committed
    (an asynchronous save: when the next save or the end has waited for it), never before;
    ``preemption`` builds the run's :class:`Preemption` from ``train_cfg.preemption`` (default
    ``Preemption.from_config``: signal handlers, main thread only)."""
    cfg = cfg if isinstance(cfg, Config) else Config(cfg)
    # a config given as a dict has not been through Config.fromfile: its own modules now
    import_custom_modules(cfg.get('custom_imports'), config_search_dirs(cfg))
    plan = check_train_config(cfg)
    # mmengine's top-level load_from / resume, unless the caller (--load-from, --resume) says
    resume = resume or plan.resume
    load_from = load_from if load_from is not None else plan.load_from
    # handlers from the start: a signal while the strategy is built is not lost (the loop
    # stops after its first iteration); restored however train() ends
    build_stops = preemption or Preemption.from_config
    stops = build_stops(plan.preemption) if plan.preemption is not None else None
    # the run's log file (the strategy opens it) ends with a line saying why the run ended
    with stops if stops is not None else contextlib.nullcontext(), run_end_logged() as ended:
        parts = _build(strategy_config(cfg), plan, resume, load_from, progress)
        parts.checkpoints.on_commit = on_checkpoint
        result = _loop(parts, stops)
        ended.append(_end_line(result, parts.max_iters))
        return result


def _end_line(result: dict[str, Any], max_iters: int) -> str:
    """The end of a run that returned: finished, or stopped by a preemption signal."""
    it = result['iter']
    if result['preempted'] is not None:
        return (
            f'run ended: preempted by {result["preempted"]} after iteration {it}/{max_iters} '
            f'(iter_{it}.pth committed; a resume continues from it)'
        )
    return f'run ended: finished, iteration {it}/{max_iters}'


@dataclass
class _Parts:
    """The run's collaborators, built once (:func:`_build`)."""

    strategy: Any
    model: torch.nn.Module
    optim_wrapper: Any
    start_iter: int
    max_iters: int
    batches: Batches
    step: Step
    schedulers: Schedulers
    validation: Validation | None
    best: BestCheckpoint | None
    checkpoints: Checkpoints
    meter: Meter
    stragglers: Stragglers
    timeout: float
    anomalies: Anomalies | None = None
    rolled_to: int | None = None  # where the last rollback went back to
    replicas: Replicas | None = None  # strategy.fault_tolerance's loop side

    @property
    def skipped(self) -> set[int]:
        return self.anomalies.skipped if self.anomalies is not None else set()


def _loop(p: _Parts, preemption: Preemption | None) -> dict[str, Any]:
    """The iterations from ``p.start_iter`` to ``p.max_iters``, each followed by the
    collaborators in a fixed order: schedulers, (the agreed preemption stop), validation and
    the best checkpoint, the periodic checkpoint, the meter's row, the stragglers' comparison
    (of the step timed at a log interval), the validation's lines.
    A preemption stop ends the loop after its iteration's checkpoint."""
    signalled = _arm_preemption(preemption, p) if preemption is not None else None
    it, preempted = p.start_iter, None
    p.model.train()
    # the meter's bar and writers close, and the log redirection ends, however the loop ends
    with p.meter, Watchdog(p.timeout, signalled=signalled) as watchdog:
        if p.anomalies is not None:
            p.anomalies.before_first(it, p.checkpoints)
        while it < p.max_iters:
            watchdog.at(it + 1, 'loading data' if it not in p.skipped else 'skipping a batch')
            if p.replicas is not None:
                p.replicas.next_iter = it
            updated = _iteration(p, it, watchdog)
            it += 1
            if p.replicas is not None:  # a heal during the iteration: the peer's position
                it = p.replicas.iteration(it)
            if updated is None:  # a rollback: from the checkpoint's iteration on
                it = _rolled_back(p, it)
                continue
            p.schedulers.after_step(it, updated)
            stop = preemption is not None and preemption.should_stop(it)
            if p.validation is not None and p.validation.due(it):
                watchdog.at(it, 'validating')
                values = p.validation.run(p.model, it)
                p.schedulers.after_validation(values)
                if p.best is not None and p.best.due(values):
                    watchdog.at(it, 'saving the best checkpoint')
                    p.validation.lines.append(p.best.save(it, values, p.checkpoints))
            # replica groups: the lowest live group saves; a group told to stop saves too
            if p.checkpoints.due(it, stop) and (
                p.replicas is None or stop or p.replicas.writes_checkpoints()
            ):
                watchdog.at(it, 'saving a checkpoint')
                p.checkpoints.after_step(it)
            if p.checkpoints.peer_due(it) and not stop:
                watchdog.at(it, 'copying the state to a peer')
                p.checkpoints.copy_to_peer(it)
            if p.meter.due(it, stop):
                p.meter.log_row(it)
            if p.stragglers.due(it):
                watchdog.at(it, "comparing the ranks' step times")
                p.stragglers.compare(it)
            p.meter.after_iteration(it, p.validation)
            if stop and it < p.max_iters:
                assert preemption is not None and p.checkpoints.saved_at == it
                preempted = preemption.received
                p.strategy.logger.warning(
                    f'preemption ({preempted}): stopping after iteration {it}/{p.max_iters}'
                )
                break
        watchdog.at(it, 'waiting for the last checkpoint')
        p.strategy.wait_for_checkpoints()  # async saves: the last one committed, or its error
        p.checkpoints.close_peer()  # the peer copy in flight: committed, or its error
    if preempted is not None:
        assert preemption is not None
        _finish_preempted(preemption, preempted, p.strategy, it, p.checkpoints.directory)
    p.checkpoints.finish()
    if p.replicas is not None:
        p.replicas.finish(it)
    return {
        'strategy': p.strategy,
        'losses': p.meter.losses,
        'val': p.validation.history if p.validation is not None else [],
        'best': None if p.best is None or p.best.filename is None else p.best.meta()['best'],
        'iter': it,
        'preempted': preempted,
        'stragglers': p.stragglers.named,
    }


def _iteration(p: _Parts, it: int, watchdog: Watchdog) -> bool | None:
    """Iteration ``it`` (0-based): its batch, the step; whether its update went ahead
    (None: ``train_cfg.anomaly`` rolled back; the action runs here)."""
    if p.anomalies is not None and p.anomalies.skips(it):
        p.anomalies.pass_over(it, p.batches)
        p.meter.dropped += 1
        return False
    p.stragglers.start(it + 1)  # the step ending a log interval: this rank's phases
    batch = p.batches.at(it)
    p.stragglers.got_batch()
    if p.meter.counting:
        p.meter.saw_batch(batch)
    watchdog.at(it + 1, 'forward, backward, update')
    loss, extras = p.step(batch)
    event = p.anomalies.found() if p.anomalies is not None else None
    if event is None:
        p.meter.after_step(loss, extras)
        return True
    assert p.anomalies is not None
    p.rolled_to = p.anomalies.act(event, it + 1, p.meter, p.checkpoints)
    return None if p.rolled_to is not None else False


def _rolled_back(p: _Parts, it: int) -> int:
    """After a rollback: the data, the meter and the bar from the checkpoint's iteration."""
    back, p.rolled_to = p.rolled_to, None
    assert back is not None
    p.checkpoints.forget_peer_copies()
    p.batches.restart()
    p.meter.rewind(back)
    p.stragglers.cancel()
    return back


def _build(
    strategy_cfg: dict, plan: RunPlan, resume: bool | str, load_from: str | None, progress: bool
) -> _Parts:
    """The strategy, the data, the prepared model, optim wrapper and schedulers, the resumed
    position, and the collaborators over them; with validation, one forward on its first batch
    (the names it logs, ``save_best`` and a metric-driven scheduler's ``monitor`` checked
    against them): every refusal before the first step."""
    from stratagem.strategies import build_strategy

    strategy = build_strategy(strategy_cfg)
    directory = plan.checkpoints.directory(strategy.work_dir)
    strategy.checkpointer.check_location(directory)  # before anything is built or trained
    batches = Batches(plan.data, strategy)
    epoch_length = batches.epoch_length
    max_iters, max_epochs = plan.run_length(epoch_length)
    every = plan.checkpoints.every(epoch_length)
    prepared = strategy.prepare(
        plan.model,
        optim_wrapper=plan.optim_wrapper,
        param_scheduler=plan.param_scheduler,
        compile=plan.compile,
        dispatch_kwargs=dict(
            max_iters=max_iters,
            max_epochs=max_epochs,
            epoch_length=epoch_length,
            train_micro_batch_size_per_gpu=batches.batch_size,
        ),
    )
    model, optim_wrapper = prepared[0], prepared[1]
    if plan.checkpoints.out_dir is not None:  # mmengine's out_dir: a pointer in both places
        strategy.checkpointer.backend_args = plan.checkpoints.backend_args
        strategy.checkpointer.also_point = strategy.work_dir
        if is_url(directory):  # every rank: the same answer everywhere, before any training
            probe_writable(directory, plan.checkpoints.backend_args)
    replicas, healed_at = None, None
    if strategy.replica_group is not None:
        if plan.anomaly is not None:
            raise ValueError(
                f'replica group {strategy.replica_group.replica_id}: train_cfg.anomaly and '
                'strategy.fault_tolerance both decide whether an update goes ahead (the '
                "optim wrapper's one step guard); remove train_cfg.anomaly"
            )
        replicas = Replicas(strategy, batches, optim_wrapper, _shared_seed(strategy_cfg, plan))
        healed_at = replicas.first_quorum()  # a live peer's state, before any storage
    peer = _peer_copies(strategy) if plan.checkpoints.peer_interval else None
    checkpoint = None
    if healed_at is None:
        checkpoint = strategy.load_or_resume(
            load_from=load_from,
            resume=resume,
            refit_schedulers=plan.refit_schedulers,
            checkpoint_dir=None if plan.checkpoints.out_dir is None else directory,
            peer=peer,
        )
        if replicas is not None and resume:
            replicas.resumed(checkpoint)
    meta = (checkpoint.get('meta') or {}) if checkpoint is not None and resume else None
    start_iter, max_iters = _resumed_position(meta, max_iters)
    if healed_at is not None:
        start_iter = healed_at
    strategy.logger.info(
        _start_line(strategy, plan, optim_wrapper, batches.batch_size, start_iter, max_iters)
    )
    seed = batches.seed_from(strategy)  # after a resume restored the run's seed
    device = _model_device(model)
    best = BestCheckpoint(plan.best) if plan.best is not None else None
    if best is not None and meta is not None:
        best.restore(meta)
    validation = None
    if plan.validation is not None:
        validation = Validation(
            plan.validation, strategy, seed, device, epoch_length, max_iters, plan.by_epoch
        )
    step = build_step(strategy, model)
    schedulers = Schedulers(prepared[2] if len(prepared) > 2 else [], epoch_length)
    if validation is not None:
        # a validation error found before the first step, not after the first interval
        names = validation.output_names(model)
        if best is not None:
            best.check(names)
        schedulers.check_monitors(names)
    meter = Meter(
        strategy,
        optim_wrapper,
        device,
        batch_size=batches.batch_size,
        epoch_length=epoch_length,
        max_iters=max_iters,
        start_iter=start_iter,
        log_interval=plan.log_interval,
        by_epoch=plan.by_epoch,
        metrics=plan.metrics,
        progress=progress,
        model=strategy.unwrap_model(),
        dataset=batches.loader.dataset,
        # replica groups share the work_dir and its checkpoints, not a metrics folder
        metrics_dir=strategy.log_dir if replicas is not None else _metrics_dir(strategy, meta),
        resumed=meta is not None,
    )
    checkpoints = Checkpoints(
        strategy,
        every,
        plan.checkpoints.max_keep,
        epoch_length,
        max_iters,
        best,
        meter,
        directory=directory,
    )
    if replicas is not None:
        replicas.meter = meter
    checkpoints.peer, checkpoints.peer_every = peer, plan.checkpoints.peer_interval
    anomalies = None
    if plan.anomaly is not None:
        anomalies = Anomalies(plan.anomaly, strategy, optim_wrapper)
        if meta is not None:
            anomalies.restore(meta)
        checkpoints.anomalies = anomalies
    return _Parts(
        strategy=strategy,
        model=model,
        optim_wrapper=optim_wrapper,
        start_iter=start_iter,
        max_iters=max_iters,
        batches=batches,
        step=meter.counted(step),
        schedulers=schedulers,
        validation=validation,
        best=best,
        checkpoints=checkpoints,
        meter=meter,
        stragglers=Stragglers(
            plan.straggler,
            strategy,
            meter,
            log_interval=plan.log_interval,
            start_iter=start_iter,
            epoch_length=epoch_length,
        ),
        timeout=dist_timeout(strategy_cfg),
        anomalies=anomalies,
        replicas=replicas,
    )


def _shared_seed(strategy_cfg: Mapping, plan: RunPlan) -> int | None:
    """The seed of the sample order the replica groups share: the sampler's, else the
    configured ``randomness.seed`` (a drawn one differs between groups), else None."""
    if plan.data.seed is not None:
        return int(plan.data.seed)
    randomness = dict(dict(strategy_cfg.get('env_kwargs') or {}).get('randomness') or {})
    seed = randomness.get('seed')
    return None if seed is None else int(seed)


def _peer_copies(strategy: Any) -> PeerCopies:
    """The run's peer copies (``checkpoint/peer.py``): under its work_dir's key in this node's
    ``/dev/shm``; copied through the filesystem when every rank runs on this node, else sent
    over a gloo group (the bytes are on the CPU); written in the background, so over a gloo
    group of their own (the writer's collectives must not meet the training thread's)."""
    import os
    import socket

    import torch.distributed as dist

    from stratagem import env

    group = None
    if strategy.distributed:
        group = dist.new_group(backend='gloo')  # every rank builds it, in the same order
    world = strategy.world_size
    hosts = env.all_gather_object(socket.gethostname(), group)
    return PeerCopies(
        peer_root(strategy.work_dir),
        strategy.rank,
        world,
        local_world_size=int(os.environ.get('LOCAL_WORLD_SIZE', world)),
        group=group,
        same_node=len(set(hosts)) == 1,
        background=True,
    )


def _resumed_position(meta: dict | None, max_iters: int) -> tuple[int, int]:
    """``(start_iter, max_iters)`` after a resume (``meta``: the resumed checkpoint's), in
    this run's units: a resume at another world size converted the position, and an
    iteration-counted ``max_iters`` (``meta['world_size_change']['max_iters']``: saved, here),
    so that exactly the samples left are read."""
    if meta is None:
        return 0, max_iters
    change = meta.get('world_size_change') or {}
    converted = change.get('max_iters')
    return int(meta.get('iter', 0)), int(converted[1]) if converted else max_iters


def _start_line(
    strategy: Any, plan: RunPlan, optim_wrapper: Any, batch: int, start: int, max_iters: int
) -> str:
    """The run's start: its iterations, the real batch (every data-parallel process's
    batch, accumulated: what one update sees) and the lr, with ``auto_scale_lr``'s
    scaling from the configured lr to the one trained with."""
    wrapper = next(iter(getattr(optim_wrapper, 'values', lambda: [optim_wrapper])()))
    acc = int(getattr(wrapper, 'accumulative_counts', 1))
    processes = strategy.data_parallel_size
    real = processes * batch * acc
    how = [f'{batch} per process']
    if processes > 1:
        how.insert(0, f'{processes} data-parallel processes')
    if acc > 1:
        how.append(f'{acc} accumulated')
    resumed = f' (resumed after {start})' if start else ''
    text = (
        f'training: iterations {start + 1}-{max_iters}{resumed}; real batch {real}'
        f'{" (" + " x ".join(how) + ")" if len(how) > 1 else ""}'
    )
    groups = getattr(wrapper, 'param_groups', None) or [{}]
    lr = groups[0].get('initial_lr', groups[0].get('lr'))
    scaling = strategy.auto_scale_lr or {}
    if scaling.get('enable') and scaling.get('base_batch_size') and lr is not None:
        configured = dict(dict(plan.optim_wrapper or {}).get('optimizer') or {}).get('lr')
        ratio = real / scaling['base_batch_size']
        before = configured if isinstance(configured, (int, float)) else lr / ratio
        # the lr trained with (a resume at another world size keeps the saving run's scaling)
        return (
            f'{text}; lr {before:.6g} -> {lr:.6g} (auto_scale_lr: real batch '
            f'{real} / base_batch_size {scaling["base_batch_size"]})'
        )
    return f'{text}; lr {lr:.6g}' if lr is not None else text


def _metrics_dir(strategy: Any, meta: dict | None) -> str:
    """Where the run's metrics go: for a resume, the folder of the run it resumes (its
    checkpoint's ``meta['metrics_dir']``, a name under work_dir; made again if it was
    removed), so that one CSV and one TensorBoard run cover the whole training; else (a
    checkpoint of another work_dir, or a resume at another world size that renumbered the
    iterations) this run's log_dir.
    Decided from the checkpoint alone, so every rank decides alike."""
    name = (meta or {}).get('metrics_dir')
    saved_iter, new_iter = ((meta or {}).get('world_size_change') or {}).get('iter') or (0, None)
    if new_iter is not None and new_iter != saved_iter:
        return strategy.log_dir  # another world size counts other iterations: a new folder
    resumed_from = getattr(strategy, 'resumed_from', None)
    elsewhere = resumed_from is not None and not _same_dir(resumed_from, strategy.work_dir)
    if elsewhere:  # another run's checkpoint (--resume PATH): this run's own folder
        return strategy.log_dir
    if isinstance(name, str) and name and not osp.isabs(name) and '..' not in name.split('/'):
        return osp.join(strategy.work_dir, name)
    return strategy.log_dir


def _same_dir(path: str, directory: str) -> bool:
    return osp.realpath(osp.dirname(osp.abspath(str(path)))) == osp.realpath(directory)


def _arm_preemption(preemption: Preemption, p: _Parts) -> Any:
    """Fit the preemption to the run (its lead, no stale marker); returns the watchdog's
    ``signalled``: a signal while a peer is dead (torchrun tearing the group down) ends the
    rank at once, no save."""
    # ranks drift apart by at most one accumulation window between two collectives
    wrappers = getattr(p.optim_wrapper, 'values', lambda: [p.optim_wrapper])()
    preemption.lead = max(getattr(w, 'accumulative_counts', 1) for w in wrappers) + 1
    if p.strategy.rank == 0:
        clear_marker(p.strategy.work_dir)
    return preemption.pending


def _finish_preempted(
    preemption: Preemption, signal: str, strategy: Any, it: int, directory: str
) -> None:
    """After a preemption stop: requeue (Slurm) and the marker for the launching parent."""
    preemption.finish(strategy.work_dir, join(directory, f'iter_{it}.pth'), strategy.rank)
    strategy.logger.warning(
        f'preempted by {signal}: checkpoint iter_{it}.pth committed; exit status '
        f'{preemption.exit_code}'
    )


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device('cpu')
