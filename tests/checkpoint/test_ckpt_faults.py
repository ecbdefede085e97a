"""Filesystem faults during a save: ENOSPC / EIO injected at the file layer, the free-space
check before writing, and once a real full tmpfs. After every failure the previous
checkpoint's bytes, its manifest and ``last_checkpoint`` are byte-identical to before, nothing
of the failed save remains, and the error names the file and the cause."""

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from ckpt_helpers import make_state
from faults import failing_io, snapshot_dir
from stratagem.checkpoint import (
    disk,
    find_latest_checkpoint,
    load_checkpoint_file,
    save_checkpoint,
    verify_checkpoint,
)
from stratagem.checkpoint.errors import CheckpointWriteError

MB = 2**20


@pytest.mark.parametrize('name', ['iter_2.pth', 'iter_1.pth'], ids=['new-name', 'same-name'])
@pytest.mark.parametrize(
    'err,op,after',
    [
        (errno.ENOSPC, 'write', 0),  # the first byte of the temp file
        (errno.ENOSPC, 'write', 100_000),  # mid tensor data
        (errno.EIO, 'write', 150_000),
        (errno.EIO, 'fsync', 0),  # the data went to the page cache; the flush fails
        (errno.EDQUOT, 'write', 20_000),
    ],
)
def test_write_fault_leaves_previous_checkpoint(tmp_path, name, err, op, after):
    first = save_checkpoint(make_state(1.0, size=256), tmp_path / 'iter_1.pth', step=1)
    before = snapshot_dir(tmp_path)
    target = tmp_path / name
    with failing_io(tmp_path, err, after_bytes=after, op=op) as inj:
        with pytest.raises(CheckpointWriteError) as info:
            save_checkpoint(make_state(2.0, size=256), target, step=2)
    assert inj.injected >= 1
    message = str(info.value)
    assert info.value.errno == err and str(target) in message, message
    assert 'previous checkpoint is unchanged' in message
    if err == errno.ENOSPC:
        assert message.startswith(f'no space left on device writing {target} (needed ~')
        assert ' MB, free ' in message
    elif err == errno.EIO:
        assert message.startswith(f'Input/output error writing {target}'), message
    assert snapshot_dir(tmp_path) == before  # bytes of file, manifest, pointer; no debris
    assert verify_checkpoint(first)['step'] == 1
    assert find_latest_checkpoint(tmp_path) == first
    assert torch.equal(
        load_checkpoint_file(first)['state_dict']['fc.bias'], torch.full((256,), 1.0)
    )
    # the filesystem recovered: the same save now succeeds
    assert save_checkpoint(make_state(2.0, size=256), target, step=2) == target
    assert find_latest_checkpoint(tmp_path) == target


def test_free_space_checked_before_anything_is_written(tmp_path, monkeypatch):
    first = save_checkpoint(make_state(1.0), tmp_path / 'iter_1.pth', step=1)
    before = snapshot_dir(tmp_path)
    monkeypatch.setattr(disk, 'free_bytes', lambda path: 3 * MB)
    state = make_state(2.0, size=2048)  # 2 x 16 MiB tensors + bias
    written = []
    real_open = os.open
    monkeypatch.setattr(os, 'open', lambda *a, **k: written.append(a[0]) or real_open(*a, **k))
    with pytest.raises(CheckpointWriteError) as info:
        save_checkpoint(state, tmp_path / 'iter_2.pth', step=2)
    monkeypatch.setattr(os, 'open', real_open)
    needed = disk.payload_bytes(state) + disk.OVERHEAD_BYTES
    assert needed > 32 * MB
    assert str(info.value) == (
        f'no space left on device writing {tmp_path / "iter_2.pth"} (needed '
        f'~{needed / MB:.0f} MB, free 3 MB); nothing was written: free space or lower '
        'max_keep_ckpts'
    )
    assert info.value.errno == errno.ENOSPC
    assert written == [] and snapshot_dir(tmp_path) == before
    assert find_latest_checkpoint(tmp_path) == first


def test_payload_bytes_counts_each_storage_once():
    base = torch.zeros(1000)
    state = {
        'a': base,
        'view': base[10:20],
        'b': [torch.ones(5, dtype=torch.float64)],
        'meta': {'x': 1},
    }
    assert disk.payload_bytes(state) == 4000 + 40


_TMPFS_SCRIPT = textwrap.dedent("""
    import errno, os, subprocess, sys
    mnt = sys.argv[1]
    subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=3m', 'tmpfs', mnt], check=True)
    import torch
    from stratagem.checkpoint import save_checkpoint, find_latest_checkpoint, verify_checkpoint
    from stratagem.checkpoint import single_file
    from stratagem.checkpoint.errors import CheckpointWriteError
    small = {'w': torch.ones(256 * 1024)}          # 1 MiB: fits
    big = {'w': torch.ones(640 * 1024)}            # 2.5 MiB: does not fit beside it
    first = save_checkpoint(small, os.path.join(mnt, 'a.pth'), step=1)
    before = {n: open(os.path.join(mnt, n), 'rb').read() for n in os.listdir(mnt)}
    # 1. the free-space check (statvfs of the real tmpfs)
    try:
        save_checkpoint(big, os.path.join(mnt, 'b.pth'), step=2)
    except CheckpointWriteError as e:
        print('PRECHECK', e.errno, e)
    # 2. the real ENOSPC from the kernel, the check bypassed
    single_file.check_free_space = lambda final, needed: None
    try:
        save_checkpoint(big, os.path.join(mnt, 'b.pth'), step=2)
    except CheckpointWriteError as e:
        print('WRITE', e.errno, e)
    after = {n: open(os.path.join(mnt, n), 'rb').read() for n in os.listdir(mnt)}
    print('UNCHANGED', after == before, find_latest_checkpoint(mnt) == first,
          verify_checkpoint(first)['step'])
""")


def test_real_full_tmpfs(tmp_path):
    """ENOSPC from a real 3 MiB tmpfs, mounted in a private user+mount namespace."""
    unshare = shutil.which('unshare')
    probe = (
        subprocess.run([unshare or 'unshare', '-rm', 'true'], capture_output=True)
        if unshare
        else None
    )
    if probe is None or probe.returncode != 0:
        pytest.skip('cannot mount a tmpfs here (unshare -rm not permitted)')
    mnt = tmp_path / 'mnt'
    mnt.mkdir()
    script = tmp_path / 'tmpfs_case.py'
    script.write_text(_TMPFS_SCRIPT)
    proc = subprocess.run(
        [unshare, '-rm', sys.executable, str(script), str(mnt)],
        capture_output=True,
        text=True,
        timeout=250,
        env=dict(os.environ, OMP_NUM_THREADS='1'),
    )
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(' ', 1) for line in proc.stdout.strip().splitlines())
    target = mnt / 'b.pth'
    assert lines['PRECHECK'].startswith(
        f'{errno.ENOSPC} no space left on device writing {target} (needed ~4 MB, free 2 MB)'
    ), lines
    assert lines['WRITE'].startswith(
        f'{errno.ENOSPC} no space left on device writing {target} (needed ~4 MB, free '
    ), lines
    assert lines['UNCHANGED'] == 'True True 1', lines


def test_sharded_directory_free_space_checked_before_writing(tmp_path, monkeypatch):
    """A sharded (DCP) directory save checks its shards' size first: a full disk is refused
    naming the checkpoint and the sizes; no staging dir is left, the previous one stays."""
    from stratagem.checkpoint import sharded as sharded_mod
    from stratagem.checkpoint.sharded import save_sharded_checkpoint

    first = save_sharded_checkpoint(
        tmp_path / 'iter_1',
        {'state_dict': {'w': torch.ones(4)}, 'meta': {'iter': 1}},
        step=1,
        collective=False,
    )
    before = snapshot_dir(tmp_path)
    monkeypatch.setattr(disk, 'free_bytes', lambda path: 3 * MB)
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '2')  # two ranks on this disk: twice the shards
    weights = {'w': torch.zeros(1024, 1024)}  # 4 MiB of shards, 8 MiB for two ranks
    checkpoint = {'state_dict': weights, 'meta': {'iter': 2}}
    with pytest.raises(CheckpointWriteError) as info:
        save_sharded_checkpoint(tmp_path / 'iter_2', checkpoint, step=2, collective=False)
    needed = 2 * sharded_mod._bytes_needed({'state_dict': weights}, [{'meta': {'iter': 2}}])
    assert needed > 8 * MB
    assert str(info.value) == (
        f'no space left on device writing {tmp_path / "iter_2"} (needed ~{needed / MB:.0f} MB, '
        'free 3 MB); nothing was written: free space or lower max_keep_ckpts'
    )
    assert info.value.errno == errno.ENOSPC
    assert snapshot_dir(tmp_path) == before  # no staging dir, no pointer change
    assert find_latest_checkpoint(tmp_path) == first
