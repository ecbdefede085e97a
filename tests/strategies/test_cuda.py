"""CUDA paths of the strategies (skipped without a GPU; CI has none — run these on a device)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from stratagem.strategies import SingleDeviceStrategy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device'),
]


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
    return (
        s,
        *s.prepare(
            model,
            optim_wrapper=dict(
                type='AmpOptimWrapper',
                dtype='float16',
                accumulative_counts=2,
                optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
                clip_grad=dict(max_norm=1.0),
            ),
            param_scheduler=[dict(type='LinearLR', start_factor=0.5, by_epoch=False, end=4)],
            dispatch_kwargs=dict(max_iters=9),
        ),
    )


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


def _ddp_nccl_one_rank(work_dir):
    """DDPStrategy on CUDA with nccl (one rank: the device has one GPU), fp16 AMP with a
    GradScaler, torch SyncBatchNorm; compared with the same steps on a plain CUDA model."""
    import copy

    from stratagem.strategies import DDPStrategy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    ref = copy.deepcopy(net).cuda()
    s = DDPStrategy(
        work_dir=work_dir,
        sync_bn='torch',
        env_kwargs=dict(dist_cfg=dict(backend='nccl'), randomness=dict(seed=1)),
    )
    model, ow = s.prepare(
        net,
        optim_wrapper=dict(
            type='AmpOptimWrapper', dtype='float16', optimizer=dict(type='SGD', lr=0.1)
        ),
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler('cuda')
    g = torch.Generator(device='cuda').manual_seed(0)
    for _ in range(4):
        x = torch.randn(8, 6, device='cuda', generator=g)
        y = torch.randint(2, (8,), device='cuda', generator=g)
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x).float(), y)
        ow.update_params(loss)
        with torch.autocast('cuda', dtype=torch.float16):
            ref_loss = F.cross_entropy(ref(x).float(), y)
        scaler.scale(ref_loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
    inner = model.module
    diff = max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(inner.parameters(), ref.parameters())
    )
    path = s.save_checkpoint('iter_4.pth', extra_ckpt={'meta': {'iter': 4}})
    return {
        'backend': torch.distributed.get_backend(),
        'device': str(next(inner.parameters()).device),
        'sync_bn': type(inner[1]).__name__,
        'diff': diff,
        'path': path,
    }


def test_ddp_with_nccl_fp16_and_sync_bn_matches_a_plain_cuda_loop(tmp_path):
    from dist_harness import run_distributed

    (r,) = run_distributed(_ddp_nccl_one_rank, nproc=1, args=(str(tmp_path),), timeout=180)
    assert r['backend'] == 'nccl' and r['device'] == 'cuda:0'
    assert r['sync_bn'] == 'SyncBatchNorm'
    assert r['diff'] < 1e-3
    ck = torch.load(r['path'], weights_only=True)
    assert ck['meta']['strategy'] == 'DDPStrategy' and 'optimizer' in ck
