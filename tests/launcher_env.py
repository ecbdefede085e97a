"""The launcher variables that tests remove: the one list.

A process that finds any of these believes a launcher started it: ``infer_launcher`` names
torchrun, Slurm or an MPI (or refuses a process alone that a scheduler's variables make one of
several nodes), ``init_dist`` joins that launcher's group, the logger takes its rank,
``stratagem train`` takes its nodes from Kubeflow's, JobSet's or SkyPilot's variables. A
test that starts a process as from a clean shell (``dist_harness``, the ``stratagem train``
runs of ``failure_helpers``, the two-node runs), or empties the
environment for an in-process check (the ``clean_env`` fixture of ``tests/conftest.py``),
removes exactly these.

The list holds every variable :mod:`stratagem.env` reads to find its launcher, rank and
world size (``tests/env/test_launcher.py`` checks it against the library's own tuples),
and what torchrun and its elastic agent set besides.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ['NAMES', 'PREFIXES', 'TORCHRUN_NAMES', 'is_launcher_variable', 'without_launcher']

#: what torchrun sets for each worker (its elastic agent's ``TORCHELASTIC_*`` are prefixes)
TORCHRUN_NAMES = (
    'RANK',
    'WORLD_SIZE',
    'LOCAL_RANK',
    'LOCAL_WORLD_SIZE',
    'GROUP_RANK',
    'GROUP_WORLD_SIZE',
    'ROLE_RANK',
    'ROLE_WORLD_SIZE',
    'ROLE_NAME',
    'MASTER_ADDR',
    'MASTER_PORT',
)
#: every name: torchrun's, ``LOCAL_SIZE``, which ``init_dist`` exports under Slurm and MPI, and
#: an Indexed Job's (JobSet's) pod index
NAMES = (*TORCHRUN_NAMES, 'LOCAL_SIZE', 'JOB_COMPLETION_INDEX')
#: Slurm, Open MPI, MPICH / Intel MPI (PMI, Hydra's MPI_LOCAL*), PMIx, MVAPICH, torchelastic,
#: torchrun's option defaults (Kubeflow's PET_*), SkyPilot
PREFIXES = (
    'SLURM_',
    'OMPI_',
    'PMI_',
    'PMIX_',
    'MV2_',
    'MPI_LOCAL',
    'TORCHELASTIC_',
    'PET_',
    'SKYPILOT_',
)


def is_launcher_variable(name: str) -> bool:
    """Whether a launcher sets ``name`` (one of :data:`NAMES`, or starts with a prefix)."""
    return name in NAMES or name.startswith(PREFIXES)


def without_launcher(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) without any launcher variable."""
    source = os.environ if env is None else env
    return {k: v for k, v in source.items() if not is_launcher_variable(k)}
