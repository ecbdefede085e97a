"""A kill between any two deletion steps of retention leaves only debris that the next
retention, or the next run's start, sweeps; the surviving checkpoints stay resumable."""

import os
import shutil
import signal
import time

import pytest
import torch

from ckpt_helpers import make_state
from stratagem.checkpoint import (
    POINTER_NAME,
    apply_retention,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint_file,
    save_checkpoint,
    sweep_debris,
    verify_checkpoint,
)
from stratagem.checkpoint.directory import new_staging_dir, save_directory
from stratagem.strategies.resume_checks import previous_run_traces

_STEPS = ('replace', 'unlink', 'rmdir')


def _populate(directory, layout):
    for step in (1, 2, 3):
        if layout == 'file':
            save_checkpoint(
                make_state(float(step), size=4), directory / f'iter_{step}.pth', step=step
            )
        else:
            save_directory(directory / f'iter_{step}', _shards(step), step=step, collective=False)
    return directory / ('iter_3.pth' if layout == 'file' else 'iter_3')


def _shards(step):
    def write(staging):
        (staging / 'shard0.pt').write_bytes(b'x' * step)
        (staging / 'sub').mkdir()
        (staging / 'sub' / 'shard1.pt').write_bytes(b'y' * step)

    return write


def _retention_killed_after(directory, steps):
    """``apply_retention(directory, 1)`` in a forked child that dies (SIGKILL) before its
    filesystem call number ``steps`` (rename, unlink, rmdir); True if it was killed."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            count = [0]
            for name in _STEPS:
                real = getattr(os, name)

                def counted(*args, _real=real, **kwargs):
                    if count[0] == steps:
                        os.kill(os.getpid(), signal.SIGKILL)
                    count[0] += 1
                    return _real(*args, **kwargs)

                setattr(os, name, counted)
            apply_retention(directory, 1)
            os._exit(0)
        finally:  # an error: never return into pytest
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0, status
    return os.WIFSIGNALED(status)


def _check_consistent(directory, newest):
    """What the killed work_dir shows: the listed checkpoints verify, latest is the newest,
    and nothing visible (not hidden) lacks its manifest."""
    assert find_latest_checkpoint(directory) == newest
    for info in list_checkpoints(directory):
        verify_checkpoint(info.path)
    for name in os.listdir(directory):
        if name.startswith('iter_') and not name.endswith('.manifest.json'):
            assert verify_checkpoint(directory / name) is not None, name


@pytest.mark.parametrize('layout', ['file', 'dir'])
@pytest.mark.parametrize('cleaner', ['retention', 'start'])
def test_kill_between_deletion_steps_leaves_sweepable_debris(tmp_path, layout, cleaner):
    clean = tmp_path / 'clean'
    clean.mkdir()
    newest = _populate(clean, layout)
    assert not _retention_killed_after(clean, 10_000)  # uninterrupted: what must remain
    expected = sorted(os.listdir(clean))
    seen = set()
    steps = 0
    while True:
        work = tmp_path / f'kill_{steps}'
        work.mkdir()
        newest = _populate(work, layout)
        if not _retention_killed_after(work, steps):
            break
        _check_consistent(work, newest)
        seen.add(tuple(sorted(os.listdir(work))))
        if cleaner == 'retention':
            apply_retention(work, 1)
        else:
            sweep_debris(work)
        names = sorted(os.listdir(work))
        if cleaner == 'retention':
            assert names == expected, f'killed before step {steps}'
        else:  # the start deletes no checkpoint: the debris is gone, the rest committed
            assert set(expected) <= set(names), f'killed before step {steps}'
            for name in names:
                assert not name.startswith('.'), f'killed before step {steps}: {name}'
                if name.endswith('.manifest.json'):
                    assert (work / name[: -len('.manifest.json')]).exists(), name
                elif name != POINTER_NAME:
                    assert verify_checkpoint(work / name) is not None, name
        assert previous_run_traces(str(work)) is not None
        if layout == 'file':
            assert (
                float(next(iter(load_checkpoint_file(newest)['state_dict'].values())).flatten()[0])
                == 3.0
            )
        shutil.rmtree(work)
        steps += 1
    assert steps >= (6 if layout == 'file' else 4) and len(seen) >= 3


def test_start_sweeps_an_orphan_manifest(tmp_path):
    from stratagem.strategies import SingleDeviceStrategy

    newest = _populate(tmp_path, 'file')
    assert _retention_killed_after(tmp_path, 1)  # iter_2.pth renamed away, manifest kept
    orphan = tmp_path / 'iter_2.pth.manifest.json'
    assert orphan.exists() and not (tmp_path / 'iter_2.pth').exists()
    strategy = SingleDeviceStrategy(work_dir=str(tmp_path), env_kwargs=dict(launcher='none'))
    strategy.prepare(torch.nn.Linear(2, 2))
    assert strategy.load_or_resume() is None  # the start: nothing loaded, debris swept
    assert not orphan.exists()
    assert not [n for n in os.listdir(tmp_path) if '.trash-' in n]
    assert find_latest_checkpoint(tmp_path) == newest


def test_sweep_spares_a_live_save_and_fresh_staging(tmp_path):
    _populate(tmp_path, 'file')
    staging = new_staging_dir(tmp_path / 'iter_4')  # this process: a live writer
    (staging / 'rank0.pt').write_bytes(b'x')
    old = time.time() - 3600
    os.utime(staging / 'rank0.pt', (old, old))
    os.utime(staging, (old, old))
    in_flight = tmp_path / '.iter_5.pth.tmp-999999-0123abcd'  # dead pid, but newer than
    in_flight.write_bytes(b'partial')  # the newest commit: maybe another host's live save
    manifest = tmp_path / 'iter_4.pth.manifest.json'  # a live save between steps 3 and 4
    shutil.copy(tmp_path / 'iter_3.pth.manifest.json', manifest)
    os.utime(manifest, (old, old))
    (tmp_path / f'.iter_4.pth.tmp-{os.getpid()}-0123abcd').write_bytes(b'x')
    assert sweep_debris(tmp_path) == []
    assert apply_retention(tmp_path, 5) == []
    assert staging.is_dir() and in_flight.exists() and manifest.exists()
    assert (tmp_path / POINTER_NAME).exists()
