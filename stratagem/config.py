"""Strict config dicts and config files.

:class:`ConfigDict` is an ``addict.Dict`` with attribute and item access where
reading a missing key raises (``AttributeError`` / ``KeyError`` naming the key)
instead of silently creating an empty dict. :class:`Config` loads ``.py``,
``.json`` and ``.yaml``/``.yml`` files with ``_base_`` inheritance, applies
``--cfg-options`` style overrides and dumps back to any of those formats.

Numbers given as strings. PyYAML follows YAML 1.1, which reads ``1e-3`` (no dot) as the
string ``'1e-3'``; JSON configs and hand-written dicts can quote numbers too. The rule: in the
sections stratagem builds (``optim_wrapper``, ``param_scheduler``, ``train_cfg``,
``train_dataloader`` except its ``dataset``, ``randomness``, ``auto_scale_lr``,
``strategy``), a key that takes a number (``lr``, ``weight_decay``, ``momentum``, ``betas``,
``eps``, ``max_norm``, ``milestones``, ``T_max``, ``*_mult``, ...; see ``NUMERIC_KEYS``)
whose value is a string that Python's ``int``/``float`` reads is **converted**, with a
:class:`ConfigWarning` naming the key, the value and the file; a string there that is not a
number is **refused** with a :class:`ConfigError` naming the key. This runs whenever a
:class:`Config` is built and after ``merge_from_dict``. A model's or a dataset's own
arguments are left alone: their types are the user's.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import pprint
import types
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from addict import Dict

__all__ = [
    'ConfigDict',
    'Config',
    'ConfigError',
    'ConfigKeyError',
    'ConfigAttributeError',
    'ConfigWarning',
    'check_keys',
    'parse_cfg_options',
    'merge_dicts',
    'normalize_numbers',
    'NUMERIC_KEYS',
]

BASE_KEY = '_base_'
DELETE_KEY = '_delete_'
_SUFFIXES = ('.py', '.json', '.yaml', '.yml')


class ConfigError(ValueError):
    """A config file that cannot be read, or a bad override; the message names the file/key."""


class ConfigWarning(UserWarning):
    """A config value was accepted after a fix (a number given as a string); the message says
    which key and how to write it."""


class ConfigAttributeError(AttributeError):
    """A missing config key read as an attribute (``cfg.modle``); the message names it."""


class ConfigKeyError(KeyError):
    """A missing config key; a KeyError whose message reads without extra quotes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ''


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
    def _hook(cls, item: Any) -> Any:
        if isinstance(item, Mapping) and not isinstance(item, ConfigDict):
            return cls(item)
        if isinstance(item, list):
            return [cls._hook(x) for x in item]
        if isinstance(item, tuple):
            return tuple(cls._hook(x) for x in item)
        return item

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


def _dotted_keys(obj: Any, prefix: str = '') -> set[str]:
    """Every dotted path in a config (dict keys and list indices), e.g. 'a', 'a.b', 'a.0'."""
    out: set[str] = set()
    items = (
        obj.items()
        if isinstance(obj, Mapping)
        else enumerate(obj)
        if isinstance(obj, (list, tuple))
        else ()
    )
    for k, v in items:
        path = f'{prefix}{k}'
        out.add(path)
        out |= _dotted_keys(v, path + '.')
    return out


def _did_you_mean(key: str, known: set[str]) -> str:
    """Existing keys ``key`` was probably meant to be: the same last name elsewhere
    (``lr`` for ``optim_wrapper.optimizer.lr``), else a near spelling beside it."""
    import difflib

    parent, _, leaf = key.rpartition('.')
    close = sorted(k for k in known if k.rsplit('.', 1)[-1] == leaf)
    if not close:
        siblings = {k.rsplit('.', 1)[-1]: k for k in known if k.rpartition('.')[0] == parent}
        close = [
            siblings[n] for n in difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.75)
        ]
    return f'did you mean {" or ".join(repr(k) for k in close[:3])}?' if close else ''


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


def check_keys(given: Mapping, allowed: Iterable[str], where: str) -> None:
    """Raise ValueError naming ``where``, the unknown keys of ``given`` and the valid ones."""
    allowed = set(allowed)
    unknown = sorted(set(given) - allowed, key=str)
    if unknown:
        raise ValueError(f'unknown key(s) {unknown} in {where}; valid keys: {sorted(allowed)}')


# Keys that take a number (or a list of numbers) in the sections stratagem builds. A value
# that may also be a word (loss_scale='dynamic', seed=None) is converted when it reads as a
# number and otherwise left to its component.
_INT_KEYS = frozenset(
    {
        'accumulative_counts',
        'max_iter',
        'begin',
        'end',
        'T_max',
        'milestones',
        'step_size',
        'total_steps',
        'steps_per_epoch',
        'epochs',
        'patience',
        'cooldown',
        'periods',
        'max_epochs',
        'max_iters',
        'checkpoint_interval',
        'max_keep_ckpts',
        'log_interval',
        'val_interval',
        'batch_size',
        'num_workers',
        'prefetch_factor',
        'seed',
        'base_batch_size',
        'num_decays',
        'warmup_length',
        'resource_limit',
        'timeout',
        'min_num_params',
    }
)
_FLOAT_KEYS = frozenset(
    {
        'lr',
        'weight_decay',
        'momentum',
        'betas',
        'eps',
        'dampening',
        'alpha',
        'lr_decay',
        'initial_accumulator_value',
        'rho',
        'lambd',
        't0',
        'momentum_decay',
        'max_norm',
        'norm_type',
        'clip_value',
        'gamma',
        'eta_min',
        'eta_max',
        'eta_min_ratio',
        'start_factor',
        'end_factor',
        'factor',
        'power',
        'restart_weights',
        'pct_start',
        'div_factor',
        'final_div_factor',
        'threshold',
        'min_value',
        'start_value',
        'end_value',
        'warmup_factor',
        'base_lr',
        'max_lr',
        'min_lr',
        'growth_factor',
        'backoff_factor',
        'init_scale',
    }
)
NUMERIC_KEYS = _INT_KEYS | _FLOAT_KEYS  # plus every key ending in '_mult' (paramwise_cfg)
_WORD_OK = frozenset({'seed', 'loss_scale', 'timeout'})  # a non-number string may be valid
_NUMERIC_SECTIONS = (
    'optim_wrapper',
    'param_scheduler',
    'train_cfg',
    'train_dataloader',
    'randomness',
    'auto_scale_lr',
    'strategy',
)
_USER_SUBTREES = frozenset({'dataset', 'model', 'collate_fn', 'sampler'})


def _is_numeric_key(key: Any) -> bool:
    return isinstance(key, str) and (
        key in NUMERIC_KEYS or key == 'loss_scale' or key.endswith('_mult')
    )


def _as_number(text: str) -> int | float | None:
    """``text`` as an int (if it reads as one) or a float, else None ('nan' stays a word)."""
    if text.strip().lower() in ('nan', '+nan', '-nan'):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


def normalize_numbers(cfg: Any, filename: str | None = None) -> list[str]:
    """Apply the numbers-as-strings rule (module docstring) to ``cfg`` in place.

    Returns the dotted keys that were converted (each also warned once with
    :class:`ConfigWarning`). Raises :class:`ConfigError` naming the key when a numeric key
    holds a string that is not a number.
    """
    converted: list[tuple[str, str]] = []
    where = f' in {filename}' if filename else ''
    for section in _NUMERIC_SECTIONS:
        if isinstance(cfg, Mapping) and section in cfg:
            _walk_numbers(cfg, section, section, None, where, converted)
    if converted:
        yaml_hint = any('e' in v.lower() and '.' not in v for _, v in converted)
        listed = ', '.join(f'{k}={v!r}' for k, v in converted)
        warnings.warn(
            f'{filename or "config"}: number(s) given as strings were converted: {listed}. '
            'Write numbers without quotes'
            + (
                '; in YAML a float with an exponent needs a dot and a signed exponent '
                '(1.0e-3, not 1e-3), else PyYAML reads it as a string'
                if yaml_hint
                else ''
            ),
            ConfigWarning,
            stacklevel=3,
        )
    return [k for k, _ in converted]


def _walk_numbers(
    parent: Any,
    key: Any,
    path: str,
    numeric_key: str | None,
    where: str,
    converted: list[tuple[str, str]],
) -> None:
    value = parent[key]
    if isinstance(value, Mapping):
        for k in list(value.keys()):
            if k in _USER_SUBTREES:
                continue
            _walk_numbers(
                value, k, f'{path}.{k}', k if _is_numeric_key(k) else None, where, converted
            )
    elif isinstance(value, list):
        for i in range(len(value)):
            _walk_numbers(value, i, f'{path}.{i}', numeric_key, where, converted)
    elif isinstance(value, tuple):
        items = list(value)
        for i in range(len(items)):
            _walk_numbers(items, i, f'{path}.{i}', numeric_key, where, converted)
        if items != list(value):
            _set(parent, key, tuple(items))
    elif isinstance(value, str) and numeric_key is not None:
        number = _as_number(value)
        if number is None:
            if numeric_key in _WORD_OK:
                return
            raise ConfigError(
                f'{path}={value!r}{where} must be a number (e.g. '
                f'{path.rsplit(".", 1)[-1]}=0.01), not the string {value!r}'
            )
        if numeric_key in _INT_KEYS and isinstance(number, float) and number.is_integer():
            number = int(number)
        _set(parent, key, number)
        converted.append((path, value))


def _set(parent: Any, key: Any, value: Any) -> None:
    # dict.__setitem__: a ConfigDict's own hook would re-wrap values; numbers need none
    if isinstance(parent, dict):
        dict.__setitem__(parent, key, value)
    else:
        parent[key] = value


def merge_dicts(base: Mapping, override: Mapping, *, where: str = '') -> dict:
    """Merge ``override`` into a copy of ``base``, recursing into dicts.

    A dict in ``override`` with ``_delete_=True`` replaces the base value
    instead of merging into it. Neither input is mutated.
    """
    out = {k: copy.deepcopy(v) for k, v in base.items()}
    for k, v in override.items():
        path = f'{where}.{k}' if where else str(k)
        if isinstance(v, Mapping):
            v = dict(v)
            delete = v.pop(DELETE_KEY, False)
            if not delete and isinstance(out.get(k), Mapping):
                out[k] = merge_dicts(out[k], v, where=path)
                continue
            out[k] = _strip_delete(v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _strip_delete(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _strip_delete(v) for k, v in obj.items() if k != DELETE_KEY}
    if isinstance(obj, list):
        return [_strip_delete(v) for v in obj]
    return obj


def _parse_value(text: str) -> Any:
    """Parse one override value: python literals, true/false/none, ``a,b`` lists, else str."""
    low = text.lower()
    if low in ('true', 'false'):
        return low == 'true'
    if low in ('none', 'null'):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    else:
        # bare "1,2" reads as a tuple in python; mmengine's overrides make it a list
        return list(value) if isinstance(value, tuple) and not text.startswith('(') else value
    if len(text) >= 2 and text[0] + text[-1] in ('[]', '()'):
        # bare words in brackets, e.g. [cat,dog] or [a,[1,b]] (mmengine's DictAction)
        items = [_parse_value(part.strip()) for part in _split_top_level(text[1:-1]) if part]
        return items if text[0] == '[' else tuple(items)
    if ',' in text:
        return [_parse_value(part) for part in _split_top_level(text) if part != '']
    return text


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in '[(':
            depth += 1
        elif ch in '])':
            depth -= 1
        elif ch == ',' and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_cfg_options(options: Iterable[str]) -> dict[str, Any]:
    """Parse ``['a.b=1', 'c=[1,2]', 'd=xyz']`` into ``{'a.b': 1, 'c': [1, 2], 'd': 'xyz'}``."""
    out: dict[str, Any] = {}
    for opt in options:
        key, sep, value = opt.partition('=')
        if not sep or not key:
            raise ConfigError(
                f'bad --cfg-options item {opt!r}: expected KEY=VALUE, e.g. '
                'optim_wrapper.optimizer.lr=0.01'
            )
        out[key.strip()] = _parse_value(value.strip())
    return out


class Config:
    """A config: a :class:`ConfigDict` plus the file it came from.

    Attribute and item access, ``in``, ``get``, ``keys``/``items`` go to the
    underlying ConfigDict. Build one from a dict, or with :meth:`fromfile`.
    """

    def __init__(
        self, cfg_dict: Mapping | None = None, filename: str | os.PathLike | None = None
    ) -> None:
        if cfg_dict is None:
            cfg_dict = {}
        if not isinstance(cfg_dict, Mapping):
            raise TypeError(f'cfg_dict must be a dict, got {type(cfg_dict).__name__}')
        object.__setattr__(self, '_cfg_dict', ConfigDict(cfg_dict))
        object.__setattr__(self, '_filename', str(filename) if filename is not None else None)
        normalize_numbers(self._cfg_dict, self._filename)

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def fromfile(cls, filename: str | os.PathLike) -> Config:
        """Load a ``.py``, ``.json``, ``.yaml`` or ``.yml`` config, resolving ``_base_``."""
        path = Path(filename).expanduser().absolute()
        return cls(cls._load_with_bases(path, chain=()), filename=path)

    @classmethod
    def _load_with_bases(cls, path: Path, chain: tuple[Path, ...]) -> dict:
        if path in chain:
            cycle = ' -> '.join(str(p) for p in (*chain, path))
            raise ConfigError(f'circular _base_ in config files: {cycle}')
        raw = cls._read_file(path)
        bases = raw.pop(BASE_KEY, [])
        if isinstance(bases, (str, os.PathLike)):
            bases = [bases]
        if not isinstance(bases, (list, tuple)):
            raise ConfigError(f'{path}: _base_ must be a path or a list of paths, got {bases!r}')
        merged: dict = {}
        for base in bases:
            base_path = (path.parent / base).absolute()
            base_cfg = cls._load_with_bases(base_path, (*chain, path))
            overlap = set(merged) & set(base_cfg)
            if overlap:
                raise ConfigError(
                    f'{path}: keys {sorted(overlap)} are defined in more than one '
                    f'_base_ file; define each key in one base only'
                )
            merged.update(base_cfg)
        return merge_dicts(merged, raw)

    @staticmethod
    def _read_file(path: Path) -> dict:
        if path.is_dir():
            found = sorted(p.name for p in path.iterdir() if p.suffix.lower() in _SUFFIXES)
            raise ConfigError(
                f'{path} is a directory, not a config file; give a '
                f'{"/".join(_SUFFIXES)} file' + (f', e.g. {path / found[0]}' if found else '')
            )
        if not path.is_file():
            raise FileNotFoundError(f'config file not found: {path}')
        suffix = path.suffix.lower()
        if suffix not in _SUFFIXES:
            raise ConfigError(
                f'{path}: unsupported config extension {suffix!r}; '
                f'use one of {", ".join(_SUFFIXES)}'
            )
        text = path.read_text()
        if suffix == '.py':
            return _exec_py_config(text, path)
        if suffix == '.json':
            try:
                data = json.loads(text) if text.strip() else {}
            except json.JSONDecodeError as e:
                raise ConfigError(f'{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}') from e
        else:
            import yaml  # only yaml configs pay for it

            try:
                data = yaml.safe_load(text) or {}
            except yaml.YAMLError as e:
                mark = getattr(e, 'problem_mark', None)
                where = f':{mark.line + 1}:{mark.column + 1}' if mark else ''
                raise ConfigError(f'{path}{where}: invalid YAML: {e}') from e
        if not isinstance(data, dict):
            raise ConfigError(
                f'{path}: a config file must hold a mapping at the top level, '
                f'got {type(data).__name__}'
            )
        return data

    # ---- access --------------------------------------------------------------------------
    @property
    def filename(self) -> str | None:
        return self._filename

    def __getattr__(self, name: str) -> Any:
        if name.startswith('__') and name.endswith('__'):
            raise AttributeError(name)
        return getattr(self._cfg_dict, name)

    def __getitem__(self, name: Any) -> Any:
        return self._cfg_dict[name]

    def __setattr__(self, name: str, value: Any) -> None:
        self._cfg_dict[name] = value

    def __setitem__(self, name: Any, value: Any) -> None:
        self._cfg_dict[name] = value

    def __delitem__(self, name: Any) -> None:
        del self._cfg_dict[name]

    def __contains__(self, name: object) -> bool:
        return name in self._cfg_dict

    def __iter__(self):
        return iter(self._cfg_dict)

    def __len__(self) -> int:
        return len(self._cfg_dict)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Config):
            return self._cfg_dict == other._cfg_dict
        return isinstance(other, Mapping) and self._cfg_dict == other

    def __deepcopy__(self, memo: dict) -> Config:
        return Config(copy.deepcopy(self._cfg_dict, memo), self._filename)

    def get(self, key: Any, default: Any = None) -> Any:
        return self._cfg_dict.get(key, default)

    def keys(self):
        return self._cfg_dict.keys()

    def values(self):
        return self._cfg_dict.values()

    def items(self):
        return self._cfg_dict.items()

    def to_dict(self) -> dict:
        return self._cfg_dict.to_dict()

    # ---- overrides -----------------------------------------------------------------------
    def merge_from_dict(self, options: Mapping[str, Any], allow_list_keys: bool = True) -> None:
        """Apply ``{'a.b.c': value}`` overrides; a numeric segment indexes a list.

        Intermediate dicts are created as needed; indexing past a list's end, or
        descending into a value that is neither a dict nor a list, raises a
        ConfigError naming the full key, and leaves the config unchanged. Numbers given
        as strings follow the module's rule.
        """
        # applied to a copy, swapped in only when every override (and the numbers rule) passed:
        # a bad override leaves the config as it was
        work = copy.deepcopy(self._cfg_dict)
        known = _dotted_keys(self._cfg_dict)
        added = []
        for full_key, value in options.items():
            parts = str(full_key).split('.')
            node: Any = work
            if str(full_key) not in known and not any(k.startswith(f'{full_key}.') for k in known):
                added.append(str(full_key))
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                if isinstance(node, list):
                    if not (allow_list_keys and part.isdigit()):
                        raise ConfigError(
                            f'override {full_key!r}: {".".join(parts[:i])!r} is a '
                            f'list; index it with a number, e.g. '
                            f'{".".join(parts[:i])}.0'
                        )
                    idx = int(part)
                    if idx >= len(node):
                        raise ConfigError(
                            f'override {full_key!r}: index {idx} is out of range '
                            f'for a list of length {len(node)}'
                        )
                    if last:
                        node[idx] = ConfigDict._hook(value)
                    else:
                        node = node[idx]
                    continue
                if not isinstance(node, Mapping):
                    raise ConfigError(
                        f'override {full_key!r}: {".".join(parts[:i])!r} is a '
                        f'{type(node).__name__}, not a dict'
                    )
                if last:
                    if isinstance(value, Mapping) and isinstance(node.get(part), Mapping):
                        node[part] = merge_dicts(node[part], value)  # type: ignore[index]
                    else:
                        node[part] = value  # type: ignore[index]
                else:
                    if part not in node:
                        node[part] = ConfigDict()  # type: ignore[index]
                    node = node[part]
        normalize_numbers(work, 'the overrides')
        object.__setattr__(self, '_cfg_dict', work)
        for key in added:  # mmengine adds them silently: a typo would then change nothing
            hint = _did_you_mean(key, known)
            if hint:  # adding a key (clip_grad=...) is fine; one that looks like a typo warns
                warnings.warn(
                    f'override {key!r} adds a key the config did not have, so it '
                    f'changes nothing unless something reads it; {hint}',
                    ConfigWarning,
                    stacklevel=2,
                )

    # ---- output --------------------------------------------------------------------------
    def dump(self, file: str | os.PathLike | None = None) -> str | None:
        """Write the config to ``file`` (format from its suffix) or return it as python text."""
        data = self.to_dict()
        if file is None:
            return _to_py_text(data, self._filename)
        path = Path(file)
        suffix = path.suffix.lower()
        if suffix == '.py':
            text = _to_py_text(data, self._filename)
        elif suffix == '.json':
            text = json.dumps(data, indent=2) + '\n'
        elif suffix in ('.yaml', '.yml'):
            import yaml

            text = yaml.safe_dump(_tuples_to_lists(data), sort_keys=False)
        else:
            raise ConfigError(
                f'cannot dump a config to {path}: unsupported extension '
                f'{suffix!r}; use one of {", ".join(_SUFFIXES)}'
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return None

    @property
    def pretty_text(self) -> str:
        return _to_py_text(self.to_dict(), None)

    def __repr__(self) -> str:
        return f'Config (path: {self._filename}):\n{self.pretty_text}'


def _tuples_to_lists(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _tuples_to_lists(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tuples_to_lists(v) for v in obj]
    return obj


def _check_literal(obj: Any, key: str) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_literal(v, f'{key}.{k}')
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_literal(v, f'{key}.{i}')
    elif not isinstance(obj, (str, int, float, bool, type(None))):
        raise ConfigError(
            f'cannot dump config key {key!r}: {obj!r} is a '
            f'{type(obj).__name__}; only dicts, lists, tuples, str, numbers, '
            'bools and None can be written to a config file (use a registered '
            'name string instead of a class)'
        )


def _to_py_text(data: dict, source: str | None) -> str:
    lines = [f'# generated from {source}' if source else '# stratagem config']
    for key, value in data.items():
        _check_literal(value, str(key))
        lines.append(f'{key} = {pprint.pformat(value, sort_dicts=False, width=96)}')
    return '\n'.join(lines) + '\n'


def _exec_py_config(text: str, path: Path) -> dict:
    try:
        code = compile(text, str(path), 'exec')
    except SyntaxError as e:
        raise ConfigError(
            f'{path}:{e.lineno}: syntax error in config: {e.msg}\n    {(e.text or "").rstrip()}'
        ) from e
    namespace: dict[str, Any] = {'__file__': str(path), '__name__': '__stratagem_config__'}
    try:
        exec(code, namespace)  # noqa: S102 - a config file is code the user asked us to run
    except Exception as e:
        tb = e.__traceback__
        line = None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == str(path):
                line = tb.tb_lineno
            tb = tb.tb_next
        where = f':{line}' if line else ''
        raise ConfigError(
            f'{path}{where}: error while executing config: {type(e).__name__}: {e}'
        ) from e
    return {
        k: v
        for k, v in namespace.items()
        if not k.startswith('__') and not isinstance(v, (types.ModuleType, types.FunctionType))
    }
