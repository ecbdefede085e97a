"""CUDA paths of the strategies (skipped without a GPU; CI has none — run these on a device)."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from stratagem.strategies import SingleDeviceStrategy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')]


def _train(strategy, model, ow, scheds, start, stop):
    for _ in range(start, stop):
        x, y = torch.randn(8, 6, device='cuda'), torch.randint(2, (8,), device='cuda')
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x).float(), y)
        ow.update_params(loss)
        for s in scheds:
            s.step()


def _build(work_dir):
    s = SingleDeviceStrategy(work_dir=str(work_dir), env_kwargs=dict(randomness=dict(seed=3)))
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    return (s, *s.prepare(model, optim_wrapper=dict(
        type='AmpOptimWrapper', dtype='float16', accumulative_counts=2,
        optimizer=dict(type='SGD', lr=0.1, momentum=0.9), clip_grad=dict(max_norm=1.0)),
        param_scheduler=[dict(type='LinearLR', start_factor=0.5, by_epoch=False, end=4)],
        dispatch_kwargs=dict(max_iters=9)))


def test_fp16_resume_on_cuda_with_default_map_location_is_exact(tmp_path):
    s, model, ow, scheds = _build(tmp_path / 'full')
    assert next(model.parameters()).is_cuda and ow.loss_scaler is not None
    _train(s, model, ow, scheds, 0, 9)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_draw = torch.rand(3, device='cuda')

    s1, m1, o1, sc1 = _build(tmp_path / 'part')
    _train(s1, m1, o1, sc1, 0, 5)  # mid-window
    path = s1.save_checkpoint('iter_5.pth', extra_ckpt={'meta': {'iter': 5}})
    s2, m2, o2, sc2 = _build(tmp_path / 'part')
    s2.resume(path)  # map_location='default': tensors land on cuda, RNG states restored
    _train(s2, m2, o2, sc2, 5, 9)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.equal(torch.rand(3, device='cuda'), want_draw)
