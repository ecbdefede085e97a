"""#42 deliverable 5: every failure of a store named once, the URL and the fix in one line,
no earlier checkpoint lost. Against the real local S3 server: a user whose IAM policy only
reads (permission denied on write), a closed port (unreachable endpoint), and a real HTTP
proxy in front of the server that answers chosen requests with ``503 SlowDown``, ``500
InternalError`` or a dropped connection (tests/s3_faults.py): the client's own retries
(botocore, s3fs) and ours (``store_retry.py``) meet the answers a throttled store sends."""

import errno
import random
import socket
import time

import pytest
import torch
from torch import nn

from stratagem import checkpoint as ckpt
from stratagem.checkpoint import location, store_retry
from stratagem.strategies import SingleDeviceStrategy

#: no botocore retries, so a test's count of refused requests is s3fs's and ours alone
NO_CLIENT_RETRY = dict(config_kwargs=dict(retries=dict(total_max_attempts=1)))


def _strategy(tmp_path, backend_args=None):
    s = SingleDeviceStrategy(work_dir=str(tmp_path / 'work'))
    torch.manual_seed(0)
    s.prepare(nn.Linear(4, 2), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)))
    s.checkpointer.backend_args = backend_args
    return s


@pytest.fixture
def proxy(s3_server):
    from s3_faults import FaultProxy

    server = FaultProxy(s3_server.endpoint).start()
    yield server
    server.stop()


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(store_retry, 'POLICY', store_retry.RetryPolicy(attempts=3, base=0.05))


def _objects(url):
    fs, path = location.filesystem(url)
    return {p.rsplit('/', 1)[-1]: fs.cat_file(p) for p in fs.ls(path, refresh=True)}


def test_throttling_500s_and_resets_are_retried_and_the_save_commits(
    s3, proxy, tmp_path, fast_retries
):
    """The object's PUT gets SlowDown twice and a dropped connection once (s3fs retries
    those), the manifest's PUT a 500 twice (s3fs does not: ours does); the save commits
    and loads."""
    args = dict(endpoint_url=proxy.endpoint, **NO_CLIENT_RETRY)
    s = _strategy(tmp_path, args)
    url = f'{s3}/run/iter_1.pth'
    proxy.fail('PUT', r'/iter_1\.pth$', times=2, answer='slowdown')
    proxy.fail('PUT', r'/iter_1\.pth$', times=1, answer='reset')
    proxy.fail('PUT', r'manifest\.json$', times=2, answer='internal')
    assert s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 1}}) == url
    assert proxy.refused == 5
    assert location.read_pointer(f'{s3}/run') == url
    assert s.load_checkpoint(url)['meta']['iter'] == 1


def test_a_store_that_keeps_failing_is_named_and_the_previous_checkpoint_stays(
    s3, proxy, tmp_path, fast_retries
):
    args = dict(endpoint_url=proxy.endpoint, **NO_CLIENT_RETRY)
    s = _strategy(tmp_path, args)
    s.save_checkpoint(f'{s3}/run/iter_1.pth', extra_ckpt={'meta': {'iter': 1}})
    before = _objects(f'{s3}/run')

    url = f'{s3}/run/iter_2.pth'
    proxy.fail('PUT', r'iter_2\.pth\.manifest\.json$', answer='internal')
    with pytest.raises(ckpt.CheckpointLocationError) as caught:
        s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 2}})
    message = str(caught.value)
    assert message.startswith(f'saving {url}: the store kept failing')
    assert 'after 3 attempt(s)' in message and 'previous checkpoint is unchanged' in message
    assert '\n' not in message
    # the object went up without its manifest: debris, listed by nobody
    assert [c.url for c in location.list_checkpoints(f'{s3}/run')] == [f'{s3}/run/iter_1.pth']

    proxy.clear()
    after = _objects(f'{s3}/run')
    assert {k: after[k] for k in before} == before
    assert location.find_latest(f'{s3}/run') == f'{s3}/run/iter_1.pth'
    assert s.load_checkpoint(f'{s3}/run/iter_1.pth')['meta']['iter'] == 1


@pytest.mark.slow
def test_a_store_that_keeps_throttling_is_named_after_the_retries(
    s3, proxy, tmp_path, fast_retries
):
    """SlowDown on every PUT of the object: s3fs retries it 5 times (~1.9 s, its backoff),
    then one message names the throttling and its fixes; the pointer stays."""
    args = dict(endpoint_url=proxy.endpoint, **NO_CLIENT_RETRY)
    s = _strategy(tmp_path, args)
    s.save_checkpoint(f'{s3}/run/iter_1.pth', extra_ckpt={'meta': {'iter': 1}})
    before = _objects(f'{s3}/run')
    proxy.fail('PUT', r'iter_3\.pth$', answer='slowdown')
    url = f'{s3}/run/iter_3.pth'
    with pytest.raises(ckpt.CheckpointLocationError) as caught:
        s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 3}})
    message = str(caught.value)
    assert message.startswith(f'saving {url}: the store kept throttling the requests (SlowDown')
    assert 'AWS_MAX_ATTEMPTS' in message and 'previous checkpoint is unchanged' in message
    assert proxy.refused == 5  # s3fs's tries; botocore's were turned off
    proxy.clear()
    assert _objects(f'{s3}/run') == before


def test_permission_denied_on_write_and_an_unreachable_endpoint_are_named(s3, s3_server, tmp_path):
    s = _strategy(tmp_path)
    good = f'{s3}/run/iter_1.pth'
    s.save_checkpoint(good, extra_ckpt={'meta': {'iter': 1}})
    before = _objects(f'{s3}/run')

    s.checkpointer.backend_args = dict(s3_server.read_only)  # may read, not write
    url = f'{s3}/run/iter_2.pth'
    with pytest.raises(ckpt.CheckpointLocationError) as caught:
        s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 2}})
    message = str(caught.value)
    assert message.startswith(f'saving {url}: permission denied')
    assert (
        'may not write (s3:PutObject)' in message and 'previous checkpoint is unchanged' in message
    )
    assert caught.value.errno == errno.EACCES
    assert s.load_checkpoint(good)['meta']['iter'] == 1  # reading is allowed

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(('127.0.0.1', 0))
        closed = f'http://127.0.0.1:{sock.getsockname()[1]}'
    s.checkpointer.backend_args = dict(endpoint_url=closed, **NO_CLIENT_RETRY)
    with pytest.raises(ckpt.CheckpointLocationError) as caught:
        s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 2}})
    message = str(caught.value)
    assert url in message and 'check the endpoint (AWS_ENDPOINT_URL' in message
    assert _objects(f'{s3}/run') == before


def test_what_is_transient_and_the_backoff():
    class ClientError(Exception):
        def __init__(self, code, status):
            super().__init__(code)
            self.response = {
                'Error': {'Code': code},
                'ResponseMetadata': {'HTTPStatusCode': status},
            }

    def translated(cause, err):
        err.__cause__ = cause
        return err

    kind = store_retry.kind
    assert kind(translated(ClientError('SlowDown', 503), OSError(errno.EBUSY, 'x'))) == 'throttled'
    assert kind(translated(ClientError('InternalError', 500), OSError(121, 'x'))) == 'server'
    assert kind(ConnectionResetError()) == 'reset'
    assert kind(translated(ClientError('AccessDenied', 403), PermissionError('x'))) is None
    assert kind(ConnectionRefusedError()) is None and kind(FileNotFoundError()) is None
    assert kind(ValueError('no')) is None
    policy = store_retry.RetryPolicy(base=1.0, cap=4.0)
    rng = random.Random(0)
    bounds = [min(4.0, 2 ** (n - 1)) for n in range(1, 6)]
    delays = [policy.delay(n, rng) for n in range(1, 6)]
    assert all(0 <= d <= b for d, b in zip(delays, bounds)) and len(set(delays)) == 5


def _next_second():
    """Sleep into the next whole second: the store's times have a resolution of 1 s."""
    time.sleep(1.02 - time.time() % 1)


def test_debris_is_listed_and_retention_removes_only_what_began_before_the_newest_commit(
    s3, tmp_path
):
    """Debris of interrupted uploads (an object whose manifest never went up, a manifest
    whose object is gone, a probe object, an incomplete multipart upload) is listed;
    retention removes what began before the newest commit and matches its series, never an
    upload begun after it (a live one) nor another file."""
    from stratagem.checkpoint.store_debris import find_debris

    prefix = f'{s3}/run'
    bucket = s3[len('s3://') :]
    s = _strategy(tmp_path)
    s.save_checkpoint(f'{prefix}/iter_1.pth', extra_ckpt={'meta': {'iter': 1}})
    fs, path = location.filesystem(prefix)
    client = fs.call_s3  # botocore's client, as s3fs holds it

    def incomplete_upload(name):
        upload = client('create_multipart_upload', Bucket=bucket, Key=f'run/{name}')['UploadId']
        client(
            'upload_part',
            Bucket=bucket,
            Key=f'run/{name}',
            UploadId=upload,
            PartNumber=1,
            Body=b'x' * 1024,
        )
        return upload

    fs.pipe_file(f'{path}/iter_2.pth', b'PK\x03\x04 an upload whose manifest never went up')
    fs.pipe_file(
        f'{path}/iter_0.pth.manifest.json', fs.cat_file(f'{path}/iter_1.pth.manifest.json')
    )
    fs.pipe_file(f'{path}/.stratagem-probe-dead', b'a killed probe')
    fs.pipe_file(f'{path}/notes.txt', b'not ours')
    dead = incomplete_upload('iter_3.pth')
    _next_second()
    s.save_checkpoint(f'{prefix}/iter_4.pth', extra_ckpt={'meta': {'iter': 4}})
    live = incomplete_upload('iter_5.pth')  # begun after the newest commit: may be live

    found = {(d.url.rsplit('/', 1)[-1], d.kind): d for d in find_debris(prefix)}
    assert sorted(found) == [
        ('.stratagem-probe-dead', 'unlisted object'),
        ('iter_0.pth.manifest.json', 'orphan manifest'),
        ('iter_2.pth', 'unlisted object'),
        ('iter_3.pth', 'incomplete multipart upload'),
        ('iter_5.pth', 'incomplete multipart upload'),
        ('notes.txt', 'unlisted object'),
    ]
    assert found['iter_3.pth', 'incomplete multipart upload'].upload_id == dead

    assert location.apply_retention(prefix, 5, pattern='iter_*') == []
    left = {(d.url.rsplit('/', 1)[-1], d.upload_id) for d in find_debris(prefix)}
    assert left == {('notes.txt', None), ('iter_5.pth', live)}
    assert [c.step for c in location.list_checkpoints(prefix)] == [4, 1]
    uploads = client('list_multipart_uploads', Bucket=bucket, Prefix='run/').get('Uploads', [])
    assert [u['UploadId'] for u in uploads] == [live]
    location.apply_retention(prefix, 5)  # no pattern: checkpoints' suffixes, never notes.txt
    assert {d.url.rsplit('/', 1)[-1] for d in find_debris(prefix)} == {'notes.txt', 'iter_5.pth'}


def test_doctor_probes_the_out_dir_and_lists_its_debris(s3, s3_server, tmp_path):
    from stratagem.doctor import diagnose
    from test_loop_out_dir import _cfg

    cfg = _cfg(tmp_path / 'exp', f'{s3}/runs')
    fs, path = location.filesystem(f'{s3}/runs/exp')
    fs.pipe_file(f'{path}/iter_9.pth', b'debris')
    fs.pipe_file(f'{path}/iter_8/__0_0.distcp', b'a directory save that died')
    findings, notes = diagnose(cfg, probe_disk=False, memory=False)
    assert findings == []
    assert f'checkpoints go to {s3}/runs/exp: written and removed a probe object' in notes
    assert any(f'{s3}/runs/exp/iter_9.pth (unlisted object, 6 bytes)' in n for n in notes)
    assert any(f'{s3}/runs/exp/iter_8 (unlisted directory, 1 object, 26 bytes)' in n for n in notes)
    assert sorted(p.rsplit('/', 1)[-1] for p in fs.ls(path, refresh=True)) == [
        'iter_8',
        'iter_9.pth',
    ]

    cfg['default_hooks']['checkpoint']['backend_args'] = dict(s3_server.read_only)
    findings, _ = diagnose(cfg, probe_disk=False, memory=False)
    assert [f.where for f in findings] == ['default_hooks.checkpoint.out_dir']
    assert findings[0].problem.startswith(f'probing {s3}/runs/exp/.stratagem-probe-')
    assert 'permission denied' in findings[0].problem
    assert 'may not write and delete (s3:PutObject' in findings[0].problem
