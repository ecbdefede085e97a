"""find_latest_checkpoint: the pointer when it is good, a warned fallback when it is not."""

import os
import time
import warnings

import pytest
import torch

from ckpt_helpers import make_state
from stratagem.checkpoint import (
    POINTER_NAME,
    CheckpointWarning,
    find_latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
)
from stratagem.checkpoint.latest import read_pointer
from stratagem.checkpoint.manifest import forget_verified


def _series(tmp_path, steps=(1, 2, 3)):
    return [
        save_checkpoint(make_state(float(s)), tmp_path / f'epoch_{s}.pth', step=s) for s in steps
    ]


def _quiet_latest(directory):
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # the good path must not warn
        return find_latest_checkpoint(directory)


def test_pointer_followed(tmp_path):
    paths = _series(tmp_path)
    assert (tmp_path / POINTER_NAME).read_text() == str(paths[-1])
    assert _quiet_latest(tmp_path) == paths[-1]
    # the pointer wins over the scan order: point back at epoch_2
    save_checkpoint(make_state(9.0), tmp_path / 'best.pth', step=0, update_pointer=False)
    (tmp_path / POINTER_NAME).write_text(str(paths[1]))
    assert _quiet_latest(tmp_path) == paths[1]


def test_empty_or_absent_directory(tmp_path):
    assert _quiet_latest(tmp_path) is None
    assert _quiet_latest(tmp_path / 'absent') is None


@pytest.mark.parametrize('pointer', [None, b'', b'\x00\xff garbage \x81', b'a\nb\nc', b'x' * 5000])
def test_missing_or_garbage_pointer_falls_back(tmp_path, pointer):
    paths = _series(tmp_path)
    if pointer is None:
        os.unlink(tmp_path / POINTER_NAME)
    else:
        (tmp_path / POINTER_NAME).write_bytes(pointer)
    with pytest.warns(CheckpointWarning, match='resuming from the newest committed') as rec:
        assert find_latest_checkpoint(tmp_path) == paths[-1]
    assert any(POINTER_NAME in str(w.message) for w in rec)


def test_pointer_to_deleted_file_falls_back(tmp_path):
    paths = _series(tmp_path)
    os.unlink(paths[-1])
    with pytest.warns(CheckpointWarning, match='does not exist'):
        assert find_latest_checkpoint(tmp_path) == paths[1]


def test_pointer_to_corrupt_file_falls_back(tmp_path):
    paths = _series(tmp_path)
    forget_verified()
    with open(paths[-1], 'r+b') as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.warns(CheckpointWarning, match='damaged') as rec:
        assert find_latest_checkpoint(tmp_path) == paths[1]
    assert any(str(paths[-1]) in str(w.message) for w in rec)


def test_fallback_skips_corrupt_candidates_newest_first(tmp_path):
    paths = _series(tmp_path)
    os.unlink(tmp_path / POINTER_NAME)
    for path in paths[1:]:
        with open(path, 'r+b') as f:
            f.truncate(10)
    with pytest.warns(CheckpointWarning) as rec:
        assert find_latest_checkpoint(tmp_path) == paths[0]
    skipped = [str(w.message) for w in rec if 'skipping' in str(w.message)]
    assert len(skipped) == 2 and str(paths[2]) in skipped[0] and str(paths[1]) in skipped[1]


def test_only_corrupt_returns_none_with_warning(tmp_path):
    (path,) = _series(tmp_path, steps=(1,))
    with open(path, 'r+b') as f:
        f.truncate(10)
    with pytest.warns(CheckpointWarning, match='no other committed checkpoint'):
        assert find_latest_checkpoint(tmp_path) is None


def test_scan_orders_by_step_then_time(tmp_path):
    later_low_step = _series(tmp_path, steps=(5,))[0]
    time.sleep(0.01)
    _series(tmp_path, steps=(2,))
    os.unlink(tmp_path / POINTER_NAME)
    assert [c.step for c in list_checkpoints(tmp_path)] == [5, 2]
    with pytest.warns(CheckpointWarning):
        assert find_latest_checkpoint(tmp_path) == later_low_step
    # ties on step: the newer wins
    a = save_checkpoint(make_state(), tmp_path / 'a.pth', step=7)
    time.sleep(0.01)
    b = save_checkpoint(make_state(), tmp_path / 'b.pth', step=7)
    assert [c.path for c in list_checkpoints(tmp_path)][:2] == [b, a]


def test_foreign_pointer_target_is_returned(tmp_path):
    """An mmengine work dir: checkpoints without manifests, pointer written by mmengine."""
    path = tmp_path / 'epoch_1.pth'
    torch.save(make_state(), path)
    (tmp_path / POINTER_NAME).write_text(str(path))
    assert _quiet_latest(tmp_path) == path
    # mmengine may write the pointer relative to the launch directory
    (tmp_path / POINTER_NAME).write_text(os.path.relpath(path))
    assert read_pointer(tmp_path) == path.absolute()


def test_moved_work_dir_uses_local_name(tmp_path):
    old = tmp_path / 'old'
    new = tmp_path / 'new'
    _series(old)
    os.rename(old, new)
    assert _quiet_latest(new) == new / 'epoch_3.pth'


@pytest.mark.parametrize(
    'pointer', ['.', '/', 'last_checkpoint', 'iter_1.pth.manifest.json', '/etc/passwd', 'notes.txt']
)
def test_review_garbage_pointer_falls_back_with_a_warning(tmp_path, pointer):
    committed = save_checkpoint({'w': torch.ones(1)}, tmp_path / 'iter_1.pth', step=1)
    (tmp_path / 'notes.txt').write_text('not a checkpoint')
    (tmp_path / 'last_checkpoint').write_text(pointer)
    with pytest.warns(UserWarning):
        assert find_latest_checkpoint(tmp_path) == committed
