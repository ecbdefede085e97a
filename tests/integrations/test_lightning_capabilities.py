"""The Lightning adapters ask a backend's capabilities and share one set-up path
(``stratagem.integrations.fabric.setup_for_host``), which runs ``prepare``'s post-steps.

The run (``capabilities_worker.py``, 2 processes under ``torchrun``, gloo, CPU; in the
torchrun launch of lightning_worker.py that test_fabric.py and test_lightning.py read, after
its runs):
Fabric on FSDPStrategy and on a subclass of it; ``auto_scale_lr`` with accumulation under
Fabric and under the Trainer, each on DDPStrategy and on FSDPStrategy; ``auto_scale_lr``
with ``fabric.setup`` before the per-process batch is known.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip('lightning')

import torch
from capabilities_worker import ACC, BASE, BATCH, LR, MICRO_STEPS, STEPS
from torch import nn

from stratagem.integrations.fabric import HostRun, setup_for_host
from stratagem.strategies import SingleDeviceStrategy

WORLD = 2
# auto_scale_lr: lr x real batch / base, the real batch counting the accumulation
SCALED_LR = LR * WORLD * BATCH * ACC / BASE


@pytest.fixture(scope='module')
def out(tmp_path_factory) -> Path:
    from lightning_worker import CAPABILITIES, launch_both

    out = launch_both(tmp_path_factory) / CAPABILITIES
    failed = sorted(out.glob('failed.rank*.txt'))
    if failed:
        raise RuntimeError('\n'.join(f'{p.name}:\n{p.read_text()}' for p in failed))
    return out


def _runs(out: Path, name: str) -> list[dict]:
    return [torch.load(out / f'{name}-rank{rank}.pt') for rank in range(WORLD)]


def _same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_subclass_of_fsdp_takes_the_fsdp_path_under_fabric(out):
    for plain, sub in zip(_runs(out, 'fabric-FSDPStrategy'), _runs(out, 'fabric-SubFSDP')):
        assert sub['strategy'] == 'SubFSDP'
        # sharded parameters, and the optimizer rebuilt over them (not the module's old ones)
        assert sub['dtensor'] and sub['optimizer_holds_model_params']
        assert plain['dtensor'] and plain['optimizer_holds_model_params']
        assert len(sub['losses']) == STEPS
        assert torch.equal(sub['losses'], plain['losses'])
        assert _same_params(sub['params'], plain['params'])
    first, second = _runs(out, 'fabric-SubFSDP')
    assert not torch.equal(first['losses'], second['losses'])  # each rank its own batches
    assert _same_params(first['params'], second['params'])  # one model


@pytest.mark.parametrize('host', ['fabric', 'trainer'])
def test_auto_scale_lr_and_accumulation_agree_between_fsdp_and_ddp(out, host):
    ddp = _runs(out, f'{host}-scaled-DDPStrategy')
    fsdp = _runs(out, f'{host}-scaled-FSDPStrategy')
    for ours, theirs in zip(fsdp, ddp):
        assert ours['lr'] == pytest.approx(SCALED_LR) and theirs['lr'] == pytest.approx(SCALED_LR)
        assert ours['steps'] == theirs['steps'] == MICRO_STEPS // ACC
        assert len(ours['losses']) == len(theirs['losses']) == MICRO_STEPS
        torch.testing.assert_close(ours['losses'], theirs['losses'])
        for key, value in theirs['params'].items():
            torch.testing.assert_close(ours['params'][key], value)


def test_fabric_auto_scale_lr_without_a_micro_batch_names_how_to_give_it(out):
    for run in _runs(out, 'fabric-no-micro-batch'):
        assert 'micro_batch_size=N' in run['error']
        assert 'fabric.setup_dataloaders(loader) before fabric.setup' in run['error']


# ------------------------------------------------------------- one process, no launch
def _run(micro_batch: int | None = None, max_iters: int | None = None) -> HostRun:
    return HostRun(micro_batch, max_iters, 'give micro', 'give length')


def _setup(tmp_path, run: HostRun, wrapper: dict, **cfg):
    strategy = SingleDeviceStrategy(work_dir=str(tmp_path), **cfg)
    module = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    return strategy, *setup_for_host(strategy, cfg, module, optimizer, wrapper, run)


def test_setup_for_host_runs_the_post_steps(tmp_path):
    scale = dict(enable=True, base_batch_size=4)
    strategy, model, wrapper = _setup(
        tmp_path, _run(8, 6), dict(accumulative_counts=3), auto_scale_lr=scale
    )
    assert strategy.optim_wrapper is wrapper and strategy.model is model
    assert wrapper.param_groups[0]['lr'] == pytest.approx(LR * 8 * 3 / 4)  # one process
    assert wrapper.max_counts == 6  # the accumulation counters know the run's length
    assert strategy.dispatch_kwargs == {'train_micro_batch_size_per_gpu': 8, 'max_iters': 6}
    strategy.attach_optim_wrapper(wrapper)  # a second attach does not scale again
    assert wrapper.param_groups[0]['lr'] == pytest.approx(LR * 8 * 3 / 4)


def test_setup_for_host_refuses_what_the_host_does_not_know(tmp_path):
    scale = dict(enable=True, base_batch_size=4)
    with pytest.raises(ValueError, match=r'auto_scale_lr=.* per-process batch .*: give micro'):
        _setup(tmp_path, _run(), {}, auto_scale_lr=scale)
    with pytest.raises(ValueError, match=r'accumulative_counts=2 needs .*: give length'):
        _setup(tmp_path, _run(), dict(accumulative_counts=2))
    # neither needed: nothing asked
    _, _, wrapper = _setup(tmp_path, _run(), {})
    assert wrapper.param_groups[0]['lr'] == LR
