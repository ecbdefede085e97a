"""``train_cfg.anomaly``: non-finite and spiking steps, decided on every rank alike, by
injection through the dataset (``anomaly_data.PoisonedDataset``). Each run is held to an
oracle: a run whose dataset never had the offending iteration's samples (one iteration
shorter), which ``skip``, ``rollback`` and a ``stop`` resumed must all equal, weight for
weight."""

import csv
import math
from pathlib import Path

import pytest
import torch

from anomaly_data import PoisonedDataset
from dist_harness import run_distributed
from failure_helpers import clean_env, finish, start, write_config
from stratagem.config import ConfigErrors
from stratagem.loop import check_train_config, train
from stratagem.loop.anomaly import AnomalyStop, anomaly_config

BATCH, ITERS, BAD = 4, 6, 2  # iteration BAD (0-based) reads samples [BAD*4, BAD*4+4)


def _cfg(work, dataset, iters=ITERS, anomaly=None, strategy='SingleDeviceStrategy', **train_cfg):
    return dict(
        model=dict(type='MLPClassifier', in_features=8, num_classes=3, hidden=8),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=0.05)),
        param_scheduler=[dict(type='LinearLR', start_factor=0.5, by_epoch=False, end=4)],
        train_dataloader=dict(dataset=dataset, batch_size=BATCH, shuffle=False),
        train_cfg=dict(max_iters=iters, log_interval=1, anomaly=anomaly, **train_cfg),
        work_dir=str(work),
        randomness=dict(seed=1),
        strategy=dict(type=strategy),
    )


def _weights(result):
    return {k: v.clone() for k, v in result['strategy'].model.state_dict().items()}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def _rows(work):
    (table,) = Path(work).glob('*/metrics.csv')
    with open(table) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope='module')
def oracle(tmp_path_factory):
    """The weights of a run that never saw iteration BAD's samples (one iteration less)."""
    work = tmp_path_factory.mktemp('oracle')
    drop = range(BAD * BATCH, (BAD + 1) * BATCH)
    return _weights(train(_cfg(work, PoisonedDataset(drop=drop), ITERS - 1), progress=False))


def test_config_read_strictly_with_close_names():
    assert anomaly_config(None) is None
    plan = anomaly_config(dict(nonfinite='stop', spike=dict(window=4)))
    assert (plan.nonfinite, plan.window, plan.zscore, plan.spike) == ('stop', 4, 6.0, 'skip')
    with pytest.raises(ValueError, match=r"did you mean 'nonfinte' -> 'nonfinite'"):
        anomaly_config(dict(nonfinte='skip'))
    with pytest.raises(ValueError, match=r"nonfinite='skp'.*did you mean 'skip'"):
        anomaly_config(dict(nonfinite='skp'))
    with pytest.raises(ValueError, match=r"'zscor' -> 'zscore'"):
        anomaly_config(dict(spike=dict(zscor=3)))
    with pytest.raises(ValueError, match='window must be an int >= 2'):
        anomaly_config(dict(spike=dict(window=1)))
    base = _cfg('w', dict(type='SyntheticClassification'))
    # rollback needs periodic checkpoints; a typo is found together with it (train = doctor)
    base['train_cfg'].update(anomaly=dict(nonfinite='rollback'), log_intreval=1)
    with pytest.raises(ConfigErrors) as err:
        check_train_config(base)
    assert 'checkpoint_interval' in str(err.value) and "'log_intreval'" in str(err.value)
    base['train_cfg'].pop('log_intreval')
    base['train_cfg']['checkpoint_interval'] = 2
    assert check_train_config(base).anomaly.nonfinite == 'rollback'
    # an engine that steps the optimizer itself: refused by its capabilities
    base['strategy'] = dict(type='DeepSpeedStrategy')
    with pytest.raises(ValueError, match='DeepSpeedStrategy steps the optimizer through its'):
        check_train_config(base)


def test_skip_equals_a_run_without_the_batch(tmp_path, oracle):
    """A NaN input at iteration BAD: the update is dropped (no parameter, optimizer-state or
    scheduler change), the batch consumed; the row and the line say so."""
    poison = [BAD * BATCH + 1]
    result = train(
        _cfg(tmp_path, PoisonedDataset(poison=poison), anomaly=dict(nonfinite='skip')),
        progress=False,
    )
    _same(_weights(result), oracle)
    assert result['iter'] == ITERS
    losses = dict(result['losses'])
    assert math.isnan(losses[BAD + 1]) and all(
        math.isfinite(v) for i, v in losses.items() if i != BAD + 1
    )
    event = [r for r in _rows(tmp_path) if r.get('anomaly/nonfinite')]
    assert [(int(r['iter']), r['anomaly/skip'], r['anomaly/loss']) for r in event] == [
        (BAD + 1, '1.0', 'nan')
    ]


def test_stop_saves_the_state_before_the_update_and_resumes_as_skip(tmp_path, oracle):
    poison = [BAD * BATCH + 1]
    cfg = _cfg(tmp_path, PoisonedDataset(poison=poison), anomaly=dict(nonfinite='stop'))
    with pytest.raises(AnomalyStop, match=rf'iteration {BAD + 1}: non-finite loss on rank 0 '):
        train(cfg, progress=False)
    assert (tmp_path / f'iter_{BAD + 1}.pth').exists()
    resumed = train(cfg, resume=True, progress=False)
    _same(_weights(resumed), oracle)


def test_rollback_replays_without_the_batch(tmp_path, oracle):
    """Checkpoints every 2 iterations: the NaN at iteration 3 rolls back to iter_2 and the
    replay never trains on its batch; later checkpoints remember it."""
    poison = [BAD * BATCH + 1]
    cfg = _cfg(
        tmp_path,
        PoisonedDataset(poison=poison),
        anomaly=dict(nonfinite='rollback'),
        checkpoint_interval=2,
    )
    result = train(cfg, progress=False)
    _same(_weights(result), oracle)
    meta = torch.load(tmp_path / f'iter_{ITERS}.pth', weights_only=True)['meta']
    assert meta['anomaly']['skipped'] == [BAD]
    assert [int(r['iter']) for r in _rows(tmp_path) if r.get('anomaly/rollback')] == [BAD + 1]


def test_rollback_with_accumulation_skips_the_whole_window(tmp_path):
    """accumulative_counts=2: the NaN in iteration 3's batch is found at the window's update
    (iteration 4); the replay passes over both of the window's batches."""
    poison = [BAD * BATCH + 1]
    accumulate = dict(optimizer=dict(type='AdamW', lr=0.05), accumulative_counts=2)
    cfg = _cfg(tmp_path / 'run', PoisonedDataset(poison=poison),
               anomaly=dict(nonfinite='rollback'), checkpoint_interval=2)  # fmt: skip
    cfg['optim_wrapper'] = accumulate
    result = train(cfg, progress=False)
    drop = range(BAD * BATCH, (BAD + 2) * BATCH)
    ref = _cfg(tmp_path / 'ref', PoisonedDataset(drop=drop), ITERS - 2)
    ref['optim_wrapper'] = accumulate
    _same(_weights(result), _weights(train(ref, progress=False)))
    assert result['strategy'].optim_wrapper.inner_count == ITERS


def test_spike_skipped_by_zscore(tmp_path, oracle):
    """Inputs x1000 at iteration BAD on a warm window: a spike, not a NaN."""
    poison = range(BAD * BATCH, (BAD + 1) * BATCH)
    anomaly = dict(spike=dict(window=2, zscore=20.0, action='skip'))
    result = train(
        _cfg(tmp_path, PoisonedDataset(poison=poison, scale=1000.0), anomaly=anomaly),
        progress=False,
    )
    _same(_weights(result), oracle)
    (event,) = [r for r in _rows(tmp_path) if r.get('anomaly/spike')]
    assert int(event['iter']) == BAD + 1 and float(event['anomaly/zscore']) > 1000


def _two_ranks(tmp, strategy):
    """In each rank: a run with a NaN on rank 1 only at iteration BAD (skip), then the
    oracle without that iteration's samples (of both ranks); returns whether they agree."""
    import os

    from anomaly_data import PoisonedDataset
    from stratagem.loop import train

    rank = int(os.environ['RANK'])
    poison = [BAD * BATCH * 2 + 1]  # rank 1's first sample of iteration BAD
    skip = train(
        _cfg(f'{tmp}/skip', PoisonedDataset(poison=poison, rank=1), strategy=strategy,
             anomaly=dict(nonfinite='skip')),
        progress=False,
    )  # fmt: skip
    drop = range(BAD * BATCH * 2, (BAD + 1) * BATCH * 2)
    ref = train(
        _cfg(f'{tmp}/ref', PoisonedDataset(drop=drop), ITERS - 1, strategy=strategy),
        progress=False,
    )
    a, b = _weights(skip), _weights(ref)
    return rank, all(torch.equal(a[k], b[k]) for k in a), dict(skip['losses'])[BAD + 1]


def test_two_ranks_nan_on_rank_1_skipped_on_both(tmp_path):
    """DDP over gloo: rank 1's NaN poisons the all-reduced gradients of both ranks; both drop
    the update, and both end where the run without those samples ends."""
    got = run_distributed(_two_ranks, nproc=2, args=(str(tmp_path), 'DDPStrategy'), timeout=240)
    assert [(r, same) for r, same, _ in got] == [(0, True), (1, True)]
    assert all(math.isnan(loss) for _, _, loss in got)


@pytest.mark.slow
def test_two_ranks_fsdp_skip(tmp_path):
    got = run_distributed(_two_ranks, nproc=2, args=(str(tmp_path), 'FSDPStrategy'), timeout=300)
    assert [(r, same) for r, same, _ in got] == [(0, True), (1, True)]


CLI_CONFIG = f"""
model = dict(type='MLPClassifier', in_features=8, num_classes=3, hidden=8)
train_dataloader = dict(dataset=__import__('anomaly_data').PoisonedDataset(64, {{poison}}),
                        batch_size={BATCH}, shuffle=False)
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=0.05))
train_cfg = dict(max_iters={ITERS}, log_interval=1, checkpoint_interval=2,
                 anomaly=dict(nonfinite={{action!r}}))
randomness = dict(seed=1)
strategy = dict(type='DDPStrategy', env_kwargs=dict(dist_cfg=dict(backend='gloo', timeout=60)))
"""


@pytest.mark.slow
def test_cli_two_ranks_stop_names_iteration_rank_value_then_resumes(tmp_path):
    """``stratagem train --nproc 2``: a NaN on rank 1 only at iteration BAD; ``stop`` exits
    non-zero with the message, its checkpoint resumes (to the end, as ``skip`` would);
    ``rollback`` ends where that skip ends."""
    poison = f'poison=[{BAD * BATCH * 2 + 1}], rank=1'
    results = {}
    for action in ('stop', 'rollback', 'skip'):
        work = tmp_path / action
        work.mkdir()
        cfg = write_config(work, CLI_CONFIG.format(poison=poison, action=action))
        code, out = finish(start(cfg, work, '--nproc', '2', env=clean_env()))
        if action == 'stop':
            assert code != 0, out[-3000:]
            assert f'stopped at iteration {BAD + 1}: non-finite loss on rank 1 (nan)' in out
            assert (work / f'iter_{BAD + 1}.pth').exists()
            code, out = finish(start(cfg, work, '--nproc', '2', '--resume', env=clean_env()))
        assert code == 0, out[-3000:]
        results[action] = torch.load(work / f'iter_{ITERS}.pth', weights_only=True)['state_dict']
    _same(results['stop'], results['skip'])
    _same(results['rollback'], results['skip'])


def _pipeline_clean(tmp):
    """examples/configs/transformer_pp.py (2 stages, 1F1B) for 6 iterations, with every
    check on and without: no update refused, the same weights."""
    import os

    from stratagem.config import Config

    root = Path(__file__).resolve().parents[1]
    weights = []
    for name, anomaly in (('plain', None), ('checked', dict(nonfinite='stop', spike=dict(
            window=2, zscore=1e6, action='stop')))):  # fmt: skip
        cfg = Config.fromfile(str(root / 'examples/configs/transformer_pp.py'))
        cfg.train_cfg = dict(max_iters=6, log_interval=2, anomaly=anomaly)
        cfg.work_dir = f'{tmp}/{name}'
        cfg.strategy.env_kwargs = dict(dist_cfg=dict(backend='gloo'))
        result = train(cfg, progress=False)
        weights.append({k: v.full_tensor() if hasattr(v, 'full_tensor') else v
                        for k, v in result['strategy'].model.state_dict().items()})  # fmt: skip
    return int(os.environ['RANK']), all(
        torch.equal(weights[0][k], weights[1][k]) for k in weights[0]
    )


@pytest.mark.slow
def test_pipeline_checked_run_equals_the_plain_one(tmp_path):
    """Under a pipeline the last stage's loss reaches the guard through after_backward; a
    clean run goes on exactly as without the check, and no rank waits on another."""
    got = run_distributed(_pipeline_clean, nproc=2, args=(str(tmp_path),), timeout=400)
    assert got == [(0, True), (1, True)]
