"""Resuming into a run of another length (``stratagem.loop.train``): a scheduler whose ``end``
was fitted to the first run keeps it with one warning naming it, or follows the new run's
length with ``train_cfg.refit_schedulers=True``."""

import csv
import math
import warnings

import pytest

from stratagem.loop import train
from stratagem.metrics import find_metrics_csv

# 32 samples / 8 = 4 iterations per epoch; the cosine cfg has no end: fitted to the run
BASE = dict(
    model=dict(type='MLPClassifier', in_features=4, num_classes=2, hidden=4),
    train_dataloader=dict(
        dataset=dict(type='SyntheticClassification', num_samples=32, num_features=4, num_classes=2),
        batch_size=8,
    ),
    optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
    param_scheduler=[
        dict(type='LinearLR', start_factor=0.5, by_epoch=False, end=2),
        dict(type='CosineAnnealingLR', by_epoch=False, eta_min=0.01),
    ],
    train_cfg=dict(max_epochs=1, log_interval=1),
    randomness=dict(seed=0),
)


def _cfg(work_dir, max_epochs, **train_cfg):
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    cfg['work_dir'] = str(work_dir)
    cfg['train_cfg'] = dict(BASE['train_cfg'], max_epochs=max_epochs, **train_cfg)
    return cfg


def _csv_lrs(strategy):
    """``{iteration: lr}`` of the run's metrics.csv (one across resumes: a resumed run
    appends to the file of the run it resumes)."""
    with open(find_metrics_csv(strategy.work_dir)) as f:
        return {int(r['iter']): float(r['lr']) for r in csv.DictReader(f)}


def test_resume_into_a_longer_run_warns_once_or_refits(tmp_path):
    first = tmp_path / 'first'
    out = train(_cfg(first, 1), progress=False)
    assert out['iter'] == 4
    # without refit: the cosine keeps end=4 (its lr stops at eta_min) and says so, once
    with pytest.warns(UserWarning) as record:
        kept = train(_cfg(first, 2), resume=True, progress=False)
    said = [str(w.message) for w in record if 'another length' in str(w.message)]
    assert len(said) == 1
    assert 'CosineAnnealingLR: end=4 from the checkpoint; this run has 8 iterations' in said[0]
    assert 'LinearLR' not in said[0]  # its end was given by the config
    assert 'train_cfg.refit_schedulers=True' in said[0]
    assert kept['iter'] == 8
    frozen = _csv_lrs(kept['strategy'])
    last = _csv_lrs(out['strategy'])[4]  # the first run's last lr
    assert [frozen[it] for it in (5, 6, 7, 8)] == [last] * 4  # the frozen lr

    # with refit: the lr of every iteration after the resume is a fresh 2-epoch run's
    second = tmp_path / 'second'
    short = train(_cfg(second, 1), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # no warning with refit
        refit = train(_cfg(second, 2, refit_schedulers=True), resume=True, progress=False)
    assert refit['iter'] == 8
    fresh = train(_cfg(tmp_path / 'fresh', 2), progress=False)
    got, want = _csv_lrs(refit['strategy']), _csv_lrs(fresh['strategy'])
    assert {5, 6, 7, 8} <= set(got)
    for it in (5, 6, 7, 8):
        assert got[it] == pytest.approx(want[it], rel=1e-12), it
    # the closed form: warm-up over (factor 1), cosine from 0.1 to 0.01 over 8 iterations
    # (the lr logged at iteration i is the one after the i-th step; step 8 is past the
    # window [0, 8), so iteration 8 keeps step 7's value, as mmengine's does)
    for it in (5, 6, 7, 8):
        t = min(it, 7)
        assert got[it] == pytest.approx(0.01 + 0.09 * (1 + math.cos(math.pi * t / 8)) / 2)
    # before the resume the 1-epoch schedule ran: another value at iteration 4
    assert _csv_lrs(short['strategy'])[4] != pytest.approx(want[4])
