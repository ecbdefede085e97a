"""Progress of `stratagem train`: periodic whole lines when stderr is not a terminal."""

import io
import re

import pytest

from stratagem.loop import train
from stratagem.progress import LineProgress, logging_above, progress_bar


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_line_progress_prints_whole_lines_every_interval():
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(100, initial=20, desc='train', file=out, interval_s=10, clock=clock)
    for step in range(1, 31):  # one iteration per second for 30 s
        clock.now += 1
        if step == 5:
            bar.set_postfix(loss='0.5000', lr='0.1')
        bar.update()
    bar.close()
    bar.close()  # a second close prints nothing
    lines = out.getvalue().split('\n')
    assert '\r' not in out.getvalue() and lines[-1] == ''
    # at 10, 20 and 30 s: 1 it/s over 80 remaining iterations
    assert lines[:-1] == [
        'train 30/100  30% | 1.00 it/s | 0:10<1:10 | loss=0.5000, lr=0.1',
        'train 40/100  40% | 1.00 it/s | 0:20<1:00 | loss=0.5000, lr=0.1',
        'train 50/100  50% | 1.00 it/s | 0:30<0:50 | loss=0.5000, lr=0.1',
    ]  # close() after the line of the same count adds none


def test_line_progress_close_prints_the_last_count_and_long_runs_show_hours():
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(10_000, file=out, interval_s=60, clock=clock)
    clock.now += 30
    bar.update(3)  # before the first interval: nothing yet
    assert out.getvalue() == ''
    bar.close()
    # 9,997 left at 0.1 it/s: 99,970 s
    assert out.getvalue() == 'train 3/10000   0% | 0.10 it/s | 0:30<27:46:10\n'
    with pytest.raises(ValueError, match='interval_s must be >= 0 seconds, got -1'):
        LineProgress(10, file=out, interval_s=-1)


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_is_tqdm_only_on_a_terminal():
    import logging

    from tqdm import tqdm

    lines = progress_bar(10, 0, file=io.StringIO())
    assert isinstance(lines, LineProgress)
    bar = progress_bar(10, 0, file=FakeTerminal())
    assert isinstance(bar, tqdm)
    bar.close()
    logger = logging.getLogger('stratagem.test_progress')
    with logging_above(lines, logger):  # nothing to redirect for lines
        assert logger.handlers == []


def test_train_prints_lines_not_redraws_when_stderr_is_not_a_terminal(tmp_path, capsys):
    cfg = dict(
        model=dict(type='MLPClassifier', in_features=4, num_classes=2, hidden=8),
        train_dataloader=dict(
            dataset=dict(
                type='SyntheticClassification', num_samples=32, num_features=4, num_classes=2
            ),
            batch_size=8,
        ),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
        train_cfg=dict(max_iters=6, log_interval=3),
        work_dir=str(tmp_path),
    )
    train(cfg)
    err = capsys.readouterr().err  # pytest's capture is not a terminal
    assert '\r' not in err
    final = [line for line in err.splitlines() if line.startswith('train ')]
    assert len(final) == 1  # a short run: the last line only
    assert re.fullmatch(
        r'train 6/6 100% \| [\d.]+ it/s \| 0:\d\d<0:00 \| '
        r'loss=\d\.\d{4}, lr=0\.1, epoch=2, samples_s=\d+',  # epochs 1-based
        final[0],
    ), final[0]


def test_count_progress_redraws_on_a_terminal_and_writes_lines_into_a_pipe():
    from stratagem.progress import count_progress

    tty = FakeTerminal()
    progress = count_progress('verifying', tty)
    for done in (1, 2, 3):
        progress(done, 3)
    bars = tty.getvalue().split('\r')[1:]
    assert [b.split()[-1] for b in bars] == ['1/3', '2/3', '3/3']  # redrawn in place
    assert tty.getvalue().endswith(f'verifying [{"#" * 30}] 3/3\n')
    # a pipe: no carriage return; a line every interval_s (here 10 s of a fake clock) + the end
    now = [0.0]
    pipe = io.StringIO()
    progress = count_progress('verifying', pipe, interval_s=10, clock=lambda: now[0])
    for done in range(1, 5):
        now[0] = 6.0 * done  # 6, 12, 18, 24 s
        progress(done, 4)
    assert '\r' not in pipe.getvalue()
    assert pipe.getvalue().splitlines() == [
        f'verifying [{"#" * 15}{"." * 15}] 2/4',  # 12 s: the first after 10 s
        f'verifying [{"#" * 30}] 4/4',  # 24 s (also the end)
    ]
