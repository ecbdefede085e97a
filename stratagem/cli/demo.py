"""``stratagem demo``: train the example classifier and show the loss falling."""

from __future__ import annotations

import argparse
import os
import os.path as osp
import re
import shutil
import statistics
from pathlib import Path

from stratagem.config import Config
from stratagem.loop import train

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / 'examples' / 'configs' / 'classifier.py'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        '--config',
        default=str(DEFAULT_CONFIG),
        help='config to train (default: examples/configs/classifier.py)',
    )
    parser.add_argument(
        '--work-dir',
        default='work_dirs/demo',
        help='where the demo writes logs and checkpoints (emptied first)',
    )


_OURS = re.compile(r'^(last_checkpoint|.*\.pth(\.manifest\.json)?|\d{8}_\d{6})$')


def _clear_previous_demo(work_dir: str) -> None:
    """Empty ``work_dir`` of an earlier demo's files; refuse to touch anything else."""
    if not osp.isdir(work_dir):
        return
    foreign = sorted(name for name in os.listdir(work_dir) if not _OURS.match(name))
    if foreign:
        raise FileExistsError(
            f'demo work dir {work_dir} holds files the demo did not write '
            f'({", ".join(foreign[:5])}); choose another --work-dir'
        )
    shutil.rmtree(work_dir)


def run(args: argparse.Namespace) -> int:
    if not osp.isfile(args.config):
        raise FileNotFoundError(f'demo config not found: {args.config}')
    cfg = Config.fromfile(args.config)
    cfg['work_dir'] = args.work_dir
    _clear_previous_demo(args.work_dir)
    print(f'stratagem demo: training {cfg.model.type} from {args.config}')
    result = train(cfg)
    losses = [v for _, v in result['losses']]
    k = max(1, len(losses) // 4)
    first, last = statistics.mean(losses[:k]), statistics.mean(losses[-k:])
    print('\nloss by logged iteration:')
    peak = max(losses)
    for it, value in result['losses']:
        print(f'  iter {it:5d}  {value:7.4f}  ' + '#' * max(1, round(40 * value / peak)))
    print(
        f'\nmean loss, first quarter {first:.4f} -> last quarter {last:.4f} '
        f'({"falling" if last < first else "NOT falling"})'
    )
    print(f'checkpoints in {result["strategy"].work_dir}')
    return 0 if last < first else 1
