import pytest
import torch
from torch import nn

from stratagem.optim import get_default_optimizer_params, reduce_param_groups


def test_reduce_param_groups_merges_equal_settings_in_order():
    a, b, c, d = (nn.Parameter(torch.zeros(1)) for _ in range(4))
    groups = [
        {'params': [a], 'lr': 1.0},
        {'params': [b], 'lr': 2.0, 'betas': (0.9, 0.99)},
        {'params': [c], 'lr': 1.0},
        {'params': [d]},
        {'params': [b], 'lr': 3.0},
    ]
    out = reduce_param_groups(groups)
    assert [(g.get('lr'), [id(p) for p in g['params']]) for g in out] == [
        (1.0, [id(a), id(c)]),
        (3.0, [id(b)]),
        (None, [id(d)]),
    ]
    assert out[1]['betas'] == (0.9, 0.99)  # later group overrides lr, keeps betas


def test_reduce_param_groups_with_names_and_unhashable_values():
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    out = reduce_param_groups(
        [
            {'params': [a], 'param_names': ['a'], 'betas': [0.9, 0.99]},
            {'params': [b], 'param_names': ['b'], 'betas': [0.9, 0.99]},
        ]
    )
    assert len(out) == 1 and out[0]['param_names'] == ['a', 'b']
    with pytest.raises(ValueError, match="'params' key"):
        reduce_param_groups([{'lr': 1.0}])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.pos_embed = nn.Parameter(torch.zeros(4))
        self.frozen = nn.Linear(2, 2).requires_grad_(False)


def lookup(model, groups):
    out = {}
    for g in groups:
        for p in g['params']:
            out[id(p)] = {k: v for k, v in g.items() if k != 'params'}
    return {n: out.get(id(p)) for n, p in model.named_parameters()}


def test_get_default_optimizer_params_detectron2_rules():
    model = Net()
    groups = get_default_optimizer_params(
        model,
        base_lr=0.1,
        weight_decay=1e-4,
        weight_decay_norm=0.0,
        bias_lr_factor=2.0,
        weight_decay_bias=0.0,
        lr_factor_func=lambda name: 0.5 if name.startswith('fc.') else 1.0,
        overrides={'pos_embed': {'weight_decay': 0.0}},
    )
    got = lookup(model, groups)
    assert got['conv.weight'] == {'lr': 0.1, 'weight_decay': 1e-4}
    assert got['conv.bias'] == {'lr': 0.2, 'weight_decay': 0.0}
    assert got['bn.weight'] == {'lr': 0.1, 'weight_decay': 0.0}
    assert got['bn.bias'] == {'lr': 0.2, 'weight_decay': 0.0}  # overrides after norm rule
    assert got['fc.weight'] == {'lr': 0.05, 'weight_decay': 1e-4}
    assert got['fc.bias'] == {'lr': 0.2, 'weight_decay': 0.0}  # override replaces the factor
    assert got['pos_embed'] == {'lr': 0.1, 'weight_decay': 0.0}
    assert got['frozen.weight'] is None
    assert len(groups) == 4
    opt = torch.optim.SGD(groups, lr=1.0)
    assert len(opt.param_groups) == 4


def test_get_default_optimizer_params_errors():
    with pytest.raises(ValueError, match='needs base_lr'):
        get_default_optimizer_params(Net(), bias_lr_factor=2.0)
    with pytest.raises(ValueError, match='conflicts'):
        get_default_optimizer_params(Net(), weight_decay_bias=0.0, overrides={'bias': {'lr': 1}})
    with pytest.raises(ValueError, match='lr_factor_func needs base_lr'):
        get_default_optimizer_params(Net(), lr_factor_func=lambda n: 1.0)
