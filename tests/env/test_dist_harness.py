"""tests/dist_harness.py: results by rank, torchrun's environment, failures and timeouts.

The worker functions import nothing heavy, so each run costs only interpreter start-up.
"""

import os
import sys
import time

import pytest

from dist_harness import RankFailure, run_distributed

ENV_NAMES = (
    'RANK',
    'WORLD_SIZE',
    'LOCAL_RANK',
    'LOCAL_WORLD_SIZE',
    'MASTER_ADDR',
    'MASTER_PORT',
    'OMP_NUM_THREADS',
    'GLOO_SOCKET_IFNAME',
    'SLURM_PROCID',
    'EXTRA',
)


def report_env(scale):
    return {name: os.environ.get(name) for name in ENV_NAMES}, int(os.environ['RANK']) * scale


def fail_on_rank_1():
    if os.environ['RANK'] == '1':
        raise ValueError('boom on rank 1')
    time.sleep(60)  # rank 0 waits as if in a collective with the dead rank


def sleep_forever():
    time.sleep(60)


def die_hard():
    if os.environ['RANK'] == '0':
        print('about to die', flush=True)
        os._exit(3)


def test_results_by_rank_and_torchrun_env(clean_env):
    clean_env['SLURM_PROCID'] = '9'  # the caller's launcher variables do not leak in
    results = run_distributed(report_env, nproc=2, args=(10,), env={'EXTRA': 'x'}, timeout=30)
    (env0, value0), (env1, value1) = results
    assert (value0, value1) == (0, 10)
    port = env0['MASTER_PORT']
    assert port.isdigit() and env1['MASTER_PORT'] == port
    for rank, env in enumerate((env0, env1)):
        assert env == dict(
            RANK=str(rank),
            WORLD_SIZE='2',
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE='2',
            MASTER_ADDR='127.0.0.1',
            MASTER_PORT=port,
            OMP_NUM_THREADS='1',
            GLOO_SOCKET_IFNAME=env0['GLOO_SOCKET_IFNAME'],
            SLURM_PROCID=None,
            EXTRA='x',
        )


def test_rank_exception_is_reraised_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure, match='rank 1 raised') as info:
        run_distributed(fail_on_rank_1, nproc=2, timeout=30, grace=0.5)
    assert time.monotonic() - start < 15  # rank 0 was killed, not waited for
    failure = info.value
    assert failure.rank == 1 and 'ValueError: boom on rank 1' in failure.remote_traceback
    assert 'in fail_on_rank_1' in failure.remote_traceback
    assert isinstance(failure.__cause__, ValueError)
    assert 'ranks [0] also failed or were stopped' in str(failure)


def test_dead_rank_without_traceback():
    with pytest.raises(RankFailure, match='rank 0 died with exit code 3') as info:
        run_distributed(die_hard, nproc=2, timeout=30)
    assert 'about to die' in info.value.output and info.value.exitcode == 3


def test_timeout_kills_every_rank():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r'timed out after 2 s; ranks still running: \[0, 1\]'):
        run_distributed(sleep_forever, nproc=2, timeout=2)
    assert time.monotonic() - start < 10


def test_local_functions_are_refused():
    def local():
        return 1

    with pytest.raises(ValueError, match='must be a function defined at module level'):
        run_distributed(local)


def _start_a_child_and_return():
    import subprocess

    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
    return child.pid


def test_processes_a_finished_rank_started_are_killed():
    import time

    pids = run_distributed(_start_a_child_and_return, nproc=2, timeout=60)
    deadline = time.monotonic() + 10
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _alive(pid)]
        time.sleep(0.1)
    assert alive == []


def _alive(pid):
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped by init) counts as gone
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().split()[2] != 'Z'
    except OSError:
        return False
