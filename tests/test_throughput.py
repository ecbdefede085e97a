"""Throughput you can compare: FLOPs counted against the analytic count of known layers, the
tokens hooks (default, configured, the model's), MFU in every row from the row's own numbers
against a labelled peak, and the metrics writer's thread losing no row, at the end or after an
exception."""

from __future__ import annotations

import csv
import logging
import threading

import pytest
import torch
from torch import nn

from stratagem.env.devices import measured_cpu_peak
from stratagem.metrics import RowWriter, RunMetrics, check_metrics_cfg
from stratagem.throughput import count_flops, device_peak, num_tokens_hook

B, IN, HID, OUT = 8, 32, 64, 4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))


def test_flops_of_linear_layers_are_the_analytic_count():
    model = _mlp()
    weights = IN * HID + HID * OUT  # the matmuls' multiply-adds per sample

    x = torch.randn(B, IN, requires_grad=True)  # every input needs its gradient: 6 N P
    _, count = count_flops(lambda: model(x).sum().backward())
    assert count == count.__class__(6 * B * weights, 2 * B * weights, 4 * B * weights, 'counted')

    # a batch of data needs no gradient: the first layer's input gradient is never computed
    model.zero_grad()
    _, count = count_flops(lambda: model(x.detach()).sum().backward())
    assert count.forward == 2 * B * weights
    assert count.backward == 2 * B * weights + 2 * B * HID * OUT
    assert count.total == count.forward + count.backward and count.method == 'counted'

    # no backward seen: 3 x the forward, and it says so
    out, count = count_flops(model, x.detach())
    assert out.shape == (B, OUT)
    assert (count.total, count.backward, count.method) == (6 * B * weights, 0, '3x forward')


def test_the_peak_is_the_table_s_on_a_gpu_and_measured_and_labelled_on_a_cpu(monkeypatch):
    cpu = device_peak(torch.device('cpu'))
    assert cpu is not None and cpu.label == 'mfu(cpu-measured)'
    assert cpu.flops == measured_cpu_peak() > 1e8  # measured once per process
    assert 'measured' in cpu.source and 'GFLOP/s' in cpu.source
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: 'NVIDIA H100 PCIe')
    gpu = device_peak(torch.device('cuda', 0))
    assert gpu is not None and gpu.flops == 756e12 and gpu.label == 'mfu' and 'bf16' in gpu.source
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: 'Tesla V100-SXM2-16GB')
    assert device_peak(torch.device('cuda', 0)).flops == 125e12  # no bf16: its fp16 peak
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: 'Some New Card')
    assert device_peak(torch.device('cuda', 0)) is None  # not guessed
    assert device_peak(torch.device('cuda', 0), configured=500e12).flops == 500e12


class _Counting:
    def num_tokens(self, batch):
        return 7


def test_the_tokens_hook_is_the_configured_one_then_the_model_s_then_the_dataset_s():
    assert num_tokens_hook('builtins.len', _Counting(), _Counting()) == (
        len,
        'train_cfg.metrics.num_tokens',
    )
    hook, source = num_tokens_hook(None, _Counting(), None)
    assert hook([]) == 7 and source == 'model.num_tokens'
    assert num_tokens_hook(None, object(), _Counting())[1] == 'dataset.num_tokens'
    assert num_tokens_hook(None)[1] == 'integer (batch, time) inputs'
    with pytest.raises(ValueError, match="num_tokens='no_such_pkg.count'.*import path"):
        num_tokens_hook('no_such_pkg.count')
    with pytest.raises(TypeError, match='train_cfg.metrics.peak_flops|must be True or False'):
        check_metrics_cfg(dict(flops='yes'))
    with pytest.raises(ValueError, match='peak_flops must be the device peak'):
        check_metrics_cfg(dict(peak_flops=-1))
    with pytest.raises(TypeError, match='num_tokens must be a function'):
        check_metrics_cfg(dict(num_tokens=3))


def test_tokens_per_s_counts_every_batch_by_default_and_by_a_custom_hook(tmp_path):
    cpu = torch.device('cpu')
    metrics = RunMetrics(str(tmp_path / 'a'), 8, enabled=True, data_parallel_size=2,
                         cfg=dict(csv=False, tensorboard=False))  # fmt: skip
    metrics.saw_batch((torch.zeros(4, 16, dtype=torch.long), None))
    metrics.saw_batch((torch.zeros(4, 8, dtype=torch.long), None))  # a shorter batch
    row = metrics.write(2, 1, 1.0, 0.1, None, 2, 2.0, cpu)
    assert row['tokens_per_s'] == (64 + 32) * 2 / 2.0  # this rank's x 2 ranks, per second
    features = RunMetrics(str(tmp_path / 'b'), 8, enabled=True, cfg=dict(csv=False))
    features.saw_batch((torch.zeros(4, 16), None))  # no token data: not asked again
    assert features.write(1, 1, 1.0, 0.1, None, 1, 1.0, cpu)['tokens_per_s'] is None
    # a hook that counts the real tokens: a tensor, summed where it is, read at the row
    masked = RunMetrics(str(tmp_path / 'c'), 8, enabled=True, cfg=dict(
        csv=False, tensorboard=False, num_tokens=lambda b: b['mask'].sum()))  # fmt: skip
    for n in (3, 5):
        masked.saw_batch({'inputs': torch.zeros(2, 4), 'mask': torch.arange(8) < n})
    assert masked.write(2, 1, 1.0, 0.1, None, 2, 4.0, cpu)['tokens_per_s'] == 8 / 4.0
    # a rollback (train_cfg.anomaly) re-does its iterations: their tokens counted once
    masked.saw_batch({'inputs': torch.zeros(2, 4), 'mask': torch.arange(8) < 7})
    masked.drop_tokens()
    masked.saw_batch({'inputs': torch.zeros(2, 4), 'mask': torch.arange(8) < 2})
    assert masked.write(3, 1, 1.0, 0.1, None, 1, 1.0, cpu)['tokens_per_s'] == 2.0


class _Raises(torch.utils.data.Dataset):
    """Token sequences; reading sample ``at`` raises (a run that fails mid-way)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        if i == self.at:
            raise RuntimeError(f'sample {i} is broken')
        x = torch.arange(i, i + 9) % 32
        return x[:-1], x[1:]


def _lm_cfg(tmp_path, **metrics) -> dict:
    return dict(
        model=dict(type='TransformerLM', vocab_size=32, dim=16, depth=1, heads=2, max_len=8),
        train_dataloader=dict(dataset=_Raises(at=-1), batch_size=4, shuffle=False),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
        train_cfg=dict(max_iters=6, log_interval=2, metrics=metrics),
        work_dir=str(tmp_path),
    )


def _rows(tmp_path) -> list[dict]:
    (table,) = tmp_path.glob('*/metrics.csv')
    with open(table) as f:
        return list(csv.DictReader(f))


def test_mfu_and_tokens_in_every_row_from_the_row_s_own_numbers(tmp_path, caplog):
    from stratagem.loop import train

    nonpad = []  # the configured hook, asked once per iteration
    cfg = _lm_cfg(tmp_path, num_tokens=lambda batch: nonpad.append(1) or 4 * 8 - 2)
    with caplog.at_level(logging.INFO, logger='stratagem'):
        train(cfg, progress=False)
    rows = _rows(tmp_path)
    assert [r['iter'] for r in rows] == ['2', '4', '6'] and len(nonpad) == 6
    peak = measured_cpu_peak()
    flops = int(rows[0]['flops_per_iter'])
    assert flops > 0 and {r['flops_per_iter'] for r in rows} == {str(flops)}  # counted once
    for r in rows:
        step = float(r['step_time_s'])
        assert float(r['mfu']) == pytest.approx(flops / step / peak, rel=1e-9)
        assert float(r['tokens_per_s']) == pytest.approx(30 / step, rel=1e-9)
    # the averages: the first row's own, then the rows after it (the warm-up left out)
    assert rows[0]['mfu_avg'] == rows[0]['mfu']
    mean_step = (float(rows[1]['step_time_s']) + float(rows[2]['step_time_s'])) / 2
    assert float(rows[2]['mfu_avg']) == pytest.approx(flops / mean_step / peak, rel=1e-9)
    assert float(rows[2]['tokens_per_s_avg']) == pytest.approx(30 / mean_step, rel=1e-9)
    log = caplog.text
    assert 'tokens counted by train_cfg.metrics.num_tokens' in log
    assert "MFU against this CPU's float32 matmul rate, measured at start" in log
    assert log.count('mfu(cpu-measured) ') == 3 + 1  # every row's line, labelled; the end's
    assert "throughput, the run's average: " in log


def test_every_row_is_written_after_a_run_that_fails(tmp_path):
    from stratagem.loop import train

    cfg = _lm_cfg(tmp_path, flops=False)
    cfg['train_dataloader']['dataset'] = _Raises(at=4 * 6)  # iteration 7's first sample
    cfg['train_cfg']['max_iters'] = 10
    with pytest.raises(RuntimeError, match='sample 24 is broken'):
        train(cfg, progress=False)
    rows = _rows(tmp_path)
    assert [r['iter'] for r in rows] == ['2', '4', '6']
    assert all(r['mfu'] == '' and float(r['tokens_per_s']) > 0 for r in rows)  # flops off


def test_the_rows_are_on_disk_when_a_checkpoint_is_committed(tmp_path):
    from stratagem.loop import train

    cfg = _lm_cfg(tmp_path, flops=False, tensorboard=False)
    cfg['train_cfg']['checkpoint_interval'] = 3
    seen = {}

    def on_checkpoint(path, iteration):  # the writer wakes once a second: this run is shorter
        seen[iteration] = [r['iter'] for r in _rows(tmp_path)]

    train(cfg, progress=False, on_checkpoint=on_checkpoint)
    assert seen == {3: ['2'], 6: ['2', '4']}  # the row of the save's own iteration comes after


def test_the_writer_writes_on_its_own_thread_every_row_in_order_and_raises_its_error():
    written, threads = [], set()

    def write(rows):
        threads.add(threading.current_thread().name)
        written.extend(row['i'] for row in rows)

    writer = RowWriter(write, lambda: None, every_s=60)  # only a flush or the close wakes it
    for i in range(50):
        writer.put({'i': i})
    assert written == []  # handed over, not written by the training thread
    writer.flush()
    assert written == list(range(50)) and threads == {'stratagem-metrics'}
    writer.put({'i': 50})
    writer.close()
    assert written == list(range(51))

    def fails(rows):
        raise OSError(28, 'No space left on device')

    broken = RowWriter(fails, lambda: None, every_s=60, what='run/metrics.csv')
    broken.put({'i': 0})
    with pytest.raises(RuntimeError, match='writing the run/metrics.csv failed: .*No space left'):
        broken.close()


def test_the_event_file_s_checksum_is_tensorboard_s_and_tensorboard_reads_it(tmp_path):
    pytest.importorskip('tensorboard')
    import random

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference

    from stratagem.event_file import EventFile, masked_crc32c

    rng = random.Random(0)
    for n in (0, 1, 7, 8, 300, 4096, 4097):  # 4097: past the position tables
        data = bytes(rng.randrange(256) for _ in range(n))
        assert masked_crc32c(data) == reference(data)
    events = EventFile(str(tmp_path))
    events.add(3, {'train/loss': 0.5, 'val/acc': 0.25})
    events.close()
    read = EventAccumulator(str(tmp_path))
    read.Reload()
    assert [(e.step, e.value) for e in read.Scalars('train/loss')] == [(3, 0.5)]
    assert [(e.step, e.value) for e in read.Scalars('val/acc')] == [(3, 0.25)]


def test_a_writer_s_error_is_raised_at_the_end_and_never_replaces_the_run_s_own(
    tmp_path, monkeypatch, caplog
):
    from types import SimpleNamespace

    from stratagem.loop.meter import Meter

    def fails(self, rows):
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(RunMetrics, '_write_rows', fails)

    def meter():
        strategy = SimpleNamespace(rank=0, log_dir=str(tmp_path), data_parallel_size=1,
                                   logger=logging.getLogger('stratagem.test'))  # fmt: skip
        return Meter(strategy, SimpleNamespace(get_lr=lambda: {'lr': [0.1]}),
                     torch.device('cpu'), batch_size=2, epoch_length=4, max_iters=4, start_iter=0,
                     log_interval=1, by_epoch=False, metrics={'tensorboard': False, 'flops': False},
                     progress=False)  # fmt: skip

    with pytest.raises(RuntimeError, match=r'metrics.csv failed: .*No space left'), meter() as m:
        m.after_step(torch.tensor(1.0), {})
        m.log_row(1)
    with caplog.at_level(logging.ERROR, logger='stratagem.test'):
        with pytest.raises(ValueError, match='the run itself'), meter() as m:
            m.after_step(torch.tensor(1.0), {})
            m.log_row(1)
            raise ValueError('the run itself')
    assert 'No space left on device (the run failed too' in caplog.text
