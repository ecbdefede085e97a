"""The reference loop's validation, save_best and default_hooks: whole-set means (checked
against the checkpoint's weights, 2 processes), when validation runs, the best checkpoint
kept apart from retention, mmengine's hook keys read or refused."""

import csv
import importlib
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from failure_helpers import clean_env, finish, start
from stratagem.data import validation_batches
from stratagem.loop import infer_rule, train

ROOT = Path(__file__).resolve().parents[1]
BYO = ROOT / 'examples' / 'byo'


def _rows(work):
    (table,) = Path(work).glob('*/metrics.csv')
    with open(table) as f:
        return list(csv.DictReader(f))


def _column(rows, name):
    """``{iter: value}`` of the rows that have ``name``."""
    return {int(r['iter']): float(r[name]) for r in rows if r.get(name, '') != ''}


@pytest.fixture
def tinyproj(monkeypatch):
    """examples/byo's ``tinyproj``, imported with its folder on sys.path for this test only."""
    monkeypatch.syspath_prepend(str(BYO))
    return importlib.import_module('tinyproj')


def _byo_means(tinyproj, state_dict):
    """val loss and acc of tinyproj's TinyNet with ``state_dict`` over the whole 50-sample
    set of examples/byo/config.py, in one process, in one batch."""
    model = tinyproj.TinyNet(in_features=8, hidden=32, num_classes=3)
    model.load_state_dict(state_dict)
    data = tinyproj.Blobs(num_samples=50, seed=1)
    with torch.no_grad():
        logits = model.fc2(torch.relu(model.fc1(data.points)))
    loss = F.cross_entropy(logits.double(), data.labels).item()
    acc = (logits.argmax(1) == data.labels).double().mean().item()
    return loss, acc


def test_byo_two_processes_validation_means_best_checkpoint_and_tensorboard(tmp_path, tinyproj):
    """examples/byo/config.py under --nproc 2: 50 validation samples, batch 8: 25 per rank,
    batches of 8, 8, 8 and 1; every mean equals the one computed from the checkpoint's
    weights on the whole set in one process."""
    work = tmp_path / 'work'
    code, out = finish(start(BYO / 'config.py', work, '--nproc', '2', env=clean_env()))
    assert code == 0, out[-4000:]
    rows = _rows(work)
    val_loss, val_acc = _column(rows, 'val/loss'), _column(rows, 'val/acc')
    # 256 samples / (2 x 16) = 8 iterations an epoch, 3 epochs, validation after each
    assert list(val_acc) == [8, 16, 24]
    # the last validation, from the last checkpoint's weights
    final = torch.load(work / 'iter_24.pth', weights_only=True)
    want_loss, want_acc = _byo_means(tinyproj, final['state_dict'])
    assert val_loss[24] == pytest.approx(want_loss, abs=1e-6, rel=0)
    assert val_acc[24] == pytest.approx(want_acc, abs=1e-6, rel=0)
    assert f'val/loss {want_loss:.4f} val/acc {want_acc:.4f}' in out
    assert 'Epoch(train) [1][8/8] iter 8/24' in out and 'Epoch(val) [3][4/4]' in out
    # the training scalar beside the loss is logged too
    assert len(_column(rows, 'acc')) == len(_column(rows, 'loss')) == 3
    assert all(0 <= v <= 1 for v in _column(rows, 'acc').values())

    # save_best='acc' (rule greater): the first highest validation accuracy's checkpoint,
    # the only best left; max_keep_ckpts=2 kept the two newest iteration checkpoints
    best_at, best_acc = max(val_acc.items(), key=lambda r: (r[1], -r[0]))
    best_name = f'best_acc_epoch_{best_at // 8}.pth'
    pth = sorted(p.name for p in work.glob('*.pth'))
    assert pth == sorted([best_name, 'iter_16.pth', 'iter_24.pth'])
    best = torch.load(work / best_name, weights_only=True)
    assert best['meta']['best'] == {
        'metric': 'acc',
        'rule': 'greater',
        'score': best_acc,
        'checkpoint': best_name,
    }
    assert final['meta']['best'] == best['meta']['best']
    assert _byo_means(tinyproj, best['state_dict'])[1] == pytest.approx(best_acc, abs=1e-6, rel=0)

    # TensorBoard holds as many points as the CSV, per column
    pytest.importorskip('tensorboard')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tb,) = work.glob('*/tensorboard')
    events = EventAccumulator(str(tb))
    events.Reload()
    for name in ('loss', 'acc', 'lr', 'val/loss', 'val/acc'):
        tag = name if '/' in name else f'train/{name}'
        points = {e.step: e.value for e in events.Scalars(tag)}
        assert len(events.Scalars(tag)) == len(points)  # one point a row
        assert points == pytest.approx(_column(rows, name), rel=1e-6), name


class Scored(nn.Module):
    """A linear regression; in validation it returns the next of ``scores`` as ``score``
    (one batch per validation, so each validation's mean is that value), in training the
    step's number as ``step``. The forward train runs at its start, before any step (the
    names save_best is checked against), takes no score."""

    def __init__(self, scores):
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.scores = list(scores)
        self.seen = 0
        self.steps = 0

    def forward(self, inputs, targets):
        loss = F.mse_loss(self.fc(inputs).squeeze(1), targets)
        if self.training:  # a training scalar beside the loss: the step's number
            self.steps += 1
            return {'loss': loss, 'step': torch.tensor(float(self.steps))}
        if not self.steps:  # train's check at its start (also a resumed run's)
            return {'loss': loss, 'score': torch.tensor(0.0)}
        self.seen += 1
        return {'loss': loss, 'score': torch.tensor(self.scores[self.seen - 1])}


def _scored_cfg(tmp_path, scores, **checkpoint):
    g = torch.Generator().manual_seed(0)
    return dict(
        model=dict(type=Scored, scores=scores),
        train_dataloader=dict(
            dataset=TensorDataset(torch.randn(8, 2, generator=g), torch.randn(8, generator=g)),
            batch_size=4,
        ),
        val_dataloader=dict(
            dataset=TensorDataset(torch.randn(4, 2, generator=g), torch.randn(4, generator=g)),
            batch_size=4,
        ),
        val_cfg=dict(type='ValLoop'),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
        # by iterations (max_iters): a validation every 2, at 2, 4, 6 and 8
        train_cfg=dict(max_iters=8, val_interval=2, metrics=dict(tensorboard=False)),
        default_hooks=dict(
            checkpoint=dict(
                type='CheckpointHook', interval=2, by_epoch=False, max_keep_ckpts=1, **checkpoint
            ),
            logger=dict(type='LoggerHook', interval=2),
            timer=dict(type='IterTimerHook'),  # the loop's own work: accepted
        ),
        work_dir=str(tmp_path),
    )


@pytest.mark.parametrize(
    'scores, rule, best_at, async_checkpoint',
    [
        ([0.9, 0.5, 0.6, 0.7], 'greater', 2, False),  # the first stays the best through retention
        ([0.5, 0.7, 0.6, 0.9], 'greater', 8, False),  # replaced at 4, then at 8
        ([0.5, 0.7, 0.6, 0.9], 'greater', 8, True),  # the same with asynchronous saves
        ([0.5, 0.7, 0.6, 0.5], 'less', 2, False),  # a tie is no improvement
    ],
)
def test_save_best_keeps_one_best_apart_from_retention(
    tmp_path, scores, rule, best_at, async_checkpoint
):
    cfg = _scored_cfg(tmp_path, scores, save_best='score', rule=rule)
    cfg['strategy'] = dict(type='SingleDeviceStrategy', async_checkpoint=async_checkpoint)
    result = train(cfg, progress=False)
    assert [(it, v['score']) for it, v in result['val']] == [
        (2, pytest.approx(s)) for s in scores[:1]
    ] + [(it, pytest.approx(s)) for it, s in zip((4, 6, 8), scores[1:])]
    best = f'best_score_iter_{best_at}.pth'
    assert sorted(p.name for p in tmp_path.glob('*.pth')) == [best, 'iter_8.pth']
    want = {'metric': 'score', 'rule': rule, 'score': scores[best_at // 2 - 1], 'checkpoint': best}
    assert result['best'] == pytest.approx(want)
    assert torch.load(tmp_path / 'iter_8.pth', weights_only=True)['meta']['best'] == result['best']
    rows = _rows(tmp_path)
    assert _column(rows, 'val/score') == pytest.approx(dict(zip((2, 4, 6, 8), scores)))
    assert [int(r['iter']) for r in rows if r['loss']] == [2, 4, 6, 8]  # logger.interval=2
    # the training scalar: its mean over each log interval (steps 1-2, 3-4, ...)
    assert _column(rows, 'step') == {2: 1.5, 4: 3.5, 6: 5.5, 8: 7.5}


def test_save_best_resumes_with_the_best_so_far(tmp_path):
    cfg = _scored_cfg(tmp_path, [0.9, 0.5, 0.6, 0.7, 0.8, 0.95], save_best='score', rule='greater')
    train(cfg, progress=False)
    cfg['train_cfg']['max_iters'] = 12
    cfg['model']['scores'] = [0.8, 0.95]  # the validations at 10 and 12
    result = train(cfg, resume=True, progress=False)
    # 0.8 at 10 is no improvement on 0.9 (restored from iter_8's meta); 0.95 at 12 is
    assert [it for it, _ in result['val']] == [10, 12]
    # iter_8, resumed from, is never deleted by retention
    assert sorted(p.name for p in tmp_path.glob('*.pth')) == [
        'best_score_iter_12.pth',
        'iter_12.pth',
        'iter_8.pth',
    ]


def _plain_cfg(tmp_path, **train_cfg):
    """A model that returns a bare loss tensor; 10 validation samples in batches of 4, 4, 2."""

    g = torch.Generator().manual_seed(1)
    return dict(
        model=dict(type=PlainRegression),
        train_dataloader=dict(
            dataset=TensorDataset(torch.randn(16, 2, generator=g), torch.randn(16, generator=g)),
            batch_size=4,
        ),
        val_dataloader=dict(
            dataset=TensorDataset(torch.randn(10, 2, generator=g), torch.randn(10, generator=g)),
            batch_size=4,
            sampler=dict(type='DefaultSampler', shuffle=False),
        ),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05)),
        train_cfg=dict(metrics=dict(tensorboard=False), **train_cfg),
        work_dir=str(tmp_path),
    )


class PlainRegression(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 1)

    def forward(self, inputs, targets):
        return F.mse_loss(self.fc(inputs).squeeze(1), targets)


def test_validation_by_epochs_of_a_bare_loss_counts_every_sample_once(tmp_path):
    cfg = _plain_cfg(tmp_path, max_epochs=3, val_interval=2)
    result = train(cfg, progress=False)
    # 4 iterations an epoch: after epoch 2 and at the end (epoch 3)
    assert [it for it, _ in result['val']] == [8, 12]
    assert list(result['val'][-1][1]) == ['loss']  # a bare tensor is the loss
    model = PlainRegression()
    model.load_state_dict(torch.load(tmp_path / 'iter_12.pth', weights_only=True)['state_dict'])
    inputs, targets = cfg['val_dataloader']['dataset'].tensors
    with torch.no_grad():
        want = F.mse_loss(model.fc(inputs).squeeze(1).double(), targets.double()).item()
    # batch means of 4, 4 and 2 samples weighted by their sizes: the mean of the 10
    assert result['val'][-1][1]['loss'] == pytest.approx(want, abs=1e-6, rel=0)
    rows = _rows(tmp_path)
    assert _column(rows, 'val/loss') == pytest.approx({8: result['val'][0][1]['loss'], 12: want})
    assert [r['epoch'] for r in rows if r['val/loss']] == ['2', '3']  # 1-based epochs


def test_validation_by_iterations_from_val_begin(tmp_path):
    result = train(
        _plain_cfg(tmp_path, max_iters=10, by_epoch=False, val_interval=4, val_begin=5),
        progress=False,
    )
    assert [it for it, _ in result['val']] == [8, 10]  # none at 4 (before val_begin), the end


def test_validation_batches_shard_without_padding():
    for n, world, batch in [(50, 2, 8), (10, 4, 3), (3, 4, 2), (7, 1, 7)]:
        shards = [
            validation_batches(n, r, world, batch, shuffle=True, seed=5) for r in range(world)
        ]
        real = [i for shard in shards for idx, w in shard if w for i in idx]
        assert sorted(real) == list(range(n)), (n, world, batch)  # each sample exactly once
        assert len({len(shard) for shard in shards}) == 1  # as many forwards on every rank
        for shard in shards:
            assert all(w in (0, len(idx)) for idx, w in shard)
    # 50 over 2 ranks in batches of 8: 25 each, the last batch of 1
    assert [w for _, w in validation_batches(50, 1, 2, 8)] == [8, 8, 8, 1]
    # 3 samples over 4 ranks: the last rank has only a filler, never counted
    assert validation_batches(3, 3, 4, 2) == [([0, 1], 0)]


def test_rule_inference():
    assert [infer_rule(n) for n in ('acc', 'loss', 'val_loss', 'mIoU', 'accuracy/top1')] == [
        'greater',
        'less',
        'less',
        'greater',
        'greater',
    ]
    assert [infer_rule(n) for n in ('heatmap_loss', 'error_rate', 'mAP', 'f1_score')] == [
        'less',
        'less',
        'greater',
        'greater',
    ]
    assert infer_rule('score', greater_keys=['score']) == 'greater'
    with pytest.raises(ValueError, match=r"higher or a lower 'score'.*rule='greater' or 'less'"):
        infer_rule('score')


def test_default_hooks_and_val_keys_are_read_or_refused(tmp_path):
    cfg = _scored_cfg(tmp_path, [0.5], save_best='score')
    with pytest.raises(ValueError, match=r"higher or a lower 'score'"):
        train(cfg, progress=False)  # no rule, none inferable: before anything is written
    assert not any(tmp_path.iterdir())
    cases = [
        (
            dict(train_cfg=dict(max_iters=2, checkpoint_interval=3)),
            'default_hooks.checkpoint.interval=2',
        ),
        (
            dict(train_cfg=dict(max_iters=2, log_interval=5)),
            r'default_hooks.logger.interval=2 and train_cfg.log_interval=5',
        ),
        (
            dict(train_cfg=dict(max_iters=2, max_keep_ckpts=3)),
            r'default_hooks.checkpoint.max_keep_ckpts=1 and train_cfg.max_keep_ckpts=3',
        ),
        (dict(val_cfg=dict(type='TestLoop')), r"val_cfg.type='TestLoop'"),
        (dict(val_dataloader=None, val_cfg=None), r"save_best='score'.*no val_dataloader"),
    ]
    for change, message in cases:
        cfg = {**_scored_cfg(tmp_path / 'x', [0.5], save_best='score', rule='less'), **change}
        with pytest.raises(ValueError, match=message):
            train(cfg, progress=False)
    bad_loader = _scored_cfg(tmp_path / 'y', [0.5])
    bad_loader['val_dataloader'].update(
        shuffle=True, sampler=dict(type='DefaultSampler', shuffle=False)
    )
    with pytest.raises(
        ValueError, match=r'val_dataloader.shuffle=True and val_dataloader.sampler.shuffle=False'
    ):
        train(bad_loader, progress=False)
    ignored = _scored_cfg(tmp_path / 'z', [0.5, 0.5, 0.5, 0.5])
    ignored['default_hooks']['logger']['ignore_last'] = False
    ignored['default_hooks']['checkpoint']['filename_tmpl'] = 'ckpt_{}.pth'
    with pytest.warns(
        UserWarning,
        match=r'does not honour default_hooks.logger.ignore_last, '
        r'default_hooks.checkpoint.filename_tmpl: ',
    ) as caught:
        train(ignored, progress=False)
    assert len(caught) == 1 and 'timer' not in str(caught[0].message)  # the loop's own work


def test_val_interval_without_validation_is_said(tmp_path):
    cfg = _plain_cfg(tmp_path, max_iters=2, val_interval=2)
    cfg['val_dataloader'] = None
    with pytest.warns(
        UserWarning, match=r'train_cfg.val_interval change nothing: .*no val_dataloader'
    ):
        result = train(cfg, progress=False)
    assert result['val'] == [] and result['best'] is None


def test_mmengine_train_dataloader_sampler_and_collate_are_read(tmp_path):
    """mmengine's ``sampler=dict(type='DefaultSampler', shuffle=True)`` and
    ``collate_fn=dict(type='default_collate')`` train exactly as ``shuffle=True`` does; the
    sampler's ``seed`` reorders the data; what the loop cannot honour is refused, named."""

    def losses(name, **loader):
        cfg = _plain_cfg(tmp_path / name, max_iters=8, log_interval=1)
        cfg['val_dataloader'] = None
        cfg['randomness'] = dict(seed=5)
        cfg['train_dataloader'].update(loader)
        return [v for _, v in train(cfg, progress=False)['losses']]

    plain = losses('plain', shuffle=True)
    mmengine = losses(
        'mm',
        sampler=dict(type='DefaultSampler', shuffle=True),
        collate_fn=dict(type='default_collate'),
    )
    assert mmengine == plain and len(plain) == 8
    assert losses('seeded', sampler=dict(type='InfiniteSampler', shuffle=True, seed=9)) != plain
    assert losses('run_seed', sampler=dict(type='DefaultSampler', seed=5)) == plain
    for loader, message in [
        (dict(collate_fn=dict(type='pseudo_collate')), r"collate_fn=\{'type': 'pseudo_collate'"),
        (dict(sampler=dict(type='DefaultSampler', round_up=False)), r'sampler.round_up=False'),
        (dict(sampler=dict(type='WeightedSampler')), r"sampler.type='WeightedSampler'"),
        (dict(shuffle=False, sampler=dict(shuffle=True)), r'train_dataloader.shuffle=False and'),
        (dict(sampler=dict(type='DefaultSampler', shufle=True)), r"'shufle'"),
    ]:
        cfg = _plain_cfg(tmp_path / 'bad', max_iters=2)
        cfg['train_dataloader'].update(loader)
        with pytest.raises((ValueError, KeyError), match=message):
            train(cfg, progress=False)
    assert not (tmp_path / 'bad').exists()  # refused before anything is written


def test_val_cfg_fp16_validates_under_autocast(tmp_path):
    """mmengine's ``val_cfg=dict(type='ValLoop', fp16=True)``: the validation forwards run
    under autocast (bfloat16 on a CPU): the means move by bfloat16's rounding, no more."""

    def val_means(name, **val_cfg):
        cfg = _plain_cfg(tmp_path / name, max_iters=2)
        cfg['randomness'] = dict(seed=3)
        cfg['val_cfg'] = dict(type='ValLoop', **val_cfg)
        return train(cfg, progress=False)['val'][-1][1]['loss']

    full, half = val_means('fp32'), val_means('fp16', fp16=True)
    assert full != half and abs(full - half) < 0.02 * abs(full)
    assert val_means('off', fp16=False) == full
    with pytest.raises(ValueError, match=r"val_cfg.fp16 must be True or False, got 'yes'"):
        val_means('bad', fp16='yes')
