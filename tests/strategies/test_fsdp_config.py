"""FSDPStrategy's config boundary (``fsdp/config.py``, ``fsdp/wrap_policy.py``): mmengine's and
FSDP1's forms of each key, mapped to FSDP2 or refused by name. Plain functions; the 2-rank
prepare with these forms (``prepare_mmengine_forms``) runs in test_fsdp.py's spawn.

The oracle for which modules an FSDP1 policy wraps is FSDP1's own recursive wrap
(``torch.distributed.fsdp.wrap._recursive_wrap``) run with a wrapper that only records.
"""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from stratagem.strategies.fsdp.config import parse_model_wrapper
from stratagem.strategies.fsdp.options import parse_activation_checkpointing, parse_state_dict_cfg

SIZE = 'torch.distributed.fsdp.wrap.size_based_auto_wrap_policy'


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2)  # FSDP1's size policy never looks inside
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.register_buffer('scale', torch.ones(d, dtype=torch.float16))
        self.register_buffer('count', torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        a, _ = self.attn(x, x, x, need_weights=False)
        return x + self.out(torch.relu(self.fc(a))) * self.scale.float()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def is_linear(module):  # a check_fn / predicate policy named by its dotted path
    return type(module) is nn.Linear  # not attention's out_proj (a subclass)


def wide(module, min_out=1):
    return type(module) is nn.Linear and module.out_features >= min_out


def _names(model, modules):
    ids = {id(m) for m in modules}
    return [n for n, m in model.named_modules() if id(m) in ids]


def _fsdp1_picks(model, policy, ignored=()):
    """What FSDP1 wraps: its recursive wrap with a recording wrapper (the root is FSDP's)."""
    from torch.distributed.fsdp.wrap import _recursive_wrap

    picked = []

    def record(module, **kwargs):
        picked.append(module)
        return module

    modules = {s for name in ignored for s in model.get_submodule(name).modules()}
    params = {p for m in modules for p in m.parameters()}
    _recursive_wrap(model, policy, record, modules, params, only_wrap_children=True)
    return _names(model, picked)


def _targets(policy, model, **kw):
    return _names(model, parse_model_wrapper(dict(auto_wrap_policy=policy, **kw)).targets(model))


def test_fsdp1_policy_callables_pick_what_fsdp1_picks():
    net = Net()
    # Block: attn 288, fc 288, out 264 = 840; head: 72 + 18; embed 40; total 1810
    outcomes = set()
    for n in (1, 20, 41, 73, 100, 264, 265, 300, 577, 840, 841, 1000, 1810, 1811):
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=n)
        mine = _targets(policy, net)
        assert mine == _fsdp1_picks(net, policy), n
        assert _targets(dict(type=SIZE, min_num_params=n), net) == mine  # mmengine's dict
        assert _targets(dict(type='size_based', min_num_params=n), net) == mine
        outcomes.add(tuple(mine))
        if n == 265:  # fc (288) fills; attn (288) is a forced leaf (never asked to wrap) and
            # out (264) falls short: the Block takes their 552
            assert mine == ['blocks.0', 'blocks.0.fc', 'blocks.1', 'blocks.1.fc']
        if n == 841:  # blocks hold 840 each; the ModuleList (1680) is never wrapped
            assert mine == []
    assert len(outcomes) >= 6
    # the policy function itself: min_num_params=1e8, nothing here is that big
    assert (
        _targets(size_based_auto_wrap_policy, net)
        == []
        == _fsdp1_picks(net, size_based_auto_wrap_policy)
    )
    layer = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    assert _targets(layer, net) == _fsdp1_picks(net, layer) == ['blocks.0', 'blocks.1']
    assert _targets(ModuleWrapPolicy({Block}), net) == ['blocks.0', 'blocks.1']
    custom = CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features == 2)
    assert _targets(custom, net) == ['head.1']
    with pytest.raises(ValueError, match='per-module FSDP arguments'):
        _targets(CustomPolicy(lambda m: {'sharding_strategy': 1} if m is net.head else False), net)

    def old_style(module, recurse, unwrapped_params, min_num_params=300):  # mmengine's docs
        return recurse or unwrapped_params >= min_num_params

    assert _targets(old_style, net) == ['blocks.0', 'blocks.1']
    # ignored modules: not counted, not entered (FSDP1's rule)
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=60)
    mine = _targets(policy, net, ignored_modules=['blocks.1', 'head'])
    assert mine == _fsdp1_picks(net, policy, ['blocks.1', 'head'])
    assert not any(n.startswith(('blocks.1', 'head')) for n in mine) and 'embed' not in mine
    assert (
        _targets(layer, net, ignored_modules=['blocks.1'])
        == ['blocks.0']
        == _fsdp1_picks(net, layer, ['blocks.1'])
    )
    assert _targets(['Block'], net, ignored_modules=['blocks.0']) == ['blocks.1']
    with pytest.raises(TypeError, match='predicate module -> bool or an FSDP1 policy'):
        parse_model_wrapper(dict(auto_wrap_policy=lambda module, depth: True))


def test_min_num_params_whole_float():
    net = Net()
    cfg = parse_model_wrapper(dict(auto_wrap_policy=dict(type=SIZE, min_num_params=1e7)))
    assert cfg.policy.fn.keywords['min_num_params'] == 10_000_000
    assert type(cfg.policy.fn.keywords['min_num_params']) is int
    assert _targets(dict(type=SIZE, min_num_params=265.0), net) == _targets(
        dict(type=SIZE, min_num_params=265), net
    )
    for bad in (1.5, 0, -3.0, True, '1e7'):
        with pytest.raises(
            ValueError,
            match=r'min_num_params must be a whole number >= 1 .*' + repr(bad).replace('.', r'\.'),
        ):
            parse_model_wrapper(dict(auto_wrap_policy=dict(type=SIZE, min_num_params=bad)))
    with pytest.raises(ValueError, match=r"unknown: \['min_params'\]"):
        parse_model_wrapper(dict(auto_wrap_policy=dict(type=SIZE, min_params=3)))


def test_policy_names_resolve_to_functions():
    net = Net()
    assert _targets(SIZE, net) == []  # the function by its path: min_num_params=1e8
    here = __name__
    assert _targets(f'{here}.is_linear', net) == [
        'embed',
        'blocks.0.fc',
        'blocks.0.out',
        'blocks.1.fc',
        'blocks.1.out',
        'head.0',
        'head.1',
    ]
    assert _targets(dict(type=f'{here}.wide', min_out=32), net) == ['blocks.0.fc', 'blocks.1.fc']
    assert _targets('torch.nn.MultiheadAttention', net) == ['blocks.0.attn', 'blocks.1.attn']
    assert _targets('Block', net) == ['blocks.0', 'blocks.1']  # a class name, as before
    assert _targets(
        dict(
            type='torch.distributed.fsdp.wrap.CustomPolicy',
            lambda_fn=functools.partial(wide, min_out=8),
        ),
        net,
    ) == ['embed', 'blocks.0.fc', 'blocks.0.out', 'blocks.1.fc', 'blocks.1.out', 'head.0']
    with pytest.raises(
        ValueError,
        match=r"\['Blok'\] are not in the model.*'Block'.*"
        r'dotted import path',
    ):
        _targets('Blok', net)
    with pytest.raises(
        ValueError,
        match=r'size_based_auto_wrap_polcy.*has no attribute.*'
        r"module classes are \[.*'Block'.*dotted import path",
    ):
        _targets('torch.distributed.fsdp.wrap.size_based_auto_wrap_polcy', net)
    with pytest.raises(ValueError, match='needs the classes to wrap'):
        _targets('transformer_auto_wrap_policy', net)
    with pytest.raises(TypeError, match='cannot be called as one.*lambda_fn'):
        _targets('torch.distributed.fsdp.wrap.lambda_auto_wrap_policy', net)
    with pytest.raises(ValueError, match=r"unknown type 'nowhere\.policy' \(no module"):
        _targets(dict(type='nowhere.policy'), net)
    assert _targets(dict(type=Block), net) == ['blocks.0', 'blocks.1']
    with pytest.raises(TypeError, match="type 'torch.nn.Linear' is the class Linear, not a"):
        _targets(dict(type='torch.nn.Linear', in_features=3), net)


def test_policy_names_in_mmengine_functions():
    registry = pytest.importorskip('mmengine.registry')
    name = 'stratagem_test_wide_linear'
    registry.FUNCTIONS.register_module(name=name, module=wide, force=True)
    try:
        net = Net()
        assert _targets(dict(type=name, min_out=8), net) == [
            'embed',
            'blocks.0.fc',
            'blocks.0.out',
            'blocks.1.fc',
            'blocks.1.out',
            'head.0',
        ]
        ac = parse_activation_checkpointing(dict(check_fn=name))
        assert _names(net, ac.selector.select(net, set())) == _targets(f'{__name__}.wide', net)
    finally:
        registry.FUNCTIONS._module_dict.pop(name)


def test_ignored_modules_by_submodule_name():
    net = Net()
    cfg = parse_model_wrapper(dict(auto_wrap_policy=['Linear'], ignored_modules=['head']))
    assert cfg.ignored_params(net) == set(net.head.parameters())
    assert _names(net, cfg.targets(net)) == [
        'embed',
        'blocks.0.fc',
        'blocks.0.out',
        'blocks.1.fc',
        'blocks.1.out',
    ]
    for spec, ignored in (
        (['blocks.1.attn', 'embed'], [net.blocks[1].attn, net.embed]),
        ('Block', list(net.blocks)),  # class names and classes still work
        ([nn.MultiheadAttention], [b.attn for b in net.blocks]),
        ([net.head[1]], [net.head[1]]),
    ):  # module objects (mmengine)
        cfg = parse_model_wrapper(dict(ignored_modules=spec))
        assert cfg.ignored_params(net) == {p for m in ignored for p in m.parameters()}, spec
    with pytest.raises(
        ValueError,
        match=r"\['haed'\] name neither.*\(did you mean 'head'\?\)"
        r".*submodule names: \['embed', 'blocks',.*"
        r"module classes: \['Block', 'Linear'",
    ):
        parse_model_wrapper(dict(ignored_modules=['haed'])).ignored_params(net)
    with pytest.raises(ValueError, match='matches the root module'):
        parse_model_wrapper(dict(ignored_modules=['Net'])).ignored_params(net)
    with pytest.raises(ValueError, match='not part of the model'):
        parse_model_wrapper(dict(ignored_modules=[nn.Linear(2, 2)])).ignored_params(net)


def test_activation_checkpointing_forms():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        OffloadWrapper,
    )

    here = __name__
    for cfg, want in (
        (dict(check_fn=f'{here}.is_linear'), 7),
        (dict(check_fn=dict(type=f'{here}.wide', min_out=32)), 2),
        (dict(check_fn=dict(type=wide, min_out=8)), 6),
        (dict(check_fn=['Block']), 2),
        ('Block', 2),
        (is_linear, 7),
        (dict(module_classes=[nn.MultiheadAttention]), 2),
        (dict(auto_wrap_policy=dict(type=SIZE, min_num_params=265)), 4),
    ):
        net = Net()
        ac = parse_activation_checkpointing(cfg)
        chosen = ac.selector.select(net, set())
        assert len(chosen) == want, cfg
        blocks = list(net.blocks)
        targets = ac.apply(net, blocks)
        wrapped = [m for m in net.modules() if isinstance(m, CheckpointWrapper)]
        assert {id(w._checkpoint_wrapped_module) for w in wrapped} == {id(m) for m in chosen}
        for block, target in zip(blocks, targets):  # a wrapped target comes back as its wrapper
            assert target is (net.blocks[blocks.index(block)] if block in chosen else block)
            assert (target is not block) == (block in chosen)
    # dict(type=fn, **args) binds args (mmengine binds the outer dict's keys: its bug)
    ac = parse_activation_checkpointing(dict(check_fn=dict(type=wide, min_out=32)))
    assert ac.selector.fn.keywords == {'min_out': 32}
    net, ref = Net(), Net()
    ac = parse_activation_checkpointing(
        dict(
            check_fn=['Block'],
            checkpoint_wrapper_fn='torch.distributed.algorithms._checkpoint.checkpoint_wrapper.'
            'offload_wrapper',
        )
    )
    targets = ac.apply(net, [net.blocks[0], net.head])
    assert isinstance(targets[0], OffloadWrapper) and targets[0] is net.blocks[0]
    assert targets[1] is net.head
    x = torch.randn(3, 5, 4)
    torch.testing.assert_close(net(x), ref(x), rtol=0, atol=0)
    for bad, match in (
        (dict(check_fn='CustomCheckFn'), r"\['CustomCheckFn'\] are not in"),
        (
            dict(check_fn=dict(type='CustomCheckFn', arg1=1)),
            r"check_fn: unknown type 'CustomCheckFn' \(not a dotted import path",
        ),
        (dict(check_fn=dict(arg1=1)), 'needs type'),
        (dict(check_fn=['Block'], checkpointing=1), r"got \['check_fn', "),
        (dict(checkpoint_wrapper_fn=is_linear), 'takes one of check_fn'),
        (dict(check_fn=is_linear, auto_wrap_policy=SIZE), 'takes one of'),
        (
            dict(check_fn=is_linear, checkpoint_wrapper_fn='nowhere.wrap'),
            r"checkpoint_wrapper_fn='nowhere\.wrap'",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            parse_activation_checkpointing(bad).selector.select(Net(), set())


def test_fsdp1_mixed_precision():
    mp = parse_model_wrapper(
        dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    ).mp_policy
    assert (mp.param_dtype, mp.reduce_dtype, mp.output_dtype, mp.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        None,
        True,
    )
    mp = parse_model_wrapper(
        dict(
            mixed_precision=MixedPrecision(
                param_dtype=torch.float16, cast_root_forward_inputs=False
            )
        )
    ).mp_policy
    assert (mp.param_dtype, mp.reduce_dtype, mp.cast_forward_inputs) == (torch.float16, None, False)
    mp = parse_model_wrapper(
        dict(mixed_precision=dict(param_dtype='bfloat16', cast_forward_inputs=False))
    ).mp_policy
    assert mp.cast_forward_inputs is False  # FSDP2's key keeps its own meaning
    # buffer_dtype float32 (mmengine's docstring example): floating buffers become float32
    for form in (
        dict(param_dtype='float16', buffer_dtype='float32', reduce_dtype='float32'),
        MixedPrecision(param_dtype=torch.float16, buffer_dtype=torch.float32),
    ):
        cfg = parse_model_wrapper(dict(mixed_precision=form))
        assert (cfg.mp_policy.param_dtype, cfg.buffer_dtype) == (torch.float16, torch.float32)
        net = Net()
        cfg.cast_buffers(net)
        assert [b.dtype for b in net.buffers()] == [torch.float32, torch.int64] * 2
        assert torch.equal(net.blocks[0].scale, torch.ones(8))
    for form, match in (
        (MixedPrecision(buffer_dtype=torch.bfloat16), 'buffer_dtype'),
        (dict(buffer_dtype='float16'), 'buffer_dtype'),
        (MixedPrecision(keep_low_precision_grads=True), 'keep_low_precision_grads'),
        (dict(param_dtype='bfloat16', buffer='float32'), r"\['buffer'\]"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_model_wrapper(dict(mixed_precision=form))
    with pytest.raises(TypeError, match='mixed_precision=3'):
        parse_model_wrapper(dict(mixed_precision=3))


def test_state_dict_cfg_dict_without_type_is_local():
    assert parse_state_dict_cfg(None, dict()) == 'sharded'
    assert (
        parse_state_dict_cfg(None, dict(state_dict_config=dict(type='LocalStateDictConfig')))
        == 'sharded'
    )
    assert parse_state_dict_cfg('sharded', dict(optim_state_dict_config={})) == 'sharded'
    assert parse_state_dict_cfg(None, dict(state_dict_type=StateDictType.FULL_STATE_DICT)) == 'full'
    with pytest.raises(ValueError, match='disagree'):
        parse_state_dict_cfg('full', dict(state_dict_config={}))
    with pytest.raises(ValueError, match=r"unknown state_dict_cfg key\(s\) \['state_dict_typ'\]"):
        parse_state_dict_cfg(None, dict(state_dict_typ='FULL_STATE_DICT'))


def test_sharding_strategy_typo():
    with pytest.raises(
        ValueError,
        match=r"unknown model_wrapper.sharding_strategy 'FULL_SHARDD'"
        r"; did you mean 'FULL_SHARD'\? valid: 'FULL_SHARD'"
        r".*'SHARD_GRAD_OP'",
    ):
        parse_model_wrapper(dict(sharding_strategy='FULL_SHARDD'))
    with pytest.raises(ValueError, match=r'unknown .*sharding_strategy 1; valid'):
        parse_model_wrapper(dict(sharding_strategy=1))
    with pytest.raises(ValueError, match='hybrid sharding needs a 2-D mesh'):
        parse_model_wrapper(dict(sharding_strategy='HYBRID_SHARD'))
    assert (
        parse_model_wrapper(
            dict(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
        ).reshard_after_forward
        is False
    )
    assert parse_model_wrapper(dict(sharding_strategy='FULL_SHARD')).reshard_after_forward is True


def prepare_mmengine_forms(work_dir):
    """prepare() with FSDP1's forms: which modules are sharded, what stays plain, one step. In
    every rank of test_fsdp.py's first spawn (its test is there: one start of processes less)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from stratagem.strategies import build_strategy
    from stratagem.strategies.fsdp.grad_sync import clean_name

    strategy = build_strategy(
        dict(
            type='FSDPStrategy',
            work_dir=str(work_dir),
            model_wrapper=dict(
                type='MMFullyShardedDataParallel',
                sharding_strategy='SHARD_GRAD_OP',
                auto_wrap_policy=functools.partial(
                    transformer_auto_wrap_policy, transformer_layer_cls={Block}
                ),
                ignored_modules=[
                    'head'
                ],  # plain parameters meet the blocks' output: no param_dtype
                mixed_precision=MixedPrecision(
                    reduce_dtype=torch.float32, buffer_dtype=torch.float32
                ),
            ),
            activation_checkpointing=dict(check_fn=f'{__name__}.is_linear'),
            state_dict_cfg=dict(state_dict_config=dict(type='LocalStateDictConfig')),
        )
    )
    model, wrapper = strategy.prepare(Net(), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)))
    sharded = [clean_name(n) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    plain = sorted(clean_name(n) for n, p in model.named_parameters() if not isinstance(p, DTensor))
    before = [
        model.head[1].weight.detach().clone(),
        model.blocks[0].fc.weight.to_local().detach().clone(),
    ]
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(strategy.rank))
    wrapper.update_params(model(x).square().mean())
    after = [model.head[1].weight, model.blocks[0].fc.weight.to_local()]
    return dict(
        sharded=sharded,
        plain=plain,
        state_dict_type=strategy.state_dict_type,
        buffers=sorted({str(b.dtype) for b in model.buffers()}),
        reduce=str(model.blocks[0]._get_fsdp_state()._mp_policy.reduce_dtype),
        checkpointed=sorted(
            clean_name(n)
            for n, m in model.named_modules()
            if type(m).__name__ == 'CheckpointWrapper'
        ),
        changed=[not torch.equal(a, b) for a, b in zip(before, after)],
    )
