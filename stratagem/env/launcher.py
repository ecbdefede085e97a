"""Which launcher started this process, and joining its process group.

``infer_launcher`` reads the environment a launcher leaves behind; ``init_dist`` turns
that environment into an initialised ``torch.distributed`` default group. Both are
safe on a CPU-only machine: CUDA is touched only after ``torch.cuda.is_available()``.
``describe_launch`` says what was inferred and from which variables (``stratagem env``).

Launchers that give each process its rank (``infer_launcher``; first match wins, in this
order):

==================  ===========================================================  ========
who starts it       variables read                                               launcher
==================  ===========================================================  ========
torchrun            ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,                    pytorch
                    ``MASTER_ADDR/PORT`` (also torchrun under any scheduler
                    below, and Ray Train's workers)
Slurm ``srun``      ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (> 1),            slurm
                    ``SLURM_LOCALID``, ``SLURM_STEP_NODELIST``
                    (:mod:`stratagem.env.slurm`)
MPI                 Open MPI ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,            mpi
                    LOCAL_SIZE}``, MVAPICH ``MV2_COMM_WORLD_{...}`` (the same),
                    MPICH / Intel MPI ``PMI_RANK``, ``PMI_SIZE``,
                    ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``
Kubeflow            ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``   pytorch
PyTorchJob pod      and no ``LOCAL_RANK``: a pod that runs ``python train.py``
                    (or ``stratagem train``) is one process of the world;
                    ``LOCAL_RANK`` becomes 0, ``LOCAL_WORLD_SIZE`` 1
==================  ===========================================================  ========

Schedulers that start one container per node, which must start that node's processes
(:mod:`stratagem.env.cluster`): ``stratagem train CONFIG`` starts torchrun with these
options, each from the first variable set; ``--nproc``, ``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port`` given on the command line must agree with them:

====================  ========================================================================
torchrun option       variables read, in order (who sets them)
====================  ========================================================================
``--nnodes``          ``PET_NNODES`` (Kubeflow Trainer v2 TrainJob; PyTorchJob with
                      ``nprocPerNode`` or ``elasticPolicy``, ``MIN:MAX`` elastic),
                      ``SKYPILOT_NUM_NODES``, the line count of ``SKYPILOT_NODE_IPS``
                      (SkyPilot)
``--node-rank``       ``PET_NODE_RANK`` (Kubeflow), ``SKYPILOT_NODE_RANK`` (SkyPilot),
                      ``JOB_COMPLETION_INDEX`` (JobSet, any Indexed Job)
``--nproc-per-node``  ``PET_NPROC_PER_NODE`` (Kubeflow; a number, or ``auto``/``cpu``/
                      ``gpu`` resolved as torchrun does), else ``SKYPILOT_NUM_GPUS_PER_NODE``
                      when > 0 (SkyPilot; a default, ``--nproc`` may differ), else 1
``--master-addr``     ``PET_MASTER_ADDR`` (Kubeflow), the first line of ``SKYPILOT_NODE_IPS``
                      (SkyPilot), ``MASTER_ADDR`` (a JobSet manifest's), else a JobSet pod's
                      ``HOSTNAME`` ``<jobset>-<job>-<i>-<pod>`` as ``<jobset>-<job>-<i>-0``
                      in the pod's DNS subdomain
``--master-port``     ``PET_MASTER_PORT`` (Kubeflow), ``MASTER_PORT``, else torchrun's 29500
``--rdzv-endpoint``   ``PET_RDZV_ENDPOINT`` (Kubeflow PyTorchJob ``elasticPolicy``)
``--rdzv-id``         ``PET_RDZV_ID`` (the same)
``--max-restarts``    ``PET_MAX_RESTARTS`` (the same)
====================  ========================================================================

JobSet sets no count of pods: its manifest states it as ``PET_NNODES`` (and
``PET_NODE_RANK``, ``PET_MASTER_ADDR`` where it wants them named). A process started alone
(no process group coming) whose environment says it is one of several is refused before
anything trains, naming the variables: ``WORLD_SIZE`` > 1 without ``RANK``, ``MASTER_ADDR``
and ``MASTER_PORT``; a node count > 1 or a node rank > 0 from the table above; a Slurm batch
script of several tasks. ``launcher='none'`` (``stratagem train --launcher none``) trains
alone on purpose.
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
from .cluster import NodeLaunch, read_node_launch

logger = logging.getLogger(__name__)

#: the launchers ``init_dist`` accepts besides ``'none'`` (one process, no process group)
LAUNCHERS = ('pytorch', 'slurm', 'mpi')
DEFAULT_PORT = 29500
# torchrun / torch.distributed.run sets all three for every worker.
_TORCHRUN_VARS = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK')
# what torch's env:// rendezvous needs: a launcher that sets these and no LOCAL_RANK (a
# Kubeflow PyTorchJob pod) gave this one process its place in the world
_POD_VARS = ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')
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
    ``'pytorch'`` when ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are
    set without ``LOCAL_RANK`` (a Kubeflow PyTorchJob pod: one process per pod); else
    ``'none'``. The order matters: torchrun inside a Slurm allocation is a torchrun job; an
    mpirun whose daemons Slurm started (the srun step's size differs from the MPI world's)
    is an MPI job.

    Raises RuntimeError, before anything trains, when this process would be alone while
    its environment says it is one of several (and no process group exists already): the
    batch script of a Slurm job with ``SLURM_NTASKS`` > 1 and no srun step; ``WORLD_SIZE``
    > 1 without the rest of env://'s variables; a node of a scheduler that starts one
    container per node (Kubeflow ``PET_*``, JobSet, SkyPilot: the module's table) whose
    node count is > 1 or node rank > 0. The message names the variables and the fix;
    ``launcher='none'``, given rather than inferred, trains alone on purpose.
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
    if all(k in env for k in _POD_VARS):
        return 'pytorch'
    if 'SLURM_PROCID' in env and _slurm.step_ntasks() > 1:
        raise _slurm.batch_step_error()
    if not (dist.is_available() and dist.is_initialized()):
        error = alone_error()
        if error is not None:
            raise error
    return 'none'


def alone_error(node: NodeLaunch | None = None) -> RuntimeError | None:
    """The error for a process started alone whose environment says it is one of several
    (``node``: the node launch read from it, default :func:`read_node_launch`), or None."""
    env = os.environ
    if _int_or(env.get('WORLD_SIZE'), 1) > 1:
        seen = ', '.join(f'{k}={env[k]}' for k in (*_TORCHRUN_VARS, *_POD_VARS[2:]) if k in env)
        missing = ', '.join(k for k in _POD_VARS if k not in env)
        return RuntimeError(
            f'this process would train alone, but its environment says it is one of '
            f'{env["WORLD_SIZE"]} ({seen}) and {missing} are not set, so no process group '
            "can form (torch's env:// needs RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). "
            'Set all four (a Kubeflow PyTorchJob sets them in every pod), start it with '
            "torchrun, or pass launcher='none' (`stratagem train --launcher none`) to train "
            'alone on purpose'
        )
    node = read_node_launch() if node is None else node
    if node is None or not node.one_of_several():
        return None
    count = (
        ''
        if node.max_nodes is not None
        else ' The number of nodes is not among them (JobSet sets none): state it in the '
        'manifest as PET_NNODES, or give `stratagem train --nnodes N`.'
    )
    return RuntimeError(
        f'this process would train alone, but {node.operator} says this node is one of '
        f'several: {node.variables()}.{count} Start the node with `stratagem train CONFIG` (it '
        'starts torchrun with --nnodes, --node-rank, --nproc-per-node, --master-addr from '
        "these variables; torchrun itself reads PET_*), or pass launcher='none' "
        '(`stratagem train --launcher none`) to train alone on purpose'
    )


def describe_launch() -> dict[str, str]:
    """What :func:`infer_launcher` infers here and why, as ``stratagem env`` prints it: the
    launcher (or the refusal), who started this process, world size, rank, local rank, the
    master, a scheduler's node launch (the torchrun options ``stratagem train`` takes from
    it) and every launcher variable that is set."""
    env = os.environ
    out: dict[str, str] = {}
    launcher: str | None = None
    try:
        launcher = out['launcher'] = infer_launcher()
    except RuntimeError as err:
        out['launcher'] = f'refused: {err}'
    place = _place(launcher)
    if place is not None:
        who, world, rank, local, master = place
        out.update({'started by': who, 'world size': world, 'rank': rank, 'local rank': local})
        out['master'] = master
    node = read_node_launch()
    if node is not None:
        out['node launch'] = node.operator
        out['nodes'] = node.nnodes or 'not set'
        out['node rank'] = '' if node.node_rank is None else str(node.node_rank)
        options = [
            f'{_FLAGS[option]} {getattr(node, option)} (from {node.source(option)})'
            for option in ('nnodes', 'node_rank', 'nproc', 'master_addr', 'master_port')
            if option in node.origin
        ]
        out['stratagem train starts torchrun with'] = '; '.join(options) or 'nothing from here'
    seen = [k for k in sorted(env) if _is_launch_variable(k)]
    out['variables read'] = ', '.join(f'{k}={env[k]!r}' for k in seen) or 'none set'
    return out


_FLAGS = {
    'nnodes': '--nnodes',
    'node_rank': '--node-rank',
    'nproc': '--nproc-per-node',
    'master_addr': '--master-addr',
    'master_port': '--master-port',
}


def _place(launcher: str | None) -> tuple[str, str, str, str, str] | None:
    """(who started it, world size, rank, local rank, master) of an inferred launcher."""
    env = os.environ
    master = f'{env.get("MASTER_ADDR", "?")}:{env.get("MASTER_PORT", "?")}'
    if launcher == 'pytorch':
        if 'LOCAL_RANK' in env:
            who, local = 'torchrun (RANK, WORLD_SIZE, LOCAL_RANK)', env['LOCAL_RANK']
        else:
            who = (
                'a pod with RANK, WORLD_SIZE, MASTER_ADDR/PORT and no LOCAL_RANK '
                '(Kubeflow PyTorchJob)'
            )
            local = '0 (one process per pod)'
        return who, env['WORLD_SIZE'], env['RANK'], local, master
    if launcher == 'slurm':
        return (
            'srun (a task of a Slurm job step)',
            str(_slurm.step_ntasks()),
            env.get('SLURM_PROCID', '?'),
            env.get('SLURM_LOCALID', '?'),
            master if 'MASTER_ADDR' in env else 'the first host of the step node list',
        )
    if launcher == 'mpi':
        family = _mpi_family()
        assert family is not None
        local = next((env[v] for v in family[3] if v in env), '?')
        return f'mpirun ({family[0]})', env[family[2]], env[family[1]], local, master
    return None


def _is_launch_variable(name: str) -> bool:
    from .cluster import NODE_VARIABLES

    node = {n for names in NODE_VARIABLES.values() for n in names if n != 'HOSTNAME'}
    mpi = {n for f in _MPI_FAMILIES for n in (f[1], f[2], *f[3], *f[4])}
    return (
        name in (*_TORCHRUN_VARS, *_POD_VARS, 'LOCAL_WORLD_SIZE', 'JOB_COMPLETION_INDEX')
        or name in node
        or name in mpi
        or name.startswith(('SLURM_', 'PET_', 'SKYPILOT_'))
    )


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
        rank, world_size, local_rank, exports, where = _from_torchrun(env_rendezvous)
        nodes = 1
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


def _from_torchrun(env_rendezvous: bool) -> tuple[int, int, int, dict[str, str], str]:
    if 'LOCAL_RANK' not in os.environ and all(k in os.environ for k in _POD_VARS):
        # a PyTorchJob pod: the operator gave this one process its rank, one per pod
        rank, world_size = _env_int('RANK'), _env_int('WORLD_SIZE')
        _port(os.environ['MASTER_PORT'], 'MASTER_PORT')
        exports = {'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '1', 'LOCAL_SIZE': '1'}
        where = 'MASTER_ADDR, set in the environment (one process per pod: no LOCAL_RANK)'
        return rank, world_size, 0, exports, where
    _require_env(_TORCHRUN_VARS, 'pytorch', 'start the script with torchrun')
    if env_rendezvous:
        _require_env(
            ('MASTER_ADDR', 'MASTER_PORT'),
            'pytorch',
            'start the script with torchrun or pass init_method=/store=',
        )
        _port(os.environ['MASTER_PORT'], 'MASTER_PORT')
    where = 'MASTER_ADDR, set by torchrun (--master-addr / --rdzv-endpoint)'
    return _env_int('RANK'), _env_int('WORLD_SIZE'), _env_int('LOCAL_RANK'), {}, where


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
