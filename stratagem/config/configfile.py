"""The :class:`Config` class: a :class:`ConfigDict` plus the file it came from.

:meth:`Config.fromfile` loads ``.py``, ``.json`` and ``.yaml``/``.yml`` files with ``_base_``
inheritance, :meth:`Config.merge_from_dict` applies ``--cfg-options`` style overrides and
:meth:`Config.dump` writes back to any of those formats."""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .configdict import ConfigDict, to_config_value
from .errors import ConfigError, ConfigWarning
from .formats import (
    _SUFFIXES,
    _assigns_base,
    _exec_py_config,
    _parse_py,
    _to_py_text,
    _tuples_to_lists,
)
from .keys import _did_you_mean, _dotted_keys
from .numeric import normalize_numbers
from .overrides import merge_dicts

BASE_KEY = '_base_'


# {{ _base_.a.b }}: a value of the bases, written in place of the placeholder (mmengine's);
# also quoted, as a yaml file must write it to stay valid yaml before the substitution
_BASE_VAR = re.compile(r'([\'"]?)\{\{\s*' + BASE_KEY + r'\.([\w.]+)\s*\}\}\1')


def _read_text(path: Path) -> str:
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
            f'{path}: unsupported config extension {suffix!r}; use one of {", ".join(_SUFFIXES)}'
        )
    return path.read_text()


def _base_placeholders(text: str) -> tuple[str, dict[str, str]]:
    """``text`` with each ``{{_base_.x}}`` replaced by a quoted token (a string in any of the
    formats, on the same line), and the tokens' dotted names."""
    placeholders: dict[str, str] = {}

    def token(match: re.Match) -> str:
        name = f'_base_var_{len(placeholders)}_{uuid.uuid4().hex[:8]}'
        placeholders[name] = match.group(2)
        return f'"{name}"'

    return _BASE_VAR.sub(token, text), placeholders


def _base_files(text: str, path: Path) -> list:
    """The file's ``_base_`` (a path or a list of paths): a ``.py`` file's top-level
    ``_base_ = ...`` evaluated alone (its code then sees the bases as ``_base_``), a
    json/yaml file's key."""
    if path.suffix.lower() == '.py':
        bases: Any = []
        for node in _parse_py(text, path).body:
            if _assigns_base(node):
                try:
                    bases = ast.literal_eval(node.value)  # type: ignore[attr-defined]
                except ValueError:
                    raise ConfigError(
                        f'{path}:{node.lineno}: _base_ must be a path or a list of paths '
                        'written as literals'
                    ) from None
    elif path.suffix.lower() == '.json':
        try:
            bases = (json.loads(text) if text.strip() else {}).get(BASE_KEY, [])
        except (json.JSONDecodeError, AttributeError):
            bases = []  # the read proper says what is wrong with the file
    else:
        loaded = _load_yaml(text, path)
        bases = loaded.get(BASE_KEY, []) if isinstance(loaded, dict) else []
    if isinstance(bases, (str, os.PathLike)):
        bases = [bases]
    if not isinstance(bases, (list, tuple)):
        raise ConfigError(f'{path}: _base_ must be a path or a list of paths, got {bases!r}')
    return list(bases)


def _load_yaml(text: str, path: Path) -> Any:
    import yaml  # only yaml configs pay for it

    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, 'problem_mark', None)
        where = f':{mark.line + 1}:{mark.column + 1}' if mark else ''
        raise ConfigError(f'{path}{where}: invalid YAML: {e}') from e


def _substitute_base_vars(obj: Any, placeholders: dict[str, str], bases: dict, path: Path) -> Any:
    """``obj`` with every placeholder token replaced by a copy of the bases' value."""
    if not placeholders:
        return obj
    if isinstance(obj, str) and obj in placeholders:
        return copy.deepcopy(_base_value(bases, placeholders[obj], path))
    if isinstance(obj, Mapping):
        return {k: _substitute_base_vars(v, placeholders, bases, path) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_substitute_base_vars(v, placeholders, bases, path) for v in obj)
    return obj


def _base_value(bases: dict, dotted: str, path: Path) -> Any:
    node: Any = bases
    for i, part in enumerate(dotted.split('.')):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            where = '.'.join(dotted.split('.')[:i])
            keys = sorted(map(str, node)) if isinstance(node, Mapping) else []
            hint = _did_you_mean(part, set(keys)) if keys else ''
            raise ConfigError(
                f'{path}: {{{{_base_.{dotted}}}}}: the _base_ files have no '
                f'{(where + "." if where else "") + part!r}'
                + (f'; {hint}' if hint else '')
                + (f'; they define: {", ".join(keys)}' if keys else '')
            )
    return node


def config_search_dirs(cfg: Config | Mapping) -> list[str]:
    """Where a config's own code is imported from besides ``sys.path``: the config file's
    directory (for a config read from a file) and the working directory."""
    filename = cfg.filename if isinstance(cfg, Config) else None
    dirs = [os.path.dirname(filename)] if filename else []
    return [*dirs, os.getcwd()]


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
    def fromfile(cls, filename: str | os.PathLike, import_custom_modules: bool = True) -> Config:
        """Load a ``.py``, ``.json``, ``.yaml`` or ``.yml`` config, resolving ``_base_``.

        With ``import_custom_modules`` (the default, as in mmengine), the config file's
        directory and the working directory join the import path and the modules of its
        ``custom_imports`` are imported now (``stratagem.config.imports``): a module that
        fails to import is a :class:`ConfigError` naming it, before anything is built.
        """
        path = Path(filename).expanduser().absolute()
        cfg = cls(cls._load_with_bases(path, chain=()), filename=path)
        if import_custom_modules:
            from .imports import import_custom_modules as do_import

            do_import(cfg.get('custom_imports'), search_dirs=config_search_dirs(cfg))
        return cfg

    @classmethod
    def _load_with_bases(cls, path: Path, chain: tuple[Path, ...]) -> dict:
        """The file's dict merged over its bases', as mmengine's ``Config`` reads it: a
        ``{{_base_.x}}`` placeholder (any format) takes the bases' value of ``x``, and a
        ``.py`` file's code sees the merged bases as ``_base_`` (``_base_.max_epochs``)."""
        if path in chain:
            cycle = ' -> '.join(str(p) for p in (*chain, path))
            raise ConfigError(f'circular _base_ in config files: {cycle}')
        text, placeholders = _base_placeholders(_read_text(path))
        bases = _base_files(text, path)
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
        raw = cls._read_file(path, text, merged)
        raw.pop(BASE_KEY, None)
        raw = _substitute_base_vars(raw, placeholders, merged, path)
        return merge_dicts(merged, raw)

    @staticmethod
    def _read_file(path: Path, text: str, bases: dict) -> dict:
        suffix = path.suffix.lower()
        if suffix == '.py':
            return _exec_py_config(text, path, ConfigDict(copy.deepcopy(bases)))
        if suffix == '.json':
            try:
                data = json.loads(text) if text.strip() else {}
            except json.JSONDecodeError as e:
                raise ConfigError(f'{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}') from e
        else:
            data = _load_yaml(text, path)
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
                        node[idx] = to_config_value(value)
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
