"""Asynchronous saves of CUDA state (skipped without a GPU; run on a device):
pinned staging buffers, every device-to-host copy done before save_checkpoint returns,
bit-exact against a synchronous save whatever the program does after the call."""

import threading

import pytest
import torch
from torch import nn

from stratagem.checkpoint import load_checkpoint_file
from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
from stratagem.strategies import SingleDeviceStrategy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device'),
]


def _run(work_dir, async_checkpoint, monkeypatch=None):
    torch.manual_seed(0)
    s = SingleDeviceStrategy(
        work_dir=str(work_dir),
        experiment_name='x',
        async_checkpoint=async_checkpoint,
        env_kwargs=dict(randomness=dict(seed=3)),
    )
    model, ow = s.prepare(
        nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.Linear(1024, 4)),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
    )
    for _ in range(3):
        ow.update_params(model(torch.randn(32, 256, device='cuda')).square().mean())
    gate = threading.Event()
    if monkeypatch is not None:  # hold the writer thread until training went on
        real = AsyncCheckpointWriter.submit
        monkeypatch.setattr(
            AsyncCheckpointWriter,
            'submit',
            lambda self, job, *a: real(self, lambda: (gate.wait(30), job(*a))[1]),
        )
    path = s.save_checkpoint('iter_3.pth', extra_ckpt={'meta': {'iter': 3}})
    if monkeypatch is not None:
        pinned = [t for t in s.checkpointer.writer._staging.values() if t.is_pinned()]
        # every CUDA tensor (model state + AdamW's two moments) is staged in pinned memory
        assert len(pinned) >= len(model.state_dict()) + 2 * len(list(model.parameters()))
        # a whole step and an in-place edit on the device while the write is held
        ow.update_params(model(torch.randn(32, 256, device='cuda')).square().mean())
        with torch.no_grad():
            model[0].weight.fill_(-1.0)
        torch.cuda.synchronize()
        gate.set()
        s.wait_for_checkpoints()
    return load_checkpoint_file(path)


def test_async_cuda_save_equals_sync(tmp_path, monkeypatch):
    want = _run(tmp_path / 'sync', False)
    got = _run(tmp_path / 'async', True, monkeypatch)
    for key in ('state_dict',):
        for name, tensor in want[key].items():
            assert torch.equal(got[key][name], tensor), name
    for a, b in zip(got['optimizer']['state'].values(), want['optimizer']['state'].values()):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_async_save_behind_queued_gpu_work_holds_the_state_at_the_call(tmp_path):
    """No gate on the writer: the copies into the pinned buffers are queued behind seconds'
    worth of GPU work, and the buffers still hold the previous save's values; the call must
    wait for its copies, or the writer (started at once) reads the old bytes. In-place edits
    right after the call must not reach the file either."""
    s = SingleDeviceStrategy(
        work_dir=str(tmp_path),
        experiment_name='x',
        async_checkpoint=True,
        env_kwargs=dict(randomness=dict(seed=3)),
    )
    model, _ = s.prepare(
        nn.Sequential(nn.Linear(512, 4096), nn.Linear(4096, 512)),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    first = s.save_checkpoint('a.pth', save_optimizer=False)  # the staging buffers: all 1.0
    s.wait_for_checkpoints()
    big = torch.randn(8192, 8192, device='cuda')
    with torch.no_grad():
        for _ in range(20):  # ~1 s of matmuls on a large GPU, queued, not waited for
            big = big @ big / 8192**0.5
        for p in model.parameters():
            p.fill_(2.0)  # queued behind them
    second = s.save_checkpoint('b.pth', save_optimizer=False)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)  # right after the call, on the same stream
    s.wait_for_checkpoints()
    for path, value in ((first, 1.0), (second, 2.0)):
        for name, t in load_checkpoint_file(path)['state_dict'].items():
            assert torch.equal(t, torch.full_like(t, value)), (path, name)
    pinned = [b for b in s.checkpointer.writer._staging.values() if b.is_pinned()]
    assert len(pinned) >= len(model.state_dict())  # the CUDA tensors (RNG states are CPU)
