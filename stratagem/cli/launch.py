"""How ``stratagem train`` starts several processes: torchrun's command line (one node, several
nodes with a static or an elastic membership, restarts), and the parent process that waits for
it (forwarding preemption signals to the workers, turning a preemption into its exit status).

1. ``add_launch_arguments``: ``--nproc``, ``--nnodes N`` or ``MIN:MAX``, ``--node-rank``,
   ``--master-addr``/``--master-port`` (static), ``--rdzv-endpoint``/``--rdzv-id``/
   ``--rdzv-conf`` (c10d rendezvous: elastic), ``--max-restarts``.
2. ``torchrun_command``: the options checked, the command built (nothing started).
3. ``relaunch``: runs it. While it runs, a preemption signal this process receives goes on
   to the workers, and torchrun's agent handles the same signals (``--signals-to-handle``
   through ``PET_SIGNALS_TO_HANDLE``): it passes them to its workers and waits for their
   save, its store up, so a signal sent to the whole job step (Slurm's ``--signal``,
   ``kill -USR1 -<pgid>``) does not kill it. Afterwards a preemption the workers recorded
   (``work_dir/preempted.json``: torchrun workers exit 0, or the agent would restart them)
   becomes this process's exit status; Ctrl-C (SIGINT) becomes one line and 130.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence

from stratagem.env.cluster import NodeLaunch, read_node_launch
from stratagem.env.launcher import resolve_master

__all__ = [
    'add_launch_arguments',
    'check_nproc',
    'interrupted_line',
    'launch_from_environment',
    'parse_nnodes',
    'torchrun_command',
    'relaunch',
]

_LAUNCH_ONLY = (
    '--nproc', '--nnodes', '--node-rank', '--master-addr', '--master-port',
    '--rdzv-endpoint', '--rdzv-id', '--rdzv-conf', '--max-restarts',
)  # fmt: skip
_AGENT_SIGNALS = 'SIGTERM,SIGINT,SIGHUP,SIGQUIT'  # torchrun's default
_AGENT_ENV = 'PET_SIGNALS_TO_HANDLE'  # torchrun's --signals-to-handle


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        '--nproc',
        type=int,
        default=None,
        help='processes on this machine, >= 1 (more than its CPU cores: a warning); > 1 '
        "re-launches with torchrun (default: a scheduler's PET_NPROC_PER_NODE / "
        'SKYPILOT_NUM_GPUS_PER_NODE, else 1)',
    )
    parser.add_argument(
        '--max-restarts',
        type=int,
        default=None,
        metavar='K',
        help='restart every worker up to K times when one fails (torchrun); a restarted '
        'worker resumes from the last committed checkpoint by itself',
    )
    node = parser.add_argument_group(
        'several machines',
        'run the same command on every node; static: --nnodes N with its own --node-rank '
        'and node 0 as --master-addr; elastic: --nnodes MIN:MAX --rdzv-endpoint HOST:PORT. '
        "Under Kubeflow (PET_*), JobSet or SkyPilot each comes from the scheduler's "
        'variables (stratagem env shows them); a flag that contradicts one is refused',
    )
    node.add_argument(
        '--nnodes', default=None, help='number of machines, N or MIN:MAX (elastic; default 1)'
    )
    node.add_argument(
        '--node-rank', type=int, default=None, help='this machine, 0 .. nnodes-1 (static)'
    )
    node.add_argument(
        '--master-addr',
        help="node 0's host name or address, reachable from every node (static, --nnodes > 1)",
    )
    node.add_argument(
        '--master-port', type=int, default=None, help='a free TCP port on node 0 (default 29500)'
    )
    node.add_argument(
        '--rdzv-endpoint',
        metavar='HOST:PORT',
        help='c10d rendezvous: the first agent to start on HOST serves it; nodes may come '
        'and go between MIN and MAX',
    )
    node.add_argument(
        '--rdzv-id', default=None, help="the job id agents rendezvous under (default 'stratagem')"
    )
    node.add_argument(
        '--rdzv-conf', help="torchrun's --rdzv-conf, e.g. last_call_timeout=5,join_timeout=600"
    )


_DEFAULTS = dict(nnodes='1', node_rank=0, rdzv_id='stratagem', max_restarts=0)
# the options a scheduler's variables give, in the order they are taken (a rendezvous
# endpoint first: it replaces the static master and node rank)
_FROM_NODE = (
    'rdzv_endpoint', 'rdzv_id', 'max_restarts', 'nnodes', 'node_rank', 'master_addr',
    'master_port', 'nproc',
)  # fmt: skip
_STATIC = ('node_rank', 'master_addr', 'master_port')
_POD = ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')


def launch_from_environment(args: argparse.Namespace) -> NodeLaunch | None:
    """Fill the launch options the user did not give (None) from a cluster scheduler's
    variables (:func:`stratagem.env.cluster.read_node_launch`: Kubeflow ``PET_*``, JobSet,
    SkyPilot), else from the defaults (one node, one process); return the node launch read,
    or None. ValueError, naming the flag and the variable with both values, for a flag that
    contradicts a variable, and for ``--nproc``/``--nnodes`` in a pod whose operator gave
    this one process its rank (``RANK``, ``WORLD_SIZE``, no ``LOCAL_RANK``).

    Nothing is read under ``--launcher none|slurm|mpi`` (the user says how this process was
    started) or in a torchrun worker (``LOCAL_RANK``: its parent read them)."""
    env = os.environ
    node = None
    if 'LOCAL_RANK' not in env and getattr(args, 'launcher', None) in (None, 'pytorch'):
        node = read_node_launch()
        if node is None and all(k in env for k in _POD):
            _refuse_processes_in_a_pod(args)
    if node is not None:
        for option in _FROM_NODE:
            _take(args, node, option)
    for option, default in _DEFAULTS.items():
        if getattr(args, option, None) is None:
            setattr(args, option, default)
    if args.nproc is None:
        args.nproc = 1
    if 'LOCAL_RANK' not in env:  # the launching parent, once; a worker's parent said it
        check_nproc(args.nproc)
    return node


def check_nproc(nproc: int) -> None:
    """``--nproc`` below 1 refused (ValueError); above this machine's CPU cores (those this
    process may run on) a warning: the processes then share cores, each step slower."""
    if nproc < 1:
        raise ValueError(
            f'--nproc {nproc}: the number of processes on this machine should be >= 1 '
            '(1 trains in this process; N > 1 starts N under torchrun)'
        )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    if cores and nproc > cores:
        warnings.warn(
            f'--nproc {nproc} on a machine with {cores} CPU core{"s" * (cores != 1)}: the '
            f'processes share them (each step slower, on a CPU usually slower in all than '
            f'--nproc {cores})',
            UserWarning,
            stacklevel=3,
        )


def _take(args: argparse.Namespace, node: NodeLaunch, option: str) -> None:
    """``args.<option>`` from ``node`` when not given; a given one that differs refused."""
    value = getattr(node, option)
    if value is None or (option in _STATIC and args.rdzv_endpoint is not None):
        return
    given = getattr(args, option)
    if option == 'nproc':
        # SkyPilot's count of GPUs is a default; auto/cpu/gpu a choice torchrun leaves to
        # the machine: neither is a number the job demands
        if given is not None and not (node.nproc_demanded and str(value).isdigit()):
            return
        value = _nproc(str(value), node)
    if given is None:
        setattr(args, option, value)
        return
    same = (
        parse_nnodes(given) == parse_nnodes(value)
        if option == 'nnodes'
        else str(given) == str(value)
    )
    if not same:
        flag = '--nproc' if option == 'nproc' else f'--{option.replace("_", "-")}'
        name = node.origin[option]
        read = node.source(option)
        derived = '' if str(value) == node.read[name].strip() else f' (read as {value})'
        raise ValueError(
            f'{flag} {given} contradicts the environment: {read}{derived}, set by '
            f'{node.operator} for this node. Drop {flag} (stratagem train takes it from '
            f'{name}), or change the job so that both agree'
        )


def _nproc(value: str, node: NodeLaunch) -> int:
    """torchrun's ``--nproc-per-node`` value (a number, or auto/cpu/gpu) as a count, as
    torchrun resolves it on this machine."""
    if value.isdigit() and int(value) > 0:
        return int(value)
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(value)
    except ValueError as err:
        raise ValueError(
            f'{node.source("nproc")} ({node.operator}) is not a number of processes on '
            f'this machine: {err}'
        ) from None


def _refuse_processes_in_a_pod(args: argparse.Namespace) -> None:
    """``--nproc``/``--nnodes`` > 1 where the operator already gave this process its rank."""
    env = os.environ
    nproc = args.nproc if args.nproc is not None else 1
    nodes = parse_nnodes(args.nnodes)[1] if args.nnodes is not None else 1
    if nproc == 1 and nodes == 1:
        return
    flag = f'--nproc {nproc}' if nproc != 1 else f'--nnodes {args.nnodes}'
    seen = ', '.join(f'{k}={env[k]}' for k in _POD)
    raise ValueError(
        f'{flag} contradicts the environment: {seen} and no LOCAL_RANK (a Kubeflow '
        'PyTorchJob pod: its operator gave this one process its rank in a world of '
        'WORLD_SIZE pods). Drop it (each pod is one process), or give the job nprocPerNode '
        "(its pods then get torchrun's PET_* variables, which stratagem train reads)"
    )


def parse_nnodes(value: str | int) -> tuple[int, int]:
    """``'N'`` or ``'MIN:MAX'`` as (min, max), checked."""
    text = str(value)
    parts = text.split(':')
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if len(parts) > 2 or not 1 <= lo <= hi:
        raise ValueError(
            f'--nnodes {text!r} is not a number of machines: give N (e.g. 2) or MIN:MAX '
            'with 1 <= MIN <= MAX (e.g. 1:2, elastic, with --rdzv-endpoint)'
        )
    return lo, hi


def wants_torchrun(args: argparse.Namespace) -> bool:
    """Whether this command must re-launch itself under torchrun."""
    return (
        args.nproc > 1
        or parse_nnodes(args.nnodes)[1] > 1
        or args.max_restarts > 0
        or args.rdzv_endpoint is not None
    )


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """torchrun's command for ``args`` (checked first, nothing started)."""
    lo, hi = parse_nnodes(args.nnodes)
    _check_launch_args(args, lo, hi)
    cmd = [sys.executable, '-m', 'torch.distributed.run', *_membership_args(args, lo, hi)]
    if args.max_restarts:
        cmd.append(f'--max-restarts={args.max_restarts}')
    cleaned = _without_launch_options(list(getattr(args, 'cli_argv', sys.argv[2:])))
    cmd += [f'--nproc-per-node={args.nproc}', '-m', 'stratagem', 'train', *cleaned]
    if not any(a == '--launcher' or a.startswith('--launcher=') for a in cleaned):
        cmd += ['--launcher', 'pytorch']
    return cmd


def _check_launch_args(args: argparse.Namespace, lo: int, hi: int) -> None:
    """Refuse launch options that cannot work together (``lo``, ``hi``: ``--nnodes``' range),
    and a rendezvous or master host that does not resolve; ValueError naming the option."""
    nproc, master_port, endpoint = args.nproc, args.master_port, args.rdzv_endpoint
    if nproc < 1:
        raise ValueError(f'--nproc and --nnodes must be >= 1, got --nproc {nproc} --nnodes {hi}')
    if args.max_restarts < 0:
        raise ValueError(
            f'--max-restarts {args.max_restarts} should be >= 0 (restarts of the workers)'
        )
    if master_port is not None and not 0 < master_port < 65536:
        raise ValueError(f'--master-port {master_port} is not a TCP port; give 1-65535')
    if lo != hi and endpoint is None:
        raise ValueError(
            f'--nnodes {lo}:{hi} (elastic) needs --rdzv-endpoint HOST:PORT: the c10d '
            'rendezvous the agents meet at, the same on every node'
        )
    if endpoint is not None:
        _check_rendezvous(args)
    else:
        _check_static_membership(args, hi)


def _check_rendezvous(args: argparse.Namespace) -> None:
    """``--rdzv-endpoint HOST:PORT``, alone (no master address or port), resolving."""
    endpoint = args.rdzv_endpoint
    if args.master_addr or args.master_port is not None:
        raise ValueError(
            '--rdzv-endpoint replaces --master-addr/--master-port (and --node-rank): '
            'give one or the other'
        )
    host, sep, port = endpoint.rpartition(':')
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f'--rdzv-endpoint {endpoint!r} should be HOST:PORT, e.g. node0.cluster:29400'
        )
    resolve_master(host, int(port), '--rdzv-endpoint')


def _check_static_membership(args: argparse.Namespace, nnodes: int) -> None:
    """A node rank among ``nnodes``, and node 0's address (resolving) when there are several."""
    node_rank, master_addr = args.node_rank, args.master_addr
    if not 0 <= node_rank < nnodes:
        raise ValueError(
            f'--node-rank {node_rank} is not one of the {nnodes} node(s): give '
            f'0 .. {nnodes - 1}, a different one on each machine'
        )
    if nnodes > 1 and not master_addr:
        raise ValueError(
            f'--nnodes {nnodes} needs --master-addr: the host name or address of '
            'node 0 (--node-rank 0), the same on every node'
        )
    if master_addr:
        resolve_master(master_addr, args.master_port or 29500, '--master-addr')


def _membership_args(args: argparse.Namespace, lo: int, hi: int) -> list[str]:
    """torchrun's options for how the nodes meet: a c10d rendezvous (elastic when
    ``lo != hi``), ``--standalone`` for one node given no address, else a static master."""
    master_addr, master_port, endpoint = args.master_addr, args.master_port, args.rdzv_endpoint
    if endpoint is not None:
        out = [
            f'--nnodes={lo}:{hi}' if lo != hi else f'--nnodes={hi}',
            '--rdzv-backend=c10d',
            f'--rdzv-endpoint={endpoint}',
            f'--rdzv-id={args.rdzv_id}',
        ]
        return out + ([f'--rdzv-conf={args.rdzv_conf}'] if args.rdzv_conf else [])
    if hi == 1 and master_addr is None and master_port is None:
        return ['--standalone']
    out = [f'--nnodes={hi}', f'--node-rank={args.node_rank}']
    out.append(f'--master-addr={master_addr or "127.0.0.1"}')
    return out + ([f'--master-port={master_port}'] if master_port is not None else [])


def _without_launch_options(argv: list[str]) -> list[str]:
    """The sub-command's own arguments without those that only shape the launch (the workers
    run under torchrun, LOCAL_RANK set, so they never re-launch)."""
    cleaned, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in _LAUNCH_ONLY:
            skip = True
            continue
        if a.startswith(tuple(f'{o}=' for o in _LAUNCH_ONLY)):
            continue
        cleaned.append(a)
    return cleaned


def relaunch(
    cmd: list[str],
    signals: Sequence[str],
    work_dir: str,
    debug: bool = False,
    checkpoints: tuple[str | None, dict | None] = (None, None),
) -> int:
    """Run torchrun's ``cmd``; forward ``signals`` to its workers meanwhile; return its exit
    status, or the preemption's when the workers recorded one in ``work_dir``, or 130 after
    Ctrl-C (SIGINT: the workers stop without saving, one line names the checkpoint to resume
    from, in ``checkpoints``: ``interrupted_line``'s arguments). A failure prints one message
    (``worker_errors.py``) unless ``debug``, which shows everything."""
    from stratagem.env.preemption import MARKER_NAME, clear_marker, read_marker

    clear_marker(work_dir)
    marker = os.path.join(work_dir, MARKER_NAME)
    with _forwarding(signals) as interrupted, _own_round_stores(cmd), _command_only():
        code = run_torchrun(
            cmd, debug, lambda: bool(interrupted) or os.path.exists(marker), interrupted
        )
    # several nodes on a shared work_dir each read it (the first must not take it from the
    # others): there the next run's start removes it
    one_node = '--standalone' in cmd or '--nnodes=1' in cmd
    info = read_marker(work_dir, remove=one_node)
    if info is not None:
        sys.stderr.write(
            f'stratagem train: preempted by {info.get("signal")} after iteration '
            f'{info.get("iteration")}; {info.get("checkpoint")} committed'
            f'{"; the Slurm job was requeued" if info.get("requeued") else ""}\n'
        )
        return int(info.get('exit_code', code))
    if interrupted:
        sys.stderr.write(interrupted_line(work_dir, *checkpoints) + '\n')
        return 130
    return code


def interrupted_line(
    work_dir: str, checkpoints: str | None = None, backend_args: dict | None = None
) -> str:
    """The one line ``stratagem train`` prints after Ctrl-C (SIGINT), in one process or
    many: the checkpoint ``--resume`` continues from (a save is atomic: nothing half-written
    is left), or that nothing was saved. ``checkpoints``: where the run saves when not in
    ``work_dir`` (``default_hooks.checkpoint.out_dir/<name>``, a path or a URL, read with
    ``backend_args``), where ``--resume`` looks first."""
    import warnings

    from stratagem.checkpoint import find_latest_checkpoint
    from stratagem.checkpoint.location import find_latest, is_url

    directory = checkpoints or work_dir
    try:
        with warnings.catch_warnings():  # the resume will say which checkpoint it passed over
            warnings.simplefilter('ignore')
            if is_url(directory):
                latest = find_latest(directory, backend_args)
            else:
                found = find_latest_checkpoint(directory)
                latest = None if found is None else str(found)
    except OSError as err:
        if is_url(directory):
            return (
                f'stratagem train: interrupted (SIGINT); nothing half-written; {directory} '
                f'could not be read now ({err}); --resume looks there'
            )
        latest = None
    except ValueError:  # a damaged pointer: the resume will say which
        latest = None
    if latest is None:
        return f'stratagem train: interrupted (SIGINT); nothing was saved in {directory}'
    return (
        'stratagem train: interrupted (SIGINT); nothing half-written; --resume continues '
        f'from {latest}'
    )


def run_torchrun(
    cmd: list[str],
    debug: bool = False,
    on_purpose: Callable[[], bool] | None = None,
    interrupted: list[int] | None = None,
) -> int:
    """Run torchrun's ``cmd`` to its end; its exit status. Its output as it is with
    ``debug``, else one failure message (``worker_errors.py``) unless ``on_purpose()``; a
    worker that Ctrl-C stopped appends SIGINT to ``interrupted``."""
    from .worker_errors import run_with_one_message

    return subprocess.call(cmd) if debug else run_with_one_message(cmd, on_purpose, interrupted)


@contextlib.contextmanager
def _forwarding(signals: Sequence[str]) -> Iterator[list[int]]:
    """While torchrun runs, its agent handles ``signals`` besides its default ones (it passes
    each on to its workers and waits for them, its store alive, up to its shutdown timeout)
    instead of dying of SIGUSR1 with the store the workers' save votes through. The variable
    is torchrun's ``--signals-to-handle`` (``PET_SIGNALS_TO_HANDLE``): torch's launcher
    overwrites ``TORCHELASTIC_SIGNALS_TO_HANDLE`` with that option's value, so setting the
    latter (as this did before) left SIGUSR1 fatal to the agent.

    A signal sent to this process goes to the workers (torchrun starts
    each in a session of its own), never to the agent: a signal sent to the whole group
    reaches the agent already (it passes on those of ``--signals-to-handle``), and a second
    one would end its shutdown early, with the store the workers' save needs. SIGINT
    (Ctrl-C) too, and the list it yields records it: the workers stop without saving and
    the caller says so in one line instead of a traceback."""
    previous_env = os.environ.get(_AGENT_ENV)
    if previous_env is None:
        os.environ[_AGENT_ENV] = ','.join(dict.fromkeys([*_AGENT_SIGNALS.split(','), *signals]))
    interrupted: list[int] = []

    def interrupt(signum: int, frame: object) -> None:
        interrupted.append(signum)
        _forward(signum, frame)

    previous: dict[int, object] = {}
    try:
        for name in signals:
            sig = getattr(signal, name)
            previous[sig] = signal.signal(sig, _forward)
        if signal.SIGINT not in previous:
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
        yield interrupted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        if previous_env is None:
            os.environ.pop(_AGENT_ENV, None)


@contextlib.contextmanager
def _command_only() -> Iterator[None]:
    """torchrun without the ``PET_*`` variables a scheduler set: torchrun reads them as the
    defaults of the options its command does not give (``PET_RDZV_BACKEND``, ``PET_STANDALONE``
    ...), which would mix a second membership into the one the command states, and the
    command already carries what ``launch_from_environment`` took from them. The signals
    the agent handles (``PET_SIGNALS_TO_HANDLE``) stay."""
    taken = {k: v for k, v in os.environ.items() if k.startswith('PET_') and k != _AGENT_ENV}
    for name in taken:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(taken)


@contextlib.contextmanager
def _own_round_stores(cmd: Sequence[str]) -> Iterator[None]:
    """Agents that meet at a ``--rdzv-endpoint`` give every rendezvous round a store of its
    own, hosted by that round's rank 0 worker, instead of sharing one agent's store across
    rounds (torch's default): the shared store keeps the keys of earlier rounds, and no
    variable the workers get names the round (``TORCHELASTIC_RESTART_COUNT`` counts each
    agent's own failures: an agent that joins later starts at 0, a scale-up does not count),
    so workers of one round could not agree on a prefix of their own."""
    key = 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE'
    if '--standalone' in cmd or '--rdzv-backend=c10d' not in cmd or key in os.environ:
        yield
        return
    os.environ[key] = '1'
    try:
        yield
    finally:
        os.environ.pop(key, None)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f'/proc/{pid}/task'):
            with open(f'/proc/{pid}/task/{task}/children') as f:
                out += [int(p) for p in f.read().split()]
    return out


def _forward(signum: int, frame: object) -> None:
    # the workers (the agent's children) save and exit 0; an agent without workers yet
    # gets the signal itself and stops
    for agent in _children(os.getpid()):
        workers = _children(agent)
        for pid in workers or [agent]:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)
