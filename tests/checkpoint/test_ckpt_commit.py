"""save_checkpoint, and save_directory in one process: round trip, manifest, validation, atomic
replace."""

import errno
import json
import os
from pathlib import Path

import pytest
import torch
import xxhash

from ckpt_helpers import make_state
from stratagem.checkpoint import (
    POINTER_NAME,
    load_checkpoint_file,
    save_checkpoint,
    verify_checkpoint,
)
from stratagem.checkpoint.digest import hash_file
from stratagem.checkpoint.directory import finalize_directory, new_staging_dir, save_directory
from stratagem.checkpoint.manifest import manifest_path
from stratagem.version import __version__


def _assert_same(a, b):
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_round_trip_equal(tmp_path, state):
    path = save_checkpoint(state, tmp_path / 'epoch_3.pth', step=3)
    assert path == (tmp_path / 'epoch_3.pth').absolute()
    for mmap in (None, False):
        loaded = load_checkpoint_file(path, mmap=mmap)
        _assert_same(state, loaded)
    # a plain torch.load reads it too: the file is an ordinary torch.save archive
    _assert_same(state, torch.load(path, weights_only=True))


def test_manifest_content(tmp_path, state):
    path = save_checkpoint(
        state,
        tmp_path / 'iter_120.pth',
        step=120,
        extra_manifest={'world_size': 4, 'strategy': 'DDPStrategy'},
    )
    sidecar = tmp_path / 'iter_120.pth.manifest.json'
    assert manifest_path(path) == sidecar
    manifest = json.loads(sidecar.read_text())
    size, digest = hash_file(path)
    assert manifest['format'] == 'stratagem-checkpoint' and manifest['format_version'] == 2
    assert manifest['kind'] == 'file' and manifest['name'] == 'iter_120.pth'
    assert manifest['files'] == [{'path': 'iter_120.pth', 'size': size, 'xxh3_128': digest}]
    assert digest == xxhash.xxh3_128(path.read_bytes()).hexdigest()
    assert size == os.path.getsize(path)
    assert manifest['step'] == 120
    assert manifest['world_size'] == 4 and manifest['strategy'] == 'DDPStrategy'
    assert manifest['stratagem_version'] == __version__
    assert manifest['torch_version'] == torch.__version__
    assert 'replaces' not in manifest
    assert (tmp_path / POINTER_NAME).read_text() == str(path)
    assert verify_checkpoint(path) == manifest
    assert sorted(os.listdir(tmp_path)) == sorted(
        [POINTER_NAME, 'iter_120.pth', 'iter_120.pth.manifest.json']
    )  # no temp left


def test_bad_content_fails_before_writing(tmp_path, state):
    good = save_checkpoint(state, tmp_path / 'a.pth', step=1)
    before = sorted(os.listdir(tmp_path))
    bad = make_state()
    bad['meta']['cfg'] = {'fn': lambda x: x}
    with pytest.raises(
        TypeError,
        match=r"checkpoint\['meta'\]\['cfg'\]\['fn'\] is a function"
        r'.*weights_only=True',
    ):
        save_checkpoint(bad, tmp_path / 'a.pth', step=2)
    assert sorted(os.listdir(tmp_path)) == before
    assert verify_checkpoint(good)['step'] == 1


@pytest.mark.parametrize(
    'value, fragment',
    [
        (torch.nn.Linear(2, 2), 'state_dict()'),
        (__import__('collections').defaultdict(list), 'plain dict'),
        (frozenset([1]), 'frozenset'),
        (object(), 'builtins.object'),
    ],
)
def test_bad_values_named(tmp_path, value, fragment):
    with pytest.raises(TypeError, match=r"checkpoint\['x'\]\[1\]") as info:
        save_checkpoint({'x': [0, value]}, tmp_path / 'a.pth')
    assert fragment in str(info.value)
    assert not any(tmp_path.iterdir())


def test_bad_arguments(tmp_path, state):
    with pytest.raises(ValueError, match='reserved'):
        save_checkpoint(state, tmp_path / 'a.pth', extra_manifest={'step': 1})
    with pytest.raises(TypeError, match='JSON'):
        save_checkpoint(state, tmp_path / 'a.pth', extra_manifest={'x': object()})
    with pytest.raises(TypeError, match='step'):
        save_checkpoint(state, tmp_path / 'a.pth', step=-1)
    with pytest.raises(ValueError, match='reserved'):
        save_checkpoint(state, tmp_path / POINTER_NAME)
    with pytest.raises(TypeError, match='dict'):
        save_checkpoint([1], tmp_path / 'a.pth')
    assert not any(tmp_path.iterdir())


def test_same_name_replace(tmp_path):
    path = save_checkpoint(make_state(1.0), tmp_path / 'latest.pth', step=1)
    save_checkpoint(make_state(2.0), path, step=2)
    manifest = verify_checkpoint(path)
    assert manifest['step'] == 2 and 'replaces' not in manifest
    assert load_checkpoint_file(path)['state_dict']['fc.bias'][0].item() == 2.0


@pytest.mark.parametrize('first', ['ours', 'foreign'])
def test_same_name_crash_window_keeps_old_verifiable(tmp_path, monkeypatch, first):
    """At the instant between the new manifest and the rename (where a SIGKILL may land) the
    old file verifies; a caught exception there rolls the manifest back. Twice in a row, and
    also when the old file had no manifest (mmengine / torch.save)."""
    path = tmp_path / 'latest.pth'
    if first == 'ours':
        save_checkpoint(make_state(1.0), path, step=1)
    else:
        torch.save(make_state(1.0), path)
    seen = []

    def die(src, dst):
        manifest = json.loads((tmp_path / 'latest.pth.manifest.json').read_text())
        seen.append((manifest['step'], verify_checkpoint(path)['files'][0]['size']))
        raise KeyboardInterrupt('simulated crash')

    real_replace = os.replace
    monkeypatch.setattr(
        os, 'replace', lambda s, d: die(s, d) if str(d) == str(path) else real_replace(s, d)
    )
    for step in (2, 3):
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(make_state(float(step)), path, step=step)
    monkeypatch.undo()
    size = path.stat().st_size
    assert seen == [(2, size), (3, size)]  # the old file verified inside each crash window
    if first == 'ours':
        assert verify_checkpoint(path)['step'] == 1  # the old manifest is back
    else:
        assert not (tmp_path / 'latest.pth.manifest.json').exists()
    loaded = load_checkpoint_file(path, verify=first == 'ours')
    assert loaded['state_dict']['fc.bias'][0].item() == 1.0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith('.')] == []


def test_directory_in_one_process(tmp_path, state):
    final = tmp_path / 'iter_10'

    def write(staging):  # returns None: the commit fsyncs and hashes every file
        assert staging.parent == tmp_path and staging.name.startswith('.iter_10.tmp-')
        assert not final.exists()
        for rank in range(2):
            torch.save(make_state(float(rank)), staging / f'rank{rank}.pt')
        (staging / 'sub').mkdir()
        (staging / 'sub' / 'meta.txt').write_text('x')

    extra = {'world_size': 2}
    assert save_directory(final, write, step=10, extra_manifest=extra, collective=False) == final
    manifest = verify_checkpoint(final)
    assert manifest['kind'] == 'directory' and manifest['world_size'] == 2
    assert [f['path'] for f in manifest['files']] == ['rank0.pt', 'rank1.pt', 'sub/meta.txt']
    assert (tmp_path / POINTER_NAME).read_text() == str(final)
    # a shard verifies against the directory manifest entry
    assert load_checkpoint_file(final / 'rank1.pt')['state_dict']['fc.bias'][0].item() == 1.0
    # overwrite the same directory atomically
    staging = new_staging_dir(final)
    torch.save(make_state(5.0), staging / 'rank0.pt')
    finalize_directory(staging, final, step=11)
    assert verify_checkpoint(final)['step'] == 11
    assert sorted(p.name for p in tmp_path.iterdir()) == ['iter_10', POINTER_NAME]


def test_directory_in_one_process_failure_leaves_nothing(tmp_path):
    def write(staging, error=None):
        (staging / 'x.pt').write_bytes(b'x')
        raise error

    for error in (RuntimeError('boom'), KeyboardInterrupt()):
        with pytest.raises(type(error)) as raised:
            save_directory(tmp_path / 'iter_1', lambda s, e=error: write(s, e), collective=False)
        assert raised.value is error  # this process's own error, as it was raised
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match='empty'):
        save_directory(tmp_path / 'iter_1', lambda staging: None, step=1, collective=False)
    assert list(tmp_path.iterdir()) == []
    # no world_size of its own: the manifest says what the caller gave
    save_directory(
        tmp_path / 'hf', lambda s: [(s / 'w').write_bytes(b'w') and 'w'], collective=False
    )
    assert 'world_size' not in verify_checkpoint(tmp_path / 'hf')


def test_zip_crc32_option_and_restore(tmp_path, state):
    import zipfile

    before = torch.serialization.get_crc32_options()
    fast = save_checkpoint(state, tmp_path / 'fast.pth')  # default: no zip CRC
    assert torch.serialization.get_crc32_options() == before  # the global is restored
    full = save_checkpoint(state, tmp_path / 'full.pth', zip_crc32=True)
    with zipfile.ZipFile(full) as archive:
        assert archive.testzip() is None  # valid CRCs for zip tools
    with zipfile.ZipFile(fast) as archive:
        assert any(name.endswith('data.pkl') for name in archive.namelist())
    _assert_same(torch.load(fast, weights_only=True), torch.load(full, weights_only=True))


def test_directory_commit_failing_at_its_rename_moves_no_pointer(tmp_path, monkeypatch):
    """The new pointer is written (and fsynced with the manifest) before the directory's
    rename, under a temp name: a rename that fails leaves the pointer on the previous
    checkpoint and no temp file behind."""
    first = save_directory(
        tmp_path / 'iter_1', lambda s: [(s / 'w').write_bytes(b'1') and 'w'], collective=False
    )
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst).name == 'iter_2':
            raise OSError(errno.EIO, 'rename failed (test)')
        return real_replace(src, dst)

    monkeypatch.setattr(os, 'replace', failing_replace)
    with pytest.raises(OSError, match='rename failed'):
        save_directory(
            tmp_path / 'iter_2', lambda s: [(s / 'w').write_bytes(b'2') and 'w'], collective=False
        )
    assert (tmp_path / POINTER_NAME).read_text() == str(first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['iter_1', POINTER_NAME]


@pytest.mark.parametrize('pointer', [True, False])
def test_directory_commit_makes_its_renames_durable_off_the_callers_thread(
    tmp_path, monkeypatch, pointer
):
    """A new name: the directory's and the pointer's renames are made durable by one fsync
    of their parent on a helper thread (the caller waits for none); ``wait_soon`` (what
    retention waits for) returns once it is done. Replacing a name: the exchange is made
    durable before the old checkpoint's files go, on the caller's thread."""
    import threading

    from stratagem.checkpoint import _fs

    synced = []
    real = _fs.fsync_dir
    monkeypatch.setattr(
        _fs,
        'fsync_dir',
        lambda d: synced.append((Path(d), threading.current_thread().name)) or real(d),
    )

    def commit(name, payload):
        staging = new_staging_dir(tmp_path / name)
        (staging / 'w').write_bytes(payload)
        return finalize_directory(staging, tmp_path / name, update_pointer=pointer)

    commit('iter_1', b'1')
    _fs.wait_soon()
    parent = [who for d, who in synced if d == tmp_path]
    assert len(parent) == 1 and parent[0].startswith('stratagem-fsync'), synced
    synced.clear()
    commit('iter_1', b'2')  # the same name: an exchange, then the old one deleted
    assert (tmp_path, threading.current_thread().name) in synced, synced
    assert (tmp_path / 'iter_1' / 'w').read_bytes() == b'2'
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith('.')] == []
