"""Asynchronous saves: the snapshot (copies, reused buffers, aliasing), the strategy option
(bit-exact with a synchronous save, the live state free to change at once), errors surfacing
at the next save / wait / exit, and resume waiting for the pending save."""

import os
import subprocess
import sys
import textwrap
import threading
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from faults import failing_io
from stratagem import checkpoint as ckpt
from stratagem.checkpoint import find_latest_checkpoint, load_checkpoint_file, verify_checkpoint
from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
from stratagem.checkpoint.errors import CheckpointWriteError
from stratagem.strategies import SingleDeviceStrategy

HERE = Path(__file__).resolve().parent


def test_snapshot_copies_reuses_buffers_and_keeps_aliases():
    w = AsyncCheckpointWriter()
    weight = torch.arange(12.0).reshape(3, 4)
    state = {
        'sd': OrderedDict(w=weight, tied=weight, t=weight.t()),
        'opt': [torch.ones(5, dtype=torch.float64), (torch.tensor(3),)],
        'raw': bytearray(b'ab'),
        'meta': {'iter': 4, 'dtype': torch.float16},
    }
    snap = w.snapshot(state)
    weight.add_(100)
    state['raw'][0] = 0
    assert type(snap['sd']) is OrderedDict and list(snap['sd']) == ['w', 'tied', 't']
    assert torch.equal(snap['sd']['w'], torch.arange(12.0).reshape(3, 4))
    assert snap['sd']['tied'] is snap['sd']['w']  # same memory: one tensor, as saved
    assert torch.equal(snap['sd']['t'], torch.arange(12.0).reshape(3, 4).t())
    assert snap['opt'][1][0].item() == 3 and type(snap['opt'][1]) is tuple
    assert snap['raw'] == bytearray(b'ab') and snap['meta'] == state['meta']
    assert w.staged_bytes == 48 + 48 + 40 + 8
    pointers = {k: snap['sd'][k].data_ptr() for k in ('w', 't')}
    again = w.snapshot(state)
    assert {k: again['sd'][k].data_ptr() for k in ('w', 't')} == pointers  # buffers reused
    assert torch.equal(again['sd']['w'], weight)
    state['sd']['w'] = torch.zeros(2, 2)  # a shape change gets a new buffer, the old is freed
    third = w.snapshot(state)
    assert third['sd']['w'].shape == (2, 2) and w.staged_bytes == 16 + 48 + 48 + 40 + 8
    gate = threading.Event()
    w.submit(gate.wait)
    with pytest.raises(RuntimeError, match='call wait'):
        w.snapshot(state)
    with pytest.raises(RuntimeError, match='call wait'):
        w.submit(gate.wait)
    gate.set()
    assert w.wait() is True and not w.pending and w.wait() is None


def _strategy(tmp_path, **kwargs):
    s = SingleDeviceStrategy(
        work_dir=str(tmp_path),
        env_kwargs=dict(randomness=dict(seed=3)),
        experiment_name='exp',
        **kwargs,
    )
    s.prepare(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)),
        param_scheduler=dict(type='StepLR', step_size=2, by_epoch=False),
        dispatch_kwargs=dict(max_iters=10),
    )
    return s


def _step(s, n=1):
    for _ in range(n):
        loss = s.model(torch.randn(4, 8)).pow(2).mean()
        s.optim_wrapper.update_params(loss)
        s.param_schedulers[0].step()


def _assert_equal(a, b, path='ckpt'):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.dtype == b.dtype, path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            if k != 'time':
                _assert_equal(a[k], b[k], f'{path}[{k!r}]')
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f'{path}[{i}]')
    else:
        assert a == b, path


def test_async_save_is_bit_exact_and_returns_before_writing(tmp_path, monkeypatch):
    sync_s = _strategy(tmp_path / 'sync')
    async_s = _strategy(tmp_path / 'async', async_checkpoint=True)
    torch.manual_seed(0)
    _step(sync_s, 3)
    torch.manual_seed(0)
    _step(async_s, 3)
    sync_path = sync_s.save_checkpoint('iter_3.pth', extra_ckpt={'meta': {'iter': 3}})
    # hold the background write until the live state has changed, deterministically
    release, real_save = threading.Event(), ckpt.save_checkpoint
    monkeypatch.setattr(
        ckpt, 'save_checkpoint', lambda *a, **k: (release.wait(30), real_save(*a, **k))[1]
    )
    async_path = async_s.save_checkpoint('iter_3.pth', extra_ckpt={'meta': {'iter': 3}})
    assert async_path == str(tmp_path / 'async' / 'iter_3.pth')
    assert not os.path.exists(async_path) and async_s.checkpointer.writer.pending
    _step(async_s, 2)  # training goes on while the save is pending
    release.set()
    async_s.wait_for_checkpoints()
    assert verify_checkpoint(async_path)['step'] == 3
    assert find_latest_checkpoint(tmp_path / 'async') == Path(async_path)
    _assert_equal(load_checkpoint_file(sync_path), load_checkpoint_file(async_path))
    # staged memory is one copy of the tensors written: model, momentum, RNG state
    params = sum(p.numel() * 4 for p in async_s.model.parameters())
    saved = ckpt.disk.payload_bytes(load_checkpoint_file(async_path))
    assert saved > 2 * params and async_s.checkpointer.writer.staged_bytes == saved


def test_async_error_reaches_next_wait_and_next_save(tmp_path):
    s = _strategy(tmp_path, async_checkpoint=True)
    first = s.save_checkpoint('iter_1.pth')
    s.wait_for_checkpoints()
    with failing_io(tmp_path, 28, after_bytes=1000):
        s.save_checkpoint('iter_2.pth')  # returns: the failure happens in the background
        with pytest.raises(
            CheckpointWriteError, match=f'no space left on device writing {tmp_path / "iter_2.pth"}'
        ):
            s.wait_for_checkpoints()
        s.wait_for_checkpoints()  # raised once, then collected
        s.save_checkpoint('iter_3.pth')
        with pytest.raises(CheckpointWriteError, match='iter_3.pth'):
            s.save_checkpoint('iter_4.pth')  # the previous failure, before this save starts
    assert not (tmp_path / 'iter_4.pth').exists()
    assert find_latest_checkpoint(tmp_path) == Path(first)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == '.pth') == ['iter_1.pth']
    s.save_checkpoint('iter_5.pth', extra_ckpt={'meta': {'iter': 5}})
    checkpoint = s.resume(str(tmp_path / 'iter_5.pth'))  # resume waits for the pending save
    assert checkpoint['meta']['iter'] == 5


_EXIT_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from faults import failing_io
    from stratagem.strategies import SingleDeviceStrategy
    s = SingleDeviceStrategy(work_dir=sys.argv[1], async_checkpoint=True)
    s.prepare(nn.Linear(64, 64), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)))
    s.save_checkpoint('a.pth')
    fault = failing_io(sys.argv[1] + '/sub', 28)
    fault.__enter__()   # stays active until exit (the reference keeps it from closing)
    s.save_checkpoint('sub/b.pth')  # waits for a.pth, then leaves b.pth pending at exit
""")


def test_exit_waits_and_reports_an_uncollected_failure(tmp_path):
    (tmp_path / 'sub').mkdir()
    script = tmp_path / 'exit_case.py'
    script.write_text(_EXIT_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=250,
        env=dict(  # tests/checkpoint/ for the script's `faults`
            os.environ,
            OMP_NUM_THREADS='1',
            PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get('PYTHONPATH', '')]),
        ),
    )
    assert proc.returncode == 0, proc.stderr
    assert verify_checkpoint(tmp_path / 'a.pth') is not None
    assert not (tmp_path / 'sub' / 'b.pth').exists() and not os.listdir(tmp_path / 'sub')
    assert 'background checkpoint save failed' in proc.stderr
    assert f'no space left on device writing {tmp_path / "sub" / "b.pth"}' in proc.stderr


def test_strategy_options_are_validated(tmp_path):
    with pytest.raises(TypeError, match="async_checkpoint must be True or False, got 'yes'"):
        SingleDeviceStrategy(work_dir=str(tmp_path), async_checkpoint='yes')
    with pytest.raises(ValueError, match='checkpoint_timeout must be a positive number'):
        SingleDeviceStrategy(work_dir=str(tmp_path), checkpoint_timeout=0)


class _Counter:  # stands for an allow-listed class (a host trainer's, e.g. HistoryBuffer)
    def __init__(self):
        self.values = [1]


def test_snapshot_copies_objects_of_other_classes():
    w = AsyncCheckpointWriter()
    obj = _Counter()
    snap = w.snapshot({'hist': obj, 'n': 3})
    obj.values.append(2)
    assert snap['hist'] is not obj and snap['hist'].values == [1] and snap['n'] == 3
