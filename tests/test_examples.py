"""The examples run as documented."""

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_embed_in_your_loop_trains_and_resumes(tmp_path):
    script = str(ROOT / 'examples' / 'embed_in_your_loop.py')
    work = str(tmp_path / 'w')
    first = subprocess.run(
        [sys.executable, script, '--work-dir', work, '--iters', '40'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert 'iter   40' in first.stdout
    second = subprocess.run(
        [sys.executable, script, '--work-dir', work, '--iters', '60', '--resume'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert 'iter   20' not in second.stdout and 'iter   60' in second.stdout
    meta = torch.load(tmp_path / 'w' / 'iter_60.pth', weights_only=True)['meta']
    assert meta['iter'] == 60
