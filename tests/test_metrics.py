"""The run metrics writer: rows to CSV and TensorBoard event files (read back), token data
detection, nothing written off rank 0, bad keys refused."""

from __future__ import annotations

import csv

import pytest
import torch

from stratagem.metrics import COLUMNS, RunMetrics, peak_memory_mib
from stratagem.throughput import FlopCount, default_num_tokens


def test_default_num_tokens_is_batch_times_time():
    assert default_num_tokens(torch.zeros(4, 16, dtype=torch.long)) == 64
    assert default_num_tokens({'inputs': torch.zeros(4, 8, dtype=torch.int32)}) == 32
    assert default_num_tokens({'input_ids': torch.zeros(2, 5, dtype=torch.long)}) == 10
    assert default_num_tokens((torch.zeros(4, 7, dtype=torch.long), torch.zeros(4))) == 28
    assert default_num_tokens(torch.zeros(4, 16)) is None  # features, not tokens
    assert default_num_tokens({'inputs': torch.zeros(4, 3, 8, dtype=torch.long)}) is None
    assert default_num_tokens([]) is None


def test_rows_go_to_csv_and_tensorboard(tmp_path):
    metrics = RunMetrics(str(tmp_path), samples_per_iter=32, enabled=True, data_parallel_size=2)
    for _ in range(10):  # 10 iterations of 16 x 10 tokens on this rank, as many on the other
        metrics.saw_batch({'inputs': torch.zeros(16, 10, dtype=torch.long)})
    metrics.add_stall(0.25)
    row = metrics.write(10, 0, 2.5, 0.01, torch.tensor(1.5), 10, 2.0, torch.device('cpu'))
    metrics.write(20, 1, 2.0, 0.005, None, 10, 4.0, torch.device('cpu'))
    metrics.close()
    # 10 iterations in 2 s, 32 samples each: 160 samples/s, 1600 tokens/s, 0.2 s a step
    assert row['samples_per_s'] == 160.0 and row['tokens_per_s'] == 1600.0
    assert row['step_time_s'] == pytest.approx(0.2) and row['checkpoint_stall_s'] == 0.25
    assert row['grad_norm'] == 1.5 and row['peak_memory_mib'] > 10
    with open(tmp_path / 'metrics.csv') as f:
        lines = list(csv.DictReader(f))
    assert list(lines[0]) == list(COLUMNS)
    assert [(r['iter'], r['loss'], r['grad_norm'], r['checkpoint_stall_s']) for r in lines] == [
        ('10', '2.5', '1.5', '0.25'),
        ('20', '2.0', '', '0.0'),
    ]
    pytest.importorskip('tensorboard')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / 'tensorboard'))
    events.Reload()
    tags = set(events.Tags()['scalars'])
    assert {'train/loss', 'train/lr', 'train/samples_per_s', 'train/tokens_per_s'} <= tags
    assert [(e.step, e.value) for e in events.Scalars('train/loss')] == [(10, 2.5), (20, 2.0)]
    assert [e.step for e in events.Scalars('train/grad_norm')] == [10]  # absent when None


def test_a_row_built_off_the_thread_is_the_row_write_builds(tmp_path):
    rows = {}
    for how in ('write', 'write_later'):
        metrics = RunMetrics(str(tmp_path / how), samples_per_iter=8, enabled=True,
                             cfg=dict(tensorboard=False))  # fmt: skip
        metrics.set_flops(FlopCount(400, 100, 300, 'counted'))
        for it in (10, 20, 30):
            metrics.add_stall(0.5 * it)
            metrics.write(it, 1, 1.0 / it, 0.1, 2.0, 10, 0.01 * it, torch.device('cpu'),
                          {'acc': it / 100}, later=how == 'write_later')  # fmt: skip
        metrics.flush()  # a checkpoint's commit: every row written, also those built later
        rows[how] = (tmp_path / how / 'metrics.csv').read_text().splitlines()
        last = metrics.last_row
        metrics.close()
        assert last['iter'] == 30 and last['checkpoint_stall_s'] == 15.0
    strip = [[c for i, c in enumerate(r.split(',')) if i != 9] for r in rows['write']]  # peak
    assert [[c for i, c in enumerate(r.split(',')) if i != 9] for r in rows['write_later']] == strip
    assert len(rows['write']) == 4 and 'acc' in rows['write'][0]


def test_other_ranks_write_nothing(tmp_path):
    metrics = RunMetrics(str(tmp_path / 'r1'), samples_per_iter=8, enabled=False)
    metrics.write(1, 0, 1.0, 0.1, None, 1, 0.1, torch.device('cpu'))
    metrics.close()
    assert not (tmp_path / 'r1').exists()


def test_writers_can_be_turned_off_and_keys_are_checked(tmp_path):
    metrics = RunMetrics(
        str(tmp_path), samples_per_iter=8, enabled=True, cfg=dict(csv=False, tensorboard=False)
    )
    metrics.write(1, 0, 1.0, 0.1, None, 1, 0.1, torch.device('cpu'))
    metrics.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"train_cfg.metrics: unknown key\(s\) \['tensorbaord'\]"):
        RunMetrics(str(tmp_path), 8, enabled=True, cfg=dict(tensorbaord=False))


def test_peak_memory_is_the_resident_high_water_mark_on_cpu():
    before = peak_memory_mib(torch.device('cpu'))
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = peak_memory_mib(torch.device('cpu'))
    assert after >= before and after > 64
    del block


def test_stratagem_train_writes_the_rows(tmp_path):
    from stratagem.loop import train

    cfg = dict(
        model=dict(type='MLPClassifier', in_features=8, num_classes=2, hidden=16),
        train_dataloader=dict(
            dataset=dict(
                type='SyntheticClassification', num_samples=64, num_features=8, num_classes=2
            ),
            batch_size=8,
        ),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
        train_cfg=dict(max_iters=10, log_interval=4, checkpoint_interval=5),
        work_dir=str(tmp_path),
    )
    result = train(cfg, progress=False)
    (table,) = tmp_path.glob('*/metrics.csv')
    with open(table) as f:
        rows = list(csv.DictReader(f))
    assert [r['iter'] for r in rows] == ['4', '8', '10']
    assert [float(r['loss']) for r in rows] == pytest.approx([v for _, v in result['losses']])
    assert all(r['grad_norm'] == '' and r['tokens_per_s'] == '' for r in rows)  # no clip, features
    # saves at 5 and 10: a stall in the rows that cover them, none in the first
    assert [float(r['checkpoint_stall_s']) > 0 for r in rows] == [False, True, True]
    for r in rows:
        assert float(r['samples_per_s']) == pytest.approx(8 / float(r['step_time_s']), rel=1e-6)
    # the start line says the real batch; the log's last line why the run ended
    log = next(table.parent.glob('*.log')).read_text().splitlines()
    assert any(line.endswith('training: iterations 1-10; real batch 8; lr 0.1') for line in log)
    assert log[-1].endswith('INFO: run ended: finished, iteration 10/10')

    # a resume from iteration 5 appends to the same file: the row of 8 and 10 re-done, once
    cfg['train_cfg']['max_iters'] = 12
    again = train(cfg, progress=False, resume=str(tmp_path / 'iter_5.pth'))
    assert list(tmp_path.glob('*/metrics.csv')) == [table]
    with open(table) as f:
        rows = list(csv.DictReader(f))
    assert [r['iter'] for r in rows] == ['4', '8', '12']
    assert float(rows[1]['loss']) == pytest.approx(again['losses'][0][1])


def test_a_resumed_run_drops_the_rows_it_redoes_from_csv_and_tensorboard(tmp_path):
    cpu = torch.device('cpu')
    first = RunMetrics(str(tmp_path), samples_per_iter=8, enabled=True)
    for it in (2, 4, 6, 8):
        first.write(it, 1, 10.0 - it, 0.1, None, 2, 0.01, cpu)
    first.write_val(4, 1, {'acc': 0.5})
    first.write_val(8, 1, {'acc': 0.7})
    first.close()
    # resumed from the checkpoint of iteration 5: 6 and 8 are trained again
    second = RunMetrics(str(tmp_path), samples_per_iter=8, enabled=True, resumed_at=5)
    second.write(6, 1, 3.5, 0.1, None, 1, 0.01, cpu)
    second.write_val(6, 1, {'acc': 0.9})
    second.close()
    with open(tmp_path / 'metrics.csv') as f:
        rows = [(r['iter'], r['loss'], r['val/acc']) for r in csv.DictReader(f)]
    assert rows == [
        ('2', '8.0', ''),
        ('4', '6.0', ''),
        ('4', '', '0.5'),
        ('6', '3.5', ''),
        ('6', '', '0.9'),
    ]
    pytest.importorskip('tensorboard')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / 'tensorboard'))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars('train/loss')] == [
        (2, 8.0),
        (4, 6.0),
        (6, 3.5),
    ]
    assert [(e.step, e.value) for e in events.Scalars('val/acc')] == [
        (4, 0.5),
        (6, pytest.approx(0.9)),
    ]


def test_a_run_that_writes_no_row_leaves_no_file(tmp_path):
    RunMetrics(str(tmp_path / 'log'), samples_per_iter=8, enabled=True).close()
    assert not (tmp_path / 'log').exists()


def test_plot_metrics_draws_the_newest_runs_curves(tmp_path, capsys):
    from stratagem.cli import main

    cpu = torch.device('cpu')
    metrics = RunMetrics(
        str(tmp_path / '20260101_000000'), 8, enabled=True, cfg=dict(tensorboard=False)
    )
    for it in range(10, 101, 10):
        metrics.write(it, 1, 1.0 / it, 0.1 * (1 - it / 100), None, 10, 0.1, cpu)
        if it % 50 == 0:
            metrics.write_val(it, 1, {'loss': 2.0 / it, 'acc': it / 100})
    metrics.close()
    assert main(['plot', 'metrics', str(tmp_path), '--ascii']) == 0
    out = capsys.readouterr().out
    for title in ('loss (last 0.01)', 'lr (last 0)', 'val/acc (last 1)', 'val/loss (last 0.02)'):
        assert title in out
    chart = out.split('loss (last 0.01)')[1].split('\n\n')[0].splitlines()
    assert chart[1].strip().startswith('0.1 |*')  # the highest loss, first
    assert chart[10].rstrip().endswith('*') and 'iterations 10..100' in chart[-1]
    pytest.importorskip('matplotlib')
    assert main(['plot', 'metrics', str(tmp_path)]) == 0
    png = tmp_path / '20260101_000000' / 'metrics.png'
    assert capsys.readouterr().out.strip() == f'wrote {png}'
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert main(['plot', 'metrics', str(tmp_path / 'none')]) == 1
    assert 'none does not exist' in capsys.readouterr().err


def test_every_row_reaches_tensorboard_and_new_columns_widen_the_csv(tmp_path):
    metrics = RunMetrics(str(tmp_path), samples_per_iter=8, enabled=True)
    cpu = torch.device('cpu')
    # rows far less than a second apart: buffered, none dropped
    for it in range(1, 6):
        metrics.write(it, 1, 1.0 / it, 0.1, None, 1, 0.01, cpu)
    metrics.write(6, 2, 0.5, 0.1, None, 1, 0.01, cpu, extras={'acc': 0.75})
    metrics.write_val(6, 2, {'loss': 0.25, 'acc': 0.5})
    metrics.close()
    with open(tmp_path / 'metrics.csv') as f:
        lines = list(csv.DictReader(f))
    assert list(lines[0]) == [*COLUMNS, 'acc', 'val/loss', 'val/acc']
    assert [(r['iter'], r['loss'], r['acc'], r['val/loss']) for r in lines] == [
        *[(str(it), str(1.0 / it), '', '') for it in range(1, 6)],
        ('6', '0.5', '0.75', ''),
        ('6', '', '', '0.25'),
    ]
    # a resumed run appends under the widened header
    again = RunMetrics(str(tmp_path), samples_per_iter=8, enabled=True, cfg=dict(tensorboard=False))
    again.write_val(8, 2, {'acc': 0.625})
    again.close()
    with open(tmp_path / 'metrics.csv') as f:
        assert list(csv.DictReader(f))[-1]['val/acc'] == '0.625'
    pytest.importorskip('tensorboard')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / 'tensorboard'))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars('train/loss')] == [
        (it, pytest.approx(1.0 / it)) for it in range(1, 6)
    ] + [(6, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars('train/acc')] == [(6, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars('val/loss')] == [(6, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars('val/acc')] == [(6, 0.5)]
