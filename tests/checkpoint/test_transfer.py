"""#42: the object upload and download of ``checkpoint/transfer.py`` against a real local S3
server (moto_server through s3fs): a multipart upload with several parts in flight is
assembled in part order and bounded in concurrency; a failed part aborts it (no incomplete
upload, the previous object intact); ranged reads give the object back; an async save to S3
returns before its upload ends."""

import asyncio
import os
import threading

import pytest
import torch
from torch import nn

from stratagem.checkpoint import location, transfer
from stratagem.strategies import SingleDeviceStrategy

PART = transfer.MIN_PART_BYTES


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def _record_parts(fs, *, fail_part=None):
    """Wrap the client's call (s3fs's, not ours) so part PUTs are counted in flight, parts 1
    and 2 are in flight together and part 1 finishes only after part 2 (out of order,
    whatever the machine's load) and, with ``fail_part``, that part is refused."""
    seen = {'in_flight': 0, 'max_in_flight': 0, 'finished': []}
    events = {}
    real = fs._call_s3

    async def call(method, *args, **kwargs):
        if method != 'upload_part':
            return await real(method, *args, **kwargs)
        number = kwargs['PartNumber']
        one_in = events.setdefault('one_in', asyncio.Event())
        two_done = events.setdefault('two_done', asyncio.Event())
        seen['in_flight'] += 1
        seen['max_in_flight'] = max(seen['max_in_flight'], seen['in_flight'])
        try:
            if number == 1:
                one_in.set()
                await two_done.wait()
            elif number == 2:
                await one_in.wait()
            if number == fail_part:
                raise OSError(f'part {number} refused (test)')
            out = await real(method, *args, **kwargs)
            seen['finished'].append(number)
            return out
        finally:
            seen['in_flight'] -= 1
            if number == 2:
                two_done.set()

    fs._call_s3 = call
    return seen


def _uploads(fs, bucket):
    return fs.call_s3('list_multipart_uploads', Bucket=bucket).get('Uploads', [])


def test_parts_go_up_in_flight_and_are_assembled_in_order(s3, tmp_path):
    """4 parts (3 of 5 MiB, 1 byte), at most 2 in flight: 2 were in flight at once, they
    finished out of order, and the object is the file, byte for byte; ranged reads of 5 MiB
    give it back, and a buffer longer than the object gets only the object's bytes."""
    data = os.urandom(3 * PART + 1)
    local = tmp_path / 'blob'
    local.write_bytes(data)
    fs = _fs()
    seen = _record_parts(fs)
    path = f'{s3[len("s3://") :]}/blob'
    transfer.put_file(fs, local, path, part_bytes=PART, concurrency=2)
    assert seen['max_in_flight'] == 2
    finished = seen['finished']
    assert sorted(finished) == [1, 2, 3, 4] and finished.index(2) < finished.index(1)
    assert fs.cat_file(path) == data
    assert _uploads(fs, path.split('/')[0]) == []

    buffer = bytearray(len(data))
    assert transfer.read_into(fs, path, memoryview(buffer), part_bytes=PART) == len(data)
    assert buffer == data


def test_a_failed_part_aborts_the_upload_and_keeps_the_previous_object(s3, tmp_path):
    """Part 2 of 3 refused: the error comes out (named by location.upload_file as a store
    failure), no incomplete multipart upload is left, and the object that had the name
    still holds its old bytes."""
    fs = _fs()
    bucket = s3[len('s3://') :]
    path = f'{bucket}/blob'
    fs.pipe_file(path, b'old bytes')
    local = tmp_path / 'blob'
    local.write_bytes(os.urandom(2 * PART + 7))
    seen = _record_parts(fs, fail_part=2)
    with pytest.raises(OSError, match='part 2 refused'):
        transfer.put_file(fs, local, path, part_bytes=PART, concurrency=3)
    assert 2 not in seen['finished']
    assert _uploads(fs, bucket) == []
    fs.invalidate_cache()
    assert fs.cat_file(path) == b'old bytes'


def test_an_async_save_to_s3_returns_before_its_upload_ends(s3, tmp_path, monkeypatch):
    """async_checkpoint: save_checkpoint returns while the upload is held (an event the test
    sets only after the call returned), so the step waited for the snapshot alone; once
    released, the checkpoint is committed and loads."""
    release, entered = threading.Event(), threading.Event()
    real = transfer.put_file
    held = {'timed_out': False}

    def held_put_file(*args, **kwargs):
        entered.set()
        held['timed_out'] = not release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(transfer, 'put_file', held_put_file)
    s = SingleDeviceStrategy(work_dir=str(tmp_path / 'work'), async_checkpoint=True)
    model, _ = s.prepare(nn.Linear(4, 2), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)))
    url = f'{s3}/run/iter_1.pth'
    assert s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 1}}) == url
    assert not release.is_set()  # returned while the upload cannot have ended
    assert entered.wait(60)  # the writer reached the upload on its own
    assert location.find_latest(f'{s3}/run') is None  # nothing committed yet
    release.set()
    s.wait_for_checkpoints()
    assert not held['timed_out']
    assert location.find_latest(f'{s3}/run') == url
    loaded = location.load_file(url)
    assert torch.equal(loaded['state_dict']['weight'], model.weight.detach())


@pytest.mark.skipif(not hasattr(os, 'memfd_create'), reason='memfd: Linux only')
def test_a_loaded_checkpoint_holds_no_download_memory(tmp_path):
    """load_file reads the object into a memfd (no file on disk); a load onto the CPU copies
    the tensors out, so no mapping or descriptor of it outlives the load."""
    import secrets

    from stratagem.checkpoint.single_file import save_checkpoint

    def held():
        with open('/proc/self/maps') as maps:
            mapped = {line.split()[4] for line in maps if 'memfd:stratagem-checkpoint' in line}
        fds = {
            fd
            for fd in os.listdir('/proc/self/fd')
            if 'memfd:stratagem-checkpoint' in os.path.realpath(f'/proc/self/fd/{fd}')
        }
        return mapped, fds

    local = save_checkpoint(
        {'state_dict': {'w': torch.arange(1000.0)}}, tmp_path / 'a.pth', update_pointer=False
    )
    url = f'memory://stratagem-{secrets.token_hex(4)}/a.pth'
    location.upload_file(local, url, update_pointer=False)
    try:
        before = held()
        loaded = location.load_file(url)
        assert torch.equal(loaded['state_dict']['w'], torch.arange(1000.0))
        assert held() == before
    finally:
        fs, path = location.filesystem(url)
        fs.rm(path.rsplit('/', 1)[0], recursive=True)
