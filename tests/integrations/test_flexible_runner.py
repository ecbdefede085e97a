"""mmengine's FlexibleRunner drives stratagem's strategies: train 3 epochs, resume to 4, and
land exactly where an uninterrupted 4-epoch run lands.

One parametrised test per strategy; each strategy's three runs are a scenario
(tests/scenarios.py): the 2-process strategies' scenarios, and the class-object check, share
one spawn of 2 processes (each spawn costs seconds, mmengine's import included); SingleDevice
runs in a spawn of 1. A strategy that lands later is one more line in ``STRATEGIES``.
"""

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

# not importorskip: the ranks import this module, and must not import mmengine before
# _train_resume_straight has decided about deepspeed
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec('mmengine') is None,
    reason='mmengine is not installed (pip install "stratagem[test]")',
)

from scenarios import Scenarios  # noqa: E402

# name: (strategy type as an mmengine config names it, its extra cfg, number of processes).
# DeepSpeed first in the 2-process spawn: mmengine imports deepspeed when it can, and the
# scenarios after it find it imported instead of blocking it (_train_resume_straight)
STRATEGIES = {
    'SingleDevice': ('stratagem.SingleDeviceStrategy', {}, 1),
    'DeepSpeed-ZeRO2-2ranks': (
        'stratagem.DeepSpeedStrategy',
        dict(zero_optimization=dict(stage=2)),
        2,
    ),
    'DDP-2ranks': ('stratagem.DDPStrategy', {}, 2),
    'FSDP-2ranks': ('stratagem.FSDPStrategy', {}, 2),
    'ShardedDDP-2ranks': ('stratagem.ShardedDDPStrategy', {}, 2),
}
SCENARIOS = Scenarios(one=dict(nproc=1, timeout=240), two=dict(nproc=2, timeout=600))


def _model():
    import torch
    from mmengine.model import BaseModel
    from torch import nn

    class ToyModel(BaseModel):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, inputs, labels, mode='tensor'):
            out = self.head(torch.relu(self.linear(inputs)))
            if mode == 'loss':
                return {'loss': ((out - labels) ** 2).mean()}
            return out

    torch.manual_seed(0)  # the same initial weights in every run and rank
    return ToyModel()


def _dataset():
    import torch

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)
    return [dict(inputs=x[i], labels=y[i]) for i in range(32)]


def _runner(work_dir, strategy, max_epochs, resume=False):
    from mmengine.runner import FlexibleRunner

    import stratagem.integrations.mmengine  # noqa: F401  (allow-list, scoped names)

    distributed = strategy[2] > 1
    work_dir = Path(work_dir)
    return FlexibleRunner(
        model=_model(),
        work_dir=str(work_dir),
        # a name of its own (mmengine's default, a timestamp to the second, is shared by the
        # runners of one process started within a second, and with it their MessageHub):
        # the resumed runner's history then comes from the checkpoint alone
        experiment_name=f'{work_dir.parent.name}_{work_dir.name}_{max_epochs}_{int(resume)}',
        strategy=dict(type=strategy[0], **strategy[1]),
        launcher='pytorch' if distributed else 'none',
        # no env_cfg: FlexibleRunner's default (backend='nccl') must run on a CPU machine
        randomness=dict(seed=3),
        train_dataloader=dict(
            dataset=_dataset(),
            batch_size=4,
            collate_fn=dict(type='default_collate'),
            sampler=dict(type='DefaultSampler', shuffle=True),
        ),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9)),
        param_scheduler=dict(type='MultiStepLR', milestones=[2, 3], end=4),
        train_cfg=dict(by_epoch=True, max_epochs=max_epochs),
        default_hooks=dict(
            checkpoint=dict(type='CheckpointHook', interval=1),
            logger=dict(type='LoggerHook', interval=2),
        ),
        resume=resume,
        log_level='WARNING',
    )


def _values(tensor):
    # a sharded backend holds DTensors: compare the whole tensor (collective, every rank)
    return (tensor.full_tensor() if hasattr(tensor, 'full_tensor') else tensor).tolist()


def _final_state(runner):
    strategy = runner.strategy
    optim = strategy.optim_state_dict()
    return {
        'weights': {k: _values(v) for k, v in strategy.model_state_dict().items()},
        # a sharded optimizer (OSS) gathers its whole state on rank 0 only
        'momentum': [_values(st['momentum_buffer']) for st in optim['state'].values()]
        if 'state' in optim
        else None,
        'lr': [g['lr'] for g in strategy.optim_wrapper.param_groups],
        'schedulers': strategy.scheduler_state_dict(),
        'iter': runner.iter,
        'epoch': runner.epoch,
        'lr_history': runner.message_hub.get_scalar('train/lr').data[0].tolist(),
        'resumed_from': strategy.resumed_from,
        # the loop's train_step ran on the wrapper (forward through it: gradient hooks),
        # and the step's zero_grad left no gradient behind
        'step_on_wrapper': getattr(runner.model.train_step, '__self__', None) is runner.model,
        'grads_left': [
            n
            for n, p in runner.model.named_parameters()
            if p.grad is not None and bool(p.grad.count_nonzero())
        ],
    }


def _train_resume_straight(tmp, name):
    """Every rank: 3 epochs, then a new runner resumes to 4; then 4 epochs in one go (in
    ``<tmp>/<name>``)."""
    strategy = STRATEGIES[name]
    if 'DeepSpeed' not in strategy[0]:
        # mmengine imports deepspeed when it is installed (~4 s per process on the CI machine)
        sys.modules.setdefault('deepspeed', None)
    root = Path(tmp) / name
    _runner(root / 'split', strategy, 3).train()
    resumed = _runner(root / 'split', strategy, 4, resume=True)
    resumed.train()
    straight = _runner(root / 'straight', strategy, 4)
    straight.train()
    # what was saved loads back with weights_only=True, message hub and all (through the
    # backend's reader: a sharded backend writes a directory)
    ckpt = resumed.strategy.checkpointer.storage.read(str(root / 'split' / 'epoch_3.pth'), 'cpu')
    hub = ckpt['message_hub']['log_scalars']['train/lr']
    return {
        'resumed': _final_state(resumed),
        'straight': _final_state(straight),
        'epoch_3_meta': {k: ckpt['meta'][k] for k in ('epoch', 'iter')},
        'epoch_3_lr_history': hub.data[0].tolist(),
        'rank': resumed.rank,
    }


for _name, (_, _, _nproc) in STRATEGIES.items():
    SCENARIOS.add('one' if _nproc == 1 else 'two', name=_name)(
        functools.partial(_train_resume_straight, name=_name)
    )


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('flexible'))


@pytest.mark.parametrize('name', list(STRATEGIES))
@pytest.mark.scenario('{name}')
def test_resume_equals_uninterrupted_run(scenario, name):
    results, nproc = scenario, STRATEGIES[name][2]
    tmp_path = scenario.tmp / name
    iters_per_epoch = 32 // 4 // nproc
    for rank, result in enumerate(results):
        resumed, straight = result['resumed'], result['straight']
        assert result['rank'] == rank
        assert resumed['resumed_from'] == str(tmp_path / 'split' / 'epoch_3.pth')
        assert straight['resumed_from'] is None
        for run in (resumed, straight):
            assert run['step_on_wrapper'], 'step_on_wrapper'
            assert run['grads_left'] == [], 'grads_left'
        assert result['epoch_3_meta'] == {'epoch': 3, 'iter': 3 * iters_per_epoch}
        assert (resumed['iter'], resumed['epoch']) == (4 * iters_per_epoch, 4)
        # bit-exact: weights, momentum buffers, lr, scheduler states, counters
        for key in ('weights', 'momentum', 'lr', 'schedulers', 'iter', 'epoch'):
            assert resumed[key] == straight[key], key
        assert resumed['lr'] == [pytest.approx(0.05 * 0.1 * 0.1)]  # both milestones passed
        # the message hub's history came back through the checkpoint and went on
        assert len(result['epoch_3_lr_history']) == 3 * iters_per_epoch
        assert resumed['lr_history'] == straight['lr_history']
        assert resumed['lr_history'][: 3 * iters_per_epoch] == result['epoch_3_lr_history']
    for name in ('epoch_1.pth', 'epoch_4.pth'):
        path = tmp_path / 'split' / name
        manifest = json.loads(
            (
                path / 'manifest.json' if path.is_dir() else path.with_name(f'{name}.manifest.json')
            ).read_text()
        )
        assert 'mmengine.logging.history_buffer.HistoryBuffer' in manifest['safe_globals']
        assert manifest['world_size'] == nproc
    final = tmp_path / 'split' / 'epoch_4.pth'
    if final.is_dir():  # our state's file inside a directory checkpoint (FSDP, DeepSpeed)
        final = next(
            final / name
            for name in ('extra.pth', 'stratagem_state.pth')
            if (final / name).is_file()
        )
    _check_load_without_integration(final)


def _check_load_without_integration(path):
    """A process that has not imported the integration names what it lacks."""
    from stratagem.checkpoint import UnsafeCheckpointError, get_safe_globals, load_checkpoint_file

    if 'mmengine.logging.history_buffer.HistoryBuffer' in get_safe_globals():
        probe = (
            'from stratagem.checkpoint import load_checkpoint_file\n'
            f'try:\n    load_checkpoint_file({str(path)!r})\n'
            'except Exception as e:\n    print(type(e).__name__, e)'
        )
        out = subprocess.run(
            [sys.executable, '-c', probe], capture_output=True, text=True, check=True
        ).stdout
    else:  # this process has not: check here, which saves starting an interpreter
        with pytest.raises(UnsafeCheckpointError) as info:
            load_checkpoint_file(path)
        out = f'{type(info.value).__name__} {info.value}'
    assert out.startswith('UnsafeCheckpointError')
    assert 'holds mmengine.logging.history_buffer.HistoryBuffer' in out
    assert 'import stratagem.integrations.mmengine' in out


@SCENARIOS.add('two')
def class_object(tmp):
    """Every rank: mmengine's pure-Python config style, the strategy's class object itself
    and no env_cfg (FlexibleRunner's default: nccl), 2 epochs (in ``<tmp>/class_object``)."""
    sys.modules.setdefault('deepspeed', None)
    from stratagem.strategies import DDPStrategy

    runner = _runner(Path(tmp) / 'class_object', (DDPStrategy, {}, 2), 2)
    runner.train()
    return {'rank': runner.rank, 'epoch': runner.epoch, 'world': runner.world_size}


@pytest.mark.scenario('class_object')
def test_class_object_strategy_with_the_default_env_cfg(scenario):
    results, tmp_path = scenario, scenario.tmp / 'class_object'
    assert [(r['rank'], r['epoch'], r['world']) for r in results] == [(0, 2, 2), (1, 2, 2)]
    manifest = json.loads((tmp_path / 'epoch_2.pth.manifest.json').read_text())
    assert manifest['world_size'] == 2
    _check_load_without_integration(tmp_path / 'epoch_2.pth')
