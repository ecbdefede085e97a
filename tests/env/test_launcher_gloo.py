"""Two real gloo ranks started with only MPICH's or MVAPICH's variables (as mpiexec /
mpirun_rsh with ``-x MASTER_ADDR -x MASTER_PORT``), and what they print once or per rank
(MVAPICH's in the slow tier)."""

import pytest

from dist_harness import run_distributed
from launcher_env import TORCHRUN_NAMES

# torchrun's variables that the harness sets, removed: the ranks must find themselves (the
# MPI launchers pass MASTER_ADDR and MASTER_PORT on: -x, -genv)
NO_TORCHRUN = dict.fromkeys(
    [n for n in TORCHRUN_NAMES if not n.startswith('MASTER_')] + ['MKL_NUM_THREADS']
)
# a callable value is called with the rank: `str` gives each rank its own number
MPICH = dict(NO_TORCHRUN, PMI_RANK=str, PMI_SIZE='2', MPI_LOCALRANKID=str, MPI_LOCALNRANKS='2')
MVAPICH = dict(
    NO_TORCHRUN,
    MV2_COMM_WORLD_RANK=str,
    MV2_COMM_WORLD_SIZE='2',
    MV2_COMM_WORLD_LOCAL_RANK=str,
    MV2_COMM_WORLD_LOCAL_SIZE='2',
)


def mpi_rank_checks():
    import logging
    import os
    import warnings

    import torch

    from stratagem import env

    seen = {
        'launcher': env.infer_launcher(),
        'torchrun_vars': [k for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK') if k in os.environ],
    }
    env.init_dist(seen['launcher'], timeout=30)
    seen.update(
        dist_info=env.get_dist_info(),
        local_rank=env.get_local_rank(),
        exported=(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_SIZE']),
        gathered=env.all_gather_object(env.get_rank()),
        total=env.all_reduce(torch.tensor([env.get_rank() + 1.0])).tolist(),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        env.warn_rank_zero('the same on every rank')
        env.warn_per_rank('about this rank')
    seen['warnings'] = [str(w.message) for w in caught]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    resources = logging.getLogger('stratagem.env.resources')
    resources.addHandler(handler)
    resources.setLevel(logging.INFO)
    env.setup_multi_processing(distributed=True)  # OMP_NUM_THREADS is set, MKL is not
    seen['thread_lines'] = [r.getMessage() for r in records if 'NUM_THREADS=1' in r.getMessage()]
    seen['mkl'] = os.environ.get('MKL_NUM_THREADS')
    return seen


# MVAPICH's ranks take the same path as MPICH's with another row of the launcher's table,
# which test_launcher.py reads for every family in this process: its gloo run is the slow
# tier's repetition
@pytest.mark.parametrize(
    'variables',
    [MPICH, pytest.param(MVAPICH, marks=pytest.mark.slow)],
    ids=['mpich', 'mvapich'],
)
def test_two_ranks_from_mpi_variables(variables):
    r0, r1 = run_distributed(mpi_rank_checks, nproc=2, env=variables, timeout=120)
    for rank, seen in enumerate((r0, r1)):
        assert seen['launcher'] == 'mpi' and seen['torchrun_vars'] == []
        assert seen['dist_info'] == (rank, 2) and seen['local_rank'] == rank
        assert seen['exported'] == (str(rank), '2', '2')
        assert seen['gathered'] == [0, 1] and seen['total'] == [3.0]
        assert seen['mkl'] == '1'  # set on every rank ...
    assert r0['thread_lines'] == [
        'set MKL_NUM_THREADS=1 in each process to avoid overloading '
        'the machine; set it yourself to tune'
    ]
    assert r1['thread_lines'] == []  # ... and said once
    assert r0['warnings'] == ['the same on every rank', '[rank 0] about this rank']
    assert r1['warnings'] == ['[rank 1] about this rank']
