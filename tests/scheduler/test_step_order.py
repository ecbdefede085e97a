"""The first scheduler.step() warns when the optimizer has not stepped (torch's and mmengine's
warning, with the how-to-adjust-learning-rate link), and only then."""

import warnings

import pytest
import torch

from stratagem.optim import OptimWrapper
from stratagem.scheduler import ExponentialLR, SchedulerArgumentError, StepLR

LINK = 'how-to-adjust-learning-rate'


def _sgd():
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model):
    return model(torch.ones(3, 2)).sum()


def _no_warning(fn):
    with warnings.catch_warnings():
        warnings.simplefilter('error', UserWarning)
        fn()


def test_scheduler_before_optimizer_warns_once():
    _, opt = _sgd()
    sched = StepLR(opt, step_size=1, gamma=0.5)
    with pytest.warns(
        UserWarning, match=f'StepLR.step\\(\\) was called before optimizer.step\\(\\).*{LINK}'
    ):
        sched.step()
    _no_warning(sched.step)  # only the first step is checked
    assert opt.param_groups[0]['lr'] == pytest.approx(0.025)


def test_optimizer_first_is_silent_and_counts_only_from_the_newest_scheduler():
    model, opt = _sgd()
    first = ExponentialLR(opt, gamma=0.9)
    _loss(model).backward()
    opt.step()
    _no_warning(first.step)
    second = StepLR(opt, step_size=1)  # a new scheduler counts the optimizer's steps anew
    with pytest.warns(UserWarning, match=LINK):
        second.step()
    assert 'step' not in vars(opt)  # counted by a step post-hook: optimizer.step untouched


def test_wrapper_accumulating_is_not_a_missing_step():
    model, opt = _sgd()
    wrapper = OptimWrapper(opt, accumulative_counts=2)
    wrapper.initialize_count_status(model, 0, 4)
    sched = StepLR(wrapper, step_size=1, by_epoch=False)
    wrapper.update_params(_loss(model))  # accumulates: the torch optimizer did not step
    assert opt.state == {}
    _no_warning(sched.step)


def test_replaced_optimizer_step_warns():
    _, opt = _sgd()
    sched = ExponentialLR(opt, gamma=0.9)
    opt.step = lambda: None
    opt.step()
    with pytest.warns(UserWarning, match=f'optimizer.step\\(\\) was replaced.*{LINK}'):
        sched.step()


def test_argument_errors_are_value_and_assertion_errors():
    _, opt = _sgd()
    for kwargs in (dict(last_step=-2), dict(last_step=1.5)):
        with pytest.raises(SchedulerArgumentError, match='last_step must be an int >= -1') as info:
            StepLR(opt, step_size=1, **kwargs)
        assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)
    with pytest.raises(KeyError, match="param 'initial_lr' is not specified in param_groups"):
        StepLR(_sgd()[1], step_size=1, last_step=3)


def test_replaying_schedules_on_resume_does_not_warn():
    from stratagem.scheduler.replay import replay_schedulers

    _, opt = _sgd()
    sched = StepLR(opt, step_size=2, gamma=0.5, by_epoch=False)
    _no_warning(lambda: replay_schedulers([sched], num_iters=5))
    assert opt.param_groups[0]['lr'] == pytest.approx(0.1 * 0.5**2)
    with pytest.warns(UserWarning, match=LINK):  # the check is back on afterwards
        StepLR(opt, step_size=1).step()


def test_the_counting_hook_goes_after_the_first_optimizer_step():
    """A run pays no Python call per optimizer step for the check: the hook is removed once
    the optimizer stepped, and a scheduler built later registers it again."""
    model, opt = _sgd()
    first = StepLR(opt, step_size=1, gamma=0.5)
    assert len(opt._optimizer_step_post_hooks) == 1
    _loss(model).backward()
    opt.step()
    assert len(opt._optimizer_step_post_hooks) == 0
    _no_warning(first.step)
    later = ExponentialLR(opt, gamma=0.9)  # counts from its own construction
    assert len(opt._optimizer_step_post_hooks) == 1
    with pytest.warns(UserWarning, match='ExponentialLR.step\\(\\) was called before'):
        later.step()
    opt.step()
    opt.step()
    assert len(opt._optimizer_step_post_hooks) == 0
