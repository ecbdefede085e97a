"""The reference loop's collaborators on their own (``stratagem.loop``): the triggers and the
orders that ``train`` relies on, with fake strategies, no process group."""

import logging
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from stratagem import checkpoint as ckpt
from stratagem.loop import check_train_config
from stratagem.loop.batches import Batches
from stratagem.loop.checkpoints import Checkpoints
from stratagem.loop.meter import Meter
from stratagem.loop.plan import BestPlan, CheckpointPlan, DataPlan
from stratagem.loop.schedulers import Schedulers
from stratagem.loop.validation import BestCheckpoint

BASE = dict(
    model=dict(type='MLPClassifier'),
    optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
    train_dataloader=dict(dataset=dict(type='RandomClassification'), batch_size=2),
)


def _data_strategy(seed=7):
    return SimpleNamespace(data_parallel_rank=0, data_parallel_size=1, randomness={'seed': seed})


def test_batches_seed_each_epoch_and_a_resume_reads_what_the_whole_run_read():
    data = DataPlan(TensorDataset(torch.arange(10.0)), 2, True, None, {})
    whole = Batches(data, _data_strategy())
    assert (whole.epoch_length, whole.seed_from(_data_strategy())) == (5, 7)
    read = []
    for it in range(15):
        read.append(whole.at(it)[0].tolist())
        # the loader's generator (worker seeds) is seeded with seed + epoch at each epoch
        assert whole.generator.initial_seed() == 7 + it // 5
    assert sorted(sum(read[:5], [])) == [float(i) for i in range(10)]  # each sample once
    assert read[:5] != read[5:10]  # another permutation each epoch
    resumed = Batches(data, _data_strategy())
    resumed.seed_from(_data_strategy())
    assert [resumed.at(it)[0].tolist() for it in range(7, 15)] == read[7:]
    assert resumed.generator.initial_seed() == 7 + 2


def test_batches_refuse_an_epoch_without_a_batch():
    data = DataPlan(TensorDataset(torch.arange(3.0)), 4, False, None, {'drop_last': True})
    with pytest.raises(ValueError, match='yields no batch per epoch: 3 samples.*batch_size=4'):
        Batches(data, _data_strategy())


class _Sched:
    def __init__(self, name, by_epoch, log, need_val_args=False):
        self.name, self.by_epoch, self.log = name, by_epoch, log
        self.need_val_args = need_val_args

    def step(self, values=None):
        self.log.append((self.name, values))


def test_schedulers_step_by_iteration_by_epoch_and_with_the_validation():
    log = []
    it_s, ep_s = _Sched('iter', False, log), _Sched('epoch', True, log)
    plateau = _Sched('plateau', True, log, need_val_args=True)
    schedulers = Schedulers({'a': [it_s, ep_s], 'b': [plateau]}, epoch_length=3)
    for it in range(1, 7):
        schedulers.after_step(it)
    names = [n for n, _ in log]
    assert names.count('iter') == 6
    assert names.count('epoch') == 2 and names.count('plateau') == 2  # at iterations 3 and 6
    assert names[:4] == ['iter', 'iter', 'iter', 'epoch']  # the iteration's before the epoch's
    log.clear()
    schedulers.after_validation({'loss': 0.5})
    assert log == [('plateau', {'loss': 0.5})]


class _SavingStrategy:
    """Records saves, waits and deletions in order; a save commits at the next wait."""

    def __init__(self, work_dir, events):
        self.rank, self.work_dir, self.resumed_from = 0, str(work_dir), None
        self.async_checkpoint, self.events = True, events
        self.logger = logging.getLogger('test')
        self.metas = {}

    def save_checkpoint(self, name, extra_ckpt):
        self.events.append(('save', name))
        self.metas[name] = extra_ckpt['meta']
        return f'{self.work_dir}/{name}'

    def wait_for_checkpoints(self):
        self.events.append(('committed',))


def test_a_new_best_is_committed_before_the_old_one_is_deleted(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(
        ckpt, 'delete_checkpoint', lambda path, protect: events.append(('delete', path, protect))
    )
    strategy = _SavingStrategy(tmp_path, events)
    best = BestCheckpoint(BestPlan('acc', 'greater', (), (), by_epoch=True))
    meter = SimpleNamespace(
        stalls=[],
        add_stall=lambda s: meter.stalls.append(s),
        flush=lambda: None,
        metrics_dir=str(tmp_path / 'log'),
    )
    checkpoints = Checkpoints(strategy, 4, None, 4, 12, best, meter)  # type: ignore[arg-type]
    assert best.due({'acc': 0.5})
    assert best.save(4, {'acc': 0.5}, checkpoints) == 'best acc 0.5000: best_acc_epoch_1.pth'
    assert events == [('save', 'best_acc_epoch_1.pth')]  # no previous best: nothing deleted
    assert not best.due({'acc': 0.4}) and best.due({'acc': 0.75})
    best.save(8, {'acc': 0.75}, checkpoints)
    new = str(tmp_path / 'best_acc_epoch_2.pth')
    assert events[1:] == [
        ('save', 'best_acc_epoch_2.pth'),
        ('committed',),
        ('delete', str(tmp_path / 'best_acc_epoch_1.pth'), [new]),
    ]
    # the periodic save goes through the same save: position and the best so far in its meta
    assert checkpoints.due(8, stop=False) and not checkpoints.due(9, stop=False)
    assert checkpoints.due(9, stop=True) and checkpoints.due(12, stop=False)
    checkpoints.after_step(8)
    assert strategy.metas['iter_8.pth'] == {
        'iter': 8,
        'epoch': 2,
        'metrics_dir': 'log',  # where a resume appends the metrics, relative to work_dir
        'best': {
            'metric': 'acc',
            'rule': 'greater',
            'score': 0.75,
            'checkpoint': 'best_acc_epoch_2.pth',
        },
    }
    assert strategy.metas['iter_8.pth'] == strategy.metas['best_acc_epoch_2.pth']
    assert len(meter.stalls) == 3 and checkpoints.saved_at == 8


def test_checkpoint_interval_in_epochs_and_the_two_settings_that_disagree():
    assert CheckpointPlan(None, (2, True), None).every(epoch_length=5) == 10
    assert CheckpointPlan(None, (-1, True), None).every(epoch_length=5) == 0
    assert CheckpointPlan(3, None, None).every(epoch_length=5) == 3
    assert CheckpointPlan(10, (2, True), None).every(epoch_length=5) == 10
    with pytest.raises(ValueError, match=r'interval=2 \(epochs, 10 iterations\).*=4'):
        CheckpointPlan(4, (2, True), None).every(epoch_length=5)
    plan = check_train_config(
        dict(BASE, train_cfg=dict(max_epochs=3), default_hooks=dict(checkpoint=dict(interval=1)))
    )
    assert (plan.checkpoints.every(4), plan.run_length(4), plan.by_epoch) == (4, (12, 3), True)


def test_a_bad_run_length_is_refused_naming_the_key():
    with pytest.raises(ValueError, match='train_cfg.max_iters must be a whole number'):
        check_train_config(dict(BASE, train_cfg=dict(max_iters=None)))


@pytest.mark.parametrize('device', ['meta', 'cpu'])
def test_the_meter_reads_the_device_once_per_row(tmp_path, monkeypatch, device):
    # 'meta' stands for an accelerator (the values stay where they are until the row's one
    # read); on a CPU the values are in host memory and read as they come, no operation
    strategy = SimpleNamespace(
        rank=0, log_dir=str(tmp_path), data_parallel_size=1, logger=logging.getLogger('test')
    )
    optim_wrapper = SimpleNamespace(get_lr=lambda: {'lr': [0.1]})
    meter = Meter(
        strategy,
        optim_wrapper,
        torch.device(device),
        batch_size=2,
        epoch_length=4,
        max_iters=10,
        start_iter=0,
        log_interval=5,
        by_epoch=False,
        metrics={'tensorboard': False},
        progress=False,
    )
    reads = []
    for name in ('tolist', 'item', '__float__'):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            reads.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    with meter:
        for it in range(1, 11):
            meter.after_step(torch.tensor(float(it)), {'acc': torch.tensor(it / 10)})
            if it == 3:
                assert reads == ([] if device == 'meta' else ['item'] * 6)
            if meter.due(it, stop=False):
                meter.log_row(it)
    if device == 'meta':
        assert reads == ['tolist', 'tolist']  # one host sync per row, none per iteration
    else:
        assert reads == ['item'] * 20  # the values, each once
    assert meter.losses == [(5, 3.0), (10, 8.0)]  # means over each interval
    rows = (tmp_path / 'metrics.csv').read_text().splitlines()
    assert len(rows) == 3 and 'acc' in rows[0]


@pytest.mark.parametrize('async_checkpoint', [False, True], ids=['sync', 'async'])
def test_on_checkpoint_hears_of_each_save_once_committed(tmp_path, async_checkpoint):
    """``train(on_checkpoint=)`` (Ray's report): every save, in order, each committed when
    heard of; an asynchronous one once the next save (or the end) has waited for it."""
    from stratagem.loop import train

    heard = []

    def on_checkpoint(path, iteration):
        # committed when heard of: the manifest is there and verifies
        assert ckpt.verify_checkpoint(path)['step'] == iteration
        heard.append((path.rsplit('/', 1)[-1], iteration))

    cfg = dict(
        BASE,
        model=dict(type='MLPClassifier', in_features=8, num_classes=3, hidden=8),
        train_dataloader=dict(
            dataset=dict(
                type='SyntheticClassification', num_samples=32, num_features=8, num_classes=3
            ),
            batch_size=4,
        ),
        train_cfg=dict(max_iters=7, checkpoint_interval=3),
        work_dir=str(tmp_path),
        strategy=dict(type='SingleDeviceStrategy', async_checkpoint=async_checkpoint),
    )
    train(cfg, progress=False, on_checkpoint=on_checkpoint)
    assert heard == [
        ('iter_3.pth', 3), ('iter_6.pth', 6), ('iter_7.pth', 7)
    ]  # fmt: skip


def test_the_start_line_says_the_real_batch_and_the_lr_scaling():
    from stratagem.loop.run import _start_line

    # 2 data-parallel processes x 16 per process x 2 accumulated: 64, base 16 -> lr x 4
    strategy = SimpleNamespace(
        data_parallel_size=2, auto_scale_lr=dict(enable=True, base_batch_size=16)
    )
    plan = SimpleNamespace(optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05)))
    wrapper = SimpleNamespace(accumulative_counts=2, param_groups=[dict(lr=0.1, initial_lr=0.2)])
    assert _start_line(strategy, plan, wrapper, 16, 0, 100) == (
        'training: iterations 1-100; real batch 64 (2 data-parallel processes x 16 per process '
        'x 2 accumulated); lr 0.05 -> 0.2 (auto_scale_lr: real batch 64 / base_batch_size 16)'
    )
    strategy.auto_scale_lr = None
    wrapper.accumulative_counts = 1
    assert _start_line(strategy, plan, wrapper, 16, 40, 100) == (
        'training: iterations 41-100 (resumed after 40); real batch 32 (2 data-parallel '
        'processes x 16 per process); lr 0.2'
    )


def test_a_resume_appends_to_the_metrics_folder_its_checkpoint_names(tmp_path):
    from stratagem.loop.run import _metrics_dir

    (tmp_path / 'first').mkdir()
    strategy = SimpleNamespace(
        work_dir=str(tmp_path), log_dir=str(tmp_path / 'second'), resumed_from=None
    )
    assert _metrics_dir(strategy, None) == strategy.log_dir  # a fresh run
    assert _metrics_dir(strategy, {'metrics_dir': 'first'}) == str(tmp_path / 'first')
    # outside work_dir, or iterations renumbered by another world size: a new folder
    for meta in (
        {'metrics_dir': '../first'},
        {'metrics_dir': str(tmp_path / 'first')},
        {'metrics_dir': 'first', 'world_size_change': {'iter': [10, 5]}},
    ):
        assert _metrics_dir(strategy, meta) == strategy.log_dir, meta
    same = {'metrics_dir': 'first', 'world_size_change': {'iter': [10, None]}}
    assert _metrics_dir(strategy, same) == str(tmp_path / 'first')
    strategy.resumed_from = str(tmp_path / 'iter_10.pth')  # this work_dir's checkpoint
    assert _metrics_dir(strategy, {'metrics_dir': 'first'}) == str(tmp_path / 'first')
    strategy.resumed_from = str(tmp_path / 'elsewhere' / 'iter_10.pth')  # --resume PATH
    assert _metrics_dir(strategy, {'metrics_dir': 'first'}) == strategy.log_dir
