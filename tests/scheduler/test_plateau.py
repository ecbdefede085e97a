"""ReduceOnPlateau driven by a metric sequence, against a hand-worked table."""

from __future__ import annotations

import io

import pytest
import torch

from stratagem.scheduler import ReduceOnPlateauLR, ReduceOnPlateauMomentum

BASE = (0.1, 0.02)


def make_opt(kind: str = 'SGD') -> torch.optim.Optimizer:
    groups = [{'params': [torch.nn.Parameter(torch.zeros(1))], 'lr': lr} for lr in BASE]
    if kind == 'SGD':
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return torch.optim.Adam(groups, lr=0.1, betas=(0.9, 0.99))


def feed(sched, opt, losses, key='lr'):
    out = []
    for loss in losses:
        sched.step()  # end of a training epoch: counts it
        sched.step({'loss': loss, 'acc': 0.0})
        out.append([g[key] for g in opt.param_groups])
    return out


def test_reduces_after_patience():
    opt = make_opt()
    s = ReduceOnPlateauLR(opt, monitor='loss', factor=0.5, patience=1)
    got = feed(s, opt, [1.0, 0.9, 0.95, 0.96, 0.8, 0.85, 0.86, 0.87])
    # best 1.0, .9 | bad 1 | bad 2 > patience: halve | best .8 | bad 1 | bad 2: halve | bad 1
    factors = [1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert got == [pytest.approx([b * f for b in BASE]) for f in factors]


def test_cooldown_min_value_and_greater_rule():
    opt = make_opt()
    s = ReduceOnPlateauLR(
        opt,
        monitor='acc',
        rule='greater',
        factor=0.1,
        patience=0,
        cooldown=1,
        min_value=[0.005, 0.001],
        threshold=0.01,
        threshold_rule='abs',
    )
    got = []
    for acc in [0.5, 0.505, 0.51, 0.6, 0.6, 0.6]:
        s.step({'acc': acc})
        got.append([g['lr'] for g in opt.param_groups])
    # .5 best | .505 not > .51: reduce (x0.1, clamped), cooldown 1 | .51 in cooldown (bad
    # ignored) | .6 best | .6 bad: reduce again (already at the floor for group 1) | cooldown
    expected = [
        [0.1, 0.02],
        [0.01, 0.002],
        [0.01, 0.002],
        [0.01, 0.002],
        [0.005, 0.001],
        [0.005, 0.001],
    ]
    assert got == [pytest.approx(row) for row in expected]


def test_momentum_variant_drives_betas_and_state_is_plain():
    opt = make_opt('Adam')
    s = ReduceOnPlateauMomentum(opt, factor=0.5, patience=0)
    got = feed(s, opt, [1.0, 1.0], key='momentum')
    assert got[-1] == pytest.approx([0.45, 0.45])
    assert opt.param_groups[0]['betas'] == pytest.approx((0.45, 0.99))
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sd['best'] == 1.0 and sd['_global_step'] == 2


def test_metric_errors_name_scheduler_and_monitor():
    s = ReduceOnPlateauLR(make_opt(), monitor='val/mAP')
    with pytest.raises(
        KeyError,
        match=r"ReduceOnPlateauLR: monitor 'val/mAP' is not in the "
        r"metrics.*\['loss'\]",
    ):
        s.step({'loss': 1.0})
    with pytest.raises(TypeError, match='ReduceOnPlateauLR: metrics must be a dict'):
        s.step(0.5)
    with pytest.raises(ValueError, match='ReduceOnPlateauLR: by_epoch must be True'):
        ReduceOnPlateauLR(make_opt(), by_epoch=False)
    with pytest.raises(ValueError, match='ReduceOnPlateauLR: factor must be < 1'):
        ReduceOnPlateauLR(make_opt(), factor=1.0)
