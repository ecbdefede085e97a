"""#42: directory checkpoints (FSDP's DCP directory, DeepSpeed's, converted ones) at an fsspec URL,
the same behaviour as on a local directory: retention, the latest pointer, auto-resume,
world-size changes and `convert`, parametrised over a local directory and a real local S3
server (moto_server through s3fs, tests/s3_server.py); what a reader trusts on a store without
rename; a 2-rank FSDP save to S3 resumed on 2 processes and on 1 (slow tier)."""

import io
import os
import urllib.parse
from pathlib import Path

import pytest
import torch
from torch import nn

from remote_state import prepared, state_bytes, train
from stratagem import checkpoint as ckpt
from stratagem.checkpoint import location
from stratagem.checkpoint.location import is_url, join


@pytest.fixture(params=['local', 's3'])
def where(request, tmp_path):
    """Where the run's directory checkpoints go: a local directory, or a prefix on S3."""
    if request.param == 'local':
        return str(tmp_path / 'ckpts')
    return f'{request.getfixturevalue("s3")}/ckpts'


def _names(where):
    if is_url(where):
        return [c.url.rsplit('/', 1)[-1] for c in location.list_checkpoints(where)]
    return [Path(c.path).name for c in ckpt.list_checkpoints(where)]


def _retain(where, keep):
    if is_url(where):
        return location.apply_retention(where, keep)
    return ckpt.apply_retention(where, keep)


def _pointer(where):
    if is_url(where):
        return location.read_pointer(where)
    return (Path(where) / 'last_checkpoint').read_text().strip()


def test_sharded_directories_retention_pointer_auto_resume_and_convert(
    where, tmp_path, monkeypatch
):
    """Sharded directories written by `convert` (file -> sharded, one process) at ``where``:
    the pointer names the newest, load_or_resume(checkpoint_dir=where) resumes it (at a URL
    reading its manifest once each to find it, agree on it and load it) and trains on
    bit-equal to the uninterrupted run, retention keeps the newest, and `convert` reads it
    back (sharded -> file) to the same weights and optimizer state."""
    from stratagem.checkpoint import remote_directory

    manifests = []
    read_small = remote_directory._read_small

    def counted(fs, path):
        manifests.append(path.rsplit('/', 2)[-2])
        return read_small(fs, path)

    s, model, ow = prepared(tmp_path / 'work')
    staged = tmp_path / 'staged'
    for it in (1, 2):
        train(model, ow, 1)
        local = s.save_checkpoint(str(staged / f'iter_{it}.pth'), extra_ckpt={'meta': {'iter': it}})
        out = ckpt.convert_checkpoint(local, join(where, f'iter_{it}'), to='sharded')
        assert str(out) == join(where, f'iter_{it}')
    at_2 = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, ow, 2)
    expected = state_bytes(model, ow)

    assert _pointer(where) == join(where, 'iter_2')
    assert _names(where) == ['iter_2', 'iter_1']
    s2, model2, ow2 = prepared(tmp_path / 'work2')
    with monkeypatch.context() as patched:
        patched.setattr(remote_directory, '_read_small', counted)
        checkpoint = s2.load_or_resume(resume=True, checkpoint_dir=where)
    assert checkpoint['meta']['iter'] == 2 and s2.resumed_from == join(where, 'iter_2')
    assert manifests.count('iter_2') == (3 if is_url(where) else 0), manifests
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in at_2.items())
    train(model2, ow2, 2)
    assert state_bytes(model2, ow2) == expected

    assert [str(p) for p in _retain(where, 1)] == [join(where, 'iter_1')]
    assert _names(where) == ['iter_2']
    back = ckpt.convert_checkpoint(join(where, 'iter_2'), tmp_path / 'back.pth')
    original = ckpt.load_checkpoint_file(staged / 'iter_2.pth')
    read = ckpt.load_checkpoint_file(back)
    assert read['state_dict'].keys() == original['state_dict'].keys()
    assert all(torch.equal(read['state_dict'][k], v) for k, v in original['state_dict'].items())
    assert read['optimizer']['state'].keys() == original['optimizer']['state'].keys()


def test_convert_between_urls_and_what_it_refuses(s3, tmp_path):
    """`stratagem convert` from a URL to a URL (file -> sharded -> hf -> safetensors), and
    to a local file; a URL that holds a directory is never overwritten, a missing source is
    named; nothing is written locally but the local target."""
    from stratagem.cli import main

    weights = {'w': torch.arange(6.0).reshape(2, 3), 'b': torch.ones(2)}
    local = ckpt.save_checkpoint(
        {'meta': {'iter': 5}, 'state_dict': weights}, tmp_path / 'm.pth', update_pointer=False
    )
    ckpt.convert_checkpoint(local, f'{s3}/m.pth')  # a local file -> an object with its manifest
    assert main(['convert', f'{s3}/m.pth', f'{s3}/sharded', '--to', 'sharded']) == 0
    with pytest.warns(UserWarning, match='no config.json'):
        assert main(['convert', f'{s3}/sharded', f'{s3}/hf', '--to', 'hf']) == 0
    assert main(['convert', f'{s3}/hf', f'{s3}/w.safetensors']) == 0
    assert main(['convert', f'{s3}/sharded', str(tmp_path / 'out.pth')]) == 0
    got = ckpt.load_checkpoint_file(tmp_path / 'out.pth')
    assert got['meta']['iter'] == 5
    assert all(torch.equal(got['state_dict'][k], v) for k, v in weights.items())
    fs, root = location.filesystem(s3)
    from safetensors.torch import load

    st = load(fs.cat_file(f'{root}/w.safetensors'))
    assert all(torch.equal(st[k], v) for k, v in weights.items())

    with pytest.raises(FileExistsError, match='cannot be replaced at a URL'):
        ckpt.convert_checkpoint(f'{s3}/m.pth', f'{s3}/sharded', to='sharded', overwrite=True)
    with pytest.raises(FileExistsError, match='exists; choose a new name'):
        ckpt.convert_checkpoint(f'{s3}/m.pth', f'{s3}/hf', to='hf')
    with pytest.raises(FileNotFoundError, match=f'checkpoint not found: {s3}/none'):
        ckpt.convert_checkpoint(f'{s3}/none', f'{s3}/none2')
    # the same-name upload of a file keeps the old one verifiable: --overwrite may replace it
    ckpt.convert_checkpoint(f'{s3}/sharded', f'{s3}/m.pth', overwrite=True)
    assert location.read_manifest_at(f'{s3}/m.pth')['source_format'] == 'sharded'
    # a directory read through a local copy (Hugging Face's) is verified as it downloads
    data = bytearray(fs.cat_file(f'{root}/hf/model.safetensors'))
    data[-3] ^= 0xFF
    fs.pipe_file(f'{root}/hf/model.safetensors', bytes(data))
    with pytest.raises(ckpt.CheckpointCorruptError, match=f'{s3}/hf/model.safetensors is damaged'):
        ckpt.convert_checkpoint(f'{s3}/hf', tmp_path / 'never.pth')
    assert sorted(os.listdir(tmp_path)) == [
        'm.pth',
        'm.pth.manifest.json',
        'out.pth',
        'out.pth.manifest.json',
    ]


def test_a_directory_at_a_url_trusts_only_its_manifest(s3, tmp_path, monkeypatch):
    """Objects of an upload that died (no manifest) are no checkpoint, and the next save of
    that name removes them first; the committed directory the pointer names is never
    replaced, another one is (with a warning); a failed upload commits nothing and moves no
    pointer; a damaged or missing file is named on read."""
    from stratagem.checkpoint.sharded import read_sharded_checkpoint, save_sharded_checkpoint

    prefix = f'{s3}/run'
    fs, root = location.filesystem(prefix)
    state = {'meta': {'iter': 1}, 'state_dict': {'w': torch.arange(8.0)}}
    save_sharded_checkpoint(f'{prefix}/iter_1', state, step=1, collective=False)
    fs.pipe_file(f'{root}/iter_2/__0_0.distcp', b'half an upload')  # debris
    assert _names(prefix) == ['iter_1']
    save_sharded_checkpoint(
        f'{prefix}/iter_2', {**state, 'meta': {'iter': 2}}, step=2, collective=False
    )
    assert sorted(p.rsplit('/', 1)[-1] for p in fs.find(f'{root}/iter_2')) == [
        '.metadata',
        '__0_0.distcp',
        'extra.pth',
        'manifest.json',
    ]
    with pytest.raises(FileExistsError, match='holds a committed checkpoint that .* names'):
        save_sharded_checkpoint(f'{prefix}/iter_2', state, step=2, collective=False)
    assert read_sharded_checkpoint(f'{prefix}/iter_2')['meta']['iter'] == 2
    # the pointer names iter_2: iter_1 saved again (a run resumed from an earlier one)
    with pytest.warns(ckpt.CheckpointWarning, match='iter_1 holds a committed checkpoint, which'):
        save_sharded_checkpoint(
            f'{prefix}/iter_1', {**state, 'meta': {'iter': 7}}, step=1, collective=False
        )
    assert read_sharded_checkpoint(f'{prefix}/iter_1')['meta']['iter'] == 7
    fs.pipe_file(f'{root}/last_checkpoint', f'{prefix}/iter_2'.encode())  # moved back

    import tempfile

    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))  # where staging dirs go
    calls = []

    def failing(fs_, local, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(5, 'the store failed mid-upload')
        fs_.put_file(os.fspath(local), path)

    with monkeypatch.context() as patch:
        patch.setattr('stratagem.checkpoint.transfer.put_file', failing)
        with pytest.raises(ckpt.CheckpointLocationError, match='mid-upload'):
            save_sharded_checkpoint(f'{prefix}/iter_3', state, step=3, collective=False)
    assert not fs.exists(f'{root}/iter_3/manifest.json') and _names(prefix) == ['iter_2', 'iter_1']
    assert location.read_pointer(prefix) == f'{prefix}/iter_2'
    assert not list(tmp_path.glob('stratagem-upload-*'))  # this rank's staging removed

    data = bytearray(fs.cat_file(f'{root}/iter_2/__0_0.distcp'))
    data[-100] ^= 0xFF
    fs.pipe_file(f'{root}/iter_2/__0_0.distcp', bytes(data))
    with pytest.raises(
        ckpt.CheckpointCorruptError, match=rf'{prefix}/iter_2/__0_0.distcp is damaged'
    ):
        read_sharded_checkpoint(f'{prefix}/iter_2')
    fs.rm_file(f'{root}/iter_1/extra.pth')
    with pytest.raises(FileNotFoundError, match=rf'{prefix}/iter_1/extra.pth is missing'):
        read_sharded_checkpoint(f'{prefix}/iter_1')


# ------------------------------------------------------------------------- FSDP (slow)
class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x


def _fsdp(work_dir, **kwargs):
    from stratagem.strategies import build_strategy

    s = build_strategy(
        dict(
            type='FSDPStrategy',
            work_dir=str(work_dir),
            env_kwargs=dict(randomness=dict(seed=7)),
            model_wrapper=dict(auto_wrap_policy=['Block', 'Linear']),
            **kwargs,
        )
    )
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(6, 8), Block(), Block(), nn.Linear(8, 2))
    model, ow = s.prepare(
        net,
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=0.01)),
        dispatch_kwargs=dict(max_iters=8),
    )
    return s, model, ow


def _fsdp_train(s, model, ow, start, stop):
    world = torch.distributed.get_world_size()
    for it in range(start, stop):
        g = torch.Generator().manual_seed(100 + it)
        x, y = torch.randn(8, 6, generator=g), torch.randint(2, (8,), generator=g)
        per = 8 // world
        x, y = x[s.rank * per : (s.rank + 1) * per], y[s.rank * per : (s.rank + 1) * per]
        ow.update_params(nn.functional.cross_entropy(model(x), y))


def _full(s):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    model = get_model_state_dict(s.model, options=opts)
    optim = get_optimizer_state_dict(s.model, s.optim_wrapper.optimizer, options=opts)
    buffer = io.BytesIO()
    torch.save({'model': model, 'optim': optim['state']}, buffer)
    return buffer.getvalue()


def _fsdp_save(prefix, work_dir):
    """2 ranks: an async sharded save to S3 at iter 3 (training goes on meanwhile), another
    at iter 6; returns the full state at 3 and at 6."""
    s, model, ow = _fsdp(work_dir, async_checkpoint=True)
    _fsdp_train(s, model, ow, 0, 3)
    # saves that fail before their write on some ranks (their callback raises there): every
    # rank fails in the call, the failed rank named, nothing written. The first would have
    # made the writer's group
    refused = {}
    for name, ranks in (('refused', {1}), ('refused_0', {0}), ('refused_all', {0, 1})):

        def refuse(checkpoint, ranks=ranks):
            if s.rank in ranks:
                raise ValueError(f'refused on rank {s.rank}')

        try:
            s.save_checkpoint(join(prefix, name), callback=refuse)
            s.wait_for_checkpoints()
            refused[name] = None
        except Exception as err:  # noqa: BLE001 - reported to the test
            refused[name] = f'{type(err).__name__}: {err}'
    # rank 1's own step inside DCP's write fails (a side file): named by rank 0 too
    from stratagem.checkpoint import sharded

    real_side = sharded._write_side
    if s.rank == 1:
        sharded._write_side = lambda obj, path: (_ for _ in ()).throw(OSError('side failed'))
    try:
        s.save_checkpoint(join(prefix, 'side_failed'))
        s.wait_for_checkpoints()
        refused['side_failed'] = None
    except Exception as err:  # noqa: BLE001 - reported to the test
        refused['side_failed'] = f'{type(err).__name__}: {err}'
    finally:
        sharded._write_side = real_side
    at_3 = _full(s)
    assert s.save_checkpoint(join(prefix, 'iter_3'), extra_ckpt={'meta': {'iter': 3}}) == join(
        prefix, 'iter_3'
    )
    _fsdp_train(s, model, ow, 3, 6)
    at_6 = _full(s)
    s.save_checkpoint(join(prefix, 'iter_6'), extra_ckpt={'meta': {'iter': 6}})
    s.wait_for_checkpoints()
    return at_3, at_6, refused


def _fsdp_resume(prefix, work_dir):
    """Any world size: iter_3 resumed (in place, each rank reading its pieces) and trained to
    6; the newest found by load_or_resume(checkpoint_dir=prefix); a save at this world size."""
    import contextlib

    from stratagem.checkpoint import remote_directory

    s, model, ow = _fsdp(work_dir)
    # what this rank read of each shard file from the store: whole (verified, then kept in
    # memory for the read), or ranges of a file another rank verified
    whole, ranged = set(), {}
    read_hashed, open_ = remote_directory._read_hashed, remote_directory.RemoteDirectory.open

    def spy_read(fs, path, size, entries, url):
        whole.add(url.rsplit('/', 1)[-1])
        return read_hashed(fs, path, size, entries, url)

    class Counted:
        def __init__(self, stream, name):
            self.stream, self.name = stream, name

        def read(self, n=-1):
            data = self.stream.read(n)
            ranged[self.name] = ranged.get(self.name, 0) + len(data)
            return data

        def __getattr__(self, name):
            return getattr(self.stream, name)

    @contextlib.contextmanager
    def spy_open(self, relative):
        with open_(self, relative) as stream:
            yield stream if relative in self.cache else Counted(stream, relative)

    remote_directory._read_hashed = spy_read
    remote_directory.RemoteDirectory.open = spy_open
    try:
        assert s.resume(join(prefix, 'iter_3'))['meta']['iter'] == 3
    finally:
        remote_directory._read_hashed = read_hashed
        remote_directory.RemoteDirectory.open = open_
    loaded = _full(s)
    _fsdp_train(s, model, ow, 3, 6)
    trained = _full(s)
    s2, _, _ = _fsdp(work_dir)
    latest = s2.load_or_resume(resume=True, checkpoint_dir=prefix)
    world = torch.distributed.get_world_size()
    s2.save_checkpoint(join(prefix, f'world_{world}'), extra_ckpt={'meta': {'iter': 6}})
    shards = None
    if is_url(prefix):
        fs, root = location.filesystem(prefix)
        sizes = {name: fs.size(f'{root}/iter_3/{name}') for name in ranged}
        shards = (
            sorted(name for name in whole if name.endswith('.distcp')),
            {name: (n, sizes[name]) for name, n in ranged.items() if name.endswith('.distcp')},
        )
    return loaded, trained, latest['meta']['iter'], s2.resumed_from, shards


def _files(where, name):
    """The files of the directory checkpoint ``name`` at ``where``, relative to it."""
    if is_url(where):
        fs, root = location.filesystem(join(where, name))
        return sorted(p[len(root) + 1 :] for p in fs.find(root))
    top = Path(where, name)
    return sorted(p.relative_to(top).as_posix() for p in top.rglob('*') if p.is_file())


def _manifest(where, name):
    if is_url(where):
        from stratagem.checkpoint.remote_directory import read_remote_manifest

        return read_remote_manifest(join(where, name))[0]
    import json

    return json.loads(Path(where, name, 'manifest.json').read_text())


@pytest.mark.slow
def test_fsdp_two_ranks_sharded_save_resumed_on_two_and_on_one(where, tmp_path):
    """FSDP on 2 ranks saves sharded directories (async) to ``where``, a local directory or
    S3; resumed on 2 processes bit-equal, and on 1 (the same full state, resharded); the
    newest found by load_or_resume(checkpoint_dir=); retention and the pointer after."""
    from dist_harness import run_distributed

    work = str(tmp_path / 'work')
    (at_3, at_6, refused_0), (_, _, refused_1) = run_distributed(
        _fsdp_save, nproc=2, args=(where, work), timeout=300
    )
    assert refused_1 == {
        'refused': 'ValueError: refused on rank 1',
        'refused_0': (
            f'CheckpointVoteError: saving {join(where, "refused_0")} failed on rank 0: '
            'ValueError: refused on rank 0; nothing was committed'
        ),
        'refused_all': 'ValueError: refused on rank 1',
        'side_failed': 'OSError: side failed',
    }
    assert refused_0 == {
        'refused': (
            f'CheckpointVoteError: saving {join(where, "refused")} failed on rank 1: '
            'ValueError: refused on rank 1; nothing was committed'
        ),
        'refused_0': 'ValueError: refused on rank 0',
        'refused_all': 'ValueError: refused on rank 0',
        'side_failed': (
            f'CheckpointVoteError: saving {join(where, "side_failed")} failed on rank 1: '
            'OSError: side failed; nothing was committed'
        ),
    }
    files = ['.metadata', '__0_0.distcp', '__1_0.distcp', 'extra.pth', 'manifest.json']
    files += ['rng_states/rank_0.pth', 'rng_states/rank_1.pth']  # each rank's own
    assert _files(where, 'iter_3') == files
    assert _pointer(where) == join(where, 'iter_6')
    assert _manifest(where, 'iter_3')['world_size'] == 2

    two = run_distributed(_fsdp_resume, nproc=2, args=(where, work), timeout=300)
    assert all(r[0] == at_3 and r[1] == at_6 for r in two)  # bit-equal on 2 ranks
    assert all(r[2] == 6 and r[3] == join(where, 'iter_6') for r in two)
    if is_url(where):
        _assert_own_pieces(where, [r[4] for r in two])
    (one,) = run_distributed(_fsdp_resume, nproc=1, args=(where, work), timeout=300)
    assert one[0] == at_3  # 2 -> 1: the same full state, resharded
    assert one[2] == 6 and one[3] == join(where, 'world_2')  # the newest, by the pointer
    if is_url(where):  # every file verified, then read from memory
        assert one[4] == (['__0_0.distcp', '__1_0.distcp'], {})
    assert _pointer(where) == join(where, 'world_1')
    # the newest two kept (all at step 6: by creation), the pointed-to among them
    assert [str(p) for p in _retain(where, 2)] == [join(where, 'iter_6'), join(where, 'iter_3')]
    assert _names(where) == ['world_1', 'world_2']


def _assert_own_pieces(prefix, reads):
    """At the saving world size each rank reads (and verifies) its own shard file once, and
    of the other rank's exactly the items DCP stored there once for all ranks (the
    optimizer's step counters and hyperparameters: one chunk, or bytes): none of its shards."""
    import pickle

    fs, root = location.filesystem(prefix)
    metadata = pickle.loads(fs.cat_file(f'{root}/iter_3/.metadata'))
    replicated = {}
    for index, info in metadata.storage_data.items():
        if len(getattr(metadata.state_dict_metadata[index.fqn], 'chunks', [None])) == 1:
            replicated[info.relative_path] = replicated.get(info.relative_path, 0) + info.length
    for rank, (own, others) in enumerate(reads):
        other = f'__{1 - rank}_0.distcp'
        assert own == [f'__{rank}_0.distcp']
        assert others.get(other, (0, 0))[0] == replicated.get(other, 0), (others, replicated)


# -------------------------------------------------------------------- DeepSpeed (slow)
def _deepspeed(work_dir, stage=2, **kwargs):
    from stratagem.strategies import build_strategy

    s = build_strategy(
        dict(
            type='DeepSpeedStrategy',
            work_dir=work_dir,
            env_kwargs=dict(randomness=dict(seed=7)),
            zero_optimization=dict(stage=stage),
            **kwargs,
        )
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    model, ow = s.prepare(
        net,
        optim_wrapper=dict(optimizer=dict(type='Adam', lr=0.05)),
        dispatch_kwargs=dict(max_iters=8, train_micro_batch_size_per_gpu=4),
    )
    return s, model, ow


def _deepspeed_train(s, model, ow, start, stop):
    for it in range(start, stop):
        g = torch.Generator().manual_seed(1000 + 10 * it + s.rank)
        x, y = torch.randn(4, 6, generator=g), torch.randint(3, (4,), generator=g)
        ow.update_params(nn.functional.cross_entropy(model(x), y))


def _deepspeed_weights(s):
    return {k: v.detach().float().clone() for k, v in s.model_state_dict().items()}


def _deepspeed_save(prefix, work_dir):
    """ZeRO-2 on this world size: an async save of DeepSpeed's directory to S3 at iteration
    2; returns the weights at 2 and at 4. And ZeRO-3's at 2, saved to ``<prefix>3``."""
    s, model, ow = _deepspeed(work_dir, async_checkpoint=True)
    _deepspeed_train(s, model, ow, 0, 2)
    at_2 = _deepspeed_weights(s)
    s.save_checkpoint(f'{prefix}/iter_2', extra_ckpt={'meta': {'iter': 2}})
    _deepspeed_train(s, model, ow, 2, 4)
    at_4 = _deepspeed_weights(s)
    s.wait_for_checkpoints()
    s, model, ow = _deepspeed(f'{work_dir}3', stage=3)
    _deepspeed_train(s, model, ow, 0, 1)  # one update: weights a fresh engine has not
    s.save_checkpoint(f'{prefix}3/iter_2', extra_ckpt={'meta': {'iter': 2}})
    return at_2, at_4, _deepspeed_weights(s)


def _deepspeed_resume(prefix, work_dir):
    """The newest at ``prefix`` resumed at another world size (through DeepSpeed's universal
    checkpoint, from a verified download) and trained to 4; the weights alone by
    load_checkpoint."""
    s, model, ow = _deepspeed(work_dir)
    at = s.load_or_resume(resume=True, checkpoint_dir=prefix)['meta']['iter']
    resumed = _deepspeed_weights(s)
    _deepspeed_train(s, model, ow, 2, 4)
    weights_only, _, _ = _deepspeed(work_dir)
    weights_only.load_checkpoint(f'{prefix}/iter_2')
    return at, resumed, _deepspeed_weights(s), _deepspeed_weights(weights_only), s.resumed_from


def _deepspeed_resume_streamed(prefix, work_dir, temp):
    """The newest at ``prefix`` resumed at the world size that saved it, trained to 4. Also:
    the bytes of the files under ``temp`` (TMPDIR, where a local copy would go) while
    DeepSpeed's engine loads, and its checkpoint engine's class after the load."""
    s, model, ow = _deepspeed(work_dir)
    engine = s.model
    load, on_disk = engine.load_checkpoint, []

    def spy(*args, **kwargs):
        on_disk.append(
            sum(
                p.stat().st_size
                for p in Path(temp).rglob('*')
                if p.is_file() and 'stratagem-dist-' not in str(p)
            )
        )
        return load(*args, **kwargs)

    engine.load_checkpoint = spy
    at = s.load_or_resume(resume=True, checkpoint_dir=prefix)['meta']['iter']
    del engine.load_checkpoint
    resumed = _deepspeed_weights(s)
    _deepspeed_train(s, model, ow, 2, 4)
    checkpoint_engine = type(engine.checkpoint_engine).__name__
    zero3, _, _ = _deepspeed(f'{work_dir}3', stage=3)  # DeepSpeed consolidates: a download
    zero3.resume(f'{prefix}3/iter_2', resume_optimizer=False)
    fresh = len(zero3.model.optimizer.optimizer.state) == 0
    weights = (_deepspeed_weights(zero3), fresh)
    return at, resumed, _deepspeed_weights(s), on_disk, checkpoint_engine, s.resumed_from, weights


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _gets(proxy, key):
    """``{file: GETs}`` of the objects under ``key`` the proxy forwarded."""
    counts = {}
    for method, target in proxy.seen:
        path = urllib.parse.urlsplit(target).path
        if method == 'GET' and f'/{key}/' in path:
            name = path.split(f'/{key}/', 1)[1]
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.slow
def test_deepspeed_directory_saved_to_s3_resumed_on_two_and_on_one(
    s3, s3_server, tmp_path, monkeypatch
):
    """DeepSpeed's ZeRO-2 directory saved to S3 by 2 ranks. Resumed on 2 bit-equal, from
    memory: each rank GETs only the files DeepSpeed reads for it (the model states, its own
    optimizer partition, our state), once each (counted by a proxy per rank), and no byte of
    the checkpoint lands on the local disk while DeepSpeed loads; the engine's own
    checkpoint engine is back after. Resumed on 1 (a world-size change: DeepSpeed's
    universal checkpoint, from a download) with the saved weights. A ZeRO-3 directory
    resumed on 2 with resume_optimizer=False (DeepSpeed consolidates the weights from every
    rank's files: a download) with the saved weights and a fresh optimizer. Every rank's
    staging and download directories are removed."""
    pytest.importorskip('deepspeed')
    from dist_harness import run_distributed
    from s3_faults import FaultProxy

    temp = tmp_path / 'tmp'  # the ranks' staging and download directories go here
    temp.mkdir()
    monkeypatch.setenv('TMPDIR', str(temp))
    work = str(tmp_path / 'work')
    prefix = f'{s3}/ds'
    saved = run_distributed(_deepspeed_save, nproc=2, args=(prefix, work), timeout=400)
    assert _manifest(prefix, 'iter_2')['world_size'] == 2
    names = _files(prefix, 'iter_2')
    assert {'manifest.json', 'stratagem_state.pth'} <= set(names)
    assert location.read_pointer(prefix) == f'{prefix}/iter_2'

    proxies = [FaultProxy(s3_server.endpoint).start() for _ in range(2)]
    try:
        streamed = run_distributed(
            _deepspeed_resume_streamed,
            nproc=2,
            args=(prefix, work, str(temp)),
            env={'AWS_ENDPOINT_URL': lambda rank: proxies[rank].endpoint},
            timeout=400,
        )
    finally:
        for proxy in proxies:
            proxy.stop()
    bucket = s3.split('://', 1)[1]
    for rank, ((at_2, at_4, zero3), (at, resumed, trained, on_disk, engine, fro, z3)) in enumerate(
        zip(saved, streamed)
    ):
        assert at == 2 and fro == f'{prefix}/iter_2'
        assert _equal(resumed, at_2) and _equal(trained, at_4)
        assert _equal(z3[0], zero3) and z3[1]  # the saved weights, a fresh optimizer
        assert on_disk == [0], on_disk  # names only: no checkpoint byte on local disk
        assert engine != 'StreamingCheckpointEngine'
        got = _gets(proxies[rank], f'{bucket}/ds/iter_2')
        assert got == {
            # rank 0 lists the checkpoints (the newest); every rank agrees on its digest,
            # then reads it once: the format detected, then verified from the same bytes
            'manifest.json': 3 if rank == 0 else 2,
            'stratagem_state.pth': 1,
            'deepspeed/mp_rank_00_model_states.pt': 1,
            f'deepspeed/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt': 1,
        }, got

    ((at, resumed, _, weights, _),) = run_distributed(
        _deepspeed_resume, nproc=1, args=(prefix, work), timeout=400
    )
    assert at == 4  # 2 iterations of 2 ranks: 4 of this one's (the samples seen)
    assert _equal(resumed, saved[0][0]) and _equal(weights, saved[0][0])
    assert not list(temp.glob('stratagem-*'))  # uploaded from, downloaded to: removed


@pytest.mark.slow
def test_stratagem_train_fsdp_with_out_dir_on_s3_resumes_in_an_empty_work_dir(s3, tmp_path):
    """`stratagem train` of the FSDP example on 2 processes with mmengine's out_dir on S3:
    sharded directories in the bucket, max_keep_ckpts applied there, the pointer in both
    places; then `--resume` on a "new machine" (an empty work_dir of the same name) resumes
    from the bucket alone and finishes the run."""
    from stratagem.cli import main

    example = Path(__file__).resolve().parents[2] / 'examples' / 'configs' / 'transformer_fsdp.py'
    options = [
        'train_cfg.max_iters=8',
        'train_cfg.max_epochs=None',
        'train_cfg.checkpoint_interval=2',
        'train_cfg.max_keep_ckpts=2',
        f'default_hooks.checkpoint.out_dir={s3}/runs',
    ]

    def train(work_dir, *extra, max_iters=6):
        args = ['train', str(example), '--nproc', '2', '--work-dir', str(work_dir)]
        return main(
            [*args, *extra, '--cfg-options', *options[1:], f'train_cfg.max_iters={max_iters}']
        )

    assert train(tmp_path / 'a' / 'exp') == 0
    prefix = f'{s3}/runs/exp'
    assert _names(prefix) == ['iter_6.pth', 'iter_4.pth']  # retention in the bucket
    assert location.read_pointer(prefix) == f'{prefix}/iter_6.pth'
    assert (tmp_path / 'a' / 'exp' / 'last_checkpoint').read_text() == f'{prefix}/iter_6.pth'
    from stratagem.checkpoint.remote_directory import read_remote_manifest

    assert read_remote_manifest(f'{prefix}/iter_6.pth')[0]['world_size'] == 2

    assert train(tmp_path / 'b' / 'exp', '--resume', max_iters=8) == 0
    assert location.read_pointer(prefix) == f'{prefix}/iter_8.pth'
    assert ckpt.convert_checkpoint(f'{prefix}/iter_8.pth', tmp_path / 'final.pth')
    assert ckpt.load_checkpoint_file(tmp_path / 'final.pth')['meta']['iter'] == 8


# ------------------------------------------------- DeepSpeed's files read from memory (tier 1)
def _zero_layout(staging):
    """A directory laid out as DeepSpeed's (2 ranks, ZeRO-2) with our state beside it."""
    from stratagem.strategies.deepspeed.files import DEEPSPEED_TAG, STATE_FILE

    tag = staging / DEEPSPEED_TAG
    tag.mkdir()
    torch.save({'meta': {'iter': 2}}, staging / STATE_FILE)
    torch.save({'module': {'w': torch.arange(4.0)}}, tag / 'mp_rank_00_model_states.pt')
    for rank in range(2):
        state = {'optimizer_state_dict': {'rank': rank, 'm': torch.full((3,), float(rank))}}
        torch.save(state, tag / f'zero_pp_rank_{rank}_mp_rank_00_optim_states.pt')
    (staging / 'zero_to_fp32.py').write_text('# DeepSpeed recovery script\n')
    return [p for p in staging.rglob('*') if p.is_file()]


def test_deepspeed_files_read_from_memory_only_what_the_rank_reads(s3, tmp_path):
    """Rank 1 of a 2-rank DeepSpeed checkpoint at a URL verifies and keeps only the files
    DeepSpeed's engine reads on it; the streaming checkpoint engine serves them by their
    (empty) local names from memory, reads another file verified when asked, refuses a name
    outside, and is swapped out again after; a damaged file this rank reads is refused
    naming it, before anything is unpickled."""
    import functools

    from stratagem.checkpoint.directory import save_directory
    from stratagem.checkpoint.errors import CheckpointCorruptError
    from stratagem.checkpoint.remote_directory import verify_remote_directory
    from stratagem.strategies.deepspeed.files import check_zero_archive, rank_reads
    from stratagem.strategies.deepspeed.streaming import StreamingCheckpointEngine, file_names

    url = f'{s3}/ds/iter_2'
    save_directory(url, _zero_layout, collective=False, update_pointer=False)
    reads = functools.partial(rank_reads, rank=1, optimizer=True)
    checked = []

    def check(relative, stream):
        checked.append(relative)
        if relative.endswith('.pt'):
            check_zero_archive(relative, stream)

    remote = verify_remote_directory(url, collective=False, reads=reads, check=check)
    mine = {
        'stratagem_state.pth',
        'deepspeed/mp_rank_00_model_states.pt',
        'deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt',
    }
    assert set(remote.cache) == set(checked) == mine
    assert not rank_reads('deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt', 1, optimizer=False)

    names = file_names(remote)
    try:
        assert sorted(p.relative_to(names).as_posix() for p in names.rglob('*.pt')) == sorted(
            p for p in remote.entries if p.startswith('deepspeed/')
        )
        assert sum(p.stat().st_size for p in names.rglob('*') if p.is_file()) == 0

        class Engine:
            checkpoint_engine = 'original'

        engine = Engine()
        streaming = StreamingCheckpointEngine(engine.checkpoint_engine, remote, names)
        with pytest.raises(RuntimeError), streaming.installed_on(engine):
            assert engine.checkpoint_engine is streaming
            own = streaming.load(names / 'deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt')
            assert torch.equal(own['optimizer_state_dict']['m'], torch.ones(3))
            other = streaming.load(
                str(names / 'deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt')
            )
            assert other['optimizer_state_dict']['rank'] == 0  # read, verified, when asked
            with pytest.raises(FileNotFoundError, match='outside the checkpoint'):
                streaming.load(tmp_path / 'elsewhere.pt')
            raise RuntimeError('DeepSpeed failed')
        assert engine.checkpoint_engine == 'original'
        assert streaming.read == [
            'deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt',
            'deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt',
        ]
    finally:
        import shutil

        shutil.rmtree(names)

    fs, root = location.filesystem(url)
    shard = f'{root}/deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt'
    data = bytearray(fs.cat_file(shard))
    data[-30] ^= 0xFF  # same size, one byte changed
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(CheckpointCorruptError, match='zero_pp_rank_1_mp_rank_00_optim_states'):
        verify_remote_directory(url, collective=False, reads=reads, check=check)
