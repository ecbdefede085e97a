"""A signal to every process of a 2-process ``stratagem train`` at once (``kill -SIG -<pgid>``,
what Slurm's ``#SBATCH --signal=USR1@120`` does to a job step running one agent per node):

- SIGUSR1: torchrun's agent passes it on instead of dying of it (its store, which the save
  votes through, stays up): one committed checkpoint, exit status 75, and ``--resume`` ends
  bit-equal to an uninterrupted run; the same when only the agent gets it, or every process
  (the workers twice: directly and forwarded);
- SIGINT (Ctrl-C): the workers stop without saving, nothing half-written is left, the last
  committed checkpoint resumes, one line on stderr says so, exit status 130; the same when
  only the agent gets it.

Each run costs a launch (seconds on 2 cores), so the SIGINT runs and the SIGUSR1 to the
agent or to every process share one work_dir, each resuming the one before.
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


def _signal_group_mid_run(tmp_path, sig, to='group', resume=False, batches=7):
    """``stratagem train --nproc 2`` in a session of its own, ``sig`` to its process group
    when rank 0 has read ``batches`` batches (iteration 7, after the checkpoint of iteration
    5; with ``resume``, ``--resume`` of ``tmp_path``'s work_dir: 7 iterations after the one
    it resumed from); ``to`` 'agent': to torchrun's agent only; 'every process': to the group
    and to each worker (in sessions of their own), as Slurm signals every process of a step."""
    cfg = tmp_path / 'cfg.py'
    if not cfg.exists():
        write_config(tmp_path, CONFIG)
    count = tmp_path / 'count'
    count.mkdir(exist_ok=True)  # one file per worker pid: runs do not mix
    work = tmp_path / 'work'
    env = clean_env(COUNT_DIR=str(count), SLOW='0.01')
    args = ('--resume',) if resume else ()
    proc = start(cfg, work, '--nproc', '2', *args, env=env, start_new_session=True)
    pids = workers(proc.pid)
    wait_reads(count, pids[0], 4 * batches)
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


def _assert_preempted(work, code, out, after):
    assert code == 75, out[-4000:]
    at = ckpt.verify_checkpoint(ckpt.find_latest_checkpoint(work))['step']
    assert after < at < ITERS_2 and f'preempted by SIGUSR1 after iteration {at}' in out, out[-4000:]
    assert 'error' not in out.lower() and not _debris(work), out[-4000:]


def _assert_interrupted(work, code, out, committed, latest):
    assert code == 130, out[-4000:]
    lines = [line for line in out.splitlines() if 'interrupted' in line or 'Traceback' in line]
    assert lines == [
        f'stratagem train: interrupted (SIGINT); nothing half-written; --resume continues '
        f'from {work / f"iter_{latest}.pth"}'
    ], out[-4000:]
    assert 'KeyboardInterrupt' not in out and 'exit status' not in out, out[-4000:]
    assert _committed(work) == committed, out[-4000:]
    assert not _debris(work)
    assert ckpt.verify_checkpoint(work / f'iter_{latest}.pth')['step'] == latest


def test_sigint_to_the_process_group_stops_unsaved_naming_the_checkpoint_to_resume(tmp_path):
    """Ctrl-C in the terminal (SIGINT to the process group, in iteration 7): exit 130, one
    line naming iteration 5's checkpoint, nothing half-written. The slow tier goes on from
    here through the other ways a signal arrives."""
    _, work, code, out = _signal_group_mid_run(tmp_path, signal.SIGINT, 'group')
    _assert_interrupted(work, code, out, ['iter_5.pth'], 5)


@pytest.mark.slow
def test_sigint_or_sigusr1_to_the_group_the_agent_or_every_process_in_turn(tmp_path):
    """One work_dir, four runs, each resuming the one before: SIGINT to the process group
    (in iteration 7), SIGINT to the agent only (in iteration 12, after resuming iteration
    5), SIGUSR1 to every process (in iteration 17, after resuming iteration 10), SIGUSR1 to
    the agent only (3 iterations after resuming where that one stopped)."""
    _, work, code, out = _signal_group_mid_run(tmp_path, signal.SIGINT, 'group')
    _assert_interrupted(work, code, out, ['iter_5.pth'], 5)
    _, work, code, out = _signal_group_mid_run(tmp_path, signal.SIGINT, 'agent', resume=True)
    _assert_interrupted(work, code, out, ['iter_10.pth', 'iter_5.pth'], 10)
    _, work, code, out = _signal_group_mid_run(
        tmp_path, signal.SIGUSR1, 'every process', resume=True
    )
    _assert_preempted(work, code, out, after=10)
    before = ckpt.verify_checkpoint(ckpt.find_latest_checkpoint(work))['step']
    _, work, code, out = _signal_group_mid_run(
        tmp_path, signal.SIGUSR1, 'agent', resume=True, batches=3
    )
    _assert_preempted(work, code, out, after=before)
