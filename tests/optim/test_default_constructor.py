import copy

import pytest
import torch
from torch import nn

from stratagem.optim import DefaultOptimWrapperConstructor, OptimWrapper, build_optim_wrapper

BASE_LR, BASE_WD = 0.01, 1e-4


class DeformConv2d(nn.Conv2d):  # recognised by class name, as mmcv's
    def __init__(self):
        super().__init__(2, 2, 3, padding=1)
        self.conv_offset = nn.Conv2d(2, 18, 3, padding=1)


class SubModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.dwconv = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4, 2)
        self.param1 = nn.Parameter(torch.ones(4))


class ExampleModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.param1 = nn.Parameter(torch.ones(1))
        self.conv1 = nn.Conv2d(3, 4, 1, bias=False)
        self.conv2 = nn.Conv2d(4, 2, 1)
        self.bn = nn.BatchNorm2d(2)
        self.embed = nn.Embedding(10, 4)
        self.ln = nn.LayerNorm(4)
        self.sub = SubModel()
        self.dcn = DeformConv2d()
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)


def settings_by_name(model, optimizer, defaults=True):
    by_id = {}
    for group in optimizer.param_groups:
        for p in group['params']:
            assert id(p) not in by_id
            by_id[id(p)] = {k: v for k, v in group.items() if k in ('lr', 'weight_decay')}
    return {n: by_id.get(id(p)) for n, p in model.named_parameters()}


PARAMWISE = dict(
    bias_lr_mult=2.0,
    bias_decay_mult=0.5,
    norm_decay_mult=0.0,
    dwconv_decay_mult=0.1,
    flat_decay_mult=0.3,
    dcn_offset_lr_mult=0.1,
    custom_keys={
        'embed': dict(lr_mult=0.5, decay_mult=0.0),
        'sub.fc': dict(lr_mult=3.0),
        'sub.fc.bias': dict(lr_mult=4.0),
    },
)


def expected_settings():
    lr, wd = BASE_LR, BASE_WD
    return {
        'param1': dict(lr=lr, weight_decay=wd * 0.3),  # flat
        'conv1.weight': dict(lr=lr, weight_decay=wd),
        'conv2.weight': dict(lr=lr, weight_decay=wd),
        'conv2.bias': dict(lr=lr * 2, weight_decay=wd * 0.5),
        'bn.weight': dict(lr=lr, weight_decay=0.0),
        'bn.bias': dict(lr=lr, weight_decay=0.0),  # norm bias: no bias_lr_mult
        'embed.weight': dict(lr=lr * 0.5, weight_decay=0.0),  # custom key
        'ln.weight': dict(lr=lr, weight_decay=0.0),
        'ln.bias': dict(lr=lr, weight_decay=0.0),
        'sub.dwconv.weight': dict(lr=lr, weight_decay=wd * 0.1),
        'sub.dwconv.bias': dict(lr=lr * 2, weight_decay=wd * 0.5),  # bias rule before dwconv
        'sub.gn.weight': dict(lr=lr, weight_decay=0.0),
        'sub.gn.bias': dict(lr=lr, weight_decay=0.0),
        'sub.fc.weight': dict(lr=lr * 3, weight_decay=wd),  # custom key, decay_mult 1
        'sub.fc.bias': dict(lr=lr * 4, weight_decay=wd),  # the longest key wins
        'sub.param1': dict(lr=lr, weight_decay=wd * 0.3),
        'dcn.weight': dict(lr=lr, weight_decay=wd),
        'dcn.bias': dict(lr=lr * 2, weight_decay=wd * 0.5),  # mmengine: the dcn's own bias
        'dcn.conv_offset.weight': dict(lr=lr * 0.1, weight_decay=wd),
        'dcn.conv_offset.bias': dict(lr=lr * 0.1, weight_decay=wd),  # offset rule over bias
        'frozen.weight': None,
        'frozen.bias': None,
    }


@pytest.mark.parametrize('merge', [False, True])
def test_paramwise_multipliers(merge):
    model = ExampleModel()
    cfg = dict(
        optimizer=dict(type='SGD', lr=BASE_LR, weight_decay=BASE_WD, momentum=0.9),
        paramwise_cfg=dict(PARAMWISE, reduce_param_groups=merge),
    )
    before = copy.deepcopy(cfg)
    wrapper = build_optim_wrapper(model, cfg)
    assert cfg == before
    got = settings_by_name(model, wrapper.optimizer)
    want = expected_settings()
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
        else:
            assert got[name] == pytest.approx(want[name], rel=1e-12), name
    distinct = {tuple(sorted(s.items())) for s in want.values() if s is not None}
    n_trainable = sum(s is not None for s in want.values())
    assert len(wrapper.param_groups) == (len(distinct) if merge else n_trainable)
    # custom-key settings are copied into the group, as mmengine does
    embed_group = next(
        g for g in wrapper.param_groups if any(p is model.embed.weight for p in g['params'])
    )
    assert embed_group['lr_mult'] == 0.5 and embed_group['decay_mult'] == 0.0


def test_custom_keys_alphabetical_among_equal_length():
    model = nn.Sequential(nn.Linear(2, 2))
    model.add_module('ab', nn.Linear(2, 2))
    wrapper = build_optim_wrapper(
        model,
        dict(
            optimizer=dict(type='SGD', lr=1.0),
            paramwise_cfg=dict(
                custom_keys={
                    'b.': dict(lr_mult=3.0),
                    'ab': dict(lr_mult=2.0),
                    'a': dict(lr_mult=5.0),
                }
            ),
        ),
    )
    lrs = {n: s['lr'] for n, s in settings_by_name(model, wrapper.optimizer).items()}
    # 'ab' and 'b.' both match 'ab.weight' and have the same length: alphabetical wins
    assert lrs == {'0.weight': 1.0, '0.bias': 5.0, 'ab.weight': 2.0, 'ab.bias': 2.0}


def test_merged_groups_train_like_per_tensor_groups():
    data = torch.randn(4, 3, 5, 5)
    results = []
    for merge in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, groups=4),
            nn.Flatten(),
            nn.Linear(4, 2),
        )
        wrapper = build_optim_wrapper(
            model,
            dict(
                optimizer=dict(type='AdamW', lr=0.01, weight_decay=0.1, foreach=True),
                paramwise_cfg=dict(
                    norm_decay_mult=0.0, bias_decay_mult=0.0, reduce_param_groups=merge
                ),
            ),
        )
        for _ in range(3):
            wrapper.update_params(model(data).square().mean())
        results.append((len(wrapper.param_groups), [p.detach() for p in model.parameters()]))
    (n_merged, merged), (n_split, split) = results
    assert (n_merged, n_split) == (2, 8)
    for a, b in zip(merged, split):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_resnet_like_model_gets_a_handful_of_groups():
    blocks = [nn.Sequential(nn.Conv2d(8, 8, 3, bias=False), nn.BatchNorm2d(8)) for _ in range(20)]
    model = nn.Sequential(*blocks, nn.Linear(8, 10))
    wrapper = build_optim_wrapper(
        model,
        dict(
            optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05),
            paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0),
        ),
    )
    assert len(list(model.parameters())) == 62
    assert [len(g['params']) for g in wrapper.param_groups] == [21, 41]
    assert [g['weight_decay'] for g in wrapper.param_groups] == [0.05, 0.0]


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def test_duplicate_params():
    with pytest.raises(
        ValueError,
        match="'head.weight' is the same tensor as 'embed.weight'.*bypass_duplicate=True",
    ):
        build_optim_wrapper(
            Tied(), dict(optimizer=dict(type='SGD', lr=0.1), paramwise_cfg=dict(bias_lr_mult=2.0))
        )
    with pytest.warns(UserWarning, match='skipped'):
        wrapper = build_optim_wrapper(
            Tied(),
            dict(
                optimizer=dict(type='SGD', lr=0.1),
                paramwise_cfg=dict(bias_lr_mult=2.0, bypass_duplicate=True),
            ),
        )
    assert sum(len(g['params']) for g in wrapper.param_groups) == 1
    plain = build_optim_wrapper(Tied(), dict(optimizer=dict(type='SGD', lr=0.1)))
    assert len(plain.param_groups) == 1 and len(plain.param_groups[0]['params']) == 1


def test_no_paramwise_cfg_one_group_without_frozen():
    model = ExampleModel()
    wrapper = build_optim_wrapper(model, dict(optimizer=dict(type=torch.optim.Adam, lr=0.1)))
    assert len(wrapper.param_groups) == 1
    params = wrapper.param_groups[0]['params']
    assert len(params) == len([p for p in model.parameters() if p.requires_grad])
    assert all(p is not model.frozen.weight for p in params)


@pytest.mark.parametrize(
    'cfg, exc, match',
    [
        (
            dict(optimizer=dict(type='SGD', lr=0.1), paramwise_cfg=dict(norm_decay=0.0)),
            ValueError,
            "'norm_decay' \\(did you mean 'norm_decay_mult'\\?\\)",
        ),
        (
            dict(optimizer=dict(type='SGD', lr=0.1), paramwise_cfg=dict(norm_decay_mult=0.0)),
            ValueError,
            'norm_decay_mult needs a base weight decay.*add weight_decay=',
        ),
        (
            dict(
                optimizer=dict(type='SGD', lr=0.1),
                paramwise_cfg=dict(custom_keys={'x': dict(decay_mult=0.0)}),
            ),
            ValueError,
            "custom_keys\\['x'\\] sets decay_mult",
        ),
        (
            dict(
                optimizer=dict(type='SGD', weight_decay=0.1), paramwise_cfg=dict(bias_lr_mult=2.0)
            ),
            ValueError,
            'bias_lr_mult needs a base lr',
        ),
        (dict(optimizer=dict(type='AdamX', lr=0.1)), KeyError, "did you mean 'Adam'"),
        (dict(optimizer=dict(lr=0.1)), TypeError, "with a 'type' key"),
        (dict(type='OptimWrapper'), ValueError, 'has no optimizer'),
        (dict(optimizer=dict(type='SGD', lr=0.1), paramwise_cfg=[1]), TypeError, 'paramwise_cfg'),
    ],
)
def test_cfg_errors(cfg, exc, match):
    with pytest.raises(exc, match=match):
        build_optim_wrapper(nn.Linear(2, 2), cfg)


def test_frozen_only_model_raises():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match='no trainable parameter'):
        build_optim_wrapper(model, dict(optimizer=dict(type='SGD', lr=0.1)))


def test_constructor_direct_and_built_optimizer():
    model = nn.Linear(2, 2)
    constructor = DefaultOptimWrapperConstructor(
        dict(type='OptimWrapper', optimizer=dict(type='SGD', lr=0.1), accumulative_counts=3)
    )
    wrapper = constructor(model)
    assert isinstance(wrapper, OptimWrapper) and wrapper.accumulative_counts == 3
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    built = build_optim_wrapper(model, dict(optimizer=opt, clip_grad=dict(max_norm=1.0)))
    assert built.optimizer is opt
    assert build_optim_wrapper(model, built) is built


def test_ddp_style_module_is_unwrapped():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    model = Wrapped()
    wrapper = build_optim_wrapper(
        model, dict(optimizer=dict(type='SGD', lr=0.1), paramwise_cfg=dict(bias_lr_mult=2.0))
    )
    names = settings_by_name(model.module, wrapper.optimizer)
    assert names['bias']['lr'] == 0.2
