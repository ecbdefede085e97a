"""load_checkpoint_file: integrity before unpickling, readable errors, safe by default."""

import os
import pickle
import shlex
import warnings

import pytest
import torch

from stratagem.checkpoint import (
    CheckpointCorruptError,
    NotACheckpointError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
    load_checkpoint_file,
    save_checkpoint,
)


@pytest.fixture
def no_unpickling(monkeypatch):
    """Fail the test if torch.load is reached."""

    def forbidden(*args, **kwargs):
        raise AssertionError('torch.load was called on a damaged file')

    monkeypatch.setattr(torch, 'load', forbidden)


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize('where', ['start', 'middle', 'end'])
def test_flipped_byte_caught_before_unpickling(tmp_path, state, where, no_unpickling):
    path = save_checkpoint(state, tmp_path / 'epoch_1.pth', step=1)
    size = path.stat().st_size
    _flip(path, {'start': 0, 'middle': size // 2, 'end': size - 1}[where])
    with pytest.raises(CheckpointCorruptError) as info:
        load_checkpoint_file(path)
    message = str(info.value)
    assert str(path) in message and 'xxh3_128 is' in message and 'says' in message
    assert isinstance(info.value, ValueError)


def test_truncated_caught_before_unpickling(tmp_path, state, no_unpickling):
    path = save_checkpoint(state, tmp_path / 'epoch_1.pth', step=1)
    size = path.stat().st_size
    with open(path, 'r+b') as f:
        f.truncate(size - 100)
    with pytest.raises(
        CheckpointCorruptError, match=f'size is {size - 100} bytes.*says {size}'
    ) as info:
        load_checkpoint_file(path, verify=False)  # the size check is free, so always on
    assert str(path) in str(info.value)


def test_missing_file_names_path(tmp_path):
    path = tmp_path / 'nope' / 'epoch_9.pth'
    with pytest.raises(FileNotFoundError, match=str(path)):
        load_checkpoint_file(path)


@pytest.mark.parametrize('content', [b'hello, this is a log file\n', os.urandom(4096), b''])
def test_not_a_checkpoint(tmp_path, content):
    if content[:1] in (b'\x80', b'P'):
        content = b'x' + content
    path = tmp_path / 'weights.pth'
    path.write_bytes(content)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', UnverifiedCheckpointWarning)
        with pytest.raises(NotACheckpointError, match='not a PyTorch checkpoint') as info:
            load_checkpoint_file(path)
    assert str(path) in str(info.value) and isinstance(info.value, ValueError)


def test_truncated_foreign_zip_is_corrupt(tmp_path, state):
    path = tmp_path / 'foreign.pth'
    torch.save(state, path)
    path.write_bytes(path.read_bytes()[:-200])
    size = path.stat().st_size
    with pytest.warns(UnverifiedCheckpointWarning):
        with pytest.raises(
            CheckpointCorruptError,
            match=f'is truncated: it is {size} bytes and lacks the end-of-archive',
        ) as info:
            load_checkpoint_file(path)
    assert str(path) in str(info.value) and 'Errno' not in str(info.value)


class _Touch:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f'touch {shlex.quote(self.marker)}',)


class _Open:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, 'w')


@pytest.mark.parametrize('payload, name', [(_Touch, 'posix.system'), (_Open, 'io.open')])
def test_malicious_pickle_refused_then_opt_in(tmp_path, payload, name):
    marker = tmp_path / 'PWNED'
    path = tmp_path / 'evil.pth'
    torch.save({'state_dict': {'w': torch.ones(2)}, 'x': payload(marker)}, path)
    assert not marker.exists()
    with pytest.warns(UnverifiedCheckpointWarning):
        with pytest.raises(UnsafeCheckpointError) as info:
            load_checkpoint_file(path)
    message = str(info.value)
    assert str(path) in message and name in message
    assert 'trust_pickled_code=True' in message and 'only if you trust' in message
    assert name in info.value.globals
    assert isinstance(info.value, pickle.UnpicklingError)
    assert not marker.exists()
    with pytest.warns(UnverifiedCheckpointWarning):
        loaded = load_checkpoint_file(path, trust_pickled_code=True)
    assert marker.exists()
    if hasattr(loaded['x'], 'close'):
        loaded['x'].close()
    assert torch.equal(loaded['state_dict']['w'], torch.ones(2))


@pytest.mark.filterwarnings('ignore:Detected pickle protocol')
@pytest.mark.parametrize('protocol', [2, pickle.HIGHEST_PROTOCOL])
def test_plain_pickle_payload_refused(tmp_path, protocol):
    marker = tmp_path / 'PWNED'
    path = tmp_path / 'evil.pkl'
    with open(path, 'wb') as f:
        pickle.dump({'x': _Touch(marker)}, f, protocol=protocol)
    with pytest.warns(UnverifiedCheckpointWarning):
        with pytest.raises(UnsafeCheckpointError, match='trust_pickled_code=True') as info:
            load_checkpoint_file(path)
    assert str(path) in str(info.value)
    assert not marker.exists()


def test_foreign_checkpoint_loads_with_warning(tmp_path, state):
    path = tmp_path / 'epoch_1.pth'
    torch.save(state, path)  # as mmengine does: no manifest
    with pytest.warns(UnverifiedCheckpointWarning, match='integrity cannot be verified') as rec:
        loaded = load_checkpoint_file(path)
    assert str(path) in str(rec[0].message)
    assert torch.equal(loaded['state_dict']['fc.weight'], state['state_dict']['fc.weight'])
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        load_checkpoint_file(path, verify=False)  # no warning when verification is off


def test_legacy_format_loads(tmp_path, state):
    path = tmp_path / 'old.pth'
    torch.save(state, path, _use_new_zipfile_serialization=False)
    with pytest.warns(UnverifiedCheckpointWarning):
        loaded = load_checkpoint_file(path)
    assert torch.equal(loaded['state_dict']['fc.bias'], state['state_dict']['fc.bias'])


@pytest.mark.parametrize(
    'map_location', ['cpu', torch.device('cpu'), None, {'cpu': 'cpu'}, lambda storage, loc: storage]
)
def test_map_location_forms(tmp_path, state, map_location):
    path = save_checkpoint(state, tmp_path / 'a.pth')
    loaded = load_checkpoint_file(path, map_location=map_location)
    assert loaded['state_dict']['fc.weight'].device.type == 'cpu'
    assert torch.equal(loaded['state_dict']['fc.weight'], state['state_dict']['fc.weight'])


def test_missing_device_error_is_not_called_corrupt(tmp_path, state):
    if torch.cuda.is_available():
        pytest.skip('needs a machine without CUDA')
    path = tmp_path / 'a.pth'
    torch.save({'w': torch.ones(1, device='meta')}, path)
    path2 = save_checkpoint(state, tmp_path / 'b.pth')
    with pytest.raises(RuntimeError) as info:
        load_checkpoint_file(path2, map_location='cuda:0')
    assert not isinstance(info.value, ValueError)


def test_directory_is_refused_with_advice(tmp_path):
    empty = tmp_path / 'empty'
    empty.mkdir()
    with pytest.raises(
        IsADirectoryError, match='is a directory, not a checkpoint file, and holds no checkpoint'
    ):
        load_checkpoint_file(empty)
    shards = tmp_path / 'shards'
    shards.mkdir()
    (shards / 'manifest.json').write_text('{}')
    with pytest.raises(IsADirectoryError, match='directory checkpoint'):
        load_checkpoint_file(shards)
    # a work dir given where a file was meant: name its newest checkpoint and the resume flag
    work = tmp_path / 'work'
    work.mkdir()
    save_checkpoint({'w': torch.ones(1)}, work / 'iter_3.pth', step=3)
    with pytest.raises(IsADirectoryError) as info:
        load_checkpoint_file(work)
    message = str(info.value)
    assert f'{work} is a work directory' in message and str(work / 'iter_3.pth') in message
    assert f'--work-dir {work} --resume' in message


def test_review_project_manifest_json_above_a_foreign_checkpoint_is_ignored(tmp_path):
    (tmp_path / 'manifest.json').write_text('{"name": "my-project"}')
    work = tmp_path / 'work_dirs' / 'exp'
    work.mkdir(parents=True)
    torch.save({'state_dict': {'w': torch.ones(2)}}, work / 'epoch_1.pth')
    with pytest.warns(UserWarning, match='no stratagem manifest'):
        loaded = load_checkpoint_file(work / 'epoch_1.pth')
    assert torch.equal(loaded['state_dict']['w'], torch.ones(2))


def test_review_trust_flag_must_be_a_bool(tmp_path):
    torch.save({'a': torch.ones(1)}, tmp_path / 'x.pth')
    with pytest.raises(TypeError, match="trust_pickled_code must be True or False, got 'false'"):
        load_checkpoint_file(tmp_path / 'x.pth', trust_pickled_code='false')


def test_review_damaged_foreign_files_always_name_the_file(tmp_path):
    import random
    import warnings

    from stratagem.checkpoint import CheckpointCorruptError, NotACheckpointError

    good = tmp_path / 'good.pth'
    torch.save(
        {'state_dict': {'w': torch.arange(64.0)}}, good, _use_new_zipfile_serialization=False
    )
    data = good.read_bytes()
    rng = random.Random(0)
    outcomes = set()
    for i in range(60):
        bad = bytearray(data)
        for _ in range(3):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        path = tmp_path / f'bad{i}.pth'
        path.write_bytes(bytes(bad))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                load_checkpoint_file(path)
            outcomes.add('loaded')
        except (CheckpointCorruptError, NotACheckpointError, UnsafeCheckpointError) as err:
            assert str(path) in str(err)
            outcomes.add(type(err).__name__)
    assert outcomes - {'loaded'}  # some flips were caught, each naming the file
