"""CapturingCheckpointEngine without DeepSpeed: files written at once or staged, buffer reuse,
errors kept for the vote, the original engine restored."""

import os
from pathlib import Path

import pytest
import torch

from stratagem.checkpoint import disk
from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
from stratagem.checkpoint.digest import entry_digest, hash_file
from stratagem.checkpoint.errors import CheckpointWriteError
from stratagem.strategies.deepspeed.capture import CapturingCheckpointEngine


class _Original:
    """Stands for DeepSpeed's engine: what the capturing one does not define is its."""

    def load(self, path, map_location=None):
        return ('loaded', path)

    def is_data_parallel_writer(self, dp_rank):
        return dp_rank == 0


def _state(value):
    return {'w': torch.full((4, 3), float(value)), 'step': value, 'names': ['a', 'b']}


def test_sync_writes_each_file_at_once_hashed(tmp_path):
    cap = CapturingCheckpointEngine(_Original(), tmp_path)
    cap.makedirs(tmp_path / 'sub', exist_ok=True)
    cap.create(None)
    cap.save(_state(1), str(tmp_path / 'sub' / 'a.pt'))
    assert (tmp_path / 'sub' / 'a.pt').exists()  # written during save(), not later
    cap.save(_state(2), tmp_path / 'b.pt')
    assert cap.commit(None) is True and cap.is_decoupled() is False
    assert cap.preserves_storage_sharing() is True  # torch.save keeps views' storages
    entries = cap.write(tmp_path)
    assert [Path(e['path']).name for e in entries] == ['a.pt', 'b.pt']
    for entry in entries:
        algo, digest = entry_digest(entry)
        assert (entry['size'], digest) == hash_file(entry['path'], algo=algo)
    loaded = torch.load(tmp_path / 'b.pt', weights_only=True)
    assert torch.equal(loaded['w'], torch.full((4, 3), 2.0)) and loaded['step'] == 2
    # DeepSpeed's other calls reach the original engine
    assert cap.load('x') == ('loaded', 'x') and cap.is_data_parallel_writer(0) is True


def test_staged_files_are_copies_written_later_into_reused_buffers(tmp_path):
    writer = AsyncCheckpointWriter()
    buffers = []
    for save in range(2):
        root = tmp_path / f'save{save}'
        root.mkdir()
        cap = CapturingCheckpointEngine(_Original(), root, writer)
        assert cap.preserves_storage_sharing() is False  # the snapshot copies each tensor
        live = _state(save)
        cap.save(live, root / 'a.pt')
        cap.save({'other': torch.arange(5)}, root / 'b.pt')
        assert not (root / 'a.pt').exists()  # staged, not written
        live['w'].fill_(-1.0)  # training goes on
        live['names'].append('c')
        entries = cap.write()
        loaded = torch.load(root / 'a.pt', weights_only=True)
        assert torch.equal(loaded['w'], torch.full((4, 3), float(save)))
        assert loaded['names'] == ['a', 'b']
        assert [Path(e['path']).name for e in entries] == ['a.pt', 'b.pt']
        buffers.append({k: v.data_ptr() for k, v in writer._staging.items()})
    # two files' buffers coexist, named by the path under the root, reused by the next save
    assert buffers[0] == buffers[1] and len(buffers[0]) == 2
    assert writer.staged_bytes == 4 * 3 * 4 + 5 * 8


def test_a_failure_is_kept_for_write_and_skips_the_rest(tmp_path):
    writer = AsyncCheckpointWriter()
    cap = CapturingCheckpointEngine(_Original(), tmp_path, writer)
    cap.save(_state(1), tmp_path / 'a.pt')
    real = writer.snapshot
    writer.snapshot = lambda *a, **k: (_ for _ in ()).throw(MemoryError('injected'))
    cap.save(_state(2), tmp_path / 'b.pt')  # never raises inside DeepSpeed
    writer.snapshot = real
    cap.save(_state(3), tmp_path / 'c.pt')  # skipped: the save already failed
    with pytest.raises(MemoryError, match='injected'):
        cap.write()
    assert os.listdir(tmp_path) == []


def test_full_disk_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(disk, 'free_bytes', lambda path: 1000)
    sync = CapturingCheckpointEngine(_Original(), tmp_path)
    sync.save(_state(1), tmp_path / 'a.pt')
    with pytest.raises(CheckpointWriteError, match=r'no space left on device writing .*a\.pt'):
        sync.write()
    staged = CapturingCheckpointEngine(_Original(), tmp_path, AsyncCheckpointWriter())
    staged.save(_state(1), tmp_path / 'b.pt')
    with pytest.raises(CheckpointWriteError, match='nothing was written'):
        staged.write()
    assert os.listdir(tmp_path) == []


def test_installed_on_restores_the_original_engine(tmp_path):
    class Engine:
        checkpoint_engine = 'original'

    engine = Engine()
    cap = CapturingCheckpointEngine(engine.checkpoint_engine, tmp_path)
    with pytest.raises(RuntimeError):
        with cap.installed_on(engine):
            assert engine.checkpoint_engine is cap
            raise RuntimeError('DeepSpeed failed')
    assert engine.checkpoint_engine == 'original'
