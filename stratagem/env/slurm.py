"""What a Slurm job step tells a process: its task, the step's size and nodes, the master.

Slurm gives a batch script (``sbatch``) and the tasks of a job step (``srun``) different
environments. Both have ``SLURM_JOB_ID``, ``SLURM_NTASKS`` and, in the batch step, also
``SLURM_PROCID=0``; only ``srun`` adds the step's variables: ``SLURM_STEP_ID``,
``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE``. So a
process is one task of a parallel step exactly when those are present; a batch script
that runs ``python train.py`` itself is one process, whatever ``SLURM_NTASKS`` says.
"""

from __future__ import annotations

import os
import re
import subprocess
import zlib
from collections.abc import Mapping

# srun sets both spellings (SLURM_STEPID is the obsolete one); the batch step sets neither.
_STEP_ID_VARS = ('SLURM_STEP_ID', 'SLURM_STEPID')
_NODELIST_VARS = ('SLURM_STEP_NODELIST', 'SLURM_JOB_NODELIST', 'SLURM_NODELIST')
# MASTER_PORT derived from the job id: 15000-29999, above the privileged ports and below
# Linux's ephemeral range (32768-60999), so the OS does not hand it to a client socket.
PORT_BASE, PORT_SPAN = 15000, 15000


def is_srun_step(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process is a task started by ``srun`` (not the batch script)."""
    env = os.environ if environ is None else environ
    return 'SLURM_PROCID' in env and any(k in env for k in _STEP_ID_VARS)


def step_ntasks(environ: Mapping[str, str] | None = None) -> int:
    """Tasks of this step: ``SLURM_STEP_NUM_TASKS`` (an ``srun -n`` smaller than the job's
    ``--ntasks`` changes only that), else ``SLURM_NTASKS``; 1 when neither is a number."""
    env = os.environ if environ is None else environ
    for name in ('SLURM_STEP_NUM_TASKS', 'SLURM_NTASKS'):
        value = env.get(name, '')
        if value.isdigit():
            return int(value)
    return 1


def batch_step_error() -> RuntimeError:
    """The error for a multi-task allocation whose batch script runs the trainer itself."""
    env = os.environ
    ntasks = env.get('SLURM_NTASKS', '?')
    return RuntimeError(
        f'this process runs in the batch script of Slurm job {env.get("SLURM_JOB_ID", "?")} '
        f'(SLURM_NTASKS={ntasks}, SLURM_PROCID={env.get("SLURM_PROCID", "?")}, no '
        'SLURM_STEP_ID): only this one process was started, and a process group of '
        f'{ntasks} would wait for tasks that never come. Start the tasks with srun in the '
        'sbatch script (`srun python train.py ...` or `srun stratagem train CONFIG`), or '
        "pass launcher='none' (`stratagem train --launcher none`) to run a single process"
    )


def master_port(job_id: str | int) -> int:
    """The ``MASTER_PORT`` used for Slurm job ``job_id`` when none is set.

    ``15000 + job_id % 15000``: two jobs sharing a node get different ports (unless their
    ids differ by a multiple of 15000), instead of both taking torch's 29500, where the
    second job's rank 0 fails with EADDRINUSE and its other ranks join the first job.
    A non-numeric id is hashed (CRC-32).
    """
    text = str(job_id).strip()
    number = int(text) if text.isdigit() else zlib.crc32(text.encode())
    return PORT_BASE + number % PORT_SPAN


def nodelist() -> tuple[str, str]:
    """``(node list, variable it came from)`` of this step; ValueError without one."""
    for name in _NODELIST_VARS:
        value = os.environ.get(name)
        if value:
            return value, name
    raise ValueError(
        "launcher 'slurm' needs SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST, "
        'SLURM_NODELIST) to find the master node; start the script with srun'
    )


def num_nodes(environ: Mapping[str, str] | None = None) -> int:
    """Nodes of this step (``SLURM_STEP_NUM_NODES``, else the job's); 1 when unknown."""
    env = os.environ if environ is None else environ
    for name in ('SLURM_STEP_NUM_NODES', 'SLURM_NNODES', 'SLURM_JOB_NUM_NODES'):
        value = env.get(name, '')
        if value.isdigit():
            return int(value)
    return 1


def local_size(world_size: int) -> int:
    """Tasks on this node, from ``SLURM_STEP_TASKS_PER_NODE`` (e.g. ``'2(x3),1'``, else the
    job's ``SLURM_TASKS_PER_NODE``) and ``SLURM_NODEID``."""
    env = os.environ
    spec = env.get('SLURM_STEP_TASKS_PER_NODE') or env.get('SLURM_TASKS_PER_NODE', '')
    counts: list[int] = []
    for part in filter(None, spec.split(',')):
        match = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part.strip())
        if match is None:
            counts = []
            break
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    node = env.get('SLURM_NODEID', '')
    node_id = int(node) if node.isdigit() else 0
    if node_id < len(counts):
        return counts[node_id]
    return max(1, world_size // num_nodes())


def first_host(nodes: str) -> str:
    """First host of a node list: ``scontrol`` is authoritative; the parser is a fallback."""
    try:
        out = subprocess.run(
            ['scontrol', 'show', 'hostnames', nodes],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return expand_slurm_nodelist(nodes)[0]


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
    prefix, suffixes = item[: match.start()], _expand_host(item[match.end() :], original)
    names: list[str] = []
    for part in match.group(1).split(','):
        bounds = part.split('-')
        if not all(b.isdigit() for b in bounds) or len(bounds) > 2:
            raise ValueError(
                f'bad range {part!r} in Slurm node list {original!r}; '
                'expected numbers like 01-03 or 7'
            )
        lo, hi = int(bounds[0]), int(bounds[-1])
        if lo > hi:
            raise ValueError(f'descending range {part!r} in Slurm node list {original!r}')
        width = len(bounds[0])
        names.extend(
            f'{prefix}{i:0{width}d}{suffix}' for i in range(lo, hi + 1) for suffix in suffixes
        )
    return names
