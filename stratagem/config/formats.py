"""Config file formats: the suffixes a config file may have, running a ``.py`` config, and
writing a config back as python text (only literals can be written)."""

from __future__ import annotations

import ast
import pprint
import types
from pathlib import Path
from typing import Any

from stratagem.schema import is_plain_data

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


def _parse_py(text: str, path: Path) -> ast.Module:
    try:
        return ast.parse(text, str(path))
    except SyntaxError as e:
        raise ConfigError(
            f'{path}:{e.lineno}: syntax error in config: {e.msg}\n    {(e.text or "").rstrip()}'
        ) from e


def _assigns_base(node: ast.stmt) -> bool:
    """Whether ``node`` is the file's ``_base_ = ...`` (read apart, as mmengine does)."""
    return (
        isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id == '_base_'
    )


# what a config file's code defines or imports that is no config key (mmengine's Config
# drops modules and functions; a class defined or imported for a registration is no key)
_NOT_KEYS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)


def _exec_py_config(text: str, path: Path, bases: Any = None) -> dict:
    """Run a ``.py`` config (its ``_base_ = ...`` line left out) with ``_base_`` bound to
    ``bases``, the merged dict of its base files; returns its variables, without dunder
    names, modules, classes and functions."""
    tree = _parse_py(text, path)
    tree.body = [node for node in tree.body if not _assigns_base(node)]
    code = compile(tree, str(path), 'exec')
    namespace: dict[str, Any] = {
        '__file__': str(path),
        '__name__': '__stratagem_config__',
        '_base_': bases if bases is not None else {},
    }
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
    imported = _imported_names(tree)
    return {
        k: v
        for k, v in namespace.items()
        if not k.startswith('__')
        and k != '_base_'
        and not isinstance(v, _NOT_KEYS)
        and not (k in imported and not is_plain_data(v))
    }


def _imported_names(tree: ast.Module) -> set[str]:
    """The names a config file's top-level imports bind (an imported registry is no key;
    an imported dict of settings still is)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split('.')[0] for a in node.names)
    return names
