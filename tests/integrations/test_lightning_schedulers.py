"""Lr schedulers from ``configure_optimizers`` under the Trainer on a backend that steps an
optimizer it builds (FSDP's over the sharded parameters, fairscale's OSS) or steps through
an engine (DeepSpeed's): moved onto that optimizer with their state, they give the lr
sequence and the weights of Lightning's own ``'ddp'``, and a resume from the Trainer's
checkpoint continues the uninterrupted run (``lightning_scheduler_worker.py``: a warmup
``SequentialLR`` every batch and a ``ReduceLROnPlateau`` on the logged loss every 2
batches; 10 steps, a save at step 5, a resume from it).

First tier: FSDPStrategy in this process, one process (sharded over one rank: the
optimizer is still rebuilt over the DTensors). Slow tier: FSDPStrategy, DeepSpeedStrategy
(ZeRO-2 over the torch optimizer) and ShardedDDPStrategy on 2 processes, against 'ddp' in
the same launches (about 4 minutes here).
"""

from __future__ import annotations

import pytest

pytest.importorskip('lightning')

import torch
from lightning_worker import SAVE_AT, STEPS

TOL = 1e-6  # float32: a sharded gradient is reduced in another order than DDP's all-reduce


def _load(out, kind: str, phase: str, rank: int = 0) -> dict:
    return torch.load(out / f'{kind}-{phase}-rank{rank}.pt')


def _assert_weights(ours: dict, theirs: dict, what: str, tol: float = 0.0) -> None:
    assert ours.keys() == theirs.keys(), what
    for key in ours:
        err = (ours[key] - theirs[key]).abs().max().item()
        assert err <= tol, f'{what} {key}: max |difference| {err:.3g} > {tol}'


def _assert_as_ddp_and_resumed(out, kind: str, ranks: int, tol: float) -> None:
    for rank in range(ranks):
        first, reference = _load(out, kind, 'first', rank), _load(out, 'ddp', 'first', rank)
        assert len(first['lrs']) == STEPS
        # the lr each step used, on the optimizer that steps: the schedulers drove it
        assert torch.equal(first['lrs'], reference['lrs']), (kind, rank)
        assert len(set(first['lrs'].tolist())) >= 5  # warmup, steps and plateau cuts
        err = (first['losses'] - reference['losses']).abs().max().item()
        assert err <= tol, f'{kind} rank {rank}: losses differ by {err:.3g}'
        _assert_weights(first['params'], reference['params'], f'{kind} rank {rank}', tol)
        # the resume continues the uninterrupted run: the same lrs, losses and weights
        resumed = _load(out, kind, 'resume', rank)
        assert torch.equal(resumed['lrs'], first['lrs'][SAVE_AT:]), (kind, rank)
        assert torch.equal(resumed['losses'], first['losses'][SAVE_AT:]), (kind, rank)
        _assert_weights(resumed['params'], first['params'], f'{kind} resumed, rank {rank}')


@pytest.fixture
def one_process(clean_env):
    """The Trainer in this process, on one device; the process group it starts, gone after."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_fsdp_moves_the_schedulers_and_matches_ddp_and_its_resume(tmp_path, one_process):
    from lightning_scheduler_worker import fit

    fit(tmp_path, 'ddp', 'first', devices=1)
    fit(tmp_path, 'fsdp', 'first', devices=1)
    fit(tmp_path, 'fsdp', 'resume', devices=1)
    _assert_as_ddp_and_resumed(tmp_path, 'fsdp', ranks=1, tol=0.0)


@pytest.fixture(scope='module')
def two_processes(tmp_path_factory):
    """Both launches, every sharding backend and 'ddp' one after the other in them."""
    pytest.importorskip('deepspeed')
    pytest.importorskip('fairscale')
    from lightning_scheduler_worker import launch

    out = tmp_path_factory.mktemp('schedulers')
    launch(out, ('fsdp', 'deepspeed', 'sharded', 'ddp'))
    return out


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['fsdp', 'deepspeed', 'sharded'])
def test_sharding_backends_on_two_processes_match_ddp_and_resume(kind, two_processes):
    _assert_as_ddp_and_resumed(two_processes, kind, ranks=2, tol=TOL)
    first = [_load(two_processes, kind, 'first', rank) for rank in (0, 1)]
    assert not torch.equal(first[0]['losses'], first[1]['losses'])  # each rank its batches
    _assert_weights(first[0]['params'], first[1]['params'], 'the ranks hold one model')


def test_a_scheduler_that_cannot_be_moved_is_refused_before_wrapping(tmp_path, one_process):
    from lightning.pytorch import Trainer
    from lightning_scheduler_worker import Scheduled

    from stratagem.integrations.lightning import StratagemStrategy

    class Closure:
        def __init__(self, optimizer):
            self.optimizer = optimizer  # Lightning asks for it; the closure holds it too

            def step():
                for group in optimizer.param_groups:
                    group['lr'] *= 0.5

            self.step = step

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    class Unmovable(Scheduled):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [{'scheduler': Closure(optimizer)}]

        def lr_scheduler_step(self, scheduler, metric):
            scheduler.step()

    trainer = Trainer(
        accelerator='cpu',
        devices=1,
        strategy=StratagemStrategy(dict(type='FSDPStrategy', work_dir=str(tmp_path))),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Unmovable()
    why = r'FSDPStrategy steps .*\.Closure holds its optimizer in Closure\.step \(a closure'
    with pytest.raises(ValueError, match=why + r'.*self\.optimizer.*DDPStrategy'):
        trainer.fit(module)
    assert not any(type(p).__name__ == 'DTensor' for p in module.parameters())  # not wrapped


def test_auto_scale_lr_with_a_scheduler_is_refused_saying_how_to_scale(tmp_path, one_process):
    """The scheduler's base lr is the unscaled one: its next step would undo the scaling
    (measured before: lrs 0.2, 0.1, 0.1 for a constant LambdaLR over lr=0.1 scaled x2)."""
    from lightning.pytorch import Trainer
    from lightning_scheduler_worker import Scheduled

    from stratagem.integrations.lightning import StratagemStrategy

    scale = dict(enable=True, base_batch_size=4)
    cfg = dict(type='DDPStrategy', work_dir=str(tmp_path), auto_scale_lr=scale)
    trainer = Trainer(
        accelerator='cpu',
        devices=1,
        strategy=StratagemStrategy(cfg),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    why = r'auto_scale_lr=.* \(ReduceLROnPlateau, SequentialLR\), .* drop auto_scale_lr'
    with pytest.raises(ValueError, match=why):
        trainer.fit(Scheduled())
