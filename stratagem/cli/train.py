"""``stratagem train CONFIG``: the reference loop (:func:`stratagem.loop.train`) from the
command line, in one process or re-launched under torchrun (``--nproc``, ``--nnodes``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import os.path as osp
import subprocess
import sys
from typing import Any

from stratagem import env
from stratagem.config import Config, parse_cfg_options
from stratagem.env.launcher import resolve_master
from stratagem.loop import train


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
        '--nproc',
        type=int,
        default=1,
        help='processes on this machine; > 1 re-launches with torchrun',
    )
    node = parser.add_argument_group(
        'several machines',
        'run the same command on every node, each with its own '
        '--node-rank; this one re-launches through torchrun (no --standalone)',
    )
    node.add_argument('--nnodes', type=int, default=1, help='number of machines (default 1)')
    node.add_argument(
        '--node-rank',
        type=int,
        default=0,
        help='this machine, 0 .. nnodes-1; node 0 hosts the rendezvous',
    )
    node.add_argument(
        '--master-addr',
        help="node 0's host name or address, reachable from "
        'every node (required with --nnodes > 1)',
    )
    node.add_argument(
        '--master-port',
        type=int,
        default=None,
        help="a free TCP port on node 0 (default torchrun's, 29500)",
    )


def run(args: argparse.Namespace) -> int:
    if (args.nproc > 1 or args.nnodes > 1) and 'LOCAL_RANK' not in os.environ:
        return _relaunch_with_torchrun(args)
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(parse_cfg_options(args.cfg_options))
    if args.work_dir:
        cfg['work_dir'] = args.work_dir
    elif 'work_dir' not in cfg:
        cfg['work_dir'] = osp.join('work_dirs', osp.splitext(osp.basename(args.config))[0])
    if args.launcher:
        strategy = dict(cfg.get('strategy') or {'type': 'auto'})
        strategy['env_kwargs'] = {
            **dict(strategy.get('env_kwargs') or {}),
            'launcher': args.launcher,
        }
        cfg['strategy'] = strategy
    resume: bool | str = False
    if args.resume == 'auto':
        resume = True
    elif args.resume:
        resume = args.resume
    result = train(cfg, resume=resume, load_from=args.load_from)
    if os.environ.get('TORCHELASTIC_RUN_ID') is not None:
        _exit_torchrun_worker(result['strategy'])
    return 0


def _exit_torchrun_worker(strategy: Any) -> None:
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
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _relaunch_with_torchrun(args: argparse.Namespace) -> int:
    """Run this same command in ``args.nproc`` processes per node under torchrun.

    One node: ``torchrun --standalone``. Several (``--nnodes N --node-rank R --master-addr
    A [--master-port P]``, the same command on every node): torchrun's static rendezvous
    at ``A:P``, which node 0 hosts. The options are checked here, before torchrun starts.
    """
    nproc, nnodes, node_rank = args.nproc, args.nnodes, args.node_rank
    master_addr, master_port = args.master_addr, args.master_port
    if nproc < 1 or nnodes < 1:
        raise ValueError(
            f'--nproc and --nnodes must be >= 1, got --nproc {nproc} --nnodes {nnodes}'
        )
    if not 0 <= node_rank < nnodes:
        raise ValueError(
            f'--node-rank {node_rank} is not one of the {nnodes} node(s): give '
            f'0 .. {nnodes - 1}, a different one on each machine'
        )
    if master_port is not None and not 0 < master_port < 65536:
        raise ValueError(f'--master-port {master_port} is not a TCP port; give 1-65535')
    if nnodes > 1 and not master_addr:
        raise ValueError(
            f'--nnodes {nnodes} needs --master-addr: the host name or address of '
            'node 0 (--node-rank 0), the same on every node'
        )
    if master_addr:
        resolve_master(master_addr, master_port or 29500, '--master-addr')
    # the sub-command's own arguments, as cli.main received them (not sys.argv: main() may
    # be called from code); the children run under torchrun (LOCAL_RANK is set), so they
    # never re-launch, and the options that only shape the launch are dropped for clarity
    argv = list(getattr(args, 'cli_argv', sys.argv[2:]))
    launch_only = ('--nproc', '--nnodes', '--node-rank', '--master-addr', '--master-port')
    cleaned, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in launch_only:
            skip = True
            continue
        if a.startswith(tuple(f'{o}=' for o in launch_only)):
            continue
        cleaned.append(a)
    cmd = [sys.executable, '-m', 'torch.distributed.run']
    if nnodes == 1 and master_addr is None and master_port is None:
        cmd.append('--standalone')
    else:
        cmd += [
            f'--nnodes={nnodes}',
            f'--node-rank={node_rank}',
            f'--master-addr={master_addr or "127.0.0.1"}',
        ]
        if master_port is not None:
            cmd.append(f'--master-port={master_port}')
    cmd += [f'--nproc-per-node={nproc}', '-m', 'stratagem', 'train', *cleaned]
    if not any(a == '--launcher' or a.startswith('--launcher=') for a in cleaned):
        cmd += ['--launcher', 'pytorch']
    return subprocess.call(cmd)
