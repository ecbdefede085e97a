import copy

import pytest
import torch
from torch import nn

from stratagem.optim import OptimWrapper, OptimWrapperDict, build_optim_wrapper


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Linear(3, 3)
        self.discriminator = nn.Linear(3, 1)


def make_dict():
    gan = GAN()
    return gan, OptimWrapperDict(
        generator=OptimWrapper(torch.optim.SGD(gan.generator.parameters(), lr=0.1, momentum=0.5)),
        discriminator=OptimWrapper(torch.optim.Adam(gan.discriminator.parameters(), lr=0.01)),
    )


def test_logging_keys_and_access():
    _, wrappers = make_dict()
    assert wrappers.get_lr() == {'generator.lr': [0.1], 'discriminator.lr': [0.01]}
    assert wrappers.get_momentum() == {'generator.momentum': [0.5], 'discriminator.momentum': [0.9]}
    assert list(wrappers.keys()) == ['generator', 'discriminator']
    assert len(wrappers) == 2 and 'generator' in wrappers
    assert isinstance(wrappers['generator'], OptimWrapper)
    assert [n for n, _ in wrappers.items()] == list(wrappers)
    assert set(wrappers.param_groups) == {'generator', 'discriminator'}
    with pytest.raises(KeyError, match='names: generator, discriminator'):
        wrappers['gen']


def test_step_and_zero_grad_over_all():
    gan, wrappers = make_dict()
    x = torch.randn(2, 3)
    gan.discriminator(gan.generator(x)).sum().backward()
    before = [p.detach().clone() for p in gan.parameters()]
    with pytest.raises(
        NotImplementedError,
        match=r'`step` should be called by each.*'
        r"optim_wrapper\['generator'\].step",
    ):
        wrappers.step()  # as in mmengine: each wrapper steps on its own
    assert all(torch.equal(a, b) for a, b in zip(gan.parameters(), before))
    for wrapper in wrappers.values():
        wrapper.step()
    assert all(not torch.equal(a, b) for a, b in zip(gan.parameters(), before))
    wrappers.zero_grad()
    assert all(p.grad is None for p in gan.parameters())


def test_optim_context_and_update_params_point_to_each_wrapper():
    gan, wrappers = make_dict()
    with pytest.raises(NotImplementedError, match=r"optim_wrapper\['generator'\].optim_context"):
        with wrappers.optim_context(gan):
            pass
    with pytest.raises(NotImplementedError, match='update_params'):
        wrappers.update_params(torch.zeros(()))


def test_state_dict_per_name_round_trip(weights_only_roundtrip):
    gan, wrappers = make_dict()
    gan.discriminator(gan.generator(torch.randn(2, 3))).sum().backward()
    for wrapper in wrappers.values():
        wrapper.step()
    sd = weights_only_roundtrip(wrappers.state_dict())
    assert set(sd) == {'generator', 'discriminator'}
    _, other = make_dict()
    other.load_state_dict(sd)
    assert other['discriminator'].optimizer.state_dict()['state'][0]['step'] == 1
    with pytest.raises(KeyError, match='lacks'):
        other.load_state_dict({'critic': {}})


def test_build_from_named_cfgs():
    gan = GAN()
    cfg = dict(
        generator=dict(optimizer=dict(type='Adam', lr=1e-4, betas=(0.0, 0.999))),
        discriminator=dict(optimizer=dict(type='SGD', lr=4e-4), accumulative_counts=2),
    )
    before = copy.deepcopy(cfg)
    wrappers = build_optim_wrapper(gan, cfg)
    assert cfg == before
    assert isinstance(wrappers, OptimWrapperDict)
    assert wrappers.get_lr() == {'generator.lr': [1e-4], 'discriminator.lr': [4e-4]}
    assert wrappers['discriminator'].accumulative_counts == 2
    assert wrappers['generator'].param_groups[0]['params'][0] is gan.generator.weight
    via_constructor = build_optim_wrapper(
        gan, dict(constructor='MultiOptimWrapperConstructor', **cfg)
    )
    assert list(via_constructor) == ['generator', 'discriminator']


def test_build_from_named_cfgs_errors():
    with pytest.raises(ValueError, match="no submodule 'critic'.*generator, discriminator"):
        build_optim_wrapper(GAN(), dict(critic=dict(optimizer=dict(type='SGD', lr=0.1))))
    with pytest.raises(ValueError, match='each entry must be a wrapper cfg'):
        build_optim_wrapper(GAN(), dict(generator=dict(lr=0.1)))
    with pytest.raises(TypeError, match='optimizer wrappers'):
        OptimWrapperDict(generator=torch.optim.SGD(GAN().parameters(), lr=0.1))
