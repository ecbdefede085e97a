"""Which launcher started this process, and joining its process group.

``infer_launcher`` reads the environment a launcher leaves behind; ``init_dist`` turns
that environment into an initialised ``torch.distributed`` default group. Both are
safe on a CPU-only machine: CUDA is touched only after ``torch.cuda.is_available()``.

Launchers and the variables read (first match wins, in this order):

=========  ===========================================================================
pytorch    torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``
slurm      an ``srun`` task: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (> 1),
           ``SLURM_LOCALID``, ``SLURM_STEP_NODELIST`` (see :mod:`stratagem.env.slurm`)
mpi        Open MPI ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``, MVAPICH
           ``MV2_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``, MPICH / Intel MPI
           ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``
=========  ===========================================================================
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import slurm as _slurm
from .backend import resolve_backend

logger = logging.getLogger(__name__)

#: the launchers ``init_dist`` accepts besides ``'none'`` (one process, no process group)
LAUNCHERS = ('pytorch', 'slurm', 'mpi')
DEFAULT_PORT = 29500
# torchrun / torch.distributed.run sets all three for every worker.
_TORCHRUN_VARS = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK')
# (implementation, rank, size, local rank candidates, local size candidates)
_MPI_FAMILIES = (
    (
        'Open MPI',
        'OMPI_COMM_WORLD_RANK',
        'OMPI_COMM_WORLD_SIZE',
        ('OMPI_COMM_WORLD_LOCAL_RANK',),
        ('OMPI_COMM_WORLD_LOCAL_SIZE',),
    ),
    (
        'MVAPICH',
        'MV2_COMM_WORLD_RANK',
        'MV2_COMM_WORLD_SIZE',
        ('MV2_COMM_WORLD_LOCAL_RANK',),
        ('MV2_COMM_WORLD_LOCAL_SIZE',),
    ),
    # Hydra (MPICH's and Intel MPI's mpiexec) sets MPI_LOCALRANKID; some PMI builds PMI_LOCAL_*
    (
        'MPICH / Intel MPI',
        'PMI_RANK',
        'PMI_SIZE',
        ('MPI_LOCALRANKID', 'PMI_LOCAL_RANK'),
        ('MPI_LOCALNRANKS', 'PMI_LOCAL_SIZE'),
    ),
)
_PASS_MASTER = (
    'pass it to every rank: mpirun -x MASTER_ADDR -x MASTER_PORT (Open MPI), '
    '-genv MASTER_ADDR <host> (MPICH, Intel MPI), MASTER_ADDR=<host> on the '
    'mpirun_rsh line (MVAPICH)'
)


def infer_launcher() -> str:
    """Name the launcher that started this process, from its environment variables.

    Returns ``'pytorch'`` when torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are
    all set; ``'slurm'`` for a task of an ``srun`` step with more than one task; ``'mpi'``
    when an MPI launcher's rank and size are set (Open MPI, MVAPICH, MPICH / Intel MPI);
    else ``'none'``. The order matters: torchrun inside a Slurm allocation is a torchrun
    job; an mpirun whose daemons Slurm started (the srun step's size differs from the MPI
    world's) is an MPI job.

    Raises RuntimeError in the batch script of a Slurm job with ``SLURM_NTASKS`` > 1 and
    no srun step: that one process would wait for tasks that were never started.
    """
    env = os.environ
    if all(k in env for k in _TORCHRUN_VARS):
        return 'pytorch'
    family = _mpi_family()
    if _slurm.is_srun_step() and _slurm.step_ntasks() > 1:
        if family is not None and _int_or(env.get(family[2]), 0) != _slurm.step_ntasks():
            return 'mpi'
        return 'slurm'
    if family is not None:
        return 'mpi'
    if 'SLURM_PROCID' in env and _slurm.step_ntasks() > 1:
        raise _slurm.batch_step_error()
    return 'none'


def init_dist(
    launcher: str,
    backend: str | None = None,
    timeout: float | timedelta | None = None,
    **kwargs: Any,
) -> None:
    """Initialise the default process group for ``launcher`` ('pytorch', 'slurm', 'mpi').

    Args:
        launcher: how the processes were started; see :func:`infer_launcher`.
        backend: ``torch.distributed`` backend. Default: ``'nccl'`` when CUDA is
            available, ``'gloo'`` otherwise.
        timeout: collective timeout, in seconds or as a ``timedelta``. Default: torch's.
        **kwargs: passed to ``torch.distributed.init_process_group`` (``init_method``,
            ``store``, ...). For ``'slurm'``, ``port`` sets ``MASTER_PORT``.

    Sets the environment variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_SIZE`` for 'slurm' and 'mpi' (torchrun already did for 'pytorch'), only once
    every check below has passed (an error changes nothing), and binds
    the process to ``cuda:LOCAL_RANK`` only when CUDA is available. A group that a host
    trainer already initialised is used as it is, whatever ``launcher`` says ('none'
    included); without one, 'none' is an error.

    The master (rank 0's host) for the ``env://`` rendezvous: a ``MASTER_ADDR`` /
    ``MASTER_PORT`` already set is respected by every launcher. Under Slurm, the address
    defaults to the first host of the step's node list and the port to
    ``stratagem.env.slurm.master_port`` of ``SLURM_JOB_ID`` (15000-29999; 29500
    without a job id); under mpirun, ``MASTER_ADDR`` must be exported (port default
    29500). A host that does not resolve fails here, naming where it came from, instead
    of timing out in the rendezvous; so does a loopback master in a multi-node Slurm step.
    """
    if launcher not in LAUNCHERS + ('none',):
        raise ValueError(
            f'unknown launcher {launcher!r}; valid launchers: {", ".join(map(repr, LAUNCHERS))}'
        )
    if dist.is_available() and dist.is_initialized():
        # Respect the host trainer's group: re-initialising would raise or, worse, split it.
        logger.info(
            'torch.distributed is already initialised (backend=%s, rank %d of %d); '
            'using the existing process group',
            dist.get_backend(),
            dist.get_rank(),
            dist.get_world_size(),
        )
        return
    if launcher == 'none':
        raise ValueError(
            "launcher 'none' means a single process and no process group exists "
            'to use; start the script with torchrun/srun/mpirun, or pass one of '
            f'{", ".join(map(repr, LAUNCHERS))}'
        )
    if not dist.is_available():
        raise RuntimeError(
            'torch.distributed is not available in this torch build '
            f'({torch.__version__}); launcher {launcher!r} needs it'
        )
    backend = resolve_backend(backend)
    if timeout is not None:
        kwargs['timeout'] = _as_timedelta(timeout)
    env_rendezvous = kwargs.get('init_method') in (None, 'env://') and kwargs.get('store') is None
    # each reader returns the variables to export; nothing changes until every check passed
    if launcher == 'pytorch':
        rank, world_size, local_rank = _from_torchrun(env_rendezvous)
        exports: dict[str, str] = {}
        where, nodes = 'MASTER_ADDR, set by torchrun (--master-addr / --rdzv-endpoint)', 1
    elif launcher == 'slurm':
        rank, world_size, local_rank, exports, where = _from_slurm(kwargs.pop('port', None))
        nodes = _slurm.num_nodes()
    else:
        rank, world_size, local_rank, exports, where = _from_mpi(env_rendezvous)
        nodes = 1
    if env_rendezvous:
        merged = {**os.environ, **exports}
        resolve_master(merged['MASTER_ADDR'], int(merged['MASTER_PORT']), where, nodes)
        logger.info('rendezvous at %s:%s (%s)', merged['MASTER_ADDR'], merged['MASTER_PORT'], where)
    cuda = torch.cuda.is_available()
    if cuda and local_rank >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(
            f'local rank {local_rank} has no GPU: {count} visible; start at '
            f'most {count} processes per node or set CUDA_VISIBLE_DEVICES'
        )
    # code after init_dist (and torch's env:// rendezvous) reads the torchrun names
    os.environ.update(exports)
    if cuda:
        torch.cuda.set_device(local_rank)
    if launcher == 'pytorch' and env_rendezvous:  # each torchrun attempt its own keys
        from .store import elastic_attempt_store

        store = elastic_attempt_store(kwargs.get('timeout'))
        if store is not None:
            kwargs.pop('init_method', None)
            kwargs['store'] = store
    kwargs.setdefault('rank', rank)
    kwargs.setdefault('world_size', world_size)
    dist.init_process_group(backend=backend, **kwargs)
    logger.info(
        'initialised torch.distributed: launcher=%s backend=%s rank %d of %d (local rank %d)',
        launcher,
        backend,
        rank,
        world_size,
        local_rank,
    )


def _from_torchrun(env_rendezvous: bool) -> tuple[int, int, int]:
    _require_env(_TORCHRUN_VARS, 'pytorch', 'start the script with torchrun')
    if env_rendezvous:
        _require_env(
            ('MASTER_ADDR', 'MASTER_PORT'),
            'pytorch',
            'start the script with torchrun or pass init_method=/store=',
        )
        _port(os.environ['MASTER_PORT'], 'MASTER_PORT')
    return _env_int('RANK'), _env_int('WORLD_SIZE'), _env_int('LOCAL_RANK')


def _from_slurm(port: int | None) -> tuple[int, int, int, dict[str, str], str]:
    if not _slurm.is_srun_step():
        if 'SLURM_PROCID' in os.environ and _slurm.step_ntasks() > 1:
            raise _slurm.batch_step_error()
        _require_env(
            ('SLURM_PROCID', 'SLURM_STEP_ID'),
            'slurm',
            'start the tasks with srun (`srun python train.py ...`)',
        )
    nodes, source = _slurm.nodelist()
    rank, world_size = _env_int('SLURM_PROCID'), _slurm.step_ntasks()
    local_size = _slurm.local_size(world_size)
    if 'SLURM_LOCALID' in os.environ:
        local_rank = _env_int('SLURM_LOCALID')
    else:
        # mmengine uses rank % num_gpus, which divides by zero on CPU-only nodes.
        local_rank = rank % local_size
    # A user's MASTER_ADDR wins over the node list (e.g. rank 0's fast interface); a stale
    # one inherited from the submitting shell is caught by resolve_master when it is a
    # loopback address or does not resolve.
    exports = _rank_vars(rank, world_size, local_rank, local_size)
    if 'MASTER_ADDR' in os.environ:
        where = 'MASTER_ADDR, set in the environment of the job step'
    else:
        exports['MASTER_ADDR'] = _slurm.first_host(nodes)
        where = f'the first host of {source}={nodes!r}'
    if port is not None:
        exports['MASTER_PORT'] = str(_port(port, 'init_dist(port=...)'))
    elif 'MASTER_PORT' in os.environ:
        _port(os.environ['MASTER_PORT'], 'MASTER_PORT')
    else:
        job = os.environ.get('SLURM_JOB_ID') or os.environ.get('SLURM_JOBID')
        exports['MASTER_PORT'] = str(_slurm.master_port(job) if job else DEFAULT_PORT)
    return rank, world_size, local_rank, exports, where


def _from_mpi(env_rendezvous: bool) -> tuple[int, int, int, dict[str, str], str]:
    family = _mpi_family()
    if family is None:
        names = '; '.join(f'{f[0]}: {f[1]}, {f[2]}' for f in _MPI_FAMILIES)
        raise ValueError(
            "launcher 'mpi' needs the rank and size an MPI launcher sets, and "
            f'none are set ({names}); start the script with mpirun / mpiexec'
        )
    name, rank_var, size_var, local_vars, size_vars = family
    local_var = next((v for v in local_vars if v in os.environ), None)
    if local_var is None:
        raise ValueError(
            f"launcher 'mpi' ({name}: {rank_var}, {size_var} are set) needs the "
            f'rank on the node from {" or ".join(local_vars)}, which is not set; '
            "start the script with the implementation's own mpirun / mpiexec"
        )
    if env_rendezvous:
        _require_env(
            ('MASTER_ADDR',), 'mpi', f'export MASTER_ADDR=<host of rank 0> and {_PASS_MASTER}'
        )
    rank, world_size, local_rank = _env_int(rank_var), _env_int(size_var), _env_int(local_var)
    size_var = next((v for v in size_vars if v in os.environ), None)
    local_size = _env_int(size_var) if size_var else world_size
    exports = _rank_vars(rank, world_size, local_rank, local_size)
    if 'MASTER_PORT' in os.environ:
        _port(os.environ['MASTER_PORT'], 'MASTER_PORT')
    else:
        exports['MASTER_PORT'] = str(DEFAULT_PORT)
    return rank, world_size, local_rank, exports, f'MASTER_ADDR, exported to the {name} ranks'


def _mpi_family() -> tuple | None:
    """The first MPI implementation whose rank and size variables are both set."""
    for family in _MPI_FAMILIES:
        if family[1] in os.environ and family[2] in os.environ:
            return family
    return None


def resolve_master(host: str, port: int, where: str, nodes: int = 1) -> None:
    """Check that the rendezvous host ``host`` resolves, before anything waits on it.

    ``where`` names the host's origin in the error (a variable, a node list, a command-line
    option). With ``nodes`` > 1, a host that resolves only to loopback addresses is an
    error too: the other nodes would wait for their own machine. ValueError otherwise.
    """
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(
            f'the master host {host!r} (from {where}) does not resolve: {exc}; '
            'give a name or address of the rank-0 node that every node can '
            'resolve'
        ) from None
    if nodes > 1 and all(
        ipaddress.ip_address(i[4][0].split('%')[0]).is_loopback  # type: ignore[union-attr]
        for i in infos
    ):
        raise ValueError(
            f'the master host {host!r} (from {where}) is a loopback address, '
            f'but the job step spans {nodes} nodes, which cannot reach it; unset '
            'MASTER_ADDR (the first host of the node list is used) or set it to '
            "the rank-0 node's name"
        )


def _port(value: Any, name: str) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f'{name}={value!r} is not a TCP port; give an integer in 1-65535')
    return port


def _rank_vars(rank: int, world_size: int, local_rank: int, local_size: int) -> dict[str, str]:
    """The torchrun names of a rank's place, for code that reads them after init_dist."""
    return dict(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_SIZE=str(local_size),
        LOCAL_WORLD_SIZE=str(local_size),
    )


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
        raise ValueError(
            f'launcher {launcher!r} needs the environment variables '
            f'{", ".join(missing)}, which are not set; {fix}'
        )


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
