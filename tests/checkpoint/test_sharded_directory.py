"""save_directory / verify_directory: the multi-rank directory-checkpoint protocol.

Single-process checks first, then one 2-rank gloo spawn for the collective paths (success,
a failure on one rank after the shards are written, a BaseException from the writer, a
corrupt shard refused on every rank), and one for a sharded save's commit in DCP's own
collectives (nothing posted to the store; a failure on one rank in its write or its checks).
"""

import json
import socket
from pathlib import Path

import pytest
import xxhash

from dist_harness import run_distributed
from stratagem.checkpoint import (
    POINTER_NAME,
    CheckpointCorruptError,
    CheckpointWarning,
    apply_retention,
    find_latest_checkpoint,
)
from stratagem.checkpoint.digest import hash_file
from stratagem.checkpoint.directory import (
    begin_directory_save,
    finish_directory_save,
    save_directory,
    verify_directory,
    write_directory_files,
)
from stratagem.checkpoint.latest import read_pointer


class _FakeCheckpointException(BaseException):
    """Stands in for DCP's CheckpointException, which is a BaseException."""


def _writer(payload: bytes, names=('a.bin', 'sub/b.bin'), claim=True, fail=None):
    def write(staging: Path):
        for name in names:
            p = staging / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(payload + name.encode())
        if fail is not None:
            raise fail
        return [staging / n for n in names] if claim else None

    return write


def test_save_commits_with_manifest_and_pointer(tmp_path):
    final = save_directory(
        tmp_path / 'iter_2', _writer(b'x' * 100), step=2, extra_manifest={'strategy': 'Test'}
    )
    assert final == (tmp_path / 'iter_2').absolute()
    manifest = json.loads((final / 'manifest.json').read_text())
    assert manifest['kind'] == 'directory' and manifest['step'] == 2
    assert manifest['world_size'] == 1 and manifest['strategy'] == 'Test'
    files = {f['path']: f for f in manifest['files']}
    assert set(files) == {'a.bin', 'sub/b.bin'}
    for rel, entry in files.items():
        assert (entry['size'], entry['xxh3_128']) == hash_file(final / rel)
    assert read_pointer(tmp_path) == final
    assert verify_directory(final)['step'] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ['iter_2', POINTER_NAME]


def test_unclaimed_files_are_hashed_by_rank0(tmp_path):
    final = save_directory(tmp_path / 'd', _writer(b'y' * 10, claim=False), step=None)
    manifest = verify_directory(final)
    assert sorted(f['path'] for f in manifest['files']) == ['a.bin', 'sub/b.bin']
    assert all(f['xxh3_128'] == hash_file(final / f['path'])[1] for f in manifest['files'])


def test_failed_write_leaves_previous_checkpoint_latest(tmp_path):
    good = save_directory(tmp_path / 'iter_1', _writer(b'1'), step=1)
    for error in (OSError('disk full'), _FakeCheckpointException('shard 0 failed')):
        expected = OSError if isinstance(error, Exception) else RuntimeError
        with pytest.raises(expected, match=str(error)):
            save_directory(tmp_path / 'iter_2', _writer(b'2', fail=error), step=2)
        assert sorted(p.name for p in tmp_path.iterdir()) == ['iter_1', POINTER_NAME]
        assert read_pointer(tmp_path) == good
        assert find_latest_checkpoint(tmp_path) == good


def test_steps_one_by_one_and_replacing_a_committed_dir(tmp_path):
    save_directory(tmp_path / 'ck', _writer(b'old'), step=1)
    staging = begin_directory_save(tmp_path / 'ck')
    assert staging.parent == tmp_path and staging.name.startswith('.ck.tmp-')
    assert list(staging.iterdir()) == []  # fresh: nothing of the old checkpoint in it
    written = write_directory_files(staging, _writer(b'new'))
    assert written.ok and {f['path'] for f in written.files} == {'a.bin', 'sub/b.bin'}
    final = finish_directory_save(staging, tmp_path / 'ck', written, step=2)
    assert (final / 'a.bin').read_bytes() == b'newa.bin'
    assert verify_directory(final)['step'] == 2 and not staging.exists()


def test_prehashed_entries_are_not_read_again(tmp_path, monkeypatch):
    """A writer that hashed its bytes while writing returns entries: nothing re-reads them,
    and this process remembers them, so verifying here reads nothing either."""
    from stratagem.checkpoint import directory, manifest, single_file

    def write(staging, size_delta=0):
        (staging / 'a.bin').write_bytes(b'abc' * 10)
        size, digest = hash_file(staging / 'a.bin')
        return [{'path': 'a.bin', 'size': size + size_delta, 'xxh3_128': digest}]

    expected = (30, xxhash.xxh3_128(b'abc' * 10).hexdigest())

    def boom(*args, **kwargs):
        raise AssertionError('a file was read again')

    for module in (single_file, directory):
        monkeypatch.setattr(module, 'hash_file', boom)
    final = save_directory(tmp_path / 'd', write)
    monkeypatch.setattr(manifest, 'hash_file', boom)
    entries = verify_directory(final)['files']
    assert entries == [{'path': 'a.bin', 'size': expected[0], 'xxh3_128': expected[1], 'rank': 0}]
    with pytest.raises(ValueError, match='changed after being written'):
        save_directory(tmp_path / 'e', lambda staging: write(staging, 1))
    assert not (tmp_path / 'e').exists()


def test_sharded_save_keeps_each_ranks_own_values_in_files_of_its_own(tmp_path, monkeypatch):
    """Each rank's RNG state goes to ``rng_states/rank_{r}.pth`` (nothing gathered) and comes
    back as the list over the ranks; DCP's ``.metadata`` is fsynced in the commit's one batch,
    with the manifest, not before it."""
    import torch

    from stratagem import env
    from stratagem.checkpoint import _fs
    from stratagem.checkpoint.sharded import read_sharded_checkpoint, save_sharded_checkpoint

    batches = []
    together = _fs.fsync_together
    monkeypatch.setattr(
        _fs,
        'fsync_together',
        lambda paths: batches.append({p.name for p in paths}) or together(paths),
    )
    rng = env.get_rng_state()
    content = {'state_dict': {'w': torch.arange(4.0)}, 'meta': {'iter': 1}}
    path = save_sharded_checkpoint(
        tmp_path / 'iter_1', content, step=1, per_rank={'rng_states': rng}, collective=False
    )
    assert 'rng_states/rank_0.pth' in [e['path'] for e in verify_directory(path)['files']]
    assert [{'.metadata', 'manifest.json'} <= b for b in batches if '.metadata' in b] == [True]
    (saved,) = read_sharded_checkpoint(path)['rng_states']
    assert torch.equal(saved['torch'], rng['torch'])
    assert torch.equal(saved['python']['state'], rng['python']['state'])
    assert torch.equal(saved['numpy']['key'], rng['numpy']['key'])
    with pytest.raises(ValueError, match=r"per_rank keys \['loaders'\] are not saved per rank"):
        save_sharded_checkpoint(
            tmp_path / 'iter_2', content, per_rank={'loaders': {}}, collective=False
        )


def test_write_fn_paths_outside_staging_are_refused(tmp_path):
    outside = tmp_path / 'elsewhere.bin'
    outside.write_bytes(b'z')
    with pytest.raises(ValueError, match='not inside the staging directory'):
        save_directory(tmp_path / 'd', lambda staging: [outside])
    assert not (tmp_path / 'd').exists()


def test_manifest_name_reserved_and_empty_refused(tmp_path):
    with pytest.raises(ValueError, match='reserved'):
        save_directory(tmp_path / 'd', _writer(b'', names=('manifest.json',)))
    with pytest.raises(ValueError, match='empty'):
        save_directory(tmp_path / 'd', lambda staging: [])
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize('damage', ['missing', 'altered', 'truncated', 'no_manifest'])
def test_verify_names_the_damaged_file(tmp_path, damage):
    final = save_directory(tmp_path / 'd', _writer(b'q' * 64))
    target = final / 'sub' / 'b.bin'
    if damage == 'missing':
        target.unlink()
        err, match = FileNotFoundError, 'sub/b.bin.*missing'
    elif damage == 'altered':
        data = bytearray(target.read_bytes())
        data[3] ^= 1
        target.write_bytes(bytes(data))
        err, match = CheckpointCorruptError, 'sub/b.bin.*xxh3_128'
    elif damage == 'truncated':
        target.write_bytes(target.read_bytes()[:-1])
        err, match = CheckpointCorruptError, 'sub/b.bin.*size'
    else:
        (final / 'manifest.json').unlink()
        err, match = CheckpointCorruptError, 'no manifest.json'
    with pytest.raises(err, match=match):
        verify_directory(final)


def test_verify_warns_on_unlisted_files_and_retention_removes_whole_dirs(tmp_path):
    dirs = [save_directory(tmp_path / f'iter_{i}', _writer(bytes([i])), step=i) for i in range(3)]
    (dirs[2] / 'stray.txt').write_text('late')
    with pytest.warns(CheckpointWarning, match='stray.txt'):
        verify_directory(dirs[2])
    removed = apply_retention(tmp_path, 1, protect=[dirs[0]])
    assert removed == [dirs[1]]
    assert dirs[0].is_dir() and dirs[2].is_dir() and not dirs[1].exists()


# ------------------------------------------------------------------------- 2 ranks, gloo
def _dist_checks(root):
    from stratagem.env import init_dist

    init_dist('pytorch')
    import torch.distributed as dist

    rank = dist.get_rank()
    root = Path(root)
    out = {}

    def per_rank(tag, fail_rank=None, error=None):
        def write(staging):
            p = staging / f'shard_{rank}.bin'
            p.write_bytes(f'{tag}-{rank}'.encode() * 50)
            if rank == fail_rank:
                raise error
            return [p.name]

        return write

    good = save_directory(
        root / 'iter_1', per_rank('one'), step=1, extra_manifest={'strategy': 'T'}
    )
    manifest = verify_directory(good)
    out['files'] = sorted(f['path'] for f in manifest['files'])
    out['writers'] = {f['path']: f['rank'] for f in manifest['files']}
    out['world'] = manifest['world_size']
    out['final'] = str(good)
    # a failure on rank 1 after every rank wrote its shard: raised on both, rank 1 named
    for error in (OSError('disk full'), _FakeCheckpointException('dcp failed')):
        try:
            save_directory(root / 'iter_2', per_rank('two', 1, error), step=2)
        except BaseException as err:  # noqa: BLE001
            out.setdefault('errors', []).append(f'{type(err).__name__}: {err}')
        dist.barrier()
        out.setdefault('listing', []).append(sorted(p.name for p in root.iterdir()))
        out.setdefault('latest', []).append(str(find_latest_checkpoint(root)))
        dist.barrier()  # both ranks listed before rank 0 creates the next staging dir
    # a shard altered after the commit is refused on both ranks, naming the file
    dist.barrier()
    if rank == 0:
        p = good / 'shard_1.bin'
        p.write_bytes(p.read_bytes()[:-1] + b'X')
    dist.barrier()
    try:
        verify_directory(good)
    except CheckpointCorruptError as err:
        out['verify'] = str(err)
    # a slow rank is waited for, not declared dead: with timeout 8 s the vote's waits time
    # out every second (the heartbeat interval) while rank 1 writes for 2.5 s, and the store
    # connections stay usable afterwards (the next save right after commits at once)
    import time

    def slow(staging):
        if rank == 1:
            time.sleep(2.5)
        return per_rank('slow')(staging)

    # the vote leaves nothing behind in the store (its server lives as long as the job)
    from stratagem.checkpoint.vote import _own_store

    store = _own_store()[0]
    dist.barrier()
    keys_before = store.num_keys()
    dist.barrier()  # both counted before either rank's next save posts its first keys
    start = time.monotonic()
    slow_dir = save_directory(root / 'iter_3', slow, step=3, timeout=8.0)
    out['slow_s'] = time.monotonic() - start
    out['slow_step'] = verify_directory(slow_dir)['step']
    out['after_slow'] = verify_directory(
        save_directory(root / 'iter_4', per_rank('four'), step=4, timeout=8.0)
    )['step']
    from stratagem.checkpoint.vote import wait_tidied

    out['tidied'] = wait_tidied()  # a closed vote's keys go on a helper thread
    dist.barrier()
    out['keys_left'] = store.num_keys() - keys_before
    # agreeing on a checkpoint: rank 0's path wins; a rank that passed another path (or
    # none) checks rank 0's in a second round; bytes that differ are refused on both
    from stratagem.checkpoint import CheckpointNotShared
    from stratagem.checkpoint import agree as agree_mod
    from stratagem.checkpoint.agree import agree_on_checkpoint

    out['agree_same'] = str(agree_on_checkpoint(root / 'iter_3'))
    out['agree_other'] = str(agree_on_checkpoint(root / ('iter_3' if rank == 0 else 'iter_4')))
    out['agree_none'] = str(agree_on_checkpoint(root / 'iter_3' if rank == 0 else None))
    if rank == 1:  # rank 1 sees other bytes at that path than rank 0 (a node-local copy)
        real_identity = agree_mod.checkpoint_identity
        agree_mod.checkpoint_identity = lambda p: {**real_identity(p), 'digest': 'other'}
    try:
        agree_on_checkpoint(root / 'iter_3')
    except CheckpointNotShared as err:
        out['agree_differs'] = str(err)
    if rank == 1:
        agree_mod.checkpoint_identity = real_identity
    # verifying: ranks that read different manifests (here: different checkpoints) refuse
    try:
        verify_directory(root / ('iter_3' if rank == 0 else 'iter_4'))
    except CheckpointCorruptError as err:
        out['verify_differs'] = str(err)
    return out


def test_two_ranks(tmp_path):
    res = run_distributed(_dist_checks, nproc=2, args=(str(tmp_path),), timeout=120)
    for rank, out in enumerate(res):
        assert out['files'] == ['shard_0.bin', 'shard_1.bin'] and out['world'] == 2
        assert out['writers'] == {'shard_0.bin': 0, 'shard_1.bin': 1}
        assert out['final'] == str(tmp_path / 'iter_1')
        assert out['listing'] == [['iter_1', POINTER_NAME]] * 2
        assert out['latest'] == [str(tmp_path / 'iter_1')] * 2
        if rank == 1:  # the failing rank re-raises its own error
            assert out['errors'] == [
                'OSError: disk full',  # its own error; a BaseException becomes a RuntimeError
                'RuntimeError: saving checkpoint directory '
                f'{tmp_path / "iter_2"} failed on rank 1: _FakeCheckpointException: dcp failed',
            ]
        else:
            assert out['errors'] == [  # named by the vote: the rank and its error
                f'CheckpointVoteError: saving {tmp_path / "iter_2"} failed on rank 1: '
                'OSError: disk full; nothing was committed',
                f'CheckpointVoteError: saving {tmp_path / "iter_2"} failed on rank 1: '
                '_FakeCheckpointException: dcp failed; nothing was committed',
            ]
        assert 'shard_1.bin' in out['verify'] and 'xxh3_128' in out['verify']
        assert out['slow_step'] == 3 and out['after_slow'] == 4
        assert out['tidied'] and out['keys_left'] == 0
        assert 2.5 <= out['slow_s'] < 8.0, out['slow_s']
        assert (
            out['agree_same'] == out['agree_other'] == out['agree_none'] == str(tmp_path / 'iter_3')
        )
        assert out['verify_differs'].startswith('ranks read different manifests in '), out.get(
            'verify_differs'
        )
        assert out['agree_differs'].startswith(
            f'rank 1 (host {socket.gethostname()}) cannot use the checkpoint that rank 0 (host '
            f'{socket.gethostname()}) chose, {tmp_path / "iter_3"}: sees different bytes there'
        )


def test_dcp_errors_are_described_by_their_first_rank():
    """DCP's CheckpointException prints only rank numbers; messages carry the rank's error."""
    from torch.distributed.checkpoint.api import CheckpointException

    from stratagem.checkpoint.rank_errors import describe_error

    err = CheckpointException(
        'save',
        {1: (OSError(28, 'No space left on device'), None), 0: (KeyError('state_dict.w'), None)},
    )
    assert describe_error(err) == (
        "CheckpointException: rank 0: KeyError: 'state_dict.w' (ranks [0, 1])"
    )
    assert describe_error(OSError('disk')) == 'OSError: disk'


def test_a_process_exits_only_after_its_closed_votes_are_tidied(tmp_path):
    # The tidy-up runs on a daemon thread; left inside a store request while the interpreter
    # tears down, it aborted processes at exit. Exit now waits for the queue.
    import subprocess
    import sys

    mark = tmp_path / 'tidied'
    code = (
        'import time\n'
        'from stratagem.checkpoint import vote\n'
        f'vote._tidy(lambda: (time.sleep(0.5), open({str(mark)!r}, "w").close()))\n'
    )
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert mark.exists()


def _dcp_commit_checks(root):
    """A sharded save's commit rides DCP's own collectives: a success posts nothing to the
    store; a failure on rank 1 (in its write, or in its checks before anything is written)
    fails the save on both ranks, rank 1 named, nothing committed."""
    import torch

    from stratagem.checkpoint import sharded
    from stratagem.checkpoint.errors import CheckpointWriteError
    from stratagem.checkpoint.vote import SaveVote
    from stratagem.env import init_dist

    init_dist('pytorch')
    import torch.distributed as dist

    rank, root, out = dist.get_rank(), Path(root), {}
    content = {'state_dict': {'w': torch.arange(4.0)}, 'meta': {'iter': 1}}

    def save(name, step):
        vote = SaveVote.open(30.0, f'saving {root / name}')
        try:
            sharded.save_sharded_checkpoint(
                root / name, content, step=step, per_rank={'rng_states': {'r': rank}}, vote=vote
            )
            return vote._posted
        except BaseException as err:  # noqa: BLE001
            return f'{type(err).__name__}: {err}'
        finally:
            vote.close()
            dist.barrier()  # both ranks done (rank 0's staging removed) before listing

    from stratagem.checkpoint.vote import _own_store, wait_tidied

    store = _own_store()[0]
    dist.barrier()
    keys_before = store.num_keys()
    dist.barrier()
    out['posted'] = save('iter_1', 1)
    out['per_rank'] = sharded.read_sharded_checkpoint(root / 'iter_1')['rng_states']
    real_side, real_space = sharded._write_side, sharded.check_free_space
    if rank == 1:
        sharded._write_side = lambda obj, path: (_ for _ in ()).throw(OSError('side failed'))
    out['write_failed'] = save('iter_2', 2)
    out['listing_write'] = sorted(p.name for p in root.iterdir())
    sharded._write_side = real_side
    if rank == 1:

        def full(where, needed):
            raise CheckpointWriteError(28, f'no space left on device writing {where}')

        sharded.check_free_space = full
    out['check_failed'] = save('iter_3', 3)
    out['listing_check'] = sorted(p.name for p in root.iterdir())
    sharded.check_free_space = real_space

    class Unpicklable(Exception):  # rebuilt from its args it would fail: DCP carries text
        def __init__(self, a, b):
            super().__init__(f'{a} {b}')

    if rank == 1:
        sharded._write_side = lambda obj, path: (_ for _ in ()).throw(Unpicklable('odd', 1))
    out['unpicklable'] = save('iter_4', 4)
    sharded._write_side = real_side
    from stratagem.checkpoint import directory

    real_commit = directory._commit
    if rank == 0:
        directory._commit = lambda *a, **k: (_ for _ in ()).throw(OSError('commit failed'))
    out['commit_failed'] = save('iter_5', 5)
    directory._commit = real_commit
    out['listing_end'] = sorted(p.name for p in root.iterdir())
    out['latest'] = str(find_latest_checkpoint(root))
    out['tidied'] = wait_tidied()
    dist.barrier()
    out['keys_left'] = store.num_keys() - keys_before
    dist.barrier()  # rank 0 serves the store: it stays until rank 1 has counted
    return out


def test_a_sharded_save_commits_in_dcps_collectives(tmp_path):
    res = run_distributed(_dcp_commit_checks, nproc=2, args=(str(tmp_path),), timeout=120)
    for out in res:
        assert out['posted'] == [], out  # the outcome reached every rank through DCP
        assert out['per_rank'] == [{'r': 0}, {'r': 1}]
        assert out['listing_write'] == out['listing_check'] == ['iter_1', POINTER_NAME]
        assert out['listing_end'] == ['iter_1', POINTER_NAME]
        assert out['latest'] == str(tmp_path / 'iter_1')
        assert out['tidied'] and out['keys_left'] == 0, out  # no save left a vote key
    assert res[1]['unpicklable'] == 'Unpicklable: odd 1'
    assert res[0]['unpicklable'] == (
        f'CheckpointVoteError: saving {tmp_path / "iter_4"} failed on rank 1: Unpicklable: odd '
        '1; nothing was committed'
    )
    assert res[0]['commit_failed'] == 'OSError: commit failed'
    assert res[1]['commit_failed'] == (
        f'CheckpointVoteError: saving {tmp_path / "iter_5"} failed on rank 0: OSError: commit '
        'failed'
    )
    assert res[1]['write_failed'] == 'OSError: side failed'  # its own error
    assert res[0]['write_failed'] == (
        f'CheckpointVoteError: saving {tmp_path / "iter_2"} failed on rank 1: OSError: side '
        'failed; nothing was committed'
    )
    full = f'no space left on device writing {tmp_path / "iter_3"}'
    assert res[1]['check_failed'] == f'CheckpointWriteError: {full}'
    assert res[0]['check_failed'] == (
        f'CheckpointVoteError: saving {tmp_path / "iter_3"} failed on rank 1: '
        f'CheckpointWriteError: {full}; nothing was committed'
    )
