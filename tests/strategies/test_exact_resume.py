"""Exact resume in a new process, at an accumulation-window boundary and mid-window."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name('resume_worker.py')


def _run(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp('full')
    _run(str(d / 'work'), str(d / 'out.pt'))
    return torch.load(d / 'out.pt', weights_only=True)


@pytest.mark.parametrize('k', [9, 10], ids=['window-boundary', 'mid-window'])
def test_resume_in_new_process_is_bit_exact(tmp_path, uninterrupted, k):
    work = tmp_path / 'work'
    _run(str(work), str(tmp_path / 'first.pt'), '--stop', str(k))
    ckpt = work / f'iter_{k}.pth'
    assert ckpt.is_file()
    _run(str(work), str(tmp_path / 'second.pt'), '--resume', str(ckpt))
    first = torch.load(tmp_path / 'first.pt', weights_only=True)
    second = torch.load(tmp_path / 'second.pt', weights_only=True)
    full = uninterrupted
    for name, value in full['state_dict'].items():
        assert torch.equal(second['state_dict'][name], value), name
    lrs = {**first['lrs'], **second['lrs']}
    assert lrs == full['lrs'] and len(lrs) == 21
    assert torch.equal(second['next_draw'], full['next_draw'])
    # the run really trained: weights moved away from a fresh initialisation's scale
    assert not torch.equal(first['state_dict']['0.weight'], full['state_dict']['0.weight'])
