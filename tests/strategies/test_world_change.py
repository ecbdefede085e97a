"""Resuming at another world size: the position, the schedule and max_iters convert exactly,
or the resume is refused naming both world sizes."""

from fractions import Fraction

import pytest
import torch

from stratagem.scheduler import build_param_schedulers
from stratagem.scheduler.replay import replay_schedulers
from stratagem.strategies.world_change import plan_world_size_change

META = dict(world_size=2, train_micro_batch_size_per_gpu=8, epoch_length=4)


def test_same_world_size_plans_nothing():
    assert plan_world_size_change({**META, 'iter': 8, 'epoch': 2}, {}, 2) is None


def test_epoch_end_two_to_one_doubles_the_position_and_the_ratio():
    change = plan_world_size_change(
        {**META, 'iter': 8, 'epoch': 2}, dict(train_micro_batch_size_per_gpu=8, epoch_length=8), 1
    )
    assert (change.new_iter, change.ratio) == (16, Fraction(2))
    assert (change.old_samples_per_iter, change.new_samples_per_iter) == (16, 8)
    assert change.as_meta()['iter'] == [8, 16]


def test_mid_epoch_position_counts_samples_into_the_epoch():
    # 1 process x 8 samples, 8 iterations per epoch: iteration 12 is 32 samples into epoch 1;
    # at 2 x 8 = 16 samples per iteration that is 2 iterations into epoch 1 of length 4
    change = plan_world_size_change(
        dict(world_size=1, train_micro_batch_size_per_gpu=8, epoch_length=8, iter=12, epoch=1),
        dict(train_micro_batch_size_per_gpu=8, epoch_length=4),
        2,
    )
    assert change.new_iter == 1 * 4 + 2 and change.ratio == Fraction(1, 2)


def test_a_position_inside_an_iteration_is_refused_naming_both_world_sizes():
    meta = dict(world_size=1, train_micro_batch_size_per_gpu=8, epoch_length=8, iter=11, epoch=1)
    with pytest.raises(
        ValueError,
        match=r'world size 2: it was saved by 1 process.*24 samples'
        r' into epoch 1.*16',
    ):
        plan_world_size_change(
            meta, dict(train_micro_batch_size_per_gpu=8, epoch_length=4), 2, filename='iter_11.pth'
        )


def test_accumulation_windows_that_would_shift_are_refused():
    meta = dict(world_size=1, train_micro_batch_size_per_gpu=8, iter=12)
    with pytest.raises(ValueError, match='accumulative_counts=4 iteration 12 becomes 6'):
        plan_world_size_change(meta, dict(train_micro_batch_size_per_gpu=8), 2, 4)
    ok = plan_world_size_change(meta, dict(train_micro_batch_size_per_gpu=8), 2, 2)
    assert ok.new_iter == 6


def test_iteration_counted_max_iters_converts_or_is_refused():
    meta = dict(world_size=2, train_micro_batch_size_per_gpu=4, iter=10)
    change = plan_world_size_change(meta, dict(train_micro_batch_size_per_gpu=4, max_iters=30), 1)
    assert change.max_iters == (30, 60) and change.new_iter == 20
    with pytest.raises(ValueError, match='max_iters=30.*7.5 iterations'):
        plan_world_size_change(
            {**meta, 'iter': 8}, dict(train_micro_batch_size_per_gpu=4, max_iters=30), 8
        )


def test_unknown_micro_batch_reports_the_change_without_converting():
    change = plan_world_size_change(dict(world_size=2, iter=5), {}, 1)
    assert change.new_iter is None and 'keep the checkpoint' in change.notes[0]


def _schedulers(linear_end, total):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0, momentum=0.9)
    cfgs = [
        dict(type='LinearLR', start_factor=0.1, by_epoch=False, end=linear_end),
        dict(type='MultiStepLR', by_epoch=False, milestones=[linear_end * 2], gamma=0.5),
        dict(type='CosineAnnealingLR', by_epoch=False, eta_min=0.01),
        dict(type='CosineAnnealingMomentum', by_epoch=False, eta_min=0.5),
    ]
    return opt, build_param_schedulers(cfgs, opt, max_iters=total)


def _run(opt, scheds, steps):
    trace = []
    for _ in range(steps):
        for s in scheds:
            s.step()
        trace.append((opt.param_groups[0]['lr'], opt.param_groups[0]['momentum']))
    return trace


@pytest.mark.parametrize('ratio', [Fraction(2), Fraction(1, 2)])
def test_rescaled_and_replayed_schedule_equals_one_run_in_the_new_units(ratio):
    old_end, old_total, done_old = 4, 24, 10
    opt_old, old = _schedulers(old_end, old_total)
    _run(opt_old, old, done_old)
    states = [s.state_dict() for s in old]
    # the resumed run builds from the same config (old iteration counts), then loads
    opt_new, new = _schedulers(old_end, int(old_total * ratio))
    opt_new.load_state_dict(opt_old.state_dict())
    done_new = int(done_old * ratio)
    for s, st in zip(new, states):
        s.load_state_dict(s.rescaled_state_dict(st, ratio, done_new))
    replay_schedulers(new, done_new)
    # reference: a run that used the new units from its start
    opt_ref, ref = _schedulers(int(old_end * ratio), int(old_total * ratio))
    _run(opt_ref, ref, done_new)
    assert opt_new.param_groups[0]['lr'] == opt_ref.param_groups[0]['lr']
    rest = int(old_total * ratio) - done_new
    got, want = _run(opt_new, new, rest), _run(opt_ref, ref, rest)
    assert got == want  # bit-equal: the same arithmetic in the same order
    assert [s.end for s in new[:2]] == [int(old_end * ratio), int(old_total * ratio)]
    assert new[1].milestones == {int(old_end * 2 * ratio): 1}


def test_a_count_that_does_not_convert_names_the_scheduler_and_field():
    opt, scheds = _schedulers(5, 20)
    lin = scheds[0]
    with pytest.raises(ValueError, match=r'LinearLR.end=5 iterations is 2.5'):
        lin.rescaled_state_dict(lin.state_dict(), Fraction(1, 2), 4)


def test_one_cycle_and_restart_tables_follow_the_rescale():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    oc, cr = build_param_schedulers(
        [
            dict(type='OneCycleLR', eta_max=1.0, total_steps=20, by_epoch=False, end=20),
            dict(
                type='CosineRestartLR',
                periods=[4, 6],
                restart_weights=[1, 0.5],
                eta_min=0.0,
                by_epoch=False,
                begin=20,
            ),
        ],
        opt,
        max_iters=40,
    )
    st = oc.rescaled_state_dict(oc.state_dict(), Fraction(2), 0)
    assert st['total_steps'] == 40 and [p['end_step'] for p in st['_schedule_phases']] == [
        pytest.approx(0.3 * 40 - 1),
        39,
    ]
    st = cr.rescaled_state_dict(cr.state_dict(), Fraction(2), 0)
    assert st['periods'] == [8, 12] and st['cumulative_periods'] == [8, 20]
    assert (st['begin'], st['end']) == (40, 80)
