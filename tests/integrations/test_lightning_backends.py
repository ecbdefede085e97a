"""Fabric and the Trainer on stratagem's sharding backends: FSDPStrategy (FSDP2, shard=2),
DeepSpeedStrategy (ZeRO-2 over the script's torch optimizer) and ShardedDDPStrategy
(fairscale's OSS), each against Lightning's own ``'ddp'`` running the same script
(``lightning_worker.py``: 2 processes, gloo, CPU, 10 steps of SGD with momentum, a save at
step 5, a resume from it in a new torchrun launch).

Slow tier (``make test-slow``): one launch pair costs about as much as the whole of
test_fabric.py and test_lightning.py; those keep DDPStrategy, bit for bit, in the first tier.

What holds:
- every loss of the first run and of the resumed one, on both ranks, equals 'ddp''s within
  ``TOL``: a sharded gradient is reduced in another order than DDP's all-reduce (float32);
- the resumed run continues exactly: its losses and final weights are the uninterrupted
  run's steps 6..10 and final weights, bit for bit;
- the final weights equal 'ddp''s within ``TOL`` and are the same on both ranks.
"""

from __future__ import annotations

import pytest

pytest.importorskip('lightning')
pytest.importorskip('deepspeed')
pytest.importorskip('fairscale')

import torch
from lightning_worker import SAVE_AT, STEPS, launch_both, load_results

pytestmark = pytest.mark.slow

KINDS = ('fsdp', 'deepspeed', 'sharded', 'ddp')
TOL = 1e-6  # float32: measured up to 6e-8 on the losses, 1.2e-7 on the weights


@pytest.fixture(scope='module')
def out(tmp_path_factory):
    return launch_both(tmp_path_factory, KINDS)


def _assert_close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        err = (a[k] - b[k]).abs().max().item()
        assert err <= TOL, f'{what} {k}: max |difference| {err:.3g} > {TOL}'


@pytest.mark.parametrize('part', ['fabric', 'trainer'])
@pytest.mark.parametrize('kind', ['fsdp', 'deepspeed', 'sharded'])
def test_trains_saves_and_resumes_as_lightning_ddp(out, part, kind):
    runs = load_results(out, part, KINDS)
    for phase in ('first', 'resume'):
        for rank in (0, 1):
            ours, theirs = runs[kind, phase, rank], runs['ddp', phase, rank]
            assert len(ours['losses']) == (STEPS if phase == 'first' else STEPS - SAVE_AT)
            err = (ours['losses'] - theirs['losses']).abs().max().item()
            assert err <= TOL, f'{phase} rank {rank}: losses differ by {err:.3g}'
            _assert_close(ours['params'], theirs['params'], f'{phase} rank {rank}')
    for rank in (0, 1):  # the resume is exact: the uninterrupted run's steps 6..10
        first, resumed = runs[kind, 'first', rank], runs[kind, 'resume', rank]
        assert torch.equal(first['losses'][SAVE_AT:], resumed['losses']), rank
        assert all(torch.equal(first['params'][k], resumed['params'][k]) for k in first['params'])
    # each rank read its own batches, and the ranks hold one model
    first0, first1 = runs[kind, 'first', 0], runs[kind, 'first', 1]
    assert not torch.equal(first0['losses'], first1['losses'])
    assert all(torch.equal(first0['params'][k], first1['params'][k]) for k in first0['params'])
