"""A signal to every process of a 2-process ``stratagem train`` at once (``kill -SIG -<pgid>``,
what Slurm's ``#SBATCH --signal=USR1@120`` does to a job step running one agent per node):

- SIGUSR1: torchrun's agent passes it on instead of dying of it (its store, which the save
  votes through, stays up): one committed checkpoint, exit status 75, and ``--resume`` ends
  bit-equal to an uninterrupted run; the same when only the agent gets it, or every process
  (the workers twice: directly and forwarded);
- SIGINT (Ctrl-C): the workers stop without saving, nothing half-written is left, the last
  committed checkpoint resumes, one line on stderr says so, exit status 130; the same when
  only the agent gets it.
"""

import os
import signal

import pytest

from failure_helpers import (
    CONFIG,
    ITERS_2,
    children,
    clean_env,
    equal,
    final_state,
    finish,
    start,
    wait_reads,
    workers,
    write_config,
)
from stratagem import checkpoint as ckpt

pytestmark = pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='needs Linux /proc')


def _signal_group_mid_run(tmp_path, sig, to='group'):
    """``stratagem train --nproc 2`` in a session of its own, ``sig`` to its process group
    when rank 0 has read 7 batches (iteration 7, after the checkpoint of iteration 5); ``to``
    'agent': to torchrun's agent only; 'every process': to the group and to each worker (in
    sessions of their own), as Slurm signals every process of a step."""
    cfg = write_config(tmp_path, CONFIG)
    count = tmp_path / 'count'
    count.mkdir()
    work = tmp_path / 'work'
    env = clean_env(COUNT_DIR=str(count), SLOW='0.01')
    proc = start(cfg, work, '--nproc', '2', env=env, start_new_session=True)
    pids = workers(proc.pid)
    wait_reads(count, pids[0], 4 * 7)
    if to == 'agent':
        os.kill(children(proc.pid)[0], sig)
    else:
        os.killpg(proc.pid, sig)
    if to == 'every process':
        for pid in pids.values():
            os.kill(pid, sig)
    code, out = finish(proc)
    return cfg, work, code, out


def _committed(work):
    return sorted(p.name for p in work.glob('iter_*.pth'))


def _debris(work):
    return sorted(p.name for p in work.iterdir() if p.name.startswith('.'))


def test_sigusr1_to_the_process_group_commits_one_checkpoint_and_resumes_exactly(
    tmp_path, uninterrupted_run
):
    cfg, work, code, out = _signal_group_mid_run(tmp_path, signal.SIGUSR1)
    assert code == 75, out[-4000:]
    stopped = ckpt.find_latest_checkpoint(work)
    assert stopped.name not in ('iter_5.pth', f'iter_{ITERS_2}.pth'), out[-4000:]
    at = ckpt.verify_checkpoint(stopped)['step']
    assert f'preempted by SIGUSR1 after iteration {at}' in out, out[-4000:]
    assert 'DistNetworkError' not in out and 'exit status -10' not in out, out[-4000:]
    assert not (work / 'preempted.json').exists()
    assert not _debris(work)
    code, out = finish(start(cfg, work, '--nproc', '2', '--resume'))
    assert code == 0, out[-4000:]
    assert equal(final_state(work), uninterrupted_run[1])


@pytest.mark.parametrize('to', ['agent', 'every process'])
def test_sigusr1_to_the_agent_or_to_every_process_commits_one_checkpoint(tmp_path, to):
    _, work, code, out = _signal_group_mid_run(tmp_path, signal.SIGUSR1, to)
    assert code == 75, out[-4000:]
    at = ckpt.verify_checkpoint(ckpt.find_latest_checkpoint(work))['step']
    assert 5 < at < ITERS_2 and f'preempted by SIGUSR1 after iteration {at}' in out, out[-4000:]
    assert 'error' not in out.lower() and not _debris(work), out[-4000:]


@pytest.mark.parametrize('to', ['group', 'agent'])
def test_sigint_to_the_process_group_stops_cleanly_in_one_line(tmp_path, to):
    cfg, work, code, out = _signal_group_mid_run(tmp_path, signal.SIGINT, to)
    assert code == 130, out[-4000:]
    lines = [line for line in out.splitlines() if 'interrupted' in line or 'Traceback' in line]
    assert lines == [
        f'stratagem train: interrupted (SIGINT); nothing half-written; --resume continues '
        f'from {work / "iter_5.pth"}'
    ], out[-4000:]
    assert 'KeyboardInterrupt' not in out and 'exit status' not in out, out[-4000:]
    assert _committed(work) == ['iter_5.pth'], out[-4000:]
    assert not _debris(work)
    assert ckpt.verify_checkpoint(work / 'iter_5.pth')['step'] == 5
    short = ('--cfg-options', 'train_cfg.max_iters=8')
    code, out = finish(start(cfg, work, '--nproc', '2', '--resume', *short))
    assert code == 0, out[-4000:]
    assert _committed(work) == ['iter_5.pth', 'iter_8.pth'], out[-4000:]
