"""What a backend may override is one documented list, ``base.OVERRIDABLE``: every registered
backend overrides nothing else of ``BaseStrategy``, and the list is the one the module
docstring and docs/architecture.md give."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import stratagem.strategies as strategies
from stratagem.registry import STRATEGIES
from stratagem.strategies import base
from stratagem.strategies.base import OVERRIDABLE, BaseStrategy

ROOT = Path(__file__).resolve().parents[2]
# what Python or ABC defines on every class, never a backend's choice
_LANGUAGE = {'_abc_impl'}


def _backends() -> list[type]:
    """Every strategy class the package registers (the lazy ones imported), and every
    BaseStrategy subclass ``stratagem.strategies`` exports."""
    found: dict[str, type] = {}
    for name in strategies.__all__:
        obj = getattr(strategies, name)
        if isinstance(obj, type) and issubclass(obj, BaseStrategy) and obj is not BaseStrategy:
            found[obj.__qualname__] = obj
    for name in list(STRATEGIES.module_dict):  # type: ignore[attr-defined]
        obj = STRATEGIES.get(name)
        if isinstance(obj, type) and issubclass(obj, BaseStrategy):
            found[obj.__qualname__] = obj
    return list(found.values())


def _overridden(cls: type) -> set[str]:
    """The names ``cls`` (and its bases below BaseStrategy) define that BaseStrategy's own
    class body (or its bases) defines too."""
    base_names = {n for klass in BaseStrategy.__mro__ for n in vars(klass)}
    own = set()
    for klass in cls.__mro__:
        if klass is BaseStrategy:
            break
        own |= set(vars(klass))
    return {
        n
        for n in own & base_names
        if not (n.startswith('__') and n.endswith('__')) and n not in _LANGUAGE
    }


BACKENDS = _backends()


def test_every_backend_is_found():
    names = {cls.__name__ for cls in BACKENDS}
    assert {
        'SingleDeviceStrategy',
        'DDPStrategy',
        'FSDPStrategy',
        'DeepSpeedStrategy',
        'ShardedDDPStrategy',
    } <= names, names


@pytest.mark.parametrize('cls', BACKENDS, ids=lambda c: c.__name__)
def test_a_backend_overrides_only_the_documented_names(cls):
    outside = sorted(_overridden(cls) - OVERRIDABLE)
    assert not outside, (
        f'{cls.__name__} overrides {outside}, which base.OVERRIDABLE does not list: supply a '
        'part class (model_part / optimizer_part / pending_grads_part) or use a documented '
        'hook instead, or add the name to OVERRIDABLE and its documentation'
    )


def test_the_list_names_members_of_base_strategy():
    missing = sorted(n for n in OVERRIDABLE if not hasattr(BaseStrategy, n))
    assert not missing, missing


def test_an_undocumented_override_is_caught():
    class Sneaky(BaseStrategy):
        def _wrap_model(self, model):
            return model

        def _step_wrapper(self):  # a private step of the base
            return None

        def save_checkpoint(self, filename, **kwargs):  # public, but written once
            return filename

    assert sorted(_overridden(Sneaky) - OVERRIDABLE) == ['_step_wrapper', 'save_checkpoint']


def test_the_documents_give_the_same_list():
    def listed(text: str) -> set[str]:
        names = re.findall(r'``?(\w+)(?:\([^)]*\))?``?', text)
        return {n for n in names if n in vars(BaseStrategy)}

    doc = inspect.getdoc(base) or ''
    section = doc.split('What a backend may override:')[1].split('The no-sync context')[0]
    assert listed(section) == OVERRIDABLE
    arch = (ROOT / 'docs' / 'architecture.md').read_text()
    section = arch.split('### What a backend may override')[1].split('Everything else')[0]
    assert listed(section) == OVERRIDABLE
