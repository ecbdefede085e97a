"""apply_retention: keep the newest N and the protected, delete only what we wrote."""

import os
import time

import pytest
import torch

from ckpt_helpers import make_state
from stratagem.checkpoint import (
    POINTER_NAME,
    apply_retention,
    delete_checkpoint,
    list_checkpoints,
    save_checkpoint,
)
from stratagem.checkpoint.directory import save_directory


def _save(directory, step, name=None, **kwargs):
    return save_checkpoint(
        make_state(float(step), size=4),
        directory / (name or f'epoch_{step}.pth'),
        step=step,
        **kwargs,
    )


def test_keeps_newest_n_and_protected(tmp_path):
    paths = [_save(tmp_path, s) for s in range(1, 7)]
    foreign = tmp_path / 'epoch_0.pth'  # mmengine's, no manifest: never ours to delete
    torch.save({'x': 1}, foreign)
    (tmp_path / 'notes.txt').write_text('keep me')
    removed = apply_retention(tmp_path, 2, protect=[paths[1]])
    assert sorted(removed) == sorted([paths[0], paths[2], paths[3]])
    names = sorted(os.listdir(tmp_path))
    assert names == sorted(
        [
            POINTER_NAME,
            'epoch_0.pth',
            'notes.txt',
            'epoch_2.pth',
            'epoch_2.pth.manifest.json',
            'epoch_5.pth',
            'epoch_5.pth.manifest.json',
            'epoch_6.pth',
            'epoch_6.pth.manifest.json',
        ]
    )


def test_keep_all_and_bad_argument(tmp_path):
    paths = [_save(tmp_path, s) for s in range(1, 4)]
    assert apply_retention(tmp_path, -1) == []
    assert apply_retention(tmp_path, 0) == []
    assert [c.path for c in list_checkpoints(tmp_path)] == paths[::-1]
    with pytest.raises(TypeError, match='max_keep_ckpts'):
        apply_retention(tmp_path, 2.0)
    with pytest.raises(NotADirectoryError):
        apply_retention(tmp_path / 'absent', 2)


def test_never_the_pointed_one(tmp_path):
    paths = [_save(tmp_path, s) for s in range(1, 5)]
    (tmp_path / POINTER_NAME).write_text(str(paths[0]))  # e.g. a resume target
    removed = apply_retention(tmp_path, 1)
    assert sorted(removed) == sorted(paths[1:3])
    assert paths[0].exists() and paths[3].exists()


def test_pattern_limits_the_series(tmp_path):
    best = _save(tmp_path, 1, name='best_acc_1.pth')
    paths = [_save(tmp_path, s) for s in range(2, 5)]
    removed = apply_retention(tmp_path, 1, pattern='epoch_*.pth')
    assert sorted(removed) == sorted(paths[:2]) and best.exists()


def test_directory_checkpoints(tmp_path):
    def shard(step):
        return lambda staging: [(staging / 'shard0.pt').write_bytes(b'x' * step) and 'shard0.pt']

    for step in range(1, 4):
        save_directory(tmp_path / f'iter_{step}', shard(step), step=step, collective=False)
    removed = apply_retention(tmp_path, 1)
    assert sorted(p.name for p in removed) == ['iter_1', 'iter_2']
    assert sorted(os.listdir(tmp_path)) == ['iter_3', POINTER_NAME]


def test_removes_only_our_stale_debris(tmp_path):
    old = time.time() - 3600
    debris = [
        tmp_path / '.epoch_9.pth.tmp-999999-0123abcd',  # a crashed save's temp file
        tmp_path / '.last_checkpoint.tmp-999999-89abcdef',
        tmp_path / '.iter_9.tmp-999999-deadbeef',
    ]  # a crashed staging dir
    debris[0].write_bytes(b'partial')
    debris[1].write_bytes(b'/x')
    debris[2].mkdir()
    (debris[2] / 'shard.pt').write_bytes(b'partial')
    orphan = tmp_path / 'epoch_8.pth.manifest.json'  # manifest written, file never renamed
    keep = [
        tmp_path / '.epoch_9.pth.tmp-abc-0123abcd',  # not our pattern
        tmp_path / '.hidden',
        tmp_path / f'.epoch_7.pth.tmp-{os.getpid()}-0123abcd',
        tmp_path / 'x.manifest.json',
    ]  # not a stratagem manifest
    for path in keep:
        path.write_bytes(b'{}')
    fresh = tmp_path / '.epoch_10.pth.tmp-999998-00000000'  # newer than the last commit
    paths = [_save(tmp_path, s) for s in (1, 2)]
    os.replace(paths[0].with_name(paths[0].name + '.manifest.json'), orphan)
    for path in debris + keep + [orphan]:
        os.utime(path, (old, old))
    fresh.write_bytes(b'in flight')
    removed = apply_retention(tmp_path, 5)
    assert sorted(removed) == sorted(debris + [orphan])
    assert all(p.exists() for p in keep + [fresh, paths[1]])
    assert paths[0].exists()  # lost its manifest: not ours any more, so not deleted


def test_review_live_writers_temp_entries_survive_retention(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True
    ).stdout.strip()
    live = str(os.getppid())  # pytest's parent: alive, and not this process
    old = time.time() - 3600
    entries = {}
    for who, pid in (('live', live), ('dead', dead)):
        staging = tmp_path / f'.sharded_{who}.tmp-{pid}-0123abcd'
        staging.mkdir()
        (staging / 'rank0.pt').write_bytes(b'x' * 10)
        for p in (staging / 'rank0.pt', staging):
            os.utime(p, (old, old))
        entries[who] = staging
    save_checkpoint({'w': torch.ones(1)}, tmp_path / 'iter_1.pth', step=1)
    removed = apply_retention(tmp_path, 3)
    assert entries['live'].is_dir() and not entries['dead'].exists()
    assert removed == [entries['dead']]


def test_delete_checkpoint_removes_one_of_ours_never_the_pointed_or_protected(tmp_path):
    """A replaced best checkpoint goes through the same safe steps; what must stay, stays."""
    old, resumed, newest = (_save(tmp_path, s) for s in (1, 2, 3))  # the pointer: newest
    foreign = tmp_path / 'best_acc_epoch_0.pth'  # no manifest: not ours
    torch.save({'x': 1}, foreign)
    assert not delete_checkpoint(foreign) and foreign.exists()
    assert not delete_checkpoint(newest) and newest.exists()
    assert not delete_checkpoint(resumed, protect=[resumed]) and resumed.exists()
    assert delete_checkpoint(old)
    assert [c.path for c in list_checkpoints(tmp_path)] == [newest, resumed]
    assert not (tmp_path / 'epoch_1.pth.manifest.json').exists()
    assert not any(n.startswith('.') for n in os.listdir(tmp_path))  # no trash left
    assert not delete_checkpoint(old)  # already gone


def test_deletion_waits_for_the_pointers_directory_fsync(tmp_path, monkeypatch):
    # The pointer's rename is made durable off the save's path (_fs.fsync_dir_soon); until
    # it is, a power cut could bring back a pointer naming the checkpoint retention deletes.
    import threading

    from stratagem.checkpoint import _fs

    paths = [_save(tmp_path, s) for s in range(1, 4)]
    release, started = threading.Event(), threading.Event()
    real = _fs.fsync_dir

    def slow_fsync_dir(directory):
        started.set()
        assert release.wait(10)
        real(directory)

    monkeypatch.setattr(_fs, 'fsync_dir', slow_fsync_dir)
    _fs.fsync_dir_soon(tmp_path)
    assert started.wait(10)
    removed: list = []
    deleter = threading.Thread(target=lambda: removed.extend(apply_retention(tmp_path, 1)))
    deleter.start()
    deleter.join(0.3)
    assert deleter.is_alive() and removed == [] and all(p.exists() for p in paths)
    release.set()
    deleter.join(10)
    assert sorted(removed) == sorted(paths[:2]) and paths[2].exists()


def test_a_forked_child_saves_and_deletes_with_pools_of_its_own(tmp_path, monkeypatch):
    # A child forked while a pointer's fsync is in flight has none of the pool's threads:
    # it must neither wait for that job nor queue work on a pool with no threads.
    import threading

    from stratagem.checkpoint import _fs

    paths = [_save(tmp_path, s) for s in range(1, 3)]
    release = threading.Event()
    real = _fs.fsync_dir
    monkeypatch.setattr(_fs, 'fsync_dir', lambda d: (release.wait(10), real(d)))
    _fs.fsync_dir_soon(tmp_path)  # in flight in the parent until released
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            monkeypatch.setattr(_fs, 'fsync_dir', real)
            _save(tmp_path, 3)
            _fs.fsync_together([tmp_path, paths[0]])
            code = 0 if sorted(apply_retention(tmp_path, 1)) == sorted(paths) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        release.set()
        pytest.fail("the forked child hung on its parent's fsync pool")
    release.set()
    assert os.waitstatus_to_exitcode(status) == 0
