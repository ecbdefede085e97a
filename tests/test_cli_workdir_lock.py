"""`stratagem train` holds its work_dir: a second run on a busy work_dir is refused at once,
naming the first (whose lock and checkpoints it leaves alone); a SIGKILLed run's work_dir is
resumed by the next run without an override. One held run serves both: the refusal while it
is busy, then the kill (a run launch less than a test each)."""

import json
import os
import time

import pytest

from failure_helpers import (
    clean_env,
    equal,
    final_state,
    finish,
    kill_tree,
    start,
    workers,
)
from stratagem.cli import main
from stratagem.env.workdir_lock import LOCK_NAME

pytestmark = pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='needs Linux /proc')


def _holder(work_dir, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(work_dir / LOCK_NAME) as f:
                return json.load(f)
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f'no lock in {work_dir}')


def test_a_busy_work_dir_is_refused_and_a_killed_runs_work_dir_is_resumed(
    uninterrupted_run, tmp_path, capfd
):
    """One run, held busy, then SIGKILLed: a second run on its work_dir is refused at once,
    naming it, and leaves its lock and its run alone; after the kill the lock file stays, and
    the next run takes the work_dir over with a notice and ends equal to the uninterrupted
    run (the killed run's checkpoints, written around the refusal, are intact)."""
    cfg, want = uninterrupted_run
    work = tmp_path / 'work'
    # both ranks hold at their 44th read (iteration 11, iter_10 committed) until killed: the
    # run stays busy for as long as the refusal takes, however loaded the machine
    first = start(cfg, work, '--nproc', '2', env=clean_env(HOLD_AT='44', HOLD_WORLD='2'))
    try:
        workers(first.pid)  # the parent holds the lock; its workers run under it
        assert _holder(work)['pid'] == first.pid
        t0 = time.monotonic()
        capfd.readouterr()
        code = main(['train', str(cfg), '--work-dir', str(work)])  # here: no start-up to wait
        out = ''.join(capfd.readouterr())
        took = time.monotonic() - t0
        assert first.poll() is None, 'the first run ended before the second was refused'
        assert _holder(work)['pid'] == first.pid  # the refused run left the lock alone
        deadline = time.monotonic() + 120
        while not (work / 'iter_10.pth').exists():
            assert time.monotonic() < deadline and first.poll() is None, 'no checkpoint'
            time.sleep(0.05)
        assert first.poll() is None  # held, not ended: the kill lands mid-run
    finally:
        kill_tree(first.pid)  # SIGKILL, the parent and its workers: the lock file stays
        first.communicate()
    assert code == 1, out[-3000:]
    assert f'pid {first.pid}' in out and 'in use by another run' in out, out[-3000:]
    assert '--work-dir' in out and '--force-unlock' in out
    assert took < 20, f'the refusal took {took:.1f} s'
    assert _holder(work)['pid'] == first.pid
    code, out = finish(start(cfg, work, '--nproc', '2', '--resume'))
    assert code == 0, out[-4000:]
    assert 'ended without releasing it' in out and f'pid {first.pid}' in out, out[-3000:]
    assert equal(final_state(work), want)
    assert not (work / LOCK_NAME).exists()
