"""``rebind_schedulers``: torch's schedulers, built over one optimizer, moved onto another
that steps instead (a sharding backend's), give the lr sequence and the weights of the
same scheduler over an optimizer that never changed, also after a state_dict round trip
(a resume), and a scheduler that cannot be moved is refused naming its class."""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as lrs

from stratagem.scheduler.rebind import rebind_schedulers, scheduler_references

STEPS, RESUME_AT = 12, 5
METRICS = [1.0, 0.9, 0.95, 0.97, 0.99, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95]  # plateaus


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # two groups: the schedulers keep a value per group
    return torch.optim.SGD(
        [
            {'params': model[0].parameters()},
            {'params': model[1].parameters(), 'lr': 0.05},
        ],
        lr=0.1,
        momentum=0.9,
    )


def _fresh(old: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """What a backend builds from the optimizer's class and constructor values (fairscale's
    OSS): the scheduler's own keys (``initial_lr``, ...) are not in its groups."""
    groups = [
        {'params': g['params'], 'lr': g['lr'], 'momentum': g['momentum']} for g in old.param_groups
    ]
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


FACTORIES: dict[str, Callable] = {
    'LambdaLR': lambda o: lrs.LambdaLR(o, lambda s: min(1.0, (s + 1) / 4)),
    'StepLR': lambda o: lrs.StepLR(o, step_size=3, gamma=0.5),
    'OneCycleLR': lambda o: lrs.OneCycleLR(o, max_lr=[0.2, 0.1], total_steps=STEPS),
    'CosineAnnealingLR': lambda o: lrs.CosineAnnealingLR(o, T_max=STEPS, eta_min=0.001),
    'SequentialLR': lambda o: lrs.SequentialLR(
        o,
        [lrs.LinearLR(o, start_factor=0.1, total_iters=3), lrs.StepLR(o, step_size=2)],
        milestones=[3],
    ),
    'ChainedScheduler': lambda o: lrs.ChainedScheduler(
        [lrs.ConstantLR(o, factor=0.5, total_iters=4), lrs.ExponentialLR(o, gamma=0.9)]
    ),
    'ReduceLROnPlateau': lambda o: lrs.ReduceLROnPlateau(o, patience=1, factor=0.5),
}


def _train(model, optimizer, scheduler, steps: range) -> list[list[float]]:
    """The lr of each group at each step, and a step of the model (the lr really used)."""
    seen = []
    for step in steps:
        seen.append([g['lr'] for g in optimizer.param_groups])
        loss = model(torch.full((2, 3), step / 10.0)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if isinstance(scheduler, lrs.ReduceLROnPlateau):
            scheduler.step(METRICS[step])
        else:
            scheduler.step()
    return seen


def _rebound(name: str, model: nn.Module):
    old = _optimizer(model)
    scheduler = FACTORIES[name](old)
    new = _fresh(old)
    rebind_schedulers([scheduler], old, new)
    return old, new, scheduler


@pytest.mark.parametrize('name', list(FACTORIES))
def test_a_rebound_scheduler_drives_the_new_optimizer_as_the_old(name):
    ref_model = _model()
    ref_opt = _optimizer(ref_model)
    ref_sched = FACTORIES[name](ref_opt)
    expected = _train(ref_model, ref_opt, ref_sched, range(STEPS))

    model = _model()
    old, new, scheduler = _rebound(name, model)
    before = [g['lr'] for g in old.param_groups]
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # torch's "optimizer.step() has been overridden"
        assert _train(model, new, scheduler, range(STEPS)) == expected
    assert [g['lr'] for g in old.param_groups] == before  # the old one is left alone
    assert scheduler_references(scheduler, old).movable == []
    for key in ('initial_lr', 'max_lr', 'min_lr'):  # the scheduler's own group values
        assert [g.get(key) for g in new.param_groups] == [g.get(key) for g in ref_opt.param_groups]
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize('name', ['LambdaLR', 'OneCycleLR', 'SequentialLR', 'ReduceLROnPlateau'])
def test_a_rebound_scheduler_resumes_from_its_state_dict(name):
    ref_model = _model()
    ref_opt = _optimizer(ref_model)
    ref_sched = FACTORIES[name](ref_opt)
    expected = _train(ref_model, ref_opt, ref_sched, range(STEPS))

    model = _model()
    _, new, scheduler = _rebound(name, model)
    _train(model, new, scheduler, range(RESUME_AT))
    saved = (copy.deepcopy(model.state_dict()), new.state_dict(), scheduler.state_dict())
    # a new process: configure_optimizers again, the backend's optimizer, then the states
    model = _model()
    _, new, scheduler = _rebound(name, model)
    model.load_state_dict(saved[0])
    new.load_state_dict(saved[1])
    scheduler.load_state_dict(saved[2])
    assert _train(model, new, scheduler, range(RESUME_AT, STEPS)) == expected[RESUME_AT:]
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


class _ClosureScheduler:
    """Holds its optimizer in a closure only: it cannot be pointed elsewhere."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        def step() -> None:
            for group in optimizer.param_groups:
                group['lr'] *= 0.5

        self.step = step


class _HiddenScheduler(_ClosureScheduler):
    """Names its optimizer too, but its step would still drive the old one."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self.optimizer = optimizer


class _WeakScheduler:
    """Holds its optimizer through a weak reference only: nothing seen to point elsewhere."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer_ref = weakref.ref(optimizer)

    def step(self) -> None:
        for group in self.optimizer_ref().param_groups:
            group['lr'] *= 0.5


@pytest.mark.parametrize(
    ('cls', 'why'),
    [
        (_ClosureScheduler, r'_ClosureScheduler holds its optimizer in _ClosureScheduler\.step \('),
        (_HiddenScheduler, r'_HiddenScheduler holds its optimizer in _HiddenScheduler\.step \('),
        (_WeakScheduler, r'_WeakScheduler refers to its optimizer through no attribute'),
    ],
)
def test_a_scheduler_that_cannot_be_moved_is_refused_naming_it_and_nothing_changes(cls, why):
    model = _model()
    old = _optimizer(model)
    movable = lrs.StepLR(old, step_size=2)
    new = _fresh(old)
    with pytest.raises(ValueError, match=why + r'.*keep the optimizer .*\(self\.optimizer\)'):
        rebind_schedulers([movable, cls(old)], old, new)
    assert movable.optimizer is old
    assert all('initial_lr' not in g for g in new.param_groups)


def test_a_scheduler_given_twice_or_also_as_a_child_moves_once():
    model = _model()
    old = _optimizer(model)
    child = lrs.StepLR(old, step_size=2)
    chained = lrs.ChainedScheduler([child, lrs.ExponentialLR(old, gamma=0.9)])
    new = _fresh(old)
    rebind_schedulers([chained, child, chained], old, new)
    assert chained.optimizer is child.optimizer is new


def test_references_in_lists_and_dicts_are_moved():
    model = _model()
    old = _optimizer(model)
    scheduler = lrs.StepLR(old, step_size=2)
    scheduler.extra = {'groups': old.param_groups, 'first': [old.param_groups[0]]}
    new = _fresh(old)
    rebind_schedulers([scheduler], old, new)
    assert scheduler.optimizer is new and scheduler.extra['groups'] is new.param_groups
    assert scheduler.extra['first'][0] is new.param_groups[0]
    assert scheduler_references(scheduler, old).movable == []


def test_a_different_number_of_param_groups_is_refused():
    model = _model()
    old = _optimizer(model)
    scheduler = lrs.StepLR(old, step_size=2)
    new = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r'SGD\) has 1 param group\(s\), .* over 2'):
        rebind_schedulers([scheduler], old, new)
    assert scheduler.optimizer is old
