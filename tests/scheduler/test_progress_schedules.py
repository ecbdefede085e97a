"""fvcore-style schedules, LRMultiplier and detectron2's build_lr_scheduler, by value table."""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch

from stratagem.scheduler import (
    CompositeSchedule,
    ConstantSchedule,
    CosineSchedule,
    ExponentialSchedule,
    LinearSchedule,
    LRMultiplier,
    MultiStepSchedule,
    PolynomialDecaySchedule,
    ScheduleEndedError,
    ScheduleRangeError,
    StepSchedule,
    StepWithFixedGammaSchedule,
    WarmupSchedule,
    build_lr_scheduler,
)

BASE = (0.1, 0.02)
WHERES = [i / 10 for i in range(10)]


def make_opt() -> torch.optim.Optimizer:
    groups = [{'params': [torch.nn.Parameter(torch.zeros(1))], 'lr': lr} for lr in BASE]
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def run(sched, opt, steps):
    out = []
    for _ in range(steps):
        out.append([g['lr'] for g in opt.param_groups])
        sched.step()
    return out


def test_simple_schedules():
    assert [ConstantSchedule(0.3)(w) for w in WHERES] == [0.3] * 10
    assert [CosineSchedule(1.0, 0.1)(w) for w in WHERES] == pytest.approx(
        [0.1 + 0.45 * (1 + math.cos(math.pi * w)) for w in WHERES]
    )
    assert [LinearSchedule(0.0, 2.0)(w) for w in WHERES] == pytest.approx([2 * w for w in WHERES])
    assert [ExponentialSchedule(2.0, 0.02)(w) for w in WHERES] == pytest.approx(
        [2.0 * 0.02**w for w in WHERES]
    )
    assert [PolynomialDecaySchedule(0.1, 2)(w) for w in WHERES] == pytest.approx(
        [0.1 * (1 - w) ** 2 for w in WHERES]
    )


def test_multistep_and_fixed_gamma():
    s = MultiStepSchedule([1, 0.1, 0.01], num_updates=90, milestones=[30, 60])
    same = [
        MultiStepSchedule([1, 0.1, 0.01], num_updates=90),
        MultiStepSchedule([1, 0.1, 0.01], milestones=[3, 6, 9]),
    ]
    table = {0: 1, 29: 1, 30: 0.1, 59: 0.1, 60: 0.01, 89: 0.01}
    for it, value in table.items():
        assert s(it / 90) == value
        assert all(o(it / 90) == value for o in same)
    f = StepWithFixedGammaSchedule(base_value=0.1, num_decays=3, gamma=0.1, num_updates=120)
    assert [f(e / 120) for e in (0, 29, 30, 59, 60, 89, 90, 119)] == pytest.approx(
        [0.1, 0.1, 0.01, 0.01, 0.001, 0.001, 1e-4, 1e-4]
    )
    with pytest.raises(ValueError, match='MultiStepSchedule: milestones must be increasing'):
        MultiStepSchedule([1, 0.1, 0.01], num_updates=90, milestones=[60, 30])


def test_composite_and_warmup():
    c = CompositeSchedule(
        [ConstantSchedule(0.42), CosineSchedule(0.42, 1e-4)],
        lengths=[0.3, 0.7],
        interval_scaling=['rescaled', 'rescaled'],
    )
    assert c(0.0) == c(0.29) == 0.42
    assert c(0.65) == pytest.approx(1e-4 + 0.5 * (0.42 - 1e-4) * (1 + math.cos(math.pi * 0.5)))
    inner = CosineSchedule(1.0, 0.0)
    w = WarmupSchedule(inner, warmup_factor=0.1, warmup_length=0.2)
    end = inner(0.2)
    assert [w(x) for x in (0.0, 0.1)] == pytest.approx([0.1, 0.1 + (end - 0.1) * 0.5])
    assert w(0.5) == pytest.approx(inner(0.5))  # 'fixed': the cosine runs on global progress
    r = WarmupSchedule(inner, 0.1, 0.2, rescale_interval=True)
    assert r(0.1) == pytest.approx(0.55) and r(0.6) == pytest.approx(inner(0.5))
    const = WarmupSchedule(inner, 0.5, 0.2, warmup_method='constant')
    assert const(0.1) == 0.5
    with pytest.raises(ValueError, match="WarmupSchedule: warmup_method must be 'linear'"):
        WarmupSchedule(inner, 0.5, 0.2, warmup_method='exp')


def test_lr_multiplier_and_state_dict():
    opt = make_opt()
    sched = LRMultiplier(
        opt, MultiStepSchedule([1, 0.5, 0.25], num_updates=6, milestones=[2, 4]), max_iter=6
    )
    got = run(sched, opt, 3)
    assert [row[1] for row in got] == pytest.approx([0.02, 0.02, 0.01])
    buf = io.BytesIO()
    torch.save({'optimizer': opt.state_dict(), 'scheduler': sched.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert ckpt['scheduler'] == {'base_lrs': list(BASE), 'last_epoch': 3}
    expected = run(sched, opt, 3)

    opt2 = make_opt()
    sched2 = LRMultiplier(
        opt2, MultiStepSchedule([1, 0.5, 0.25], num_updates=6, milestones=[2, 4]), max_iter=6
    )
    opt2.load_state_dict(ckpt['optimizer'])  # carries the lr of iteration 3
    sched2.load_state_dict(ckpt['scheduler'])
    assert run(sched2, opt2, 3) == expected
    assert [row[0] for row in expected] == pytest.approx([0.05, 0.025, 0.025])
    with pytest.raises(TypeError, match='LRMultiplier: multiplier must be a Schedule'):
        LRMultiplier(opt, 0.5, max_iter=6)


def _solver(**kw):
    base = dict(
        MAX_ITER=10,
        BASE_LR=0.1,
        WARMUP_FACTOR=0.1,
        WARMUP_ITERS=3,
        WARMUP_METHOD='linear',
        GAMMA=0.1,
    )
    base.update(kw)
    return base


def test_build_lr_scheduler_multistep_drops_late_steps(caplog):
    opt = make_opt()
    with caplog.at_level(logging.WARNING, logger='stratagem.scheduler.multiplier'):
        sched = build_lr_scheduler(
            _solver(LR_SCHEDULER_NAME='WarmupMultiStepLR', STEPS=(4, 7, 20)), opt
        )
    assert 'larger than SOLVER.MAX_ITER' in caplog.text
    got = [row[0] for row in run(sched, opt, 10)]
    # warm-up: 0.1 * (1 - a) + a with a = t / 3, then gamma at 4 and 7 (20 dropped)
    expected = [0.1 * (0.1 * (1 - t / 3) + t / 3) for t in range(3)] + [
        0.1,
        0.01,
        0.01,
        0.01,
        0.001,
        0.001,
        0.001,
    ]
    assert got == pytest.approx(expected)


def test_build_lr_scheduler_cosine_and_rescale():
    opt = make_opt()
    solver = _solver(LR_SCHEDULER_NAME='WarmupCosineLR', BASE_LR_END=0.001, WARMUP_ITERS=2)
    got = [row[1] for row in run(build_lr_scheduler(solver, opt), opt, 10)]

    def cos(w):
        return 0.01 + 0.5 * 0.99 * (1 + math.cos(math.pi * w))

    expected = [0.1 * (1 - t / 2) + cos(0.2) * t / 2 for t in range(2)] + [
        cos(t / 10) for t in range(2, 10)
    ]
    assert got == pytest.approx([0.02 * e for e in expected])

    opt = make_opt()
    got = [
        row[0] for row in run(build_lr_scheduler(dict(solver, RESCALE_INTERVAL=True), opt), opt, 10)
    ]
    expected = [0.1 * (1 - t / 2) + 1.0 * t / 2 for t in range(2)] + [
        cos((t - 2) / 8) for t in range(2, 10)
    ]
    assert got == pytest.approx([0.1 * e for e in expected])


def test_build_lr_scheduler_fixed_gamma_and_errors():
    opt = make_opt()
    solver = _solver(
        LR_SCHEDULER_NAME='WarmupStepWithFixedGammaLR',
        GAMMA=0.5,
        NUM_DECAYS=3,
        MAX_ITER=12,
        WARMUP_ITERS=0,
    )
    sched = build_lr_scheduler(solver, opt)
    got = [row[0] for row in run(sched, opt, 11)] + [opt.param_groups[0]['lr']]
    assert got == pytest.approx([0.1 * 0.5 ** min(t // 3, 3) for t in range(12)])
    # the step after the last iteration evaluates where=1: fvcore's IndexError (detectron2's
    # guard against stepping past MAX_ITER), as a ScheduleEndedError naming the schedule
    with pytest.raises(
        IndexError,
        match='StepWithFixedGammaSchedule: where must be in '
        r'\[0, 1\), got 1.0',
    ) as info:
        sched.step()
    assert isinstance(info.value, ScheduleEndedError) and isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="unknown SOLVER.LR_SCHEDULER_NAME 'WarmupPolyLR'"):
        build_lr_scheduler(_solver(LR_SCHEDULER_NAME='WarmupPolyLR'), make_opt())
    with pytest.raises(KeyError, match='MAX_ITER'):
        build_lr_scheduler({'LR_SCHEDULER_NAME': 'WarmupCosineLR'}, make_opt())


def test_out_of_range_raises_fvcores_exception_types():
    # fvcore: RuntimeError from the constant (where >= 1) and multi-step (where > 1) schedules
    with pytest.raises(RuntimeError, match=r'ConstantSchedule: where must be in \[0, 1\), got 1.0'):
        ConstantSchedule(0.3)(1.0)
    multi = MultiStepSchedule([1, 0.1], num_updates=4, milestones=[2])
    assert multi(1.0) == 0.1  # the end itself is in range, as in fvcore
    with pytest.raises(ScheduleRangeError, match='got 1.5'):
        multi(1.5)
    # ... and the IndexError of a step schedule whose values ran out; no clamping
    steps = StepSchedule(num_updates=4, values=[1, 0.5])
    assert [steps(w) for w in (0, 0.25, 0.5, 0.75)] == [1, 1, 0.5, 0.5]
    with pytest.raises(IndexError, match='StepSchedule: where must be in'):
        steps(1.0)
    for err in (ScheduleRangeError('x'), ScheduleEndedError('x')):
        assert isinstance(err, ValueError)
