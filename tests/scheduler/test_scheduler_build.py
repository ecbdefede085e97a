"""Building from configs: default end, convert_to_iter_based, errors, dicts of optimizers."""

from __future__ import annotations

import math

import pytest
import torch

from stratagem.registry import PARAM_SCHEDULERS, RegistryError
from stratagem.scheduler import (
    INF,
    CosineAnnealingLR,
    MultiStepLR,
    build_param_scheduler,
    build_param_schedulers,
    simulate,
)

BASE = (0.1, 0.02)


def make_opt(momentum: float = 0.9) -> torch.optim.Optimizer:
    groups = [{'params': [torch.nn.Parameter(torch.zeros(1))], 'lr': lr} for lr in BASE]
    return torch.optim.SGD(groups, lr=BASE[0], momentum=momentum)


def lrs(opt):
    return [g['lr'] for g in opt.param_groups]


def test_registry_holds_every_name():
    for kind in (
        'Constant',
        'CosineAnnealing',
        'CosineRestart',
        'Exponential',
        'Linear',
        'MultiStep',
        'OneCycle',
        'Poly',
        'ReduceOnPlateau',
        'Step',
    ):
        assert f'{kind}ParamScheduler' in PARAM_SCHEDULERS
        assert f'{kind}LR' in PARAM_SCHEDULERS
        assert (f'{kind}Momentum' in PARAM_SCHEDULERS) == (kind != 'OneCycle')


def test_build_iter_from_epoch_multistep():
    epoch_length = 3
    opt = make_opt()
    s = MultiStepLR.build_iter_from_epoch(
        opt, milestones=[1, 2], gamma=0.5, epoch_length=epoch_length
    )
    assert (s.by_epoch, s.begin, s.end, s.milestones) == (False, 0, INF, {3: 1, 6: 1})
    seen = []
    for _ in range(8):
        seen.append(lrs(opt)[1])
        s.step()
    assert seen == pytest.approx([0.02 * 0.5 ** ((t >= 3) + (t >= 6)) for t in range(8)])


def test_convert_to_iter_based_cfg_and_default_end():
    opt = make_opt()
    cfg = dict(
        type='CosineAnnealingLR', by_epoch=True, convert_to_iter_based=True, begin=0.5, eta_min=0.0
    )
    s = build_param_scheduler(cfg, opt, epoch_length=4, max_epochs=3)
    # end defaults to max_epochs (an epoch-based cfg), then everything is ×4 iterations
    assert (s.begin, s.end, s.T_max, s.by_epoch) == (2, 12, 10, False)
    seen = []
    for _ in range(12):
        seen.append(lrs(opt)[0])
        s.step()
    assert seen == pytest.approx(
        [0.1] * 2 + [0.1 * (1 + math.cos(math.pi * (t - 2) / 10)) / 2 for t in range(2, 12)]
    )


def test_default_end_by_iters_and_registry_build():
    opt = make_opt()
    built = build_param_schedulers(
        [dict(type='LinearLR', by_epoch=False, start_factor=0.5), dict(type='StepLR', step_size=2)],
        opt,
        max_epochs=6,
        max_iters=60,
    )
    assert [(s.end, s.by_epoch) for s in built] == [(60, False), (6, True)]
    # PARAM_SCHEDULERS.build goes through the same builder (epoch_length is consumed)
    s = PARAM_SCHEDULERS.build(
        dict(type='MultiStepLR', milestones=[1], convert_to_iter_based=True),
        default_args=dict(optimizer=make_opt(), epoch_length=5),
    )
    assert isinstance(s, MultiStepLR) and s.milestones == {5: 1}
    s = PARAM_SCHEDULERS.build(
        dict(type='CosineAnnealingLR', T_max=3),
        default_args=dict(optimizer=make_opt(), epoch_length=5),
    )
    assert isinstance(s, CosineAnnealingLR) and s.T_max == 3 and s.by_epoch


def test_build_errors():
    opt = make_opt()
    with pytest.raises(RegistryError, match="unknown type 'CosineLR'.*did you mean"):
        build_param_schedulers([dict(type='CosineLR')], opt)
    with pytest.raises(
        ValueError, match='MultiStepLR: convert_to_iter_based=True needs epoch_length'
    ):
        build_param_schedulers(
            dict(type='MultiStepLR', milestones=[1], convert_to_iter_based=True), opt
        )
    with pytest.raises(TypeError, match="'gama'.*did you mean 'gamma'"):
        build_param_schedulers(dict(type='StepLR', step_size=1, gama=0.5), opt)
    with pytest.raises(ValueError, match=r'LinearLR: end \(2\) must be greater than begin \(4\)'):
        build_param_schedulers(dict(type='LinearLR', begin=4, end=2), opt)


def test_dict_of_optimizers():
    gen, disc = make_opt(), make_opt()
    wrappers = {'generator': gen, 'discriminator': disc}
    same = build_param_schedulers(dict(type='ExponentialLR', gamma=0.5), wrappers)
    assert sorted(same) == ['discriminator', 'generator']
    per = build_param_schedulers(
        {'generator': [dict(type='ExponentialLR', gamma=0.5)], 'discriminator': None}, wrappers
    )
    assert len(per['generator']) == 1 and per['discriminator'] == []
    with pytest.raises(KeyError, match="no entry for optimizer 'discriminator'"):
        build_param_schedulers({'generator': []}, wrappers)


def test_simulate_epoch_run_with_iteration_warmup():
    cfgs = [
        dict(type='LinearLR', start_factor=0.25, by_epoch=False, begin=0, end=4),
        dict(type='MultiStepLR', milestones=[2], gamma=0.1),
        dict(type='StepMomentum', step_size=1, gamma=0.5, by_epoch=True),
    ]
    tr = simulate(
        cfgs,
        dict(type='OptimWrapper', optimizer=dict(type='SGD', lr=0.1, momentum=0.8)),
        max_epochs=3,
        epoch_length=3,
        param_groups=[{}, {'lr': 0.01}],
    )
    assert tr.num_iters == 9 and tr.epoch_length == 3
    for g, base in enumerate((0.1, 0.01)):
        expected = [base * (0.25 + 0.75 * min(t, 3) / 3) * (0.1 if t >= 6 else 1) for t in range(9)]
        assert tr.lr[g] == pytest.approx(expected)
    assert tr.momentum[0] == pytest.approx([0.8 * 0.5 ** (t // 3) for t in range(9)])


def test_simulate_needs_epoch_length():
    with pytest.raises(ValueError, match='LinearLR is iteration-based.*epoch_length'):
        simulate(
            [dict(type='LinearLR', by_epoch=False, end=3)], dict(type='SGD', lr=0.1), max_epochs=2
        )
    with pytest.raises(ValueError, match='StepLR is epoch-based.*epoch_length'):
        simulate([dict(type='StepLR', step_size=1)], dict(type='SGD', lr=0.1), max_iters=10)
    tr = simulate(
        [dict(type='StepLR', step_size=1, gamma=0.5)], dict(type='Adam', lr=0.1), max_epochs=3
    )  # epoch-based only: one value per epoch
    assert tr.lr[0] == pytest.approx([0.1, 0.05, 0.025]) and tr.momentum[0] == [0.9] * 3


def test_review_one_cycle_without_a_length_and_float_step_size():
    import torch

    from stratagem.scheduler import OneCycleLR, StepLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(ValueError, match='OneCycleLR: the cycle length is unknown'):
        OneCycleLR(opt, eta_max=0.1, by_epoch=False)
    sched = StepLR(opt, step_size=2.0, gamma=0.5)
    values = []
    for _ in range(5):
        values.append(opt.param_groups[0]['lr'])
        sched.step()
    assert values == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
