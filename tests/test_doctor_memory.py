"""`stratagem doctor`'s memory estimate (fake tensors, fake process group, one process) against
the peak of a real CPU step measured the same way (real tensors; DDP and FSDP on 2 gloo
processes, one spawn for the scenarios the selected tests name): within 15%. Sizes parse; a
config over --device-memory is a finding."""

import copy
import functools

import pytest
import torch

from scenarios import Scenarios
from stratagem import doctor
from stratagem.doctor.memory import estimate_memory, measure_step, parse_size

MODEL = dict(type='MLPClassifier', in_features=256, num_classes=8, hidden=512, num_layers=3)
CFG = dict(
    model=MODEL,
    train_dataloader=dict(
        dataset=dict(
            type='SyntheticClassification', num_samples=256, num_features=256, num_classes=8
        ),
        batch_size=64,
    ),
    optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
    train_cfg=dict(max_iters=10),
)
STRATEGIES = {
    'single': dict(type='SingleDeviceStrategy'),
    'ddp': dict(type='DDPStrategy'),
    'fsdp': dict(type='FSDPStrategy', model_wrapper=dict(auto_wrap_policy=['Linear'])),
}
# the real peaks: one process (this one), then DDP and FSDP on 2 gloo processes
SCENARIOS = Scenarios(here=dict(nproc=0), ranks=dict(nproc=2, timeout=240))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 256, generator=g), torch.randint(8, (64,), generator=g)


def _real(name, work_dir):
    """One real step's peak, through the strategy's own prepare (every rank)."""
    from stratagem.strategies import build_strategy

    strategy = build_strategy(dict(STRATEGIES[name], work_dir=work_dir))
    model, wrapper = strategy.prepare(MODEL, optim_wrapper=CFG['optim_wrapper'])[:2]
    return measure_step(model, wrapper, _batch(), fsdp=name == 'fsdp')['peak']


def _real_distributed(work_dir, name):
    from stratagem.env import init_dist

    init_dist('pytorch', backend='gloo')  # once: a later call uses the group
    return _real(name, work_dir)


SCENARIOS.add('here', name='real_single')(functools.partial(_real, 'single'))
for _name in ('ddp', 'fsdp'):
    SCENARIOS.add('ranks', name=f'real_{_name}')(functools.partial(_real_distributed, name=_name))


def _estimate(name, nproc):
    cfg = copy.deepcopy(CFG)
    cfg['strategy'] = STRATEGIES[name]
    return estimate_memory(cfg, nproc, _batch())


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('mem'))


@pytest.mark.parametrize('name,nproc', [('single', 1), ('ddp', 2), ('fsdp', 2)])
@pytest.mark.scenario('real_{name}')
def test_estimate_within_15_percent_of_a_real_step(scenario, name, nproc):
    real_peaks = {name: scenario[0]}  # rank 0's
    estimate = _estimate(name, nproc)
    ratio = estimate.peak / real_peaks[name]
    print(f'{name}: estimate {estimate.peak} real {real_peaks[name]} ratio {ratio:.3f}')
    assert 0.85 <= ratio <= 1.15, (name, estimate, real_peaks[name])
    assert not torch.distributed.is_initialized()


def test_sharding_lowers_the_estimate_by_the_known_factors():
    single = _estimate('single', 1)
    fsdp4 = _estimate('fsdp', 4)
    assert fsdp4.peak < single.peak / 2  # sharded parameters, gradients, optimizer state
    cfg = copy.deepcopy(CFG)
    for stage in (0, 1, 2, 3):
        cfg['strategy'] = dict(type='DeepSpeedStrategy', zero_optimization=dict(stage=stage))
        est = estimate_memory(cfg, 4, _batch())
        assert est.parts['optimizer'] == (
            single.parts['optimizer'] // 4 if stage else single.parts['optimizer']
        )
        assert (est.parts['gradients'] < single.parts['gradients']) == (stage >= 2)
        assert (est.parts['parameters'] < single.parts['parameters']) == (stage == 3)
        assert f'ZeRO-{stage}' in est.method


def test_parse_size():
    assert parse_size('16GiB') == 16 * 2**30
    assert parse_size('80GB') == 80 * 10**9
    assert parse_size('512 MiB') == 512 * 2**20
    assert parse_size('1e9') == 10**9
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError, match="e.g. '16GiB'"):
        parse_size('lots')


def test_device_memory_finding_and_note(tmp_path):
    cfg = dict(copy.deepcopy(CFG), work_dir=str(tmp_path), strategy=STRATEGIES['fsdp'])
    findings, notes = doctor.diagnose(cfg, 2, probe_disk=False, device_memory=parse_size('1MiB'))
    memory = {f.where: f for f in findings}['memory']
    assert 'does not fit --device-memory 1.00 MiB' in memory.problem
    assert 'activation checkpointing' in memory.fix
    assert any(n.startswith('estimated peak memory per device:') for n in notes)
    findings, _ = doctor.diagnose(cfg, 2, probe_disk=False, device_memory=parse_size('16GiB'))
    assert findings == []
    assert not torch.distributed.is_initialized()
