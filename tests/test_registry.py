"""Registry: registration, lookup, lazy entries, parents, build and its error messages."""

import copy

import pytest
import torch

from stratagem.registry import OPTIMIZERS, Registry, RegistryError, build_from_cfg


class Widget:
    def __init__(self, size: int, colour: str = 'red') -> None:
        self.size, self.colour = size, colour


def test_register_as_decorator_and_call_and_get():
    reg = Registry('thing')

    @reg.register_module()
    class A:
        pass

    reg.register_module(name=['B', 'Bee'], module=Widget)
    assert reg.get('A') is A and reg.get('B') is Widget and reg.get('Bee') is Widget
    assert reg.get('nope') is None
    assert 'A' in reg and 'nope' not in reg and len(reg) == 3
    assert repr(reg) == "Registry(name='thing', items=3: A, B, Bee)"


def test_duplicate_name_needs_force():
    reg = Registry('thing')
    reg.register_module(module=Widget)
    with pytest.raises(KeyError, match="'Widget' is already registered in the 'thing' registry"):
        reg.register_module(name='Widget', module=dict)
    reg.register_module(name='Widget', module=dict, force=True)
    assert reg.get('Widget') is dict


def test_build_with_default_args_does_not_mutate_cfg():
    reg = Registry('thing')
    reg.register_module(module=Widget)
    cfg = {'type': 'Widget', 'size': 3}
    before = copy.deepcopy(cfg)
    w = reg.build(cfg, default_args={'colour': 'blue', 'size': 99})
    assert (w.size, w.colour) == (3, 'blue')
    assert cfg == before


def test_build_type_may_be_a_class():
    reg = Registry('thing')
    assert reg.build({'type': Widget, 'size': 5}).size == 5


def test_unknown_type_names_registry_close_match_and_registered():
    with pytest.raises(RegistryError) as info:
        OPTIMIZERS.build({'type': 'AdamX', 'params': [torch.zeros(1, requires_grad=True)]})
    msg = str(info.value)
    assert "unknown type 'AdamX' in the 'optimizer' registry" in msg
    assert "did you mean 'Adam'" in msg or "did you mean 'AdamW'" in msg
    assert 'registered names: ' in msg and 'SGD' in msg
    assert 'registry registered' not in msg


def test_cfg_without_type_says_so():
    reg = Registry('thing')
    reg.register_module(module=Widget)
    with pytest.raises(KeyError, match="cfg for the 'thing' registry has no 'type' key.*Widget"):
        reg.build({'size': 1})


def test_constructor_type_error_names_class_and_offending_keys():
    reg = Registry('thing')
    reg.register_module(module=Widget)
    with pytest.raises(TypeError) as info:
        reg.build({'type': 'Widget', 'size': 1, 'colur': 'x'})
    msg = str(info.value)
    assert "cannot build 'Widget'" in msg
    assert "unexpected key(s) 'colur' (did you mean 'colour'?)" in msg
    assert 'accepted: size, colour' in msg
    with pytest.raises(TypeError, match="missing required key.*'size'"):
        reg.build({'type': 'Widget'})


def test_parent_lookup_and_lazy_registration():
    parent = Registry('root')
    parent.register_module(module=Widget)
    child = Registry('child', parent=parent)
    assert child.get('Widget') is Widget
    assert 'Widget' in child
    child.register_lazy('OD', 'collections:OrderedDict')
    import collections

    assert child.get('OD') is collections.OrderedDict
    with pytest.raises(ValueError, match='module.path:Attr'):
        child.register_lazy('bad', 'collections.OrderedDict')


def test_optimizers_has_every_torch_optimizer():
    names = [
        n
        for n in dir(torch.optim)
        if isinstance(getattr(torch.optim, n), type)
        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != 'Optimizer'
    ]
    for n in names:
        assert OPTIMIZERS.get(n) is getattr(torch.optim, n)
    p = torch.nn.Parameter(torch.ones(2))
    opt = OPTIMIZERS.build({'type': 'SGD', 'lr': 0.5}, default_args={'params': [p]})
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]['lr'] == 0.5


def test_build_from_cfg_rejects_non_mapping():
    with pytest.raises(TypeError, match='must be a dict'):
        build_from_cfg(['type', 'X'], Registry('thing'))
