"""``stratagem plot-schedule``: a PNG, a terminal chart, the fallback and the errors."""

from __future__ import annotations

import sys
import textwrap

import pytest

from stratagem.cli import main
from stratagem.scheduler.plot import ascii_chart

CONFIG = textwrap.dedent("""
    optim_wrapper = dict(type='OptimWrapper',
                         optimizer=dict(type='SGD', lr=0.02, momentum=0.9, weight_decay=1e-4))
    param_scheduler = [
        dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=20),
        dict(type='MultiStepLR', by_epoch=True, milestones=[8, 11], gamma=0.1),
        dict(type='CosineAnnealingMomentum', eta_min=0.85, T_max=12, by_epoch=True,
             convert_to_iter_based=True),
    ]
    train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=12, val_interval=1)
""")


@pytest.fixture
def config(tmp_path):
    path = tmp_path / 'retina.py'
    path.write_text(CONFIG)
    return path


def test_png(config, tmp_path, capsys):
    pytest.importorskip('matplotlib')
    out = tmp_path / 'plots' / 'lr.png'
    assert main(['plot-schedule', str(config), '--epoch-length', '10', '--out', str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 10_000
    text = capsys.readouterr().out
    assert '120 iterations, 12 epochs of 10' in text and 'LinearLR, MultiStepLR' in text


def test_ascii(config, capsys):
    assert (
        main(
            ['plot-schedule', str(config), '--epoch-length', '10', '--ascii', '--max-iters', '100']
        )
        == 0
    )
    text = capsys.readouterr().out
    assert 'learning rate' in text and 'momentum' in text and 'epoch' in text
    assert text.count('*') > 100 and '0.02 |' in text


def test_falls_back_to_ascii_without_matplotlib(config, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, 'matplotlib', None)  # import matplotlib -> ImportError
    assert main(['plot-schedule', str(config), '--epoch-length', '10']) == 0
    captured = capsys.readouterr()
    assert 'stratagem[plot]' in captured.err and 'learning rate' in captured.out


def test_config_errors(config, tmp_path, capsys):
    # an iteration-based warm-up in an epoch-based run needs the epoch length
    assert main(['plot-schedule', str(config), '--ascii']) == 2
    assert '--epoch-length' in capsys.readouterr().err
    bad = tmp_path / 'bad.py'
    bad.write_text(
        "optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1))\n"
        "param_scheduler = [dict(type='CosineLR')]\n"
        'train_cfg = dict(by_epoch=False, max_iters=10)\n'
    )
    assert main(['plot-schedule', str(bad), '--ascii']) == 2
    assert "unknown type 'CosineLR'" in capsys.readouterr().err


def test_ascii_chart_shape():
    chart = ascii_chart([1.0] * 5 + [0.1] * 5, width=10, height=4, epoch_length=5, title='t')
    lines = chart.splitlines()
    assert lines[0] == 't'
    assert lines[1].endswith('|*****     ') and lines[4].endswith('|     *****')
    assert '+----+---' in lines[5]
