"""What a cluster scheduler tells a node (a pod, a VM) about the run it is one node of.

Kubeflow's Trainer (v2) and PyTorchJob (``nprocPerNode``, ``elasticPolicy``), JobSet and
SkyPilot start one container per node and expect it to start that node's processes, with
torchrun or the like, meeting the other nodes at one master. They say so in variables that
name a node, not a process; :func:`read_node_launch` turns them into torchrun's options
(``--nnodes``, ``--node-rank``, ``--nproc-per-node``, ``--master-addr``, ``--master-port``),
each with the variable it came from. The table of every launcher and what each variable
becomes is in :mod:`stratagem.env.launcher`.

Each option is read from the first variable of its list that is set (:data:`NODE_VARIABLES`):
torchrun's own ``PET_*`` first (torchrun reads them as its defaults, and Kubeflow sets them),
then SkyPilot's, then an Indexed Job's (JobSet's pods are one): its ``JOB_COMPLETION_INDEX``
is the node rank, and a JobSet pod's host name ``<jobset>-<job>-<job index>-<pod index>``
names the job's first pod, its master. JobSet sets no count of pods: a manifest states it
as ``PET_NNODES``.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ['NODE_VARIABLES', 'NodeLaunch', 'read_node_launch', 'jobset_master']

#: torchrun's option → the variables that give it, in the order read (``(ips)``: the first or
#: the count of the lines of ``SKYPILOT_NODE_IPS``)
NODE_VARIABLES: dict[str, tuple[str, ...]] = {
    'nnodes': ('PET_NNODES', 'SKYPILOT_NUM_NODES', 'SKYPILOT_NODE_IPS'),
    'node_rank': ('PET_NODE_RANK', 'SKYPILOT_NODE_RANK', 'JOB_COMPLETION_INDEX'),
    'nproc': ('PET_NPROC_PER_NODE', 'SKYPILOT_NUM_GPUS_PER_NODE'),
    'master_addr': ('PET_MASTER_ADDR', 'SKYPILOT_NODE_IPS', 'MASTER_ADDR', 'HOSTNAME'),
    'master_port': ('PET_MASTER_PORT', 'MASTER_PORT'),
    'rdzv_endpoint': ('PET_RDZV_ENDPOINT',),
    'rdzv_id': ('PET_RDZV_ID',),
    'max_restarts': ('PET_MAX_RESTARTS',),
}
#: the variables that make a node launch: one of them set, and this process is one node
_MARKERS = (
    'PET_NNODES', 'PET_NODE_RANK', 'PET_NPROC_PER_NODE', 'PET_MASTER_ADDR', 'PET_RDZV_ENDPOINT',
    'SKYPILOT_NODE_RANK', 'SKYPILOT_NODE_IPS', 'SKYPILOT_NUM_NODES', 'JOB_COMPLETION_INDEX',
)  # fmt: skip
# what sets each family, for messages and ``stratagem env``
_OPERATORS = (
    ('PET_', "Kubeflow (torchrun's PET_* variables)"),
    ('SKYPILOT_', 'SkyPilot'),
    ('JOB_COMPLETION_INDEX', 'an Indexed Job (JobSet)'),
)
# a JobSet pod's host name: <jobset>-<replicated job>-<job index>-<pod index>
_JOBSET_HOST = re.compile(r'^(?P<job>.+-\d+)-(?P<pod>\d+)$')


@dataclass(frozen=True)
class NodeLaunch:
    """torchrun's options for this node, from the scheduler's variables.

    Every option is None where no variable gives it. ``origin`` maps each option that has a
    value to the variable it came from; ``read`` holds every variable consulted, with its
    value, in the order read. ``nproc`` is torchrun's text (a number, or ``auto``/``cpu``/
    ``gpu``); ``nproc_demanded`` tells Kubeflow's ``PET_NPROC_PER_NODE`` (how many processes
    the job runs) from SkyPilot's count of GPUs (a default only)."""

    operator: str
    nnodes: str | None = None
    node_rank: int | None = None
    nproc: str | None = None
    nproc_demanded: bool = False
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int | None = None
    origin: dict[str, str] = field(default_factory=dict)
    read: dict[str, str] = field(default_factory=dict)

    @property
    def max_nodes(self) -> int | None:
        """The number of nodes (the upper bound of an elastic ``MIN:MAX``), or None."""
        if self.nnodes is None:
            return None
        text = self.nnodes.rpartition(':')[2]
        return int(text) if text.isdigit() else None

    def one_of_several(self) -> bool:
        """Whether the variables say this node is one of several."""
        nodes = self.max_nodes
        return (nodes is not None and nodes > 1) or bool(self.node_rank)

    def variables(self) -> str:
        """``NAME=value, ...`` of the variables read (a multi-line value on one line)."""
        return ', '.join(
            f'{k}={v.strip()!r}' if '\n' in v else f'{k}={v}' for k, v in self.read.items()
        )

    def source(self, option: str) -> str:
        """``VARIABLE=value`` that gave ``option``."""
        name = self.origin[option]
        value = self.read[name]
        if name == 'SKYPILOT_NODE_IPS':
            return f'{name}={value.strip()!r}'
        return f'{name}={value}'


def read_node_launch(environ: Mapping[str, str] | None = None) -> NodeLaunch | None:
    """This node's torchrun options from a cluster scheduler's variables, or None when none of
    them is set (:data:`NODE_VARIABLES`). ValueError names a variable whose value is not what
    its scheduler sets (a node rank that is not a number, ...)."""
    env = os.environ if environ is None else environ
    if not any(k in env for k in _MARKERS):
        return None
    read: dict[str, str] = {}
    origin: dict[str, str] = {}
    values: dict[str, object] = {}
    for option, names in NODE_VARIABLES.items():
        for name in names:
            if name not in env:
                continue
            value = _option_value(option, name, env)
            if value is None:
                continue
            read[name] = env[name]
            origin[option] = name
            values[option] = value
            break
    if 'PET_NPROC_PER_NODE' not in read and 'SKYPILOT_NUM_GPUS_PER_NODE' in env:
        read['SKYPILOT_NUM_GPUS_PER_NODE'] = env['SKYPILOT_NUM_GPUS_PER_NODE']
    for name in _MARKERS:  # a marker no option took (a JOB_COMPLETION_INDEX behind PET_*)
        if name in env and name not in read:
            read[name] = env[name]
    operators = [text for prefix, text in _OPERATORS if any(k.startswith(prefix) for k in read)]
    return NodeLaunch(
        operator=' + '.join(operators) or 'torchrun variables',
        nproc_demanded=origin.get('nproc') == 'PET_NPROC_PER_NODE',
        origin=origin,
        read=read,
        **values,  # type: ignore[arg-type]
    )


def _option_value(option: str, name: str, env: Mapping[str, str]) -> object:
    """The option's value from variable ``name``; None where the variable does not give it
    here (SkyPilot's 0 GPUs, a host name that is not a JobSet pod's, MASTER_ADDR without a
    node count or rank of a scheduler)."""
    value = env[name].strip()
    if name == 'SKYPILOT_NODE_IPS':
        ips = [line.strip() for line in value.splitlines() if line.strip()]
        if not ips:
            return None
        return str(len(ips)) if option == 'nnodes' else ips[0]
    if name == 'SKYPILOT_NUM_GPUS_PER_NODE':
        return value if value.isdigit() and int(value) > 0 else None
    if name in ('MASTER_ADDR', 'MASTER_PORT') and not _scheduled(env):
        return None
    if name == 'HOSTNAME':
        return jobset_master(value, socket.getfqdn()) if 'JOB_COMPLETION_INDEX' in env else None
    if option in ('node_rank', 'master_port', 'max_restarts'):
        return _int(name, value)
    if option == 'nnodes':
        _nnodes(name, value)
    return value


def _scheduled(env: Mapping[str, str]) -> bool:
    # MASTER_ADDR/PORT count only beside a scheduler's node variables (a JobSet or SkyPilot
    # task states them): alone they may be a shell's leftovers
    return any(
        k in env
        for k in ('PET_NNODES', 'PET_NODE_RANK', 'JOB_COMPLETION_INDEX', 'SKYPILOT_NODE_RANK')
    )


def jobset_master(hostname: str, fqdn: str = '') -> str | None:
    """The first pod of a JobSet pod's job: ``<jobset>-<job>-<job index>-0``, in the pod's
    own DNS subdomain (the domain of ``fqdn``, when it extends ``hostname``); None for a host
    name that is not a JobSet pod's."""
    match = _JOBSET_HOST.match(hostname.split('.')[0])
    if match is None:
        return None
    host = f'{match.group("job")}-0'
    short = hostname.split('.')[0]
    if fqdn.startswith(short + '.'):
        return host + fqdn[len(short) :]
    return host


def _int(name: str, value: str) -> int:
    if not value.isdigit():
        raise ValueError(f'{name}={value!r} is not a non-negative integer')
    return int(value)


def _nnodes(name: str, value: str) -> None:
    parts = value.split(':')
    if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f'{name}={value!r} is not a number of nodes: N or MIN:MAX')
