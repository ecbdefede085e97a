"""Merging and overrides: :func:`merge_dicts` (``_base_`` files and ``merge_from_dict``, with
``_delete_``) and :func:`parse_cfg_options` (``--cfg-options KEY=VALUE`` items to values)."""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import ConfigError

DELETE_KEY = '_delete_'


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
        value = _dict_call(text)
        if value is not None:
            return value
    else:
        # bare "1,2" reads as a tuple in python; mmengine's overrides make it a list
        return list(value) if isinstance(value, tuple) and not text.startswith('(') else value
    if len(text) >= 2 and text[0] + text[-1] in ('[]', '()'):
        # bare words in brackets, e.g. [cat,dog] or [a,[1,b]] (mmengine's DictAction)
        items = [_parse_value(part.strip()) for part in _split_top_level(text[1:-1]) if part]
        return items if text[0] == '[' else tuple(items)
    parts = _split_top_level(text) if ',' in text else [text]
    if len(parts) > 1:
        return [_parse_value(part) for part in parts if part != '']
    return text


def _dict_call(text: str) -> dict | None:
    """``dict(type='norm', max_norm=5.0)`` (keyword arguments of literals, or of such calls
    nested) as the dict it writes, as a config file would; None for any other text."""
    try:
        node = ast.parse(text.strip(), mode='eval').body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    return _literal_dict(node)


def _literal_dict(node: ast.AST) -> dict | None:
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == 'dict'
        and not node.args
        and all(kw.arg is not None for kw in node.keywords)
    ):
        return None
    out: dict[str, Any] = {}
    for kw in node.keywords:
        nested = _literal_dict(kw.value)
        if nested is not None:
            out[str(kw.arg)] = nested
            continue
        try:
            out[str(kw.arg)] = ast.literal_eval(kw.value)
        except (ValueError, SyntaxError, TypeError):
            return None
    return out


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


def _schema_sections() -> dict[str, frozenset[str]]:
    """The sections whose whole key set the schema documents (a key outside it is an error
    where the section is read), by dotted path."""
    from stratagem import schema

    return {
        'train_cfg': schema.TRAIN_CFG_KEYS,
        'train_dataloader': schema.TRAIN_DATALOADER_KEYS,
        'randomness': schema.RANDOMNESS_KEYS,
        'strategy.env_kwargs': schema.ENV_KEYS,
        'strategy.env_kwargs.randomness': schema.RANDOMNESS_KEYS,
    }


def check_overrides(cfg: Any, options: Mapping[str, Any]) -> None:
    """Refuse a ``--cfg-options`` key that would change nothing: one the config lacks that
    is no documented key of its section, or that looks like a typo of a key it has.

    A key the config has passes. One it lacks passes when the schema documents it
    (``train_cfg.preemption``, ``randomness.seed``, ... :mod:`stratagem.schema`), or when it
    is a new argument of a built object (``model.dropout``, ``optim_wrapper.clip_grad``:
    the build refuses an argument its class does not take) that resembles no key of the
    config. Otherwise a ``ConfigError`` names the key, the closest keys (``lr`` → did you
    mean ``optim_wrapper.optimizer.lr``?) and, in a documented section, its valid keys.
    mmengine adds such keys silently, and ``Config.merge_from_dict`` only warns: this is the
    strict check of the command line. ``cfg``: a ``Config`` or a mapping.
    """
    from .keys import _did_you_mean, _dotted_keys

    known = _dotted_keys(cfg.to_dict() if hasattr(cfg, 'to_dict') else cfg)
    sections = _schema_sections()
    documented = {f'{s}.{k}' for s, keys in sections.items() for k in keys}
    for full_key in options:
        key = str(full_key)
        if key in known or key in documented or any(k.startswith(f'{key}.') for k in known):
            continue
        parts = key.split('.')
        # the deepest section the config (or the schema) has, and the first new name in it
        depth = max(
            (i for i in range(1, len(parts)) if '.'.join(parts[:i]) in known | set(sections)),
            default=0,
        )
        section, new = '.'.join(parts[:depth]), parts[depth]
        if section and f'{section}.{new}' in documented:
            continue  # e.g. train_cfg.preemption.exit_code with no preemption in the config
        if not section:  # a new top-level name: the same name elsewhere (lr), or a near one
            hint = _did_you_mean(key, known | documented)
        else:  # inside a section: only a near spelling of a name beside it (optimzer)
            hint = _did_you_mean(f'{section}.{new}', _children(section, known | documented))
        if section in sections:
            valid = ', '.join(sorted(sections[section]))
            raise ConfigError(
                f'unknown key {key!r} in --cfg-options: {section} has no {new!r}'
                + (f'; {hint} ' if hint else '; ')
                + f'valid keys of {section}: {valid}'
            )
        if hint:
            raise ConfigError(
                f'unknown key {key!r} in --cfg-options: the config has no such key, so '
                f'setting it would change nothing; {hint}'
            )


def _children(section: str, keys: set[str]) -> set[str]:
    """The keys directly under ``section`` (dotted paths)."""
    return {k for k in keys if k.rpartition('.')[0] == section}
