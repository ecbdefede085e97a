"""Every backend declares what it does (``BaseStrategy.capabilities``), and ``stratagem
doctor`` asks it through the registry: a subclass of a backend gets its parent's checks."""

from __future__ import annotations

import dataclasses

import pytest

from stratagem.doctor import checks
from stratagem.doctor.memory import estimate_memory
from stratagem.doctor.mesh import mesh_findings
from stratagem.doctor.sharding import sharding_findings
from stratagem.registry import STRATEGIES
from stratagem.strategies import BaseStrategy, DDPStrategy
from stratagem.strategies.capabilities import Capabilities, capabilities_of
from stratagem.strategies.deepspeed import DeepSpeedStrategy
from stratagem.strategies.fsdp import FSDPStrategy

# what each backend does that code outside it asks
EXPECTED = {
    'SingleDeviceStrategy': Capabilities(),
    'DDPStrategy': Capabilities(gradient_buckets=True),
    'FSDPStrategy': Capabilities(
        replaces_parameters=True, fully_shards=True, device_mesh=True, pipeline=True
    ),
    'DeepSpeedStrategy': Capabilities(
        engine_steps=True, deepspeed_config=True, requires=('deepspeed',)
    ),
    'ShardedDDPStrategy': Capabilities(
        optimizer_from_cfg=True, zero_stage=2, requires=('fairscale',)
    ),
}


class MyFSDP(FSDPStrategy):
    """A user's backend: another name, FSDP's capabilities."""


class MyDeepSpeed(DeepSpeedStrategy):
    """A user's backend: another name, DeepSpeed's capabilities."""


def test_every_registered_backend_declares_its_capabilities():
    ours = {
        name: STRATEGIES.get(name)
        for name in STRATEGIES.names()
        if STRATEGIES.get(name).__module__.startswith('stratagem.')
    }
    assert set(ours) == set(EXPECTED)
    for name, cls in ours.items():
        assert isinstance(cls.__dict__.get('capabilities'), Capabilities), name  # its own
        assert cls.capabilities == EXPECTED[name], name
        assert capabilities_of(name) == EXPECTED[name]
    assert BaseStrategy.capabilities == Capabilities()


def test_capabilities_are_frozen_and_documented():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DDPStrategy.capabilities.gradient_buckets = False  # type: ignore[misc]
    doc = Capabilities.__doc__ or ''
    for field in dataclasses.fields(Capabilities):
        assert f'{field.name}:' in doc, field.name
    assert EXPECTED['FSDPStrategy'].builds_optimizer
    assert EXPECTED['ShardedDDPStrategy'].builds_optimizer
    assert not EXPECTED['DeepSpeedStrategy'].builds_optimizer


def test_capabilities_of_a_cfg_type():
    assert capabilities_of(MyFSDP) == EXPECTED['FSDPStrategy']  # a class, as cfgs may give
    assert capabilities_of('stratagem.DDPStrategy') == EXPECTED['DDPStrategy']  # mmengine's scope
    assert capabilities_of('auto', nproc=2) == EXPECTED['DDPStrategy']  # build_strategy's pick
    assert capabilities_of(None) == EXPECTED['SingleDeviceStrategy']
    assert capabilities_of('NoSuchStrategy') == Capabilities()  # the key check names it
    assert capabilities_of(dict) == Capabilities()


def test_doctor_follows_a_subclass():
    mesh = dict(replicate=3, shard=1)  # product 3, not 2 processes
    for cfg_type in ('FSDPStrategy', MyFSDP):
        found = mesh_findings(dict(type=cfg_type, mesh=mesh), 2, None)
        assert [where for where, *_ in found] == ['strategy.mesh'], cfg_type
        bad_policy = dict(type=cfg_type, model_wrapper=dict(sharding_strategy='NO_SUCH'))
        assert sharding_findings(bad_policy, {}, 2, None), cfg_type
    assert mesh_findings(dict(type='DDPStrategy', mesh=mesh), 2, None) == []
    ddp = dict(type='DDPStrategy', model_wrapper=dict(sharding_strategy='NO_SUCH'))
    assert sharding_findings(ddp, {}, 2, None) == []  # DDP's model_wrapper is not FSDP's
    for cfg_type in ('DeepSpeedStrategy', MyDeepSpeed):  # no clip_grad: it must be 0
        clips = dict(type=cfg_type, gradient_clipping=1.0)
        found = sharding_findings(clips, dict(optimizer=dict(type='SGD')), 2, None)
        assert [where for where, *_ in found] == ['strategy.gradient_clipping'], cfg_type


def test_doctor_packages_come_from_capabilities(monkeypatch):
    monkeypatch.setattr(checks, '_find_spec', lambda name: None)
    for cfg_type, package in ((MyDeepSpeed, 'deepspeed'), ('ShardedDDPStrategy', 'fairscale')):
        doctor = checks.Doctor({'strategy': {'type': cfg_type}}, 2)
        doctor.check_packages()
        fixes = {f.where: f.fix for f in doctor.findings}
        assert fixes['strategy.type'].startswith(f'pip install {package}'), fixes


def test_doctor_memory_estimate_follows_capabilities():
    import torch

    cfg = dict(
        model=dict(type='MLPClassifier', in_features=16, num_classes=4, hidden=64),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
    )
    batch = (torch.randn(8, 16), torch.randint(4, (8,)))
    zero = estimate_memory(dict(cfg, strategy=dict(type='ShardedDDPStrategy')), 4, batch)
    assert 'ZeRO-2' in zero.method  # fairscale's OSS + ShardedDataParallel
    sub = estimate_memory(
        dict(cfg, strategy=dict(type=MyDeepSpeed, zero_optimization=dict(stage=1))), 4, batch
    )
    assert 'DeepSpeed ZeRO-1' in sub.method
