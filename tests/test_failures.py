"""A 2-process ``stratagem train`` run that survives failures by itself, compared bit for bit
(weights, optimizer state, schedulers) with the same run uninterrupted:

- a preemption signal to one rank only, during an asynchronous save, the stop falling
  inside an accumulation window, ``requeue=True`` under a (fake) Slurm: one checkpoint,
  exit status 75, ``scontrol requeue`` called, and the next run continues exactly;
- in that next run, an exception on one rank, then (in the restarted attempt) a worker
  SIGKILLed, under ``--max-restarts``: every worker restarts and resumes, twice (one run
  for both checks: each launch costs seconds);
- a rank stopped with SIGSTOP: the other exits within ``dist_cfg.timeout`` + 15 s with an
  error naming rank 1.
"""

import os
import re
import shutil
import signal
import time

import pytest

from failure_helpers import (
    CONFIG,
    ITERS_2,
    clean_env,
    equal,
    final_state,
    finish,
    kill_tree,
    start,
    wait_reads,
    workers,
    write_config,
)
from stratagem import checkpoint as ckpt
from stratagem.cli import main

pytestmark = pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='needs Linux /proc')


def _count_files(count):
    return sorted(n for n in os.listdir(count) if n.endswith('.txt'))


def test_preemption_requeues_then_an_exception_then_a_kill_restart_and_the_run_ends_bit_exact(
    uninterrupted_run, tmp_path, caplog
):
    """A preempted run (one checkpoint, requeued), then the requeued run, which survives two
    failures by itself; it ends equal to the uninterrupted run."""
    cfg, want = uninterrupted_run
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    log = tmp_path / 'scontrol.log'
    fake = bin_dir / 'scontrol'
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    preempt_cfg = write_config(
        tmp_path,
        CONFIG.replace(
            'log_interval=4)', 'log_interval=4, preemption=dict(signals=["SIGUSR1"], requeue=True))'
        ),
    )
    work = tmp_path / 'work'
    # rank 1 alone gets SIGUSR1 in iteration 10, while the asynchronous save of iteration 10
    # is written; the ranks agree to stop after 13 (lead: accumulation window 2 + 1), inside
    # a window
    env = clean_env(
        SIGNAL_AT='38',
        SIGNAL_RANK='1',
        SLURM_JOB_ID='4242',
        PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}',
    )
    async_opt = ('--cfg-options', 'strategy.async_checkpoint=True')
    code, out = finish(start(preempt_cfg, work, '--nproc', '2', *async_opt, env=env))
    assert code == 75, out[-4000:]
    assert 'preempted by SIGUSR1 after iteration 13' in out
    assert ckpt.find_latest_checkpoint(work).name == 'iter_13.pth'
    assert ckpt.verify_checkpoint(work / 'iter_13.pth')['step'] == 13
    assert not (work / 'preempted.json').exists()
    assert log.read_text().split() == ['requeue', '4242']
    assert not (work / f'iter_{ITERS_2}.pth').exists()
    # a run of one process (a re-formed elastic round) cannot continue iter_13 exactly (mid
    # window): it resumes from iter_10, the newest that it can, and runs to the end
    alone = tmp_path / 'alone'
    shutil.copytree(work, alone)
    (alone / 'last_checkpoint').unlink()  # the copy's pointer names the original
    # in this process: one process needs no launch of its own (seconds of start-up)
    caplog.clear()
    code = main(['train', str(cfg), '--work-dir', str(alone), '--resume'])
    out = caplog.text  # the log, as the process's stderr shows it
    assert code == 0, out[-4000:]
    assert re.search(r'cannot resume \S+iter_13.pth exactly at world size 1.*resuming from '
                     r'\S+iter_10.pth instead', out), out[-4000:]  # fmt: skip
    assert ckpt.verify_checkpoint(alone / f'iter_{2 * ITERS_2}.pth')['step'] == 2 * ITERS_2
    # the requeued job's next run, `--resume` under --max-restarts, fails twice: rank 1
    # raises in iteration 21 of the first attempt (its 30th read after resuming iteration
    # 13); rank 0 of the second (resumed from iteration 20) is SIGKILLed in iteration 27
    # (the last checkpoint 25). Each time every worker restarts and resumes; the run ends
    # equal to the uninterrupted one.
    count = tmp_path / 'count'
    count.mkdir()
    env = clean_env(COUNT_DIR=str(count), FAIL_AT='30', FAIL_RANK='1', SLOW='0.01')
    proc = start(cfg, work, '--nproc', '2', '--resume', '--max-restarts', '2', env=env)
    first = set(workers(proc.pid).values())
    deadline = time.monotonic() + 120
    while True:  # the second attempt's workers
        second = workers(proc.pid)
        if not set(second.values()) & first:
            break
        assert time.monotonic() < deadline and proc.poll() is None, 'no restart'
        time.sleep(0.05)
    wait_reads(count, second[0], 4 * 6 + 1)
    os.kill(second[0], signal.SIGKILL)
    code, out = finish(proc)
    assert code == 0, out[-4000:]
    assert 'injected failure on rank 1' in out, out[-4000:]
    assert len(_count_files(count)) == 6, out[-3000:]  # a third pair of workers ran
    assert equal(final_state(work), want)


def test_a_stopped_rank_ends_the_others_within_the_timeout_naming_it(tmp_path):
    timeout = 5
    cfg = write_config(tmp_path, CONFIG.replace('timeout=60', f'timeout={timeout}'))
    count = tmp_path / 'count'
    count.mkdir()
    proc = start(
        cfg, tmp_path / 'work', '--nproc', '2', env=clean_env(COUNT_DIR=str(count), SLOW='0.01')
    )
    pids = workers(proc.pid)
    try:
        wait_reads(count, pids[1], 4 * 7)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while os.path.exists(f'/proc/{pids[0]}') and time.monotonic() - stopped < 60:
            with open(f'/proc/{pids[0]}/stat') as f:
                if f.read().split(')')[-1].split()[0] == 'Z':
                    break  # a zombie: it exited, torchrun has not reaped it yet
            time.sleep(0.1)
        elapsed = time.monotonic() - stopped
    finally:
        kill_tree(pids[1])  # torchrun would wait 30 s for a stopped worker to take SIGTERM
    code, out = finish(proc)
    assert code != 0
    assert elapsed < timeout + 15, (elapsed, out[-3000:])
    assert 'rank 1' in out and 'stopped answering' in out, out[-3000:]
