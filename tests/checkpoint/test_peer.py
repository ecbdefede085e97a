"""Peer checkpoints (``stratagem/checkpoint/peer.py``): the rule that picks the tier, the
commit of a copy and of a copy received as bytes, what a torn or missing copy leaves, a copy
of DTensor shards (their layout kept, restored on it only), the background writer (the state
at the call, one copy in flight, its error raised at the next call), and the reference loop
resuming from one in one process (bit-equal to the uninterrupted run) or falling back to
storage. Two ranks exchanging copies: ``tests/strategies/test_ddp.py`` (``peer_copies``);
FSDP's shards on 2 ranks: ``tests/strategies/test_fsdp.py``, on HSDP and 2-D meshes:
``test_fsdp_mesh.py`` (``peer_copies``); killed ``stratagem train --nproc 2`` runs:
``tests/test_peer_restart.py`` (slow tier)."""

import logging
import os
import shutil

import pytest
import torch
from torch.utils.data import Dataset

from stratagem.checkpoint import CheckpointCorruptError
from stratagem.checkpoint.peer import (
    PEER_DIR_ENV,
    PeerCopies,
    choose,
    commit_bytes,
    peer_root,
    ring_stride,
    scan_copies,
)
from stratagem.checkpoint.single_file import save_checkpoint
from stratagem.loop import check_train_config, train

# ------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ('own', 'held', 'storage', 'step', 'fetch', 'says'),
    [
        # newer than storage: peer
        ([[6], [6]], [[6], [6]], ('iter_5.pth', 5), 6, {}, 'at least as new'),
        # as new as storage: peer (a read from memory)
        ([[5], [5]], [[5], [5]], ('iter_5.pth', 5), 5, {}, 'iteration 5'),
        # older than storage: storage
        ([[4], [4]], [[4], [4]], ('iter_5.pth', 5), None, {}, 'older than the newest storage'),
        # no storage checkpoint at all: peer
        ([[2], [2]], [[2], [2]], None, 2, {}, 'no storage checkpoint'),
        # rank 0's own copy gone: its holder (rank 1) holds it
        ([[], [6]], [[6], [6]], ('iter_5.pth', 5), 6, {0: 1}, 'rank(s) [0] from their holder'),
        # rank 1's own and held copies gone: storage, naming rank 1 and its holder
        ([[6], []], [[], [6]], ('iter_5.pth', 5), None, {}, 'no verified peer copy of rank 1'),
        # killed between the commits: rank 0's own at 8 (its 6 pruned), the rest still at 6
        ([[8], [6]], [[6], [6]], None, 6, {0: 1}, 'iteration 6'),
        # nothing common
        ([[8], [6]], [[4], [2]], None, None, {}, 'no common iteration'),
        # none at all
        ([[], []], [[], []], ('iter_5.pth', 5), None, {}, 'no peer copies'),
        # a storage checkpoint of unknown iteration: storage
        ([[6], [6]], [[6], [6]], ('foreign.pth', None), None, {}, 'no iteration to compare'),
    ],
)
def test_the_tier_rule(own, held, storage, step, fetch, says):
    """``held[h]`` is what rank h holds: of rank 1 for h=0 and of rank 0 for h=1 (2 ranks:
    each holds the other's)."""
    choice = choose(own, held, [1, 0], storage)
    assert (choice.step, choice.fetch) == (step, fetch)
    assert choice.tier == ('storage' if step is None else 'peer')
    assert says in choice.reason


def test_the_holder_is_on_another_node_when_there_is_one():
    assert ring_stride(4, 2) == 2 and ring_stride(2, 2) == 1 and ring_stride(3, 2) == 1
    peer = PeerCopies('/nowhere', rank=1, world_size=4, local_world_size=2)
    assert (peer.holders, peer.holder, peer.keeps) == ([2, 3, 0, 1], 3, 3)
    one_node = PeerCopies('/nowhere', rank=1, world_size=2)
    assert (one_node.holder, one_node.keeps) == (0, 0)


def test_the_root_is_per_work_dir_and_follows_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(PEER_DIR_ENV, str(tmp_path))
    a, b = peer_root(tmp_path / 'a'), peer_root(tmp_path / 'b')
    assert a != b and a.parent == b.parent == tmp_path
    assert peer_root(tmp_path / 'a' / '.') == a
    monkeypatch.delenv(PEER_DIR_ENV)
    shm = '/dev/shm/' if os.path.isdir('/dev/shm') else '/'
    assert str(peer_root(tmp_path / 'a')).startswith(shm)


# ------------------------------------------------------------------ commit, scan


def _content(value: float, step: int) -> dict:
    return {'meta': {'iter': step}, 'state_dict': {'w': torch.full((4,), value)}}


def test_a_commit_keeps_the_newest_verified_copy_and_a_torn_one_is_never_used(tmp_path):
    peer = PeerCopies(tmp_path, rank=0, world_size=1)
    first = peer.commit(_content(1.0, 2), 2)
    newest = peer.commit(_content(2.0, 4), 4)
    assert not first.exists() and sorted(os.listdir(peer.own_dir)) == [
        'iter_4.pth',
        'iter_4.pth.manifest.json',
    ]
    assert scan_copies(peer.own_dir, 0, 1).steps == {4: str(newest)}
    # another rank's or another world size's copy: refused, named
    assert scan_copies(peer.own_dir, 1, 1).steps == {}
    assert 'not of rank 1' in scan_copies(peer.own_dir, 1, 1).refused[0][1]
    # torn: a byte changed after the commit
    data = bytearray(newest.read_bytes())
    data[-30] ^= 0xFF
    newest.write_bytes(bytes(data))
    from stratagem.checkpoint.manifest import forget_verified

    forget_verified()  # as a restarted process: it hashes every byte
    found = scan_copies(peer.own_dir, 0, 1)
    assert found.steps == {} and 'damaged' in found.refused[0][1]
    # a copy whose manifest never came (killed mid-commit): not used either
    save_checkpoint(_content(3.0, 6), peer.own_dir / 'iter_6.pth', step=6, update_pointer=False)
    (peer.own_dir / 'iter_6.pth.manifest.json').unlink()
    assert 6 not in scan_copies(peer.own_dir, 0, 1).steps
    # a temporary name (the commit's first step) is not even looked at
    (peer.own_dir / '.iter_8.pth.tmp-1-ab').write_bytes(b'half')
    assert 8 not in scan_copies(peer.own_dir, 0, 1).steps


def test_a_full_dev_shm_is_a_warning_and_the_older_copy_stays(tmp_path, monkeypatch):
    import errno

    from stratagem.checkpoint import CheckpointWarning, CheckpointWriteError
    from stratagem.checkpoint import peer as peer_module

    peer = PeerCopies(tmp_path, rank=0, world_size=1)
    kept = peer.commit(_content(1.0, 2), 2)

    def full(*args, **kwargs):
        raise CheckpointWriteError(errno.ENOSPC, f'no space left for {args[1]}')

    monkeypatch.setattr(peer_module, 'save_checkpoint', full)
    with pytest.warns(CheckpointWarning, match=r'peer copies of iteration 4 not kept \(rank 0: '
                      'no space left'):  # fmt: skip
        assert peer.commit(_content(2.0, 4), 4) is None
    assert scan_copies(peer.own_dir, 0, 1).steps == {2: str(kept)}


def test_a_received_copy_is_committed_only_when_its_bytes_match_the_manifest(tmp_path):
    sent = PeerCopies(tmp_path / 'a', rank=0, world_size=1).commit(_content(1.0, 3), 3)
    manifest = sent.with_name(sent.name + '.manifest.json').read_bytes()
    final = tmp_path / 'held' / 'iter_3.pth'
    data = bytearray(sent.read_bytes())
    data[100] ^= 1
    with pytest.raises(CheckpointCorruptError, match='damaged.*not kept'):
        commit_bytes(final, manifest, bytes(data))
    assert not final.parent.exists()  # nothing written: no temp file, no manifest
    commit_bytes(final, manifest, sent.read_bytes())
    assert torch.load(final, weights_only=True)['state_dict']['w'][0] == 1.0
    assert sorted(os.listdir(final.parent)) == ['iter_3.pth', 'iter_3.pth.manifest.json']


# ------------------------------------------------------------------ sharded state


@pytest.fixture
def mesh(tmp_path):
    """A 1-rank gloo process group and a 1-D device mesh over it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group('gloo', store=dist.FileStore(str(tmp_path / 'store'), 1), rank=0,
                            world_size=1)  # fmt: skip
    yield init_device_mesh('cpu', (1,), mesh_dim_names=('shard',))
    dist.destroy_process_group()


def test_a_copy_of_shards_keeps_the_local_ones_and_their_layout_and_restores_on_it_only(
    tmp_path, mesh
):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from stratagem.checkpoint.peer import (
        LAYOUT_KEY,
        join_shards,
        shard_digest,
        shard_meshes,
        split_shards,
    )

    weight = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
    optimizer = {'state': {'w': {'exp_avg': weight * 2, 'step': torch.tensor(3.0)}}}
    content = {'meta': {'iter': 2}, 'state_dict': {'w': weight, 'plain': torch.ones(2)}}
    content['optimizer'] = optimizer
    local, records = split_shards(content)
    assert type(local['state_dict']['w']) is torch.Tensor and len(records) == 2
    assert records[0] == [
        ['state_dict', 'w'],
        [3, 2],
        [2, 1],
        ['Shard(dim=0)'],
        [1],
        ['shard'],
        [0],
    ]
    assert shard_meshes(records) == shard_meshes(content) == [[[1], ['shard']]]
    assert shard_meshes({'w': torch.ones(1)}) == []  # an unsharded state: no mesh

    peer = PeerCopies(tmp_path / 'peer', rank=0, world_size=1)
    path = peer.commit(content, 2)
    read = torch.load(path, weights_only=True)
    assert read[LAYOUT_KEY] == records
    # restored around the live DTensors: their sharding, the copy's values
    live = {'state_dict': {'w': weight * 0, 'plain': torch.zeros(2)}}
    live['optimizer'] = {'state': {'w': {'exp_avg': weight * 0, 'step': torch.tensor(0.0)}}}
    back = join_shards({k: v for k, v in read.items() if k != LAYOUT_KEY}, records, live, 'copy')
    assert isinstance(back['optimizer']['state']['w']['exp_avg'], DTensor)
    assert torch.equal(
        back['optimizer']['state']['w']['exp_avg'].full_tensor(), weight.full_tensor() * 2
    )
    # a restart on other meshes does not use it, and says why
    assert scan_copies(peer.own_dir, 0, 1, meshes=[[[1], ['shard']]]).steps == {2: str(path)}
    refused = scan_copies(peer.own_dir, 0, 1, meshes=[[[1, 1], ['replicate', 'shard']]])
    assert refused.steps == {} and refused.refused[0][1] == (
        'a copy of the shards on the mesh (shard=1); this run lays them out on the mesh '
        '(replicate=1, shard=1) (a copy restores only its own layout)'
    )
    # the same mesh, other tensors sharded on this rank (a pipeline cut elsewhere): not used
    mine = shard_digest(records)
    assert mine == shard_digest(content) and shard_digest({'w': torch.ones(1)}) is None
    assert scan_copies(peer.own_dir, 0, 1, shards=mine).steps == {2: str(path)}
    refused = scan_copies(peer.own_dir, 0, 1, shards=shard_digest({'state_dict': {'v': weight}}))
    assert refused.steps == {} and refused.refused[0][1] == (
        'a copy of the shards of other model tensors than rank 0 holds in this run (another '
        'pipeline cut or another model: a copy restores only the tensors it holds)'
    )
    # another model behind the same mesh: named, nothing half restored
    other = {'state_dict': {'w': distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])}}
    with pytest.raises(
        ValueError, match=r'copy: state_dict.w is a shard of \[3, 2\].*another model'
    ):
        join_shards(read, records[:1], other, 'copy')


# ------------------------------------------------------------------ the background writer


def test_a_background_copy_is_the_state_at_the_call_one_at_a_time_its_error_raised_next(
    tmp_path, monkeypatch
):
    import threading

    from stratagem.checkpoint import peer as peer_module

    peer = PeerCopies(tmp_path, rank=0, world_size=1, background=True)
    release, started = threading.Event(), threading.Event()
    real = peer_module.save_checkpoint

    def held(*args, **kwargs):  # the writer's commit, held until released
        started.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(peer_module, 'save_checkpoint', held)
    live = _content(1.0, 2)
    assert peer.save(live, 2) == peer.own_dir / 'iter_2.pth'  # returned before the commit
    assert started.wait(30) and not (peer.own_dir / 'iter_2.pth').exists()
    live['state_dict']['w'].fill_(9.0)  # after the call: never in the copy
    second = threading.Thread(target=peer.save, args=(_content(3.0, 4), 4))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # at most one copy in flight: the next one waits
    release.set()
    second.join(30)
    peer.wait()
    assert scan_copies(peer.own_dir, 0, 1).steps.keys() == {4}  # the newest kept
    monkeypatch.setattr(peer_module, 'save_checkpoint', real)

    def broken(*args, **kwargs):
        raise RuntimeError('injected: the writer failed')

    monkeypatch.setattr(peer_module, 'save_checkpoint', broken)
    peer.save(_content(5.0, 6), 6)  # its error is this copy's, raised at the next call
    with pytest.raises(RuntimeError, match='injected: the writer failed'):
        peer.save(_content(7.0, 8), 8)
    monkeypatch.setattr(peer_module, 'save_checkpoint', real)
    peer.save(_content(7.0, 8), 8)
    peer.close()
    assert scan_copies(peer.own_dir, 0, 1).steps.keys() == {8}
    snapshot = PeerCopies(tmp_path / 'b', rank=0, world_size=1, background=True)
    live = _content(1.0, 2)
    snapshot.save(live, 2)
    live['state_dict']['w'].fill_(9.0)
    snapshot.close()
    assert (
        torch.load(snapshot.own_dir / 'iter_2.pth', weights_only=True)['state_dict']['w'][0] == 1.0
    )


# ------------------------------------------------------------------ the loop


class _Crashing(Dataset):
    """64 fixed samples; ``fail_at``: the read that raises (a crash mid-run)."""

    fail_at = None

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randint(3, (64,), generator=g)
        self.reads = 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == _Crashing.fail_at:
            raise RuntimeError('crash')
        return self.x[i], self.y[i]


def _cfg(work_dir, **hook):
    return dict(
        model=dict(type='MLPClassifier', in_features=8, num_classes=3, hidden=16),
        train_dataloader=dict(dataset=_Crashing(), batch_size=4, shuffle=True),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=0.01), accumulative_counts=2),
        train_cfg=dict(max_iters=10, log_interval=5, checkpoint_interval=4),
        default_hooks=dict(checkpoint=dict(peer_interval=5, **hook)),
        randomness=dict(seed=1),
        work_dir=str(work_dir),
    )


@pytest.fixture
def crashed_run(tmp_path, monkeypatch):
    """An uninterrupted run's weights, and a run of the same config that crashed in
    iteration 7 (storage: iter_4; peer copy: iteration 5, mid accumulation window) in
    ``tmp_path / 'run'``."""
    monkeypatch.setenv(PEER_DIR_ENV, str(tmp_path / 'shm'))
    monkeypatch.setattr(_Crashing, 'fail_at', None)
    result = train(_cfg(tmp_path / 'whole'), progress=False)
    want = {k: v.clone() for k, v in result['strategy'].unwrap_model().state_dict().items()}
    monkeypatch.setattr(_Crashing, 'fail_at', 4 * 6 + 2)
    with pytest.raises(RuntimeError, match='crash'):
        train(_cfg(tmp_path / 'run'), progress=False)
    monkeypatch.setattr(_Crashing, 'fail_at', None)
    # the crashed run's copy in flight outlives its error (in a killed process it would not):
    # a PeerCopies over the same root waits for it
    PeerCopies(peer_root(tmp_path / 'run'))
    return tmp_path / 'run', want


def _resumed(work_dir, caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger='stratagem'):
        result = train(_cfg(work_dir), resume=True, progress=False)
    got = result['strategy'].unwrap_model().state_dict()
    tier = [r.getMessage() for r in caplog.records if 'resume tier' in r.getMessage()]
    return got, tier


def test_a_restart_resumes_from_the_newer_peer_copy_bit_equal(crashed_run, caplog):
    work, want = crashed_run
    got, tier = _resumed(work, caplog)
    assert len(tier) == 1 and tier[0].startswith('resume tier: peer (peer copies of iteration 5')
    assert 'iter_4.pth (iteration 4)' in tier[0]
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_without_its_peer_copy_a_restart_falls_back_to_storage_bit_equal(crashed_run, caplog):
    work, want = crashed_run
    shutil.rmtree(peer_root(work))
    got, tier = _resumed(work, caplog)
    assert tier == ['resume tier: storage (no peer copies)']
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_peer_interval_is_checked_before_anything_runs():
    cfg = _cfg('unused')
    cfg['default_hooks']['checkpoint']['peer_interval'] = -1
    with pytest.raises(ValueError, match='peer_interval must be a number of iterations >= 0'):
        check_train_config(cfg)
    cfg['default_hooks']['checkpoint']['peer_interval'] = 2
    cfg['strategy'] = dict(type='FSDPStrategy')
    check_train_config(cfg)  # its copies are each rank's shards and their layout
    cfg['strategy'] = dict(type='DeepSpeedStrategy')
    with pytest.raises(ValueError, match="peer copies keep what each rank captures, and "
                       "DeepSpeedStrategy keeps its state in an engine's files"):  # fmt: skip
        check_train_config(cfg)
    cfg['strategy'] = dict(type='DDPStrategy', fault_tolerance=dict(min_replicas=1))
    with pytest.raises(ValueError, match='with strategy.fault_tolerance: a replica group heals'):
        check_train_config(cfg)
