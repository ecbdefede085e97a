"""``stratagem train CONFIG``: the reference loop (:func:`stratagem.loop.train`) from the
command line, in one process or re-launched under torchrun (``--nproc``, ``--nnodes``,
``--max-restarts``: ``launch.py``). A worker under torchrun with restarts, or of a requeued
Slurm job, resumes from the last committed checkpoint by itself; a preempted run exits with
``train_cfg.preemption.exit_code`` (default 75).

The run holds ``work_dir/.stratagem.lock`` (:mod:`stratagem.env.workdir_lock`) from before it
writes anything to its end: under ``--nproc`` the parent takes it before torchrun starts and
its workers share it; otherwise rank 0 takes it. ``--force-unlock`` takes a lock another host
claims.

A config that needs mmengine's runner (``stratagem.schema.runner_reasons``:
``runner_type='FlexibleRunner'``, ``val_evaluator``, ``test_*``, ``custom_hooks``,
``visualizer``, ``log_processor``, mmengine's ``default_hooks`` beyond the loop's, ...) runs
under mmengine's ``FlexibleRunner`` on stratagem's strategies instead
(``stratagem.integrations.mmengine_runner``), with the same flags, in every process of a
``--nproc`` run; without mmengine installed it stops first, naming those keys and the extra."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import os.path as osp
import signal
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from stratagem import env
from stratagem.config import Config, ConfigError, parse_cfg_options
from stratagem.config.overrides import check_overrides
from stratagem.env.logging import run_end_logged
from stratagem.env.preemption import PreemptionConfig, preemption_config
from stratagem.env.workdir_lock import TOKEN_ENV, WorkDirBusyError, WorkDirLock
from stratagem.loop import train
from stratagem.loop.plan import CheckpointPlan, run_work_dir
from stratagem.schema import runner_reasons
from stratagem.strategies.replica_groups import LIGHTHOUSE_ENV, REPLICA_ID_ENV, FaultTolerance

from . import debug_enabled
from .launch import (
    add_launch_arguments,
    interrupted_line,
    launch_from_environment,
    relaunch,
    torchrun_command,
    wants_torchrun,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('config', help='config file (.py, .json, .yaml)')
    parser.add_argument(
        '--work-dir',
        help='where logs and checkpoints go (default: the '
        "config's work_dir, else work_dirs/<config name>)",
    )
    parser.add_argument(
        '--resume',
        nargs='?',
        const='auto',
        default=None,
        metavar='PATH',
        help='resume from PATH, or from the latest checkpoint in work_dir. Into a run of '
        "another length: a scheduler whose end was fitted to the earlier run's length keeps "
        'it, with a warning; --cfg-options train_cfg.refit_schedulers=True fits it to this '
        'run (the lr then follows a fresh run of this length)',
    )
    parser.add_argument('--load-from', help='load model weights (not the training state) first')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        default=[],
        metavar='KEY=VALUE',
        help='override config keys, e.g. optim_wrapper.optimizer.lr=0.01 '
        '"optim_wrapper.clip_grad=dict(max_norm=5.0)" (values: Python literals, a,b lists, '
        'dict(k=v)); a key the config does not have is an error naming the key meant, '
        'unless stratagem.schema documents it (train_cfg.preemption) or it is a new '
        'argument of a built object (model.dropout)',
    )
    parser.add_argument(
        '--seed',
        type=int,
        default=None,
        metavar='N',
        help='seed of the run (randomness.seed): every RNG (python, numpy, torch) and the '
        "data order; default: the config's, else one drawn on rank 0 and recorded in the "
        'checkpoints',
    )
    parser.add_argument(
        '--deterministic',
        action='store_true',
        help='deterministic algorithms (randomness.deterministic=True: '
        'torch.use_deterministic_algorithms, cuDNN benchmark off); slower on GPUs',
    )
    parser.add_argument(
        '--amp',
        nargs='?',
        const='auto',
        default=None,
        choices=['auto', 'bf16', 'fp16'],
        help='mixed precision: the optim wrapper becomes AmpOptimWrapper with this autocast '
        'dtype (fp16 adds a dynamic loss scale); bare --amp: bf16 where the device supports '
        'it (CPU, recent GPUs), else fp16. fp16 needs a CUDA device',
    )
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default=None,
        help='job launcher (default: inferred from the environment)',
    )
    parser.add_argument(
        '--force-unlock',
        action='store_true',
        help='take the work_dir lock (work_dir/.stratagem.lock) that a run on another host '
        'claims, once you know that run has ended; a live holder on this host is never broken',
    )
    parser.add_argument(
        '--ray',
        default=None,
        metavar='N|MIN:MAX',
        help='run under Ray Train with N workers (GPU ones where this machine has GPUs), or '
        "MIN:MAX for Ray's elastic mode (between MIN and MAX workers, as many as the cluster "
        'has room for; each restart may run another count, resuming with the sample position '
        'exact): the cluster at RAY_ADDRESS, else a local one; a killed worker restarts the '
        'run from the last committed checkpoint (stratagem.integrations.ray; pip install '
        '"stratagem[ray]")',
    )
    group = parser.add_argument_group(
        'replica groups',
        'a fault-tolerant job over torchft (strategy.fault_tolerance; pip install '
        '"stratagem[torchft]"): start `stratagem lighthouse`, then each group with '
        '--replica-id I (its own I) and --nproc K; a killed group, relaunched by '
        '--max-restarts, heals from a live peer',
    )
    group.add_argument(
        '--replica-id',
        type=int,
        default=None,
        metavar='I',
        help='this run is replica group I (an integer >= 0, one per group) of a '
        'fault-tolerant job; turns on strategy.fault_tolerance (DDPStrategy) when the config '
        f'has none ({REPLICA_ID_ENV})',
    )
    group.add_argument(
        '--lighthouse',
        default=None,
        metavar='ADDR',
        help=f'the lighthouse address `stratagem lighthouse` printed (default ${LIGHTHOUSE_ENV})',
    )
    add_launch_arguments(parser)


def _replica_group_flags(cfg: Config, args: argparse.Namespace) -> bool:
    """``--replica-id`` / ``--lighthouse``: the environment the group's workers read, and
    ``strategy.fault_tolerance`` turned on (a DDPStrategy's) when the config has none; a
    config with it is checked here (keys, the group's id and lighthouse), before torchrun
    starts the workers. Returns whether this run is a replica group."""
    if args.lighthouse:
        os.environ[LIGHTHOUSE_ENV] = args.lighthouse
    strategy = dict(cfg.get('strategy') or {'type': 'auto'})
    if args.replica_id is not None:
        if args.replica_id < 0:
            raise ValueError(f'--replica-id {args.replica_id}: give an integer >= 0, one per group')
        os.environ[REPLICA_ID_ENV] = str(args.replica_id)
        if strategy.get('fault_tolerance') in (None, False):
            kind = strategy.get('type', 'auto')
            if kind not in ('auto', 'DDPStrategy'):
                raise ValueError(
                    f'--replica-id: strategy.type={kind!r} has no fault_tolerance; replica '
                    "groups run DDPStrategy or FSDPStrategy: set strategy=dict(type='DDPStrategy' "
                    "(or 'FSDPStrategy'), fault_tolerance=dict(min_replicas=1))"
                )
            strategy.update(type='DDPStrategy', fault_tolerance={})
            cfg['strategy'] = strategy
    spec = FaultTolerance.option(strategy.get('fault_tolerance'))
    if spec is None:
        return False
    args.replica_id = spec.replica_id  # the group's own lock in the shared work_dir
    return True


def run(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    replica_group = _replica_group_flags(cfg, args)
    mmengine_keys = runner_reasons(cfg)
    if mmengine_keys:
        _require_mmengine(cfg, mmengine_keys)  # before torchrun starts
    preemption = preemption_config(dict(cfg.get('train_cfg') or {}).get('preemption', True))
    if args.ray is not None:
        return _run_ray(cfg, args, mmengine_keys)
    launch_from_environment(args)  # a scheduler's nodes, or the defaults
    if not (wants_torchrun(args) or replica_group) and args.launcher is None:
        env.infer_launcher()  # alone, but the environment says one of several: refused here
    # a replica group is a process group of its own even with one process: torchrun's
    launch = wants_torchrun(args) or replica_group
    if launch and 'LOCAL_RANK' not in os.environ:
        # a config error in seconds, not after torchrun started every worker
        if mmengine_keys:
            from stratagem.integrations.mmengine_runner import check_runner_config

            check_runner_config(cfg)
        else:
            check_before_launch(cfg)
        cmd = torchrun_command(args)
        debug = debug_enabled(list(getattr(args, 'cli_argv', [])))
        # taken before torchrun starts: a busy work_dir is refused in a second, and the
        # workers (every attempt of a --max-restarts run) share it through the token
        with _work_dir_lock(cfg, args, parent=True) as lock:
            os.environ.update(lock.child_env())
            try:
                return relaunch(
                    cmd,
                    preemption.signals if preemption else (),
                    run_work_dir(cfg),
                    debug,
                    _checkpoints_at(cfg),
                )
            finally:
                os.environ.pop(TOKEN_ENV, None)
    resume: bool | str = False
    if args.resume == 'auto' or (args.resume is None and _restarted()):
        resume = True
    elif args.resume:
        resume = args.resume
    if os.environ.get('TORCHELASTIC_RUN_ID') is not None:
        # a torchrun worker: its parent (relaunch) prints the one line for every rank
        signal.signal(signal.SIGINT, _interrupt_once)
        return _run_here(cfg, args, resume, mmengine_keys, preemption)
    try:
        return _run_here(cfg, args, resume, mmengine_keys, preemption)
    except KeyboardInterrupt:
        if _launch_rank() == 0:  # one line for the run, however many processes it has
            print(interrupted_line(run_work_dir(cfg), *_checkpoints_at(cfg)), file=sys.stderr)
        if debug_enabled(list(getattr(args, 'cli_argv', []))):
            raise
        return 130


def _run_here(
    cfg: Config,
    args: argparse.Namespace,
    resume: bool | str,
    mmengine_keys: list[str],
    preemption: PreemptionConfig | None,
) -> int:
    """The run in this process: the reference loop, or mmengine's FlexibleRunner."""
    if mmengine_keys:
        return _run_flexible_runner(cfg, args, resume)
    if args.launcher:
        strategy = dict(cfg.get('strategy') or {'type': 'auto'})
        strategy['env_kwargs'] = {
            **dict(strategy.get('env_kwargs') or {}),
            'launcher': args.launcher,
        }
        cfg['strategy'] = strategy
    with _work_dir_lock(cfg, args) as lock:
        result = train(cfg, resume=resume, load_from=args.load_from)
        if os.environ.get('TORCHELASTIC_RUN_ID') is not None:
            # a preempted worker exits 0 too, or torchrun's agent would restart it; the parent
            # (relaunch) turns the preemption it recorded into the exit status
            _exit_torchrun_worker(result['strategy'], lock)
    if result.get('preempted') and preemption is not None:
        return preemption.exit_code
    return 0


def _run_ray(cfg: Config, args: argparse.Namespace, mmengine_keys: list[str]) -> int:
    """``--ray N`` or ``--ray MIN:MAX``: the reference loop under Ray Train's
    ``TorchTrainer`` of N workers, or of ``num_workers=(MIN, MAX)`` (Ray's elastic mode)
    (:func:`stratagem.integrations.ray.fit`), this process holding the work_dir lock."""
    workers = ray_workers(args.ray)
    others = [
        flag
        for flag, given in (
            # launch options not given are None (a scheduler's variables fill them later)
            ('--nproc', args.nproc is not None),
            ('--nnodes', args.nnodes is not None),
            ('--max-restarts', args.max_restarts is not None),
            ('--launcher', args.launcher is not None),
            ('--resume', args.resume is not None),
        )
        if given
    ]
    if others:
        raise ValueError(
            f'--ray starts the workers itself (Ray places them and restarts them, resuming '
            f'from the last checkpoint by itself); drop {", ".join(others)}'
        )
    if mmengine_keys:
        raise ConfigError(
            f"--ray runs the reference loop; {', '.join(mmengine_keys)} need mmengine's "
            'runner, which --ray does not start: run this config without --ray'
        )
    import importlib.util

    if importlib.util.find_spec('ray') is None:
        raise ImportError('--ray needs Ray Train: pip install "stratagem[ray]"')
    check_before_launch(cfg)
    from stratagem.integrations.ray import fit

    cfg['work_dir'] = osp.abspath(cfg['work_dir'])  # the workers' directory is not ours
    with _work_dir_lock(cfg, args, parent=True):
        fit(cfg, workers, load_from=args.load_from)
    return 0


def ray_workers(value: str | int) -> int | tuple[int, int]:
    """``--ray``'s value: ``N`` (a count) or ``MIN:MAX`` (Ray's elastic ``num_workers``,
    ``1 <= MIN <= MAX``; ``N:N`` is ``N``), refused with the value and what would be right."""
    text = str(value).strip()
    parts = text.split(':')
    try:
        if len(parts) > 2:
            raise ValueError
        counts = [int(p) for p in parts]
    except ValueError:
        raise ValueError(
            f'--ray {text}: expected a number of Ray workers N (e.g. --ray 2) or a range '
            "MIN:MAX for Ray's elastic mode (e.g. --ray 1:4)"
        ) from None
    if len(counts) == 1:
        if counts[0] < 1:
            raise ValueError(f'--ray {text}: the number of Ray workers should be >= 1')
        return counts[0]
    low, high = counts
    if low < 1 or high < low:
        raise ValueError(
            f'--ray {text}: an elastic range MIN:MAX needs 1 <= MIN <= MAX (the fewest and the '
            f'most Ray workers), e.g. --ray {max(1, min(low, high))}:{max(1, low, high)}'
        )
    return low if low == high else (low, high)


def _require_mmengine(cfg: Config, keys: list[str]) -> None:
    """Stop, naming ``keys`` and the extra, when mmengine is not installed."""
    import importlib.util

    if importlib.util.find_spec('mmengine') is None:
        raise ConfigError(
            f"config {cfg.filename or ''}: {', '.join(keys)} are read only by mmengine's "
            "runner: stratagem train runs such a config under mmengine's FlexibleRunner on "
            "stratagem's strategies, and mmengine is not installed: pip install "
            '"stratagem[mmengine]" (or remove those keys to run the reference loop)'
        )


def _run_flexible_runner(cfg: Config, args: argparse.Namespace, resume: bool | str) -> int:
    """The config under mmengine's FlexibleRunner, holding the work_dir lock as the
    reference loop's run does."""
    from stratagem.integrations.mmengine_runner import train_with_flexible_runner

    with _work_dir_lock(cfg, args) as lock:
        # the run's log file (its strategy opens it) ends with a line saying why it ended
        with run_end_logged() as ended:
            runner = train_with_flexible_runner(
                cfg, launcher=args.launcher, resume=resume, load_from=args.load_from
            )
            ended.append(f'run ended: finished, iteration {runner.iter}/{runner.max_iters}')
        if os.environ.get('TORCHELASTIC_RUN_ID') is not None:
            _exit_torchrun_worker(runner.strategy, lock)
    return 0


def check_before_launch(cfg: Config) -> None:
    """The cheap checks of a config (no model or dataset built): the reference loop's key
    checks (:func:`stratagem.loop.check_train_config`) and every ``type`` resolving in its
    registry (its module imported: a missing package shows here too). Raises the error
    ``stratagem train`` would raise in every worker, naming the key."""
    from stratagem.loop import check_train_config
    from stratagem.registry import (
        DATASETS,
        MODELS,
        OPTIM_WRAPPERS,
        OPTIMIZERS,
        PARAM_SCHEDULERS,
        STRATEGIES,
    )

    check_train_config(cfg)
    ow = cfg.get('optim_wrapper') or {}
    schedulers = cfg.get('param_scheduler') or []
    if isinstance(schedulers, Mapping) and 'type' in schedulers:
        schedulers = [schedulers]
    elif isinstance(schedulers, Mapping):  # one list per optimizer
        schedulers = [s for v in schedulers.values() for s in (v or [])]
    typed = [
        ('model', cfg.get('model'), MODELS),
        ('train_dataloader.dataset', (cfg.get('train_dataloader') or {}).get('dataset'), DATASETS),
        ('optim_wrapper', ow, OPTIM_WRAPPERS),
        ('optim_wrapper.optimizer', ow.get('optimizer'), OPTIMIZERS),
        ('strategy', cfg.get('strategy'), STRATEGIES),
        *((f'param_scheduler[{i}]', s, PARAM_SCHEDULERS) for i, s in enumerate(schedulers)),
    ]
    for where, section, registry in typed:
        name = section.get('type') if isinstance(section, Mapping) else None
        # a dotted 'pkg.mod.Class' is imported where it is built; 'auto' picks a strategy
        if not isinstance(name, str) or name == 'auto' or '.' in name:
            continue
        if registry.get(name) is None:
            err = registry.unknown_name_error(name)
            raise type(err)(f'{where}: {err}')


def apply_run_flags(
    cfg: Config, *, seed: int | None = None, deterministic: bool = False, amp: str | None = None
) -> None:
    """``--seed``, ``--deterministic`` and ``--amp`` written into ``cfg``: ``randomness``
    (and ``strategy.env_kwargs.randomness`` when the config seeds there, as it wins), and
    ``optim_wrapper`` (each wrapper of a dict of wrappers) as ``AmpOptimWrapper`` with the
    dtype of :func:`amp_dtype`."""
    changes: dict[str, Any] = {}
    if seed is not None:
        changes['seed'] = seed
    if deterministic:
        changes['deterministic'] = True
    if changes:
        cfg['randomness'] = {**dict(cfg.get('randomness') or {}), **changes}
        env_kwargs = dict(dict(cfg.get('strategy') or {}).get('env_kwargs') or {})
        if env_kwargs.get('randomness') is not None:
            env_kwargs['randomness'] = {**dict(env_kwargs['randomness']), **changes}
            cfg['strategy'] = {**dict(cfg['strategy']), 'env_kwargs': env_kwargs}
    if amp is None:
        return
    dtype = amp_dtype(amp)
    ow = dict(cfg.get('optim_wrapper') or {})
    single = not ow or any(k in ow for k in ('type', 'optimizer'))
    names = [None] if single else [k for k, v in ow.items() if isinstance(v, Mapping)]
    for name in names:
        wrapper = dict(ow if name is None else ow[name])
        where = 'optim_wrapper' if name is None else f'optim_wrapper.{name}'
        kind = wrapper.get('type', 'OptimWrapper')
        if kind not in ('OptimWrapper', 'AmpOptimWrapper'):
            raise ValueError(
                f'--amp: {where}.type={kind!r} is not OptimWrapper; set '
                f"{where}.type='AmpOptimWrapper' (and its dtype) in the config instead"
            )
        wrapper.update(type='AmpOptimWrapper', dtype=dtype)
        if name is None:
            ow = wrapper
        else:
            ow[name] = wrapper
    cfg['optim_wrapper'] = ow


def amp_dtype(amp: str) -> str:
    """The autocast dtype name of ``--amp`` (``'auto'``, ``'bf16'``, ``'fp16'``) on the
    device this run trains on (CUDA when available, else CPU); fp16 on a CPU is refused."""
    import torch

    cuda = torch.cuda.is_available()
    if amp == 'auto':
        amp = 'bf16' if not cuda or torch.cuda.is_bf16_supported() else 'fp16'
    if amp == 'fp16' and not cuda:
        raise ValueError(
            '--amp fp16 needs a CUDA device and this machine has none (float16 autocast '
            'on a CPU is slow and unsupported by many operators); use --amp bf16, or bare '
            '--amp to pick what the device supports'
        )
    if amp == 'bf16' and cuda and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f'--amp bf16: {torch.cuda.get_device_name()} does not support bfloat16; use '
            '--amp fp16, or bare --amp to pick what the device supports'
        )
    return {'bf16': 'bfloat16', 'fp16': 'float16'}[amp]


def _load_config(args: argparse.Namespace) -> Config:
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        options = parse_cfg_options(args.cfg_options)
        check_overrides(cfg, options)
        cfg.merge_from_dict(options)
    apply_run_flags(cfg, seed=args.seed, deterministic=args.deterministic, amp=args.amp)
    if args.work_dir:
        cfg['work_dir'] = args.work_dir
    elif 'work_dir' not in cfg:
        cfg['work_dir'] = osp.join('work_dirs', osp.splitext(osp.basename(args.config))[0])
    return cfg


@contextlib.contextmanager
def _work_dir_lock(
    cfg: Config, args: argparse.Namespace, *, parent: bool = False
) -> Iterator[WorkDirLock]:
    """The run's lock on its work_dir (the strategy's, as ``loop.train`` resolves it).

    One process of a run holds it: the launching parent of node 0 (``--nproc``; under
    ``--rdzv-endpoint`` every agent's parent takes part under the rendezvous's token, the
    first holds it), else rank 0. A worker whose parent
    is ``stratagem train`` (``STRATAGEM_WORKDIR_LOCK`` set) and every other rank hold
    nothing: the run's holder does, for all of its ranks and torchrun attempts.
    """
    work_dir = run_work_dir(cfg)
    replica_id = getattr(args, 'replica_id', None)
    if replica_id is not None:  # the groups of a job share the work_dir, one lock each
        work_dir = osp.join(work_dir, f'.replica{replica_id}')
    endpoint = getattr(args, 'rdzv_endpoint', None) if parent else None
    # elastic agents of one rendezvous start apart (one may join later): all of them take
    # part in the run's lock under a token each derives alike, none is refused by another
    run_token = f'rdzv:{endpoint}:{getattr(args, "rdzv_id", "")}' if endpoint else None
    lock = WorkDirLock(
        str(work_dir), force=bool(getattr(args, 'force_unlock', False)), run_token=run_token
    )
    holder = (endpoint is not None or _holds_for_the_run(args)) if parent else _launch_rank() == 0
    if not holder or TOKEN_ENV in os.environ:
        yield lock
        return
    try:
        lock.acquire()  # WorkDirBusyError: `stratagem: error: ...`, exit status 1
    except WorkDirBusyError as err:
        if replica_id is None:
            raise
        raise WorkDirBusyError(
            f'replica group {replica_id} is already running in {run_work_dir(cfg)}: each group '
            f'needs its own --replica-id; start this one with an id no other group uses '
            f'({err})'
        ) from err
    try:
        yield lock
    finally:
        lock.release()


def _checkpoints_at(cfg: Config) -> tuple[str | None, dict | None]:
    """Where the run saves when not in its work_dir (``default_hooks.checkpoint.out_dir``,
    joined with the work_dir's name as the loop and mmengine's CheckpointHook do) and that
    store's ``backend_args``; ``(None, None)`` without an ``out_dir``."""
    hook = (cfg.get('default_hooks') or {}).get('checkpoint') or {}
    out_dir, backend_args = hook.get('out_dir'), hook.get('backend_args')
    if not isinstance(out_dir, str) or not out_dir.strip():
        return None, None
    directory = CheckpointPlan(out_dir=out_dir).directory(run_work_dir(cfg))
    return directory, dict(backend_args or {}) or None


def _holds_for_the_run(args: argparse.Namespace) -> bool:
    """Whether this launching parent (static membership) holds the run's lock: node 0's."""
    return int(getattr(args, 'node_rank', 0) or 0) == 0


def _launch_rank() -> int:
    """This process's global rank as its launcher set it (0 when started alone)."""
    for name in ('RANK', 'SLURM_PROCID', 'OMPI_COMM_WORLD_RANK', 'MV2_COMM_WORLD_RANK', 'PMI_RANK'):
        value = os.environ.get(name, '')
        if value.isdigit():
            return int(value)
    return 0


def _restarted() -> bool:
    """Whether this process continues a run by itself: a worker under torchrun with restarts
    (``--max-restarts``; also its first attempt, which finds the checkpoints of a run killed
    before, or none and starts fresh) or a requeued Slurm job (``SLURM_RESTART_COUNT``)."""
    counts = (
        os.environ.get('TORCHELASTIC_MAX_RESTARTS', '0'),
        os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'),
        os.environ.get('SLURM_RESTART_COUNT', '0'),
    )
    return any(c.isdigit() and int(c) > 0 for c in counts)


def _interrupt_once(signum: int, frame: Any) -> None:
    """Ctrl-C in a torchrun worker: it comes twice (from the agent and from ``stratagem
    train``, ``launch.py``); the second must not interrupt the first's unwinding (a save
    removing its temporary files, the one-line exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _exit_torchrun_worker(strategy: Any, lock: WorkDirLock) -> None:
    """End a torchrun worker whose run succeeded, without interpreter teardown.

    With gloo, a worker that returned normally was sometimes killed at exit by
    ``terminate called without an active exception`` (SIGABRT) while the process group was
    torn down in interpreter finalisation, and torchrun then reported the finished run as
    failed. So: wait for pending checkpoints, wait for every rank, flush, and leave with
    ``os._exit(0)``; the OS closes the sockets.
    """
    wait = getattr(strategy, 'wait_for_checkpoints', None)
    if callable(wait):
        wait()
    with contextlib.suppress(Exception):
        env.barrier()
    lock.release()  # os._exit skips the context's exit
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
