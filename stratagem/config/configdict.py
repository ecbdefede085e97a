"""The strict :class:`ConfigDict`: an ``addict.Dict`` with attribute and item access where
reading a missing key raises (``AttributeError`` / ``KeyError`` naming the key) instead of
silently creating an empty dict; plus its helpers (the missing-key message, the deep copy to
plain dicts)."""

from __future__ import annotations

import copy
import pprint
from collections.abc import Mapping
from typing import Any

from addict import Dict

from .errors import ConfigAttributeError, ConfigKeyError


class ConfigDict(Dict):
    """A dict with attribute access that never invents keys on read.

    ``cfg.a`` and ``cfg['a']`` raise ``AttributeError`` / ``KeyError`` naming
    ``'a'`` and the keys that exist when ``a`` is missing (addict would return a
    new empty dict). Assignment works as usual; nested plain dicts become
    ConfigDicts.
    """

    def __missing__(self, name: Any) -> Any:
        raise ConfigKeyError(_missing_message(self, name))

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            if name.startswith('__') and name.endswith('__'):
                raise AttributeError(name) from None
            raise ConfigAttributeError(_missing_message(self, name)) from None

    # addict hands a parent reference to missing children so that ``d.a.b = 1``
    # creates ``a``; with strict reads there are no such children, and the
    # default implementation would touch the parent on every set.
    def __setitem__(self, name: Any, value: Any) -> None:
        dict.__setitem__(self, name, self._hook(value))

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self.__class__, name) and not name.startswith('_'):
            raise AttributeError(
                f"'ConfigDict' attribute {name!r} is read-only "
                f'(it is a method); use cfg[{name!r}] = ...'
            )
        self[name] = value

    @classmethod
    def _hook(cls, item: Any) -> Any:  # addict's name for what a stored value becomes
        return to_config_value(item, cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        dict.__init__(self)
        for arg in args:
            if arg is None:
                continue
            if not isinstance(arg, Mapping):
                arg = dict(arg)
            for k, v in arg.items():
                self[k] = v
        for k, v in kwargs.items():
            self[k] = v

    def __deepcopy__(self, memo: dict) -> ConfigDict:
        other = self.__class__()
        memo[id(self)] = other
        for k, v in self.items():
            dict.__setitem__(other, copy.deepcopy(k, memo), copy.deepcopy(v, memo))
        return other

    def __copy__(self) -> ConfigDict:
        other = self.__class__()
        for k, v in self.items():
            dict.__setitem__(other, k, v)
        return other

    def copy(self) -> ConfigDict:
        return self.__copy__()

    def __reduce__(self) -> tuple:
        return (self.__class__, (dict(self),))

    def get(self, key: Any, default: Any = None) -> Any:
        return dict.get(self, key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        if key not in self and not default:
            raise ConfigKeyError(_missing_message(self, key))
        return dict.pop(self, key, *default)

    def update(self, *args: Any, **kwargs: Any) -> None:  # plain update: no recursive merge
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def to_dict(self) -> dict:
        """A deep copy as plain dicts / lists / tuples."""
        return _to_plain(self)

    def __repr__(self) -> str:
        return f'ConfigDict({pprint.pformat(self.to_dict(), sort_dicts=False)})'


def to_config_value(item: Any, dict_type: type[ConfigDict] = ConfigDict) -> Any:
    """``item`` as a ConfigDict stores it: a mapping becomes a ``dict_type`` (a ConfigDict is
    kept), lists and tuples are converted item by item, anything else is kept as it is."""
    if isinstance(item, Mapping) and not isinstance(item, ConfigDict):
        return dict_type(item)
    if isinstance(item, list):
        return [to_config_value(x, dict_type) for x in item]
    if isinstance(item, tuple):
        return tuple(to_config_value(x, dict_type) for x in item)
    return item


def _missing_message(d: Mapping, name: Any) -> str:
    keys = ', '.join(repr(k) for k in d) or '(none)'
    return f'config has no key {name!r}; keys here: {keys}'


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_plain(v) for v in obj)
    return obj
