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
