"""Stragglers named (``stratagem/loop/stragglers.py``): the decision on plain numbers, the
settings refused, and two processes where rank 1 loads its data slowly on purpose."""

import csv
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from dist_harness import run_distributed
from stratagem.config import ConfigErrors
from stratagem.loop import check_train_config
from stratagem.loop.stragglers import SlowCounts, StragglerConfig, _PhaseTimer, straggler_config


def test_a_rank_is_named_after_the_configured_intervals_in_a_row():
    counts = SlowCounts(StragglerConfig(factor=1.5, intervals=3))
    # rank 2 at 2x the others' median twice, then an interval at 1.4x resets its count
    assert counts.update([1.0, 1.1, 2.0, 0.9]) == []
    assert counts.update([1.0, 1.0, 2.0, 1.0]) == []
    assert counts.update([1.0, 1.0, 1.4, 1.0]) == [] and counts.counts[2] == 0
    assert counts.update([1.0, 1.0, 3.0, 1.0]) == []
    assert counts.update([1.0, 1.0, 3.0, 1.0]) == []
    (slow,) = counts.update([1.0, 2.0, 3.0, 1.0])  # median of the others' (1, 2, 1): 1
    assert (slow.rank, slow.ratio, slow.count, slow.first) == (2, 3.0, 3, True)
    (again,) = counts.update([1.0, 1.0, 1.5, 1.0])  # exactly the factor is slow
    assert (again.rank, again.ratio, again.count, again.first) == (2, 1.5, 4, False)
    assert counts.recovered == []
    assert counts.update([1.0, 1.0, 1.0, 1.0]) == [] and counts.recovered == [2]


def test_a_rank_must_also_be_min_seconds_slower():
    counts = SlowCounts(StragglerConfig(factor=1.5, intervals=1, min_seconds=0.01))
    # 3x the other's time, but 2 ms of a tiny step's jitter: not slow
    assert counts.update([0.001, 0.003]) == [] and counts.counts == {0: 0, 1: 0}
    (slow,) = counts.update([0.005, 0.02])
    assert (slow.rank, slow.ratio) == (1, pytest.approx(4.0))


def test_ratios_against_the_median_of_the_other_ranks():
    counts = SlowCounts(StragglerConfig())
    # two ranks: each against the other (a median over both could never reach 2x)
    assert counts.ratios([0.5, 1.5]) == [pytest.approx(1 / 3), 3.0]
    assert counts.ratios([2.0, 1.0, 3.0]) == [1.0, 0.4, 2.0]
    assert counts.ratios([0.0, 0.0, 0.2]) == [0.0, 0.0, float('inf')]
    assert counts.ratios([0.0, 0.0]) == [1.0, 1.0]


@pytest.mark.parametrize(
    ('value', 'error'),
    [
        (dict(factor=1.0), 'train_cfg.straggler.factor should be a number > 1'),
        (dict(factor='2'), 'train_cfg.straggler.factor should be a number > 1'),
        (dict(intervals=0), 'train_cfg.straggler.intervals should be an int >= 1'),
        (dict(intervals=2.0), 'train_cfg.straggler.intervals should be an int >= 1'),
        (dict(min_seconds=-1), 'train_cfg.straggler.min_seconds should be a number >= 0'),
        (dict(factr=2), "unknown key(s) ['factr'] in train_cfg.straggler"),
        ('on', 'train_cfg.straggler should be a dict'),
    ],
)
def test_settings_are_checked(value, error):
    with pytest.raises((TypeError, ValueError)) as info:
        straggler_config(value)
    assert error in str(info.value)


def test_settings_default_on_and_turn_off(tmp_path):
    assert straggler_config(True) == StragglerConfig(1.5, 3, 0.01) == straggler_config({})
    assert straggler_config(None) is None and straggler_config(False) is None
    cfg = dict(
        model=dict(type='MLPClassifier'),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
        train_dataloader=dict(dataset=dict(type='SyntheticClassification')),
        train_cfg=dict(max_iters=2),
    )
    assert check_train_config(cfg).straggler == StragglerConfig(1.5, 3)
    cfg['train_cfg'] = dict(max_iters=2, straggler=dict(factor=3, intervals=1, min_seconds=0))
    assert check_train_config(cfg).straggler == StragglerConfig(3.0, 1, 0.0)
    cfg['train_cfg'] = dict(max_iters=2, straggler=None)
    assert check_train_config(cfg).straggler is None
    cfg['train_cfg'] = dict(max_iters=2, straggler=dict(factor=0.5))
    with pytest.raises((ValueError, ConfigErrors), match='straggler.factor'):
        check_train_config(cfg)


class SlowForward(nn.Module):
    """Sleeps 30 ms in its forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        time.sleep(0.03)
        return self.fc(x).sum()


def test_one_step_phases_and_the_hooks_gone_after_it():
    model = SlowForward()
    timer = _PhaseTimer(model, cuda=False, compute=True)
    timer.arm()
    time.sleep(0.02)
    timer.got_batch()
    loss = model(torch.randn(2, 4))
    time.sleep(0.04)
    model(torch.randn(2, 4))  # a forward again (a recomputation) moves no mark
    loss.backward()
    phases = timer.finish()
    assert 0.02 <= phases['data'] < 0.02 + 0.5
    assert 0.03 <= phases['forward'] < 0.03 + 0.5
    assert 0.07 <= phases['backward'] < 0.07 + 0.5  # from the first forward's end
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    # without compute (a backend whose forward holds collectives): data only, no hooks
    timer = _PhaseTimer(model, cuda=False, compute=False)
    timer.arm()
    assert not model._forward_hooks
    timer.got_batch()
    model(torch.randn(2, 4)).backward()
    assert timer.finish()['forward'] is None


def _rank():
    return int(os.environ.get('RANK', '0'))


class Sleepy(Dataset):
    """32 samples; on rank 1 each takes ``extra`` s more to load than ``base``."""

    def __init__(self, base, extra):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 4, generator=g), torch.randn(32, generator=g)
        self.delay = base + (extra if _rank() == 1 else 0.0)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.x[i], self.y[i]


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Regression(nn.Module):
    """Two layers; on rank 1 its forward takes ``forward`` s more, and its backward
    ``backward`` s more between the second layer's gradients and the first's."""

    def __init__(self, forward=0.0, backward=0.0):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 1)
        slow = _rank() == 1
        self.forward_s, self.backward_s = (forward, backward) if slow else (0.0, 0.0)

    def forward(self, inputs, targets):
        time.sleep(self.forward_s)
        h = _SleepInBackward.apply(self.fc1(inputs), self.backward_s)
        return F.mse_loss(self.fc2(torch.relu(h)).squeeze(1), targets)


def _cfg(work, data=0.0, **model):
    return dict(
        model=dict(type=Regression, **model),
        # 4 samples a batch: every rank loads for 4 x 4 ms, rank 1 for 4 x data s more
        train_dataloader=dict(dataset=dict(type=Sleepy, base=0.004, extra=data), batch_size=4),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
        train_cfg=dict(
            max_iters=8,
            log_interval=2,
            straggler=dict(factor=1.5, intervals=2),
            metrics=dict(tensorboard=False),
        ),
        work_dir=work,
    )


def _runs(root, cases):
    """``{name: train()'s stragglers}`` of one run per ``(name, slow phases)`` case."""
    from stratagem.loop import train

    return {
        name: train(_cfg(os.path.join(root, name), **slow), progress=False)['stragglers']
        for name, slow in cases
    }


def _named(rows):
    return [(r['iter'], r['rank']) for r in rows]


def test_a_rank_slow_on_purpose_is_the_one_named(tmp_path):
    """Rank 1 loads each sample 20 ms more slowly: timed at iterations 2, 4, 6, 8
    (log_interval 2; the first step is not timed), slow in 2 intervals in a row from
    iteration 4 on, so named at 4, 6 and 8 with a ratio above the factor; a run where every
    rank loads alike names nobody."""
    cases = [('slow', dict(data=0.02)), ('even', {})]
    result, rank1 = run_distributed(_runs, nproc=2, args=(str(tmp_path), cases), timeout=180)
    slow = result['slow']
    assert _named(slow) == [(4, 1), (6, 1), (8, 1)]
    assert all(r['ratio'] > 1.5 and r['data'] >= 0.08 for r in slow), slow
    assert result['even'] == []
    assert rank1 == {'slow': [], 'even': []}  # rank 0 decides
    (table,) = Path(tmp_path, 'slow').glob('*/metrics.csv')
    with open(table) as f:
        rows = [r for r in csv.DictReader(f) if r['straggler/rank']]
    assert [(int(r['iter']), int(float(r['straggler/rank']))) for r in rows] == _named(slow)
    assert [float(r['straggler/ratio']) for r in rows] == pytest.approx([r['ratio'] for r in slow])
    (table,) = Path(tmp_path, 'even').glob('*/metrics.csv')
    with open(table) as f:
        assert 'straggler/rank' not in f.readline()


@pytest.mark.slow
def test_a_slow_forward_or_backward_is_timed_before_the_all_reduce(tmp_path):
    """Rank 1's forward, then its backward (between its two layers' gradients, so its last
    gradient, and its entry into DDP's all-reduce, come 40 ms later) is slow: named, and
    that phase is the one that took the time (rank 0 waits for rank 1's gradients inside
    the all-reduce, after its own marks)."""
    cases = [('forward', dict(forward=0.04)), ('backward', dict(backward=0.04))]
    result, _ = run_distributed(_runs, nproc=2, args=(str(tmp_path), cases), timeout=240)
    for phase, rows in result.items():
        assert _named(rows) == [(4, 1), (6, 1), (8, 1)], (phase, rows)
        for row in rows:
            others = [p for p in ('data', 'forward', 'backward') if p != phase]
            assert row[phase] >= 0.04 and all(row[p] < 0.04 for p in others), (phase, row)
