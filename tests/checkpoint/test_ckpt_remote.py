"""#42: checkpoints at an fsspec URL through the public API, against a real local S3 server
(moto_server, reached by s3fs through AWS_ENDPOINT_URL as a user's client is) and fsspec's
memory store: save, load and resume round trips (bit-equal), the order of the objects (the
commit on a store without rename), what a reader trusts, and the failures named."""

import io
import secrets

import pytest
import torch
from torch import nn

from remote_state import OPTIM, prepared, state_bytes, train
from stratagem import checkpoint as ckpt
from stratagem.checkpoint import location
from stratagem.strategies import SingleDeviceStrategy


@pytest.fixture
def memory_url():
    url = f'memory://stratagem-{secrets.token_hex(4)}'
    yield url
    fs, path = location.filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.mark.parametrize('store', ['s3', 'memory'])
def test_save_load_resume_round_trip_at_a_url(store, request, tmp_path):
    """save_checkpoint(url) then resume(url) in a fresh strategy continues bit-equal to the
    uninterrupted run; load_checkpoint(url) loads the weights; nothing is written locally
    (no directory named 's3:' or 'memory:')."""
    base = request.getfixturevalue('s3' if store == 's3' else 'memory_url')
    url = f'{base}/api/iter_3.pth'
    s, model, ow = prepared(tmp_path / 'work')
    train(model, ow, 3)
    returned = s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 3}})
    assert returned == url
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, ow, 2)
    expected = state_bytes(model, ow)

    s2, model2, ow2 = prepared(tmp_path / 'work2')
    checkpoint = s2.resume(url)
    assert checkpoint['meta']['iter'] == 3 and s2.resumed_from == url
    train(model2, ow2, 2)
    assert state_bytes(model2, ow2) == expected

    s3_, model3, _ = prepared(tmp_path / 'work3')
    s3_.load_checkpoint(url)
    loaded = model3.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    assert not any(p.name.endswith(':') for p in tmp_path.rglob('*'))
    assert not (tmp_path / 'work' / 'last_checkpoint').exists()


def test_the_objects_appear_in_commit_order_and_the_pointer_names_the_manifested_one(s3, tmp_path):
    """After a save: the object, its manifest (listing its size and digest) and the pointer
    naming it; an object no manifest lists is ignored by the scan and by load_or_resume."""
    s, model, ow = prepared(tmp_path / 'work')
    prefix = f'{s3}/run'
    s.save_checkpoint(f'{prefix}/iter_1.pth', extra_ckpt={'meta': {'iter': 1}})
    fs, path = location.filesystem(prefix)
    names = sorted(p.rsplit('/', 1)[-1] for p in fs.ls(path, refresh=True))
    assert names == ['iter_1.pth', 'iter_1.pth.manifest.json', 'last_checkpoint']
    assert fs.cat_file(f'{path}/last_checkpoint').decode() == f'{prefix}/iter_1.pth'
    manifest = location.read_manifest_at(f'{prefix}/iter_1.pth')
    assert manifest['files'][0]['size'] == fs.size(f'{path}/iter_1.pth')
    assert manifest['step'] == 1

    # debris of a killed upload: a newer object, no manifest; a pointer moved to it by hand
    fs.pipe_file(f'{path}/iter_9.pth', b'PK\x03\x04 not a complete checkpoint')
    assert [c.url for c in location.list_checkpoints(prefix)] == [f'{prefix}/iter_1.pth']
    fs.pipe_file(f'{path}/last_checkpoint', f'{prefix}/iter_9.pth'.encode())
    s2, _, _ = prepared(tmp_path / 'work2')
    with pytest.warns(ckpt.CheckpointWarning, match='iter_9.pth, which no manifest lists'):
        checkpoint = s2.load_or_resume(resume=True, checkpoint_dir=prefix)
    assert checkpoint['meta']['iter'] == 1 and s2.resumed_from == f'{prefix}/iter_1.pth'


def test_a_damaged_object_is_refused_naming_the_url(memory_url, tmp_path):
    s, _, _ = prepared(tmp_path / 'work')
    url = f'{memory_url}/iter_2.pth'
    s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 2}})
    fs, path = location.filesystem(url)
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf'{url} is damaged: xxh3_128'):
        s.load_checkpoint(url)
    fs.pipe_file(path, bytes(data[:-10]))
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf'{url} is damaged: it is \d+ bytes'):
        s.load_checkpoint(url)


def test_retention_at_a_url_keeps_the_newest_and_the_pointed(memory_url, tmp_path):
    s, model, ow = prepared(tmp_path / 'work')
    for it in (1, 2, 3, 4):
        s.save_checkpoint(f'{memory_url}/iter_{it}.pth', extra_ckpt={'meta': {'iter': it}})
    removed = location.apply_retention(memory_url, 2, pattern='iter_*')
    assert removed == [f'{memory_url}/iter_2.pth', f'{memory_url}/iter_1.pth']
    assert [c.step for c in location.list_checkpoints(memory_url)] == [4, 3]
    fs, path = location.filesystem(memory_url)
    assert not fs.exists(f'{path}/iter_1.pth.manifest.json')
    # the pointer moved back by hand: never deleted, even beyond max_keep
    fs.pipe_file(f'{path}/last_checkpoint', f'{memory_url}/iter_3.pth'.encode())
    assert location.apply_retention(memory_url, 1) == []


def test_a_save_to_a_missing_bucket_or_with_refused_credentials_names_the_url(s3, tmp_path):
    """One message naming the URL and the fix; the earlier checkpoint, its manifest and the
    pointer are unchanged; no staging directory is left behind."""
    s, model, ow = prepared(tmp_path / 'work')
    good = f'{s3}/run/iter_1.pth'
    s.save_checkpoint(good, extra_ckpt={'meta': {'iter': 1}})
    fs, path = location.filesystem(f'{s3}/run')
    before = {p: fs.cat_file(p) for p in fs.ls(path, refresh=True)}
    missing = f's3://no-such-bucket-{secrets.token_hex(3)}/run/iter_2.pth'
    with pytest.raises(ckpt.CheckpointLocationError) as caught:
        s.save_checkpoint(missing, extra_ckpt={'meta': {'iter': 2}})
    message = str(caught.value)
    assert missing in message and 'bucket does not exist' in message
    assert 'previous checkpoint is unchanged' in message and '\n' not in message
    s.checkpointer.backend_args = dict(key='wrong', secret='wrong')
    with pytest.raises(ckpt.CheckpointLocationError, match='check the credentials') as caught:
        s.save_checkpoint(f'{s3}/run/iter_2.pth', extra_ckpt={'meta': {'iter': 2}})
    assert f'{s3}/run/iter_2.pth' in str(caught.value)
    with pytest.raises(ckpt.CheckpointLocationError, match='check the credentials'):
        s.load_checkpoint(good)
    s.checkpointer.backend_args = None
    assert {p: fs.cat_file(p) for p in fs.ls(path, refresh=True)} == before
    s.load_checkpoint(good)


def test_a_url_without_its_package_names_the_extra(monkeypatch, tmp_path):
    import fsspec

    def refuse(url, **kwargs):
        raise ImportError('Install gcsfs to access Google Storage')

    monkeypatch.setattr(fsspec.core, 'url_to_fs', refuse)
    with pytest.raises(ImportError, match=r'pip install "stratagem\[gcs\]"'):
        location.filesystem('gs://bucket/ckpt/iter_1.pth')


def test_a_directory_layout_refuses_a_url_before_writing(tmp_path):
    from stratagem.checkpoint.storage import CheckpointStorage

    class Directory(CheckpointStorage):
        urls = False

    s, _, _ = prepared(tmp_path / 'work')
    s.checkpointer.storage = Directory()
    with pytest.raises(NotImplementedError, match='cannot be saved to or read from a URL yet'):
        s.save_checkpoint('memory://x/iter_1.pth')


def test_url_helpers():
    assert location.is_url('s3://b/k') and location.is_url('memory://x')
    assert not location.is_url('file:///tmp/x') and not location.is_url('/tmp/x')
    assert not location.is_url('C:/x') and not location.is_url('iter_1.pth')
    assert location.absolute('file:///tmp/x.pth') == '/tmp/x.pth'
    assert location.absolute('s3://b/p/') == 's3://b/p'
    assert location.join('s3://b/p', 'iter_1.pth') == 's3://b/p/iter_1.pth'


def test_an_async_save_to_a_url_holds_the_state_at_the_call(memory_url, tmp_path):
    """async_checkpoint: the snapshot at the call is uploaded on the writer thread; with
    ``also_point`` the work_dir's pointer names the URL, and resume=True in that work_dir
    (no checkpoint_dir) finds it there."""
    work = tmp_path / 'work'
    s = SingleDeviceStrategy(
        work_dir=str(work), env_kwargs=dict(randomness=dict(seed=1)), async_checkpoint=True
    )
    torch.manual_seed(0)
    model, ow, _ = s.prepare(
        nn.Sequential(nn.Linear(4, 2)),
        optim_wrapper=OPTIM,
        param_scheduler=[dict(type='ConstantLR')],
        dispatch_kwargs=dict(max_iters=10),
    )
    s.checkpointer.also_point = str(work)
    train(model, ow, 2)
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    url = f'{memory_url}/iter_2.pth'
    assert s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 2}}) == url
    train(model, ow, 2)  # while the upload may still run
    s.wait_for_checkpoints()
    assert (work / 'last_checkpoint').read_text() == url
    with pytest.warns(ckpt.CheckpointWarning, match=f'names {url}, a checkpoint at a URL'):
        assert ckpt.find_latest_checkpoint(work) is None  # the local scan: the URL unmangled
    s2b = SingleDeviceStrategy(work_dir=str(work), env_kwargs=dict(randomness=dict(seed=1)))
    torch.manual_seed(0)
    model3, _, _ = s2b.prepare(
        nn.Sequential(nn.Linear(4, 2)),
        optim_wrapper=OPTIM,
        param_scheduler=[dict(type='ConstantLR')],
        dispatch_kwargs=dict(max_iters=10),
    )
    checkpoint = s2b.load_or_resume(resume=True)
    assert checkpoint['meta']['iter'] == 2 and s2b.resumed_from == url
    assert all(torch.equal(model3.state_dict()[k], v) for k, v in at_call.items())


def _ddp_round_trip(url, work_dir):
    """In each of 2 gloo ranks: DDP trains, saves to ``url`` (rank 0 uploads), trains on;
    a fresh DDPStrategy resumes ``url`` (every rank agrees on it through the store) and
    trains the same steps: returns whether both end bit-equal."""
    from stratagem.strategies import build_strategy

    def make():
        s = build_strategy(
            dict(type='DDPStrategy', work_dir=work_dir, env_kwargs=dict(randomness=dict(seed=3)))
        )
        torch.manual_seed(0)
        model, ow = s.prepare(
            nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
            optim_wrapper=OPTIM,
            dispatch_kwargs=dict(max_iters=10),
        )
        return s, model, ow

    def steps(model, ow, seed):
        g = torch.Generator().manual_seed(seed + 100 * torch.distributed.get_rank())
        for _ in range(2):
            ow.update_params(model(torch.randn(3, 4, generator=g)).square().mean())

    s, model, ow = make()
    steps(model, ow, 1)
    assert s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 2}}) == url
    steps(model, ow, 2)
    expected = state_bytes(s.unwrap_model(), ow)
    s2, model2, ow2 = make()
    assert s2.resume(url)['meta']['iter'] == 2
    steps(model2, ow2, 2)
    return state_bytes(s2.unwrap_model(), ow2) == expected


@pytest.mark.slow
def test_ddp_on_two_ranks_saves_to_s3_and_resumes_from_it(s3, tmp_path):
    from dist_harness import run_distributed

    url = f'{s3}/ddp/iter_2.pth'
    assert run_distributed(
        _ddp_round_trip, nproc=2, args=(url, str(tmp_path / 'work')), timeout=300
    ) == [True, True]
    fs, path = location.filesystem(f'{s3}/ddp')
    assert sorted(p.rsplit('/', 1)[-1] for p in fs.ls(path, refresh=True)) == [
        'iter_2.pth',
        'iter_2.pth.manifest.json',
        'last_checkpoint',
    ]


def test_foreign_objects_load_unverified_in_either_format_and_a_truncated_one_is_named(
    memory_url,
):
    """A torch.save object with no manifest (mmengine's, on S3) loads with the warning a
    local one gets, zip or legacy pickle; a truncated zip is named as truncated."""
    fs, path = location.filesystem(memory_url)
    tensors = {'w': torch.arange(6.0).reshape(2, 3)}
    for name, zipped in (('zip.pth', True), ('legacy.pth', False)):
        buffer = io.BytesIO()
        torch.save(tensors, buffer, _use_new_zipfile_serialization=zipped)
        fs.pipe_file(f'{path}/{name}', buffer.getvalue())
        with pytest.warns(ckpt.UnverifiedCheckpointWarning, match='no stratagem manifest'):
            got = location.load_file(f'{memory_url}/{name}')
        assert torch.equal(got['w'], tensors['w'])
    whole = fs.cat_file(f'{path}/zip.pth')
    fs.pipe_file(f'{path}/cut.pth', whole[: len(whole) // 2])
    with (
        pytest.warns(ckpt.UnverifiedCheckpointWarning),
        pytest.raises(ckpt.CheckpointCorruptError, match=rf'{memory_url}/cut.pth is truncated'),
    ):
        location.load_file(f'{memory_url}/cut.pth')


def test_resume_at_a_url_passes_over_a_damaged_newest(memory_url, tmp_path):
    """The newest object's bytes no longer match its manifest (same size): the automatic
    resume warns and continues from the newest other committed one."""
    s, _, _ = prepared(tmp_path / 'work')
    for it in (1, 2):
        s.save_checkpoint(f'{memory_url}/iter_{it}.pth', extra_ckpt={'meta': {'iter': it}})
    fs, path = location.filesystem(memory_url)
    data = bytearray(fs.cat_file(f'{path}/iter_2.pth'))
    data[-200] ^= 0xFF
    fs.pipe_file(f'{path}/iter_2.pth', bytes(data))
    s2, _, _ = prepared(tmp_path / 'work2')
    with pytest.warns(ckpt.CheckpointWarning, match=r'iter_2.pth is damaged.*iter_1.pth'):
        checkpoint = s2.load_or_resume(resume=True, checkpoint_dir=memory_url)
    assert checkpoint['meta']['iter'] == 1 and s2.resumed_from == f'{memory_url}/iter_1.pth'


def test_a_same_name_save_that_fails_mid_upload_leaves_the_old_object_verifiable(
    memory_url, tmp_path, monkeypatch
):
    """Saving over ``latest.pth``: the new manifest (naming the old one it replaces) goes up
    first; the object's upload fails (the store refuses it); the old object still loads and
    is still listed, and the next save over it works."""
    s, model, ow = prepared(tmp_path / 'work')
    url = f'{memory_url}/latest.pth'
    s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 1}})
    fs, _ = location.filesystem(url)

    def refuse(*args, **kwargs):
        raise OSError(5, 'the store failed mid-upload')

    with monkeypatch.context() as patch:
        patch.setattr(type(fs), 'put_file', refuse)
        train(model, ow, 1)
        with pytest.raises(ckpt.CheckpointLocationError, match='mid-upload'):
            s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 2}})
    assert 'replaces' in location.read_manifest_at(url)
    assert s.load_checkpoint(url)['meta']['iter'] == 1
    assert [c.url for c in location.list_checkpoints(memory_url)] == [url]
    s.save_checkpoint(url, extra_ckpt={'meta': {'iter': 3}})
    assert 'replaces' not in location.read_manifest_at(url)
    assert s.load_checkpoint(url)['meta']['iter'] == 3


def test_the_file_functions_take_a_url_or_refuse_it_never_writing_an_s3_directory(
    tmp_path, monkeypatch, memory_url
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match='writes a local file, not s3://b/iter_1.pth'):
        ckpt.save_checkpoint({'w': torch.ones(2)}, 's3://b/iter_1.pth')
    local = ckpt.save_checkpoint({'w': torch.ones(2)}, tmp_path / 'iter_1.pth', step=1)
    location.upload_file(local, f'{memory_url}/iter_1.pth')
    assert torch.equal(ckpt.load_checkpoint_file(f'{memory_url}/iter_1.pth')['w'], torch.ones(2))
    assert location.find_latest(memory_url) == f'{memory_url}/iter_1.pth'
    for name in ('iter_1.pth', 'iter_1.pth.manifest.json', 'last_checkpoint'):
        (tmp_path / name).unlink()
    # convert reads from and writes to a URL (test_ckpt_remote_dirs.py), never an 's3:' dir
    weights = ckpt.save_checkpoint(
        {'state_dict': {'w': torch.ones(2)}}, tmp_path / 'w.pth', update_pointer=False
    )
    out = ckpt.convert_checkpoint(weights, f'{memory_url}/sharded', to='sharded')
    assert out == f'{memory_url}/sharded'
    for name in ('w.pth', 'w.pth.manifest.json'):
        (tmp_path / name).unlink()
    assert not list(tmp_path.iterdir())
