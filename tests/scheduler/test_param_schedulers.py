"""Value tables: every scheduler against closed forms computed here, two param groups."""

from __future__ import annotations

import io
import math

import pytest
import torch

from stratagem.scheduler import (
    INF,
    ConstantLR,
    CosineAnnealingLR,
    CosineAnnealingMomentum,
    CosineRestartLR,
    ExponentialLR,
    ExponentialMomentum,
    LinearLR,
    MultiStepLR,
    MultiStepMomentum,
    OneCycleLR,
    PolyLR,
    PolyParamScheduler,
    StepLR,
    StepMomentum,
)

BASE = (0.1, 0.02)  # two groups with different base lr
N = 12  # steps checked


def make_opt(kind: str = 'SGD', momentum: float = 0.9) -> torch.optim.Optimizer:
    groups = [{'params': [torch.nn.Parameter(torch.zeros(1))], 'lr': lr} for lr in BASE]
    if kind == 'SGD':
        return torch.optim.SGD(groups, lr=BASE[0], momentum=momentum)
    return torch.optim.Adam(groups, lr=BASE[0], betas=(momentum, 0.999))


def run(scheds, opt, steps: int = N, key: str = 'lr') -> list[list[float]]:
    """Values used in steps 0..steps-1 (as a loop sees them), per group."""
    out = [[] for _ in opt.param_groups]
    for _ in range(steps):
        for g, group in enumerate(opt.param_groups):
            out[g].append(group['betas'][0] if key == 'betas0' else group[key])
        for s in scheds:
            s.step()
    return out


def check(actual: list[list[float]], factor) -> None:
    """``actual[g][t] == BASE[g] * factor(t)`` for both groups."""
    for g, base in enumerate(BASE):
        expected = [base * factor(t) for t in range(len(actual[g]))]
        assert actual[g] == pytest.approx(expected, rel=1e-9, abs=1e-12), f'group {g}'


def cosine(t: float, T: float, lo: float = 0.0) -> float:
    return lo + (1 - lo) * (1 + math.cos(math.pi * t / T)) / 2


# (cfg builder, closed-form factor of the base value at step t)
TABLES = {
    'step': (lambda o: StepLR(o, step_size=3, gamma=0.5), lambda t: 0.5 ** (t // 3)),
    'multistep': (
        lambda o: MultiStepLR(o, milestones=[2, 5, 5, 9], gamma=0.1),
        lambda t: 0.1 ** sum(m <= t for m in [2, 5, 5, 9]),
    ),
    'constant': (lambda o: ConstantLR(o, factor=0.25, end=5), lambda t: 0.25 if t < 4 else 1.0),
    'exponential': (lambda o: ExponentialLR(o, gamma=0.8), lambda t: 0.8**t),
    'cosine': (
        lambda o: CosineAnnealingLR(o, T_max=10, eta_min_ratio=0.1),
        lambda t: cosine(t, 10, 0.1),
    ),
    'cosine_default_tmax': (lambda o: CosineAnnealingLR(o, end=8), lambda t: cosine(min(t, 7), 8)),
    'linear': (
        lambda o: LinearLR(o, start_factor=0.2, end_factor=0.9, end=6),
        lambda t: 0.2 + 0.7 * min(t, 5) / 5,
    ),
    'poly': (lambda o: PolyLR(o, power=2.0, end=11), lambda t: (1 - min(t, 10) / 10) ** 2),
    'restart': (
        lambda o: CosineRestartLR(o, periods=[4, 6], restart_weights=[1, 0.5], eta_min_ratio=0.0),
        lambda t: (
            cosine(t, 4) if t < 4 else 0.5 * cosine(t - 4, 6) if t < 10 else 0.5 * cosine(5, 6)
        ),
    ),
}


@pytest.mark.parametrize('name', sorted(TABLES))
def test_value_table(name):
    build, factor = TABLES[name]
    opt = make_opt()
    check(run([build(opt)], opt), factor)


def test_cosine_eta_min_absolute_and_past_t_max():
    opt = make_opt()
    vals = run([CosineAnnealingLR(opt, T_max=4, eta_min=0.01)], opt, steps=10)
    for g, base in enumerate(BASE):
        # the chainable form keeps following the cosine past T_max (it rises again)
        expected = [0.01 + (base - 0.01) * (1 + math.cos(math.pi * t / 4)) / 2 for t in range(10)]
        assert vals[g] == pytest.approx(expected, rel=1e-9)


def test_poly_eta_min():
    opt = make_opt()
    vals = run([PolyParamScheduler(opt, 'lr', eta_min=0.001, power=1.0, end=5)], opt, steps=7)
    for g, base in enumerate(BASE):
        expected = [(base - 0.001) * (1 - min(t, 4) / 4) + 0.001 for t in range(7)]
        assert vals[g] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize('three_phase,strategy', [(False, 'cos'), (True, 'linear')])
def test_one_cycle(three_phase, strategy):
    opt = make_opt()
    total, pct, div, final = 20, 0.25, 10.0, 100.0
    s = OneCycleLR(
        opt,
        eta_max=[0.5, 0.1],
        total_steps=total,
        pct_start=pct,
        anneal_strategy=strategy,
        div_factor=div,
        final_div_factor=final,
        three_phase=three_phase,
        by_epoch=False,
    )
    vals = run([s], opt, steps=total)

    def anneal(a, b, p):
        if strategy == 'cos':
            return b + (a - b) * (1 + math.cos(math.pi * p)) / 2
        return a + (b - a) * p

    for g, peak in enumerate([0.5, 0.1]):
        init, low = peak / div, peak / div / final
        e1 = pct * total - 1  # 4
        if three_phase:
            e2 = 2 * pct * total - 2  # 8
            phases = [(0, e1, init, peak), (e1, e2, peak, init), (e2, total - 1, init, low)]
        else:
            phases = [(0, e1, init, peak), (e1, total - 1, peak, low)]
        expected = []
        for t in range(total):
            for i, (a, b, v0, v1) in enumerate(phases):
                if t <= b or i == len(phases) - 1:
                    expected.append(anneal(v0, v1, (t - a) / (b - a)))
                    break
        assert vals[g] == pytest.approx(expected, rel=1e-9)
        assert opt.param_groups[g]['initial_lr'] == pytest.approx(init)


def test_one_cycle_total_steps_from_epochs_and_window():
    opt = make_opt()
    a = OneCycleLR(opt, eta_max=1.0, epochs=2, steps_per_epoch=5)
    b = OneCycleLR(make_opt(), eta_max=1.0, end=10)
    assert a.total_steps == b.total_steps == 10
    with pytest.raises(ValueError, match='OneCycleLR: stepped 12 times'):
        for _ in range(11):
            a.step()


def test_sgd_momentum_and_adam_betas():
    for kind in ('SGD', 'Adam'):
        opt = make_opt(kind, momentum=0.9)
        key = 'momentum' if kind == 'SGD' else 'betas0'
        vals = run([StepMomentum(opt, step_size=2, gamma=0.5)], opt, steps=6, key=key)
        for g in range(2):
            assert vals[g] == pytest.approx([0.9 * 0.5 ** (t // 2) for t in range(6)])
        if kind == 'Adam':
            assert opt.param_groups[0]['betas'][1] == 0.999
    opt = make_opt('Adam', momentum=0.95)
    vals = run([CosineAnnealingMomentum(opt, T_max=6, eta_min=0.85)], opt, steps=7, key='betas0')
    assert vals[1] == pytest.approx(
        [0.85 + 0.1 * (1 + math.cos(math.pi * t / 6)) / 2 for t in range(7)]
    )


def test_momentum_needs_momentum_or_betas():
    opt = torch.optim.Adadelta([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match='ExponentialMomentum: the optimizer has neither'):
        ExponentialMomentum(opt, gamma=0.9)


# --- composition and windows --------------------------------------------------------------


def test_begin_end_window_leaves_values_alone():
    opt = make_opt()
    vals = run([ExponentialLR(opt, gamma=0.5, begin=2, end=5)], opt, steps=8)
    # steps 2,3,4 are in the window; the first one in it is the scheduler's step 0
    check(vals, lambda t: 0.5 ** (min(max(t - 2, 0), 2)))


def test_warmup_then_cosine_sequential():
    opt = make_opt()
    warm = LinearLR(opt, start_factor=0.1, begin=0, end=4, by_epoch=False)
    cos = CosineAnnealingLR(opt, T_max=8, begin=4, end=12, by_epoch=False, eta_min=0.0)
    vals = run([warm, cos], opt, steps=12)
    check(vals, lambda t: 0.1 + 0.9 * t / 3 if t < 4 else cosine(t - 4, 8))


def test_warmup_overlapping_cosine_multiplies():
    opt = make_opt()
    warm = LinearLR(opt, start_factor=0.25, end=5)
    cos = CosineAnnealingLR(opt, T_max=10, end=10)
    # eta_min=0 makes the chainable cosine a pure ratio, so the two factors multiply
    check(run([warm, cos], opt, steps=10), lambda t: (0.25 + 0.75 * min(t, 4) / 4) * cosine(t, 10))


def test_warmup_with_multistep():
    opt = make_opt()
    warm = LinearLR(opt, start_factor=0.5, end=4)
    steps = MultiStepLR(opt, milestones=[2, 6], gamma=0.1)
    check(
        run([warm, steps], opt, steps=9),
        lambda t: (0.5 + 0.5 * min(t, 3) / 3) * 0.1 ** sum(m <= t for m in [2, 6]),
    )


def test_initial_lr_recorded_once_and_last_value():
    opt = make_opt()
    LinearLR(opt, start_factor=0.5, end=3)
    s = StepLR(opt, step_size=1, gamma=0.5, begin=3)
    assert [g['initial_lr'] for g in opt.param_groups] == list(BASE)
    assert s.base_values == list(BASE)
    assert s.get_last_value() == [g['lr'] for g in opt.param_groups]


# --- state dicts ------------------------------------------------------------------------


def _build_all(opt):
    return [
        LinearLR(opt, start_factor=0.1, end=3),
        MultiStepLR(opt, milestones=[4, 7]),
        CosineRestartLR(opt, periods=[5, 5], restart_weights=[1, 0.5], eta_min=0.001),
        MultiStepMomentum(opt, milestones=[5], gamma=0.5),
    ]


def test_state_dict_round_trip_mid_schedule():
    opt = make_opt()
    scheds = _build_all(opt)
    run(scheds, opt, steps=5)
    buf = io.BytesIO()
    torch.save({'optimizer': opt.state_dict(), 'schedulers': [s.state_dict() for s in scheds]}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # plain values only: no optimizer, no functions
    for sd in ckpt['schedulers']:
        assert 'optimizer' not in sd
    expected_lr = run(scheds, opt, steps=6)

    opt2 = make_opt()
    scheds2 = _build_all(opt2)  # build, then restore optimizer, then schedulers
    opt2.load_state_dict(ckpt['optimizer'])
    for s, sd in zip(scheds2, ckpt['schedulers']):
        s.load_state_dict(sd)
    assert run(scheds2, opt2, steps=6) == expected_lr


def test_one_cycle_state_dict_is_plain():
    opt = make_opt()
    s = OneCycleLR(opt, eta_max=0.3, total_steps=10)
    run([s], opt, steps=3)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    s2 = OneCycleLR(make_opt(), eta_max=0.3, total_steps=10)
    s2.load_state_dict(sd)
    assert s2.last_step == s.last_step == 3


# --- errors ----------------------------------------------------------------------------


def test_errors_name_scheduler_and_argument():
    opt = make_opt()
    with pytest.raises(ValueError, match=r'LinearLR: end \(5\) must be greater than begin \(5\)'):
        LinearLR(opt, begin=5, end=5)
    with pytest.raises(ValueError, match=r'MultiStepLR: milestones must be sorted.*\[5, 2\]'):
        MultiStepLR(opt, milestones=[5, 2])
    with pytest.raises(TypeError, match=r'StepLR: optimizer should be an Optimizer.*dict'):
        StepLR({'lr': 0.1}, step_size=1)
    with pytest.raises(ValueError, match='ConstantLR: factor must be in'):
        ConstantLR(opt, factor=2.0)
    with pytest.raises(ValueError, match='CosineRestartLR: give exactly one of eta_min'):
        CosineRestartLR(opt, periods=[2])
    with pytest.raises(ValueError, match="OneCycleLR: anneal_strategy must be 'cos'"):
        OneCycleLR(opt, eta_max=0.1, total_steps=5, anneal_strategy='exp')
    with pytest.raises(KeyError, match='initial_lr'):
        StepLR(make_opt(), step_size=1, last_step=3)
    assert int(1e9) == INF


class _DuckWrapper:
    """What stratagem.optim's wrapper looks like to a scheduler."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups


def test_duck_typed_optim_wrapper():
    opt = make_opt('Adam')
    wrapper = _DuckWrapper(opt)
    s = ExponentialLR(wrapper, gamma=0.5)
    m = ExponentialMomentum(wrapper, gamma=0.5)
    s.step()
    m.step()
    assert [g['lr'] for g in opt.param_groups] == pytest.approx([b * 0.5 for b in BASE])
    assert opt.param_groups[0]['betas'][0] == pytest.approx(0.45)
