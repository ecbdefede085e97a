"""Config file formats: the suffixes a config file may have, running a ``.py`` config, and
writing a config back as python text (only literals can be written)."""

from __future__ import annotations

import pprint
import types
from pathlib import Path
from typing import Any

from .errors import ConfigError

_SUFFIXES = ('.py', '.json', '.yaml', '.yml')


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
