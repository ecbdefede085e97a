"""examples/flexible_runner.py runs as the README says: 3 epochs, then --resume to 4."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec('mmengine') is None,
    reason='mmengine is not installed (pip install "stratagem[test]")',
)
ROOT = Path(__file__).resolve().parents[2]


def _run(work, *args):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
        ),
    )
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / 'examples' / 'flexible_runner.py'),
            '--work-dir',
            str(work),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


def test_example_trains_then_resumes(tmp_path):
    work = tmp_path / 'w'
    assert 'finished at epoch 3, iter 24' in _run(work, '--epochs', '3')
    second = _run(work, '--epochs', '4', '--resume')
    assert 'resumed epoch: 3, iter: 24' in second and 'Epoch(train) [1]' not in second
    assert 'finished at epoch 4, iter 32' in second
    ckpt = torch.load(work / 'epoch_4.pth', weights_only=False)  # plain torch.load reads it
    assert (ckpt['meta']['epoch'], ckpt['meta']['iter']) == (4, 32)
    manifest = json.loads((work / 'epoch_4.pth.manifest.json').read_text())
    assert manifest['step'] == 32 and 'safe_globals' in manifest
    assert (work / 'last_checkpoint').read_text().strip() == str(work / 'epoch_4.pth')
