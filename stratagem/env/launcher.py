"""Which launcher started this process, and joining its process group.

``infer_launcher`` reads the environment a launcher leaves behind; ``init_dist`` turns
that environment into an initialised ``torch.distributed`` default group. Both are
safe on a CPU-only machine: CUDA is touched only after ``torch.cuda.is_available()``.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

LAUNCHERS = ('pytorch', 'slurm', 'mpi')
DEFAULT_PORT = 29500
# torchrun / torch.distributed.run sets all three for every worker.
_TORCHRUN_VARS = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK')
_OMPI_VARS = ('OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE', 'OMPI_COMM_WORLD_LOCAL_RANK')


def infer_launcher() -> str:
    """Name the launcher that started this process, from its environment variables.

    Returns ``'pytorch'`` when torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are
    all set; ``'slurm'`` when ``SLURM_NTASKS`` > 1 and ``SLURM_PROCID`` is set; ``'mpi'``
    when Open MPI's ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK}`` are set; else ``'none'``.
    The order matters: torchrun inside a Slurm allocation is a torchrun job.
    """
    env = os.environ
    if all(k in env for k in _TORCHRUN_VARS):
        return 'pytorch'
    if 'SLURM_PROCID' in env and _int_or(env.get('SLURM_NTASKS'), 1) > 1:
        return 'slurm'
    if all(k in env for k in _OMPI_VARS):
        return 'mpi'
    return 'none'


def init_dist(launcher: str, backend: str | None = None,
              timeout: float | timedelta | None = None, **kwargs: Any) -> None:
    """Initialise the default process group for ``launcher`` ('pytorch', 'slurm', 'mpi').

    Args:
        launcher: how the processes were started; see :func:`infer_launcher`.
        backend: ``torch.distributed`` backend. Default: ``'nccl'`` when CUDA is
            available, ``'gloo'`` otherwise.
        timeout: collective timeout, in seconds or as a ``timedelta``. Default: torch's.
        **kwargs: passed to ``torch.distributed.init_process_group`` (``init_method``,
            ``store``, ...). For ``'slurm'``, ``port`` sets ``MASTER_PORT``
            (default: the existing ``MASTER_PORT``, else 29500).

    Sets the environment variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_SIZE`` for 'slurm' and 'mpi' (torchrun already did for 'pytorch'), and binds
    the process to ``cuda:LOCAL_RANK`` only when CUDA is available. A group that a host
    trainer already initialised is used as it is, whatever ``launcher`` says ('none'
    included); without one, 'none' is an error.
    """
    if launcher not in LAUNCHERS + ('none',):
        raise ValueError(f'unknown launcher {launcher!r}; valid launchers: '
                         f'{", ".join(map(repr, LAUNCHERS))}')
    if dist.is_available() and dist.is_initialized():
        # Respect the host trainer's group: re-initialising would raise or, worse, split it.
        logger.info('torch.distributed is already initialised (backend=%s, rank %d of %d); '
                    'using the existing process group', dist.get_backend(), dist.get_rank(),
                    dist.get_world_size())
        return
    if launcher == 'none':
        raise ValueError("launcher 'none' means a single process and no process group exists "
                         'to use; start the script with torchrun/srun/mpirun, or pass one of '
                         f'{", ".join(map(repr, LAUNCHERS))}')
    if not dist.is_available():
        raise RuntimeError('torch.distributed is not available in this torch build '
                           f'({torch.__version__}); launcher {launcher!r} needs it')
    backend = _resolve_backend(backend)
    if timeout is not None:
        kwargs['timeout'] = _as_timedelta(timeout)
    if launcher == 'pytorch':
        rank, world_size, local_rank = _from_torchrun(kwargs)
    elif launcher == 'slurm':
        rank, world_size, local_rank = _from_slurm(kwargs.pop('port', None))
    else:
        rank, world_size, local_rank = _from_mpi()
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(f'local rank {local_rank} has no GPU: {count} visible; start at '
                             f'most {count} processes per node or set CUDA_VISIBLE_DEVICES')
        torch.cuda.set_device(local_rank)
    kwargs.setdefault('rank', rank)
    kwargs.setdefault('world_size', world_size)
    dist.init_process_group(backend=backend, **kwargs)
    logger.info('initialised torch.distributed: launcher=%s backend=%s rank %d of %d '
                '(local rank %d)', launcher, backend, rank, world_size, local_rank)


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list such as ``'node[01-03,07],gpu5'`` into host names.

    Zero padding is kept (``node[08-10]`` → ``node08, node09, node10``) and several
    bracket groups in one name expand as a product (``r[1-2]n[1-2]``). This is the
    fallback for machines without ``scontrol``; it covers the forms Slurm prints.
    """
    if not nodelist or not nodelist.strip():
        raise ValueError(f'empty Slurm node list {nodelist!r}; expected e.g. "node[01-03],gpu5"')
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip(), nodelist):
        hosts.extend(_expand_host(item, nodelist))
    return hosts


def _split_top_level(text: str, original: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == '[':
            depth += 1
        elif ch == ']':
            depth -= 1
        elif ch == ',' and depth == 0:
            items.append(text[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise ValueError(f'unbalanced brackets in Slurm node list {original!r}')
    if depth:
        raise ValueError(f'unbalanced brackets in Slurm node list {original!r}')
    items.append(text[start:])
    if any(not item for item in items):
        raise ValueError(f'empty host name in Slurm node list {original!r}')
    return items


def _expand_host(item: str, original: str) -> list[str]:
    match = re.search(r'\[([^\[\]]*)\]', item)
    if match is None:
        return [item]
    prefix, suffixes = item[:match.start()], _expand_host(item[match.end():], original)
    names = []
    for part in match.group(1).split(','):
        bounds = part.split('-')
        if not all(b.isdigit() for b in bounds) or len(bounds) > 2:
            raise ValueError(f'bad range {part!r} in Slurm node list {original!r}; '
                             'expected numbers like 01-03 or 7')
        lo, hi = int(bounds[0]), int(bounds[-1])
        if lo > hi:
            raise ValueError(f'descending range {part!r} in Slurm node list {original!r}')
        width = len(bounds[0])
        names.extend(f'{prefix}{i:0{width}d}{suffix}'
                     for i in range(lo, hi + 1) for suffix in suffixes)
    return names


def _slurm_first_host(nodelist: str) -> str:
    """First host of the allocation: ``scontrol`` is authoritative; the parser is a fallback."""
    try:
        out = subprocess.run(['scontrol', 'show', 'hostnames', nodelist], capture_output=True,
                             text=True, timeout=10, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return expand_slurm_nodelist(nodelist)[0]


def _from_torchrun(kwargs: dict) -> tuple[int, int, int]:
    _require_env(_TORCHRUN_VARS, 'pytorch', 'start the script with torchrun')
    if kwargs.get('init_method') in (None, 'env://') and kwargs.get('store') is None:
        _require_env(('MASTER_ADDR', 'MASTER_PORT'), 'pytorch',
                     'start the script with torchrun or pass init_method=/store=')
    return _env_int('RANK'), _env_int('WORLD_SIZE'), _env_int('LOCAL_RANK')


def _from_slurm(port: int | None) -> tuple[int, int, int]:
    _require_env(('SLURM_PROCID', 'SLURM_NTASKS'), 'slurm', 'start the script with srun')
    nodelist = os.environ.get('SLURM_STEP_NODELIST') or os.environ.get('SLURM_JOB_NODELIST') \
        or os.environ.get('SLURM_NODELIST')
    if not nodelist:
        raise ValueError("launcher 'slurm' needs SLURM_JOB_NODELIST (or SLURM_NODELIST) to "
                         'find the master node; start the script with srun')
    rank, world_size = _env_int('SLURM_PROCID'), _env_int('SLURM_NTASKS')
    local_size = _slurm_local_size(world_size)
    if 'SLURM_LOCALID' in os.environ:
        local_rank = _env_int('SLURM_LOCALID')
    else:
        # mmengine uses rank % num_gpus, which divides by zero on CPU-only nodes.
        local_rank = rank % local_size
    # The node list is the job's truth; a MASTER_ADDR inherited from the submitting shell
    # would point every node at the wrong host.
    os.environ['MASTER_ADDR'] = _slurm_first_host(nodelist)
    if port is not None:
        os.environ['MASTER_PORT'] = str(int(port))
    else:
        os.environ.setdefault('MASTER_PORT', str(DEFAULT_PORT))
    _export(rank, world_size, local_rank, local_size)
    return rank, world_size, local_rank


def _slurm_local_size(world_size: int) -> int:
    """Tasks on this node, from ``SLURM_TASKS_PER_NODE`` (e.g. ``'2(x3),1'``) and the node id."""
    spec = os.environ.get('SLURM_TASKS_PER_NODE', '')
    counts: list[int] = []
    for part in filter(None, spec.split(',')):
        match = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part.strip())
        if match is None:
            counts = []
            break
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    node_id = _int_or(os.environ.get('SLURM_NODEID'), 0)
    if node_id < len(counts):
        return counts[node_id]
    nnodes = _int_or(os.environ.get('SLURM_NNODES') or os.environ.get('SLURM_JOB_NUM_NODES'), 1)
    return max(1, world_size // max(1, nnodes))


def _from_mpi() -> tuple[int, int, int]:
    _require_env(_OMPI_VARS, 'mpi', 'start the script with mpirun')
    _require_env(('MASTER_ADDR',), 'mpi', 'export MASTER_ADDR=<host of rank 0> before mpirun')
    os.environ.setdefault('MASTER_PORT', str(DEFAULT_PORT))
    rank, world_size = _env_int('OMPI_COMM_WORLD_RANK'), _env_int('OMPI_COMM_WORLD_SIZE')
    local_rank = _env_int('OMPI_COMM_WORLD_LOCAL_RANK')
    local_size = _int_or(os.environ.get('OMPI_COMM_WORLD_LOCAL_SIZE'), world_size)
    _export(rank, world_size, local_rank, local_size)
    return rank, world_size, local_rank


def _export(rank: int, world_size: int, local_rank: int, local_size: int) -> None:
    # Code after init_dist (and torch's env:// rendezvous) reads the torchrun names.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      LOCAL_SIZE=str(local_size), LOCAL_WORLD_SIZE=str(local_size))


def _resolve_backend(backend: str | None) -> str:
    if backend is None:
        return 'nccl' if torch.cuda.is_available() else 'gloo'
    if not isinstance(backend, str) or not backend:
        raise TypeError(f'backend must be a non-empty str such as "gloo" or "nccl", '
                        f'got {backend!r}')
    if 'nccl' in backend.lower() and not torch.cuda.is_available():
        raise ValueError(f'backend {backend!r} needs CUDA, which is not available here; '
                         'use backend="gloo" (or leave backend=None to choose)')
    return backend


def _as_timedelta(timeout: float | timedelta) -> timedelta:
    if isinstance(timeout, timedelta):
        value = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = timedelta(seconds=timeout)
    else:
        raise TypeError(f'timeout must be seconds (int/float) or a timedelta, got {timeout!r}')
    if value.total_seconds() <= 0:
        raise ValueError(f'timeout must be positive, got {timeout!r}')
    return value


def _require_env(names: tuple[str, ...], launcher: str, fix: str) -> None:
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise ValueError(f'launcher {launcher!r} needs the environment variables '
                         f'{", ".join(missing)}, which are not set; {fix}')


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f'environment variable {name}={value!r} is not an integer') from None


def _int_or(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
