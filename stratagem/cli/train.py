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
from collections.abc import Iterator
from typing import Any

from stratagem import env
from stratagem.config import Config, ConfigError, parse_cfg_options
from stratagem.env.preemption import preemption_config
from stratagem.env.workdir_lock import TOKEN_ENV, WorkDirLock
from stratagem.loop import train
from stratagem.schema import runner_reasons

from . import debug_enabled
from .launch import add_launch_arguments, relaunch, torchrun_command, wants_torchrun


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
        help='resume from PATH, or from the latest checkpoint in work_dir',
    )
    parser.add_argument('--load-from', help='load model weights (not the training state) first')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        default=[],
        metavar='KEY=VALUE',
        help='override config keys, e.g. optim_wrapper.optimizer.lr=0.01',
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
    add_launch_arguments(parser)


def run(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    mmengine_keys = runner_reasons(cfg)
    if mmengine_keys:
        _require_mmengine(cfg, mmengine_keys)  # before torchrun starts
    preemption = preemption_config(dict(cfg.get('train_cfg') or {}).get('preemption', True))
    if wants_torchrun(args) and 'LOCAL_RANK' not in os.environ:
        cmd = torchrun_command(args)
        debug = debug_enabled(list(getattr(args, 'cli_argv', [])))
        # taken before torchrun starts: a busy work_dir is refused in a second, and the
        # workers (every attempt of a --max-restarts run) share it through the token
        with _work_dir_lock(cfg, args, parent=True) as lock:
            os.environ.update(lock.child_env())
            try:
                return relaunch(
                    cmd, preemption.signals if preemption else (), cfg['work_dir'], debug
                )
            finally:
                os.environ.pop(TOKEN_ENV, None)
    resume: bool | str = False
    if args.resume == 'auto' or (args.resume is None and _restarted()):
        resume = True
    elif args.resume:
        resume = args.resume
    if os.environ.get('TORCHELASTIC_RUN_ID') is not None:
        signal.signal(signal.SIGINT, _interrupt_once)
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
        runner = train_with_flexible_runner(
            cfg, launcher=args.launcher, resume=resume, load_from=args.load_from
        )
        if os.environ.get('TORCHELASTIC_RUN_ID') is not None:
            _exit_torchrun_worker(runner.strategy, lock)
    return 0


def _load_config(args: argparse.Namespace) -> Config:
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(parse_cfg_options(args.cfg_options))
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
    work_dir = dict(cfg.get('strategy') or {}).get('work_dir') or cfg.get('work_dir', 'work_dirs')
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
    lock.acquire()  # WorkDirBusyError: `stratagem: error: ...`, exit status 1
    try:
        yield lock
    finally:
        lock.release()


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
