"""Exact resume in a new process, at an accumulation-window boundary and mid-window, from the
checkpoints that the uninterrupted run saved on its way (one run less per case than
stopping a run there)."""

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
    """The whole run, which also saves at iterations 9 and 10 on its way (what a run stopped
    there saves: the checkpoint is written before the next iteration draws anything)."""
    d = tmp_path_factory.mktemp('full')
    _run(str(d / 'work'), str(d / 'out.pt'), '--save-at', '9', '--save-at', '10')
    return torch.load(d / 'out.pt', weights_only=True), d / 'work'


@pytest.mark.parametrize('k', [9, 10], ids=['window-boundary', 'mid-window'])
def test_resume_in_new_process_is_bit_exact(tmp_path, uninterrupted, k):
    from stratagem.checkpoint import load_checkpoint_file

    full, full_work = uninterrupted
    ckpt = full_work / f'iter_{k}.pth'
    assert ckpt.is_file()
    _run(str(tmp_path / 'work'), str(tmp_path / 'second.pt'), '--resume', str(ckpt))
    second = torch.load(tmp_path / 'second.pt', weights_only=True)
    for name, value in full['state_dict'].items():
        assert torch.equal(second['state_dict'][name], value), name
    assert len(full['lrs']) == 21
    assert second['lrs'] == {i: lr for i, lr in full['lrs'].items() if i >= k}
    assert torch.equal(second['next_draw'], full['next_draw'])
    # the run really trained: weights moved away from a fresh initialisation's scale
    saved = load_checkpoint_file(ckpt)['state_dict']
    assert not torch.equal(saved['0.weight'], full['state_dict']['0.weight'])
