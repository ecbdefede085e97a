"""Exact resume in a new process, at an accumulation-window boundary and mid-window, from the
checkpoints that the uninterrupted run saved on its way (one run less per case than
stopping a run there)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name('resume_worker.py')


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> None:
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    """The whole run, which also saves at iterations 9 and 10 on its way (what a run stopped
    there saves: the checkpoint is written before the next iteration draws anything)."""
    d = tmp_path_factory.mktemp('full')
    _finish(_start(str(d / 'work'), str(d / 'out.pt'), '--save-at', '9', '--save-at', '10'))
    return torch.load(d / 'out.pt', weights_only=True), d / 'work'


@pytest.fixture(scope='module')
def resumed(request, tmp_path_factory, uninterrupted):
    """``{k: (started resume from iteration k, its output file)}`` for the ``k`` of the
    session's selected tests, started together: each is mostly one process's start-up, so
    two overlap on CI's 2 cores."""
    wanted = {
        item.callspec.params['k']
        for item in request.session.items
        if getattr(item, 'module', None) is request.module
        and item.originalname == 'test_resume_in_new_process_is_bit_exact'
    }
    runs = {}
    for k in sorted(wanted):
        d = tmp_path_factory.mktemp(f'resume{k}')
        ckpt = uninterrupted[1] / f'iter_{k}.pth'
        runs[k] = (_start(str(d / 'work'), str(d / 'second.pt'), '--resume', str(ckpt)), d)
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize('k', [9, 10], ids=['window-boundary', 'mid-window'])
def test_resume_in_new_process_is_bit_exact(uninterrupted, resumed, k):
    from stratagem.checkpoint import load_checkpoint_file

    full, full_work = uninterrupted
    ckpt = full_work / f'iter_{k}.pth'
    assert ckpt.is_file()
    proc, out = resumed[k]
    _finish(proc)
    second = torch.load(out / 'second.pt', weights_only=True)
    for name, value in full['state_dict'].items():
        assert torch.equal(second['state_dict'][name], value), name
    assert len(full['lrs']) == 21
    assert second['lrs'] == {i: lr for i, lr in full['lrs'].items() if i >= k}
    assert torch.equal(second['next_draw'], full['next_draw'])
    # the run really trained: weights moved away from a fresh initialisation's scale
    saved = load_checkpoint_file(ckpt)['state_dict']
    assert not torch.equal(saved['0.weight'], full['state_dict']['0.weight'])
