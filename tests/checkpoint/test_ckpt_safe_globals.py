"""Allow-listed classes in checkpoints: saved and loaded with weights_only=True, recorded in
the manifest, named when missing; everything else refused at save, arbitrary pickles at load."""

import json
import os
import pickle
import timeit
import types
from collections import defaultdict

import pytest
import torch

from stratagem.checkpoint import (
    UnsafeCheckpointError,
    add_safe_globals,
    get_safe_globals,
    load_checkpoint_file,
    safe_globals,
    save_checkpoint,
)
from stratagem.checkpoint.content import validate_checkpoint_content


class Point:
    """A class a host trainer might keep in its checkpoint (plain state in __dict__)."""

    def __init__(self, xy, count):
        self.xy, self.count = xy, count


class Unlisted:
    def __init__(self):
        self.value = 1


class _Touch:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f'touch {self.marker}',)


POINT = f'{Point.__module__}.Point'


def _manifest(path):
    return json.loads((path.parent / f'{path.name}.manifest.json').read_text())


def test_allow_listed_class_saves_and_loads_weights_only(tmp_path):
    state = {
        'state_dict': {'w': torch.arange(3.0)},
        'hub': {'p': Point(torch.tensor([1.5, -2.0]), 7), 'q': [Point(None, 0)]},
    }
    with safe_globals([Point]):
        assert POINT in get_safe_globals()
        assert validate_checkpoint_content(state) == [POINT]
        path = save_checkpoint(state, tmp_path / 'a.pth', step=3)
        loaded = load_checkpoint_file(path)
        direct = torch.load(path, weights_only=True)  # torch's own loader agrees
    assert _manifest(path)['safe_globals'] == [POINT]
    for got in (loaded, direct):
        assert type(got['hub']['p']) is Point
        assert torch.equal(got['hub']['p'].xy, torch.tensor([1.5, -2.0]))
        assert got['hub']['p'].count == 7 and got['hub']['q'][0].count == 0
        assert torch.equal(got['state_dict']['w'], torch.arange(3.0))
    assert POINT not in get_safe_globals()  # the context restored the allow-list


def test_plain_content_records_nothing(tmp_path):
    path = save_checkpoint({'w': torch.ones(2), 'meta': {'iter': 1}}, tmp_path / 'a.pth')
    assert validate_checkpoint_content({'w': torch.ones(2)}) == []
    assert 'safe_globals' not in _manifest(path)


def test_class_not_allow_listed_refused_at_save_with_its_name(tmp_path):
    with safe_globals([Point]):
        with pytest.raises(TypeError) as info:
            save_checkpoint({'meta': {'x': [Unlisted()]}}, tmp_path / 'a.pth')
    message = str(info.value)
    assert "checkpoint['meta']['x'][0] is a " + f'{Unlisted.__module__}.Unlisted' in message
    assert 'add_safe_globals([Unlisted])' in message
    assert not any(tmp_path.iterdir())  # nothing written


def test_allow_listed_class_holding_an_unlisted_value_refused(tmp_path):
    with safe_globals([Point]):
        with pytest.raises(TypeError) as info:
            save_checkpoint({'p': Point(defaultdict(list), 1)}, tmp_path / 'a.pth')
    assert "checkpoint['p'] is a " + POINT in str(info.value)
    assert 'collections.defaultdict' in str(info.value)  # what inside it load would refuse
    assert not any(tmp_path.iterdir())


def test_loader_without_the_allow_list_names_the_class(tmp_path):
    with safe_globals([Point]):
        path = save_checkpoint({'p': Point(1, 2)}, tmp_path / 'a.pth')
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint_file(path)
    message = str(info.value)
    assert f'it holds {POINT}, allow-listed by the process that saved it' in message
    assert 'stratagem.checkpoint.add_safe_globals([...]) with Point' in message
    assert info.value.globals == (POINT,)
    with safe_globals([Point]):
        assert load_checkpoint_file(path)['p'].count == 2


def test_malicious_pickle_executes_nothing_with_an_allow_list_active(tmp_path):
    marker = tmp_path / 'PWNED'
    path = tmp_path / 'evil.pth'
    torch.save({'p': Point(1, 2), 'x': _Touch(marker)}, path)
    with safe_globals([Point]):
        with pytest.warns(UserWarning, match='no stratagem manifest'):
            with pytest.raises(UnsafeCheckpointError, match='system'):
                load_checkpoint_file(path)
        with pytest.raises(TypeError, match="checkpoint\\['x'\\]"):  # and refused at save
            save_checkpoint({'x': _Touch(marker)}, tmp_path / 'b.pth')
    assert not marker.exists()


@pytest.mark.parametrize(
    'bad, error, fragment',
    [
        (getattr, ValueError, 'refuses builtins.getattr'),
        (os.system, ValueError, 'run arbitrary code'),
        (eval, ValueError, 'refuses builtins.eval'),
        (pickle.loads, ValueError, 'refuses'),
        ((getattr, 'x.y'), ValueError, 'refuses x.y'),
        (types.FunctionType, ValueError, 'refuses builtins.function'),  # bytecode -> function
        (types.CodeType, ValueError, 'refuses builtins.code'),
        (types.ModuleType, ValueError, 'refuses builtins.module'),
        (timeit.timeit, ValueError, 'refuses timeit.timeit'),  # runs a string of code
        ((Point, 'builtins.int'), None, None),  # a plain class under another name: fine
        (Point(1, 2), TypeError, 'not a class or function'),
        ((Point, 3), TypeError, "'module.name') pair"),
    ],
)
def test_add_safe_globals_refuses_what_would_run_code(bad, error, fragment):
    before = get_safe_globals()
    if error is None:
        with safe_globals([bad]):
            assert 'builtins.int' in get_safe_globals()
        return
    with pytest.raises(error, match=fragment.replace('(', r'\(').replace(')', r'\)')):
        add_safe_globals([Point, bad])
    assert get_safe_globals() == before  # checked before anything was added
    with pytest.raises(TypeError, match='a list of classes'):
        add_safe_globals(Point)


def test_loader_without_the_package_says_it_is_not_installed(tmp_path, monkeypatch):
    """A verified file holding a class of a package this environment lacks (an mmengine
    checkpoint read where mmengine is not installed) is not called damaged."""
    import sys
    import types as _types

    module = _types.ModuleType('rev1_absent_pkg')

    class Stat:
        def __init__(self, n):
            self.n = n

    Stat.__module__, Stat.__qualname__ = module.__name__, 'Stat'
    module.Stat = Stat
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with safe_globals([Stat]):
        path = save_checkpoint({'hub': Stat(3)}, tmp_path / 'a.pth')
    monkeypatch.delitem(sys.modules, module.__name__)  # not installed in the loading process
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint_file(path)
    message = str(info.value)
    assert 'damaged:' not in message
    assert 'rev1_absent_pkg are not installed here' in message
    assert 'rev1_absent_pkg.Stat' in message
