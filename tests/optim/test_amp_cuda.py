"""AMP on CUDA (skipped without a GPU; ``make gpu`` runs it): float16 with a GradScaler that
skips overflowing steps and backs off exactly as a raw ``torch.amp.GradScaler`` loop does, and
resumes mid-run with its scale and counters; bfloat16 without a scaler, as a raw autocast loop;
``stratagem train --amp`` choosing bf16 where the card supports it."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from stratagem.strategies import SingleDeviceStrategy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device'),
]

STEPS, SAVE_AT = 10, 5
# 2**24 overflows float16 gradients: the first steps are skipped and the scale halves each time
SCALE = dict(init_scale=2.0**24, growth_interval=3)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def _batch(it):
    g = torch.Generator().manual_seed(it)
    return torch.randn(32, 16, generator=g).cuda(), torch.randint(4, (32,), generator=g).cuda()


def _ours(work_dir, dtype):
    s = SingleDeviceStrategy(work_dir=str(work_dir), env_kwargs=dict(randomness=dict(seed=0)))
    cfg = dict(
        type='AmpOptimWrapper', dtype=dtype, optimizer=dict(type='SGD', lr=0.1, momentum=0.9)
    )
    if dtype == 'float16':
        cfg['loss_scale'] = dict(SCALE)
    model, ow = s.prepare(_net(), optim_wrapper=cfg, dispatch_kwargs=dict(max_iters=STEPS))
    return s, model, ow


def _train_ours(model, ow, start, stop):
    changed = []
    for it in range(start, stop):
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(it)
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x).float(), y)
        ow.update_params(loss)
        changed.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
    return changed


def _raw(dtype):
    """The hand-written loop: autocast, and for float16 torch's GradScaler."""
    net = _net().cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler('cuda', **SCALE) if dtype == torch.float16 else None
    for it in range(STEPS):
        x, y = _batch(it)
        with torch.autocast('cuda', dtype=dtype):
            loss = F.cross_entropy(net(x).float(), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return net, scaler


def _max_diff(a, b):
    return max(
        float((p.float() - q.float()).abs().max()) for p, q in zip(a.parameters(), b.parameters())
    )


def test_fp16_skips_back_off_and_resume_as_a_raw_gradscaler_loop(tmp_path):
    s, model, ow = _ours(tmp_path / 'full', 'float16')
    changed = _train_ours(model, ow, 0, STEPS)
    net, scaler = _raw(torch.float16)
    # overflowing steps change nothing (momentum neither), the others train
    assert not changed[0] and any(changed)
    assert ow.skipped_steps == changed.count(False) >= 1
    assert ow.loss_scaler.get_scale() == scaler.get_scale() < SCALE['init_scale']
    assert _max_diff(model, net) <= 1e-6
    # a checkpoint taken after the skips resumes with its scale and counters, exactly
    s1, m1, o1 = _ours(tmp_path / 'part', 'float16')
    _train_ours(m1, o1, 0, SAVE_AT)
    path = s1.save_checkpoint(f'iter_{SAVE_AT}.pth', extra_ckpt={'meta': {'iter': SAVE_AT}})
    s2, m2, o2 = _ours(tmp_path / 'part', 'float16')
    s2.resume(path)
    assert o2.loss_scaler.state_dict() == o1.loss_scaler.state_dict()
    assert o2.skipped_steps == o1.skipped_steps
    _train_ours(m2, o2, SAVE_AT, STEPS)
    for a, b in zip(m2.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert o2.loss_scaler.get_scale() == ow.loss_scaler.get_scale()


def test_bf16_has_no_scaler_and_matches_a_raw_autocast_loop(tmp_path):
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f'{torch.cuda.get_device_name()} has no bfloat16')
    _, model, ow = _ours(tmp_path, 'bfloat16')
    assert ow.loss_scaler is None and ow.cast_dtype == torch.bfloat16
    with ow.optim_context(model):
        assert model[0](_batch(0)[0]).dtype == torch.bfloat16
    assert all(_train_ours(model, ow, 0, STEPS))
    net, _ = _raw(torch.bfloat16)
    assert _max_diff(model, net) <= 1e-6


CONFIG = """
model = dict(type='MLPClassifier', in_features=8, num_classes=3, hidden=16)
train_dataloader = dict(dataset=dict(type='SyntheticClassification', num_samples=64,
                                     num_features=8, num_classes=3), batch_size=16)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.05))
train_cfg = dict(max_iters=4, checkpoint_interval=4, log_interval=2)
randomness = dict(seed=3)
"""


def test_bare_amp_trains_in_bf16_where_the_card_has_it(tmp_path):
    from stratagem.cli import main
    from stratagem.cli.train import amp_dtype

    bf16 = torch.cuda.is_bf16_supported()
    assert amp_dtype('auto') == ('bfloat16' if bf16 else 'float16')
    cfg = tmp_path / 'cfg.py'
    cfg.write_text(CONFIG)
    assert main(['train', str(cfg), '--work-dir', str(tmp_path / 'w'), '--amp']) == 0
    ck = torch.load(tmp_path / 'w' / 'iter_4.pth', weights_only=True)
    # a GradScaler's state only under float16
    assert ('loss_scaler' in ck['optimizer']) is not bf16
    assert 'skipped_steps' in ck['optimizer'] and ck['meta']['iter'] == 4
