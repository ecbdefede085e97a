"""Distributed saves under faults, 2 gloo ranks on CPU (two spawns for the module: each ends
with a rank killed).

Spawn 1 (single-file layout, DDPStrategy): async and sync saves commit; ENOSPC injected on
rank 0 raises on both ranks naming the file and the cause, the previous checkpoint unchanged;
then rank 1 is SIGKILLed in the middle of an async save: rank 0's save fails within the
timeout naming rank 1, nothing is committed. Spawn 2 (FSDPStrategy's sharded directory: DCP
shards, the directory protocol): rank 1 dies inside DCP's write: no commit, rank 0 names rank
1. After each spawn a new process resumes from (or reads) the previous checkpoint.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest
from torch import nn

from dist_harness import RankFailure, run_distributed
from stratagem.checkpoint import find_latest_checkpoint, load_checkpoint_file, verify_checkpoint
from stratagem.strategies import DDPStrategy

TIMEOUT = 4.0  # checkpoint_timeout of the spawned strategies, seconds


def _strategy(work_dir, cls=DDPStrategy, **kwargs):
    s = cls(
        work_dir=str(work_dir),
        experiment_name='x',
        checkpoint_timeout=TIMEOUT,
        env_kwargs=dict(randomness=dict(seed=1)),
        **kwargs,
    )
    s.prepare(
        nn.Linear(32, 32), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
    )
    return s


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f'{type(e).__name__}: {e}'
    return None


def _single_file_faults(work_dir, out_dir):
    from faults import failing_io

    s = _strategy(work_dir, async_checkpoint=True)
    rank = s.rank
    res = {}
    s.save_checkpoint('iter_1.pth', extra_ckpt={'meta': {'iter': 1}})
    s.wait_for_checkpoints()
    res['committed_async'] = verify_checkpoint(os.path.join(work_dir, 'iter_1.pth'))['step']
    s.async_checkpoint = False
    s.save_checkpoint('iter_2.pth', extra_ckpt={'meta': {'iter': 2}})
    res['committed_sync'] = verify_checkpoint(os.path.join(work_dir, 'iter_2.pth'))['step']
    before = {
        p: Path(work_dir, p).read_bytes()
        for p in sorted(os.listdir(work_dir))
        if not os.path.isdir(os.path.join(work_dir, p))
    }
    # ENOSPC on rank 0 only, sync then async: every rank raises, naming file and cause
    for mode in ('sync', 'async'):
        s.async_checkpoint = mode == 'async'
        with failing_io(work_dir, 28, after_bytes=2000) if rank == 0 else _nothing():
            if mode == 'sync':
                res[f'enospc_{mode}'] = _error(lambda: s.save_checkpoint('iter_3.pth'))
            else:
                s.save_checkpoint('iter_3.pth')
                res[f'enospc_{mode}'] = _error(s.wait_for_checkpoints)
    after = {
        p: Path(work_dir, p).read_bytes()
        for p in sorted(os.listdir(work_dir))
        if not os.path.isdir(os.path.join(work_dir, p))
    }
    res['unchanged'] = after == before
    with open(os.path.join(out_dir, f'rank{rank}.json'), 'w') as f:
        json.dump(res, f)  # before the kill below, so rank 1's view is kept too
    # rank 1 dies in the middle of an async save (after the path and RNG states were agreed)
    s.async_checkpoint = True

    def die(checkpoint):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    start = time.monotonic()
    s.save_checkpoint('iter_4.pth', extra_ckpt={'meta': {'iter': 4}}, callback=die)
    res['killed'] = _error(s.wait_for_checkpoints)
    res['killed_after_s'] = time.monotonic() - start
    res['listing'] = sorted(os.listdir(work_dir))
    with open(os.path.join(out_dir, f'rank{rank}_end.json'), 'w') as f:
        json.dump(res, f)
    return res


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _directory_kill(work_dir, out_dir):
    """FSDP's sharded directory save; rank 1 is SIGKILLed inside DCP's write of iter_2 (its
    shard written, at its fsync). Rank 0's own write then fails in DCP's collective with a
    bare connection error; it must still name rank 1 and commit nothing."""
    from stratagem.strategies import build_strategy

    s = _strategy(work_dir, cls=lambda **kw: build_strategy(dict(type='FSDPStrategy', **kw)))
    s.save_checkpoint('iter_1', extra_ckpt={'meta': {'iter': 1}})
    res = {'first': verify_checkpoint(os.path.join(work_dir, 'iter_1'))['step']}
    real_fsync = os.fsync
    if s.rank == 1:
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    res['killed'] = _error(lambda: s.save_checkpoint('iter_2', extra_ckpt={'meta': {'iter': 2}}))
    res['killed_after_s'] = time.monotonic() - start
    os.fsync = real_fsync
    res['listing'] = sorted(os.listdir(work_dir))
    with open(os.path.join(out_dir, f'rank{s.rank}_end.json'), 'w') as f:
        json.dump(res, f)
    return res


def _spawn(fn, tmp_path):
    work, out = tmp_path / 'work', tmp_path / 'out'
    work.mkdir()
    out.mkdir()
    with pytest.raises(RankFailure) as info:
        run_distributed(fn, nproc=2, args=(str(work), str(out)), timeout=240, grace=90)
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL, info.value
    assert not (out / 'rank1_end.json').exists()
    return work, out, json.loads((out / 'rank0_end.json').read_text())


def test_single_file_faults_and_killed_rank(tmp_path):
    work, out, r0 = _spawn(_single_file_faults, tmp_path)
    r1 = json.loads((out / 'rank1.json').read_text())
    assert r0['committed_async'] == r1['committed_async'] == 1
    assert r0['committed_sync'] == r1['committed_sync'] == 2
    target = work / 'iter_3.pth'
    assert r0['enospc_sync'].startswith(
        f'CheckpointWriteError: no space left on device writing {target} (needed ~'
    ), r0
    assert r0['enospc_async'].startswith(
        f'CheckpointWriteError: no space left on device writing {target}'
    ), r0
    assert r0['unchanged'] is True and r1['unchanged'] is True
    # rank 1 wrote nothing and still gets rank 0's error, file and cause named
    for mode in ('sync', 'async'):
        assert r1[f'enospc_{mode}'].startswith(
            f'CheckpointVoteError: saving {target} failed on rank 0: CheckpointWriteError: no '
            f'space left on device writing {target} (needed ~'
        ), r1
    assert r0['killed'].startswith(
        f'CheckpointVoteError: saving {work / "iter_4.pth"} failed: rank 1 did not finish writing'
    ), r0
    assert 'nothing was committed' in r0['killed']
    assert TIMEOUT <= r0['killed_after_s'] < TIMEOUT + 30, r0
    assert 'iter_4.pth' not in r0['listing'] and not [
        n for n in r0['listing'] if n.startswith('.')
    ], r0
    # the next run resumes from the previous checkpoint
    latest = find_latest_checkpoint(work)
    assert latest == work / 'iter_2.pth' and verify_checkpoint(latest)['step'] == 2
    assert load_checkpoint_file(latest)['meta']['iter'] == 2


def test_directory_save_with_killed_rank_commits_nothing(tmp_path):
    work, _, r0 = _spawn(_directory_kill, tmp_path)
    assert r0['first'] == 1
    assert r0['killed'].startswith(
        f'CheckpointVoteError: saving {work / "iter_2"} failed: rank 1 did not finish writing'
    ), r0
    assert TIMEOUT <= r0['killed_after_s'] < TIMEOUT + 30, r0
    # the staging directory is removed: nothing but the previous checkpoint is left
    committed = [n for n in r0['listing'] if not n[0].isdigit()]  # (the log dir aside)
    assert committed == ['iter_1', 'last_checkpoint'], r0
    latest = find_latest_checkpoint(work)
    assert latest == work / 'iter_1' and verify_checkpoint(latest)['step'] == 1
    # the next run (one process, no process group) reads it
    from stratagem.checkpoint import read_sharded_checkpoint

    state = read_sharded_checkpoint(latest)
    assert state['meta']['iter'] == 1 and state['state_dict']['weight'].shape == (32, 32)
