"""A config's own code: ``custom_imports`` and where it (and a dotted ``type``) is found.

``custom_imports = dict(imports=['mypkg', 'mypkg.models'], allow_failed_imports=False)`` has
mmengine's meaning: the modules are imported before anything of the config is built, so the
classes they register (``stratagem.registry.MODELS.register_module()``, ``DATASETS``, ...) build
by name. :meth:`Config.fromfile` calls :func:`import_custom_modules` (so ``stratagem train``,
``doctor`` and every torchrun worker import them, each process for itself), and so does
``stratagem.loop.train`` for a config given as a dict.

Where they are found: ``sys.path``, plus the config file's directory and the working directory
(:func:`add_import_paths`; appended after ``sys.path``, so a file beside the config never shadows
an installed package). A dotted ``type='mypkg.models.TinyNet'`` in any registry is imported from
the same places (``stratagem.registry``), without a registration and without ``custom_imports``.

A failed import is an error naming the module and why: not found (with where it looked), or its
own code raising (the exception and the line). ``allow_failed_imports=True`` turns it into a
warning, as in mmengine.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

from .errors import ConfigError, ConfigWarning

__all__ = ['add_import_paths', 'import_custom_modules']

_KEYS = ('imports', 'allow_failed_imports')


def add_import_paths(dirs: Iterable[str | os.PathLike]) -> list[str]:
    """Append each directory in ``dirs`` that ``sys.path`` lacks to ``sys.path`` (absolute,
    in order); returns ``sys.path``'s directories that ``import`` now searches beyond the
    installed ones, for messages. The working directory is one of them only if given."""
    added = []
    present = {os.path.abspath(p or os.curdir) for p in sys.path}
    for d in dirs:
        path = os.path.abspath(d)
        added.append(path)
        if path not in present:
            sys.path.append(path)
            present.add(path)
    return added


def import_custom_modules(
    custom_imports: Mapping[str, Any] | None,
    search_dirs: Iterable[str | os.PathLike] = (),
) -> list[ModuleType]:
    """Import the modules of a config's ``custom_imports`` and return them.

    Args:
        custom_imports: ``dict(imports=<module name or list of names>,
            allow_failed_imports=False)``; ``None`` or empty imports nothing.
        search_dirs: Directories added to ``sys.path`` first (:func:`add_import_paths`):
            the config file's directory and the working directory.

    Raises:
        ConfigError: ``custom_imports`` is malformed (naming the key and the form), or a
            module cannot be imported and ``allow_failed_imports`` is false (naming the module:
            not found, with the directories searched, or the exception its own code raised).
    """
    dirs = add_import_paths(search_dirs)
    if custom_imports is None:
        return []
    if not isinstance(custom_imports, Mapping):
        raise ConfigError(
            f"custom_imports must be a dict like dict(imports=['mypkg'], "
            f'allow_failed_imports=False), got {type(custom_imports).__name__}: '
            f'{custom_imports!r}'
        )
    unknown = sorted(set(custom_imports) - set(_KEYS))
    if unknown:
        raise ConfigError(f'custom_imports: unknown key(s) {unknown}; valid: {", ".join(_KEYS)}')
    names = custom_imports.get('imports', [])
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f'custom_imports.imports must be a module name or a list of module names, got {names!r}'
        )
    allow_failed = custom_imports.get('allow_failed_imports', False)
    if not isinstance(allow_failed, bool):
        raise ConfigError(
            f'custom_imports.allow_failed_imports must be True or False, got {allow_failed!r}'
        )
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except Exception as err:  # the module's own code may raise anything
            message = import_failure(name, err, dirs)
            if not allow_failed:
                raise ConfigError(message) from err
            warnings.warn(f'{message}; skipped (allow_failed_imports=True)', ConfigWarning,
                          stacklevel=2)  # fmt: skip
    return modules


def import_failure(name: str, err: BaseException, dirs: Iterable[str] = ()) -> str:
    """Why importing module ``name`` failed, for a user: the module (or a parent package) not
    found, with the directories searched besides the installed packages; or the exception its
    own code raised and the line that raised it."""
    missing = getattr(err, 'name', None) if isinstance(err, ModuleNotFoundError) else None
    if missing is not None and (name == missing or name.startswith(f'{missing}.')):
        where = ', '.join(dict.fromkeys(dirs)) or 'sys.path only'
        return (
            f'custom_imports: cannot import {name!r}: no module named {missing!r} on the import '
            f'path (searched the installed packages and: {where}); put it beside the config '
            'or in the working directory, install it, or add its directory to PYTHONPATH'
        )
    frames = traceback.extract_tb(err.__traceback__)
    own = [f for f in frames if not f.filename.startswith('<frozen')]
    at = f' ({own[-1].filename}:{own[-1].lineno})' if own else ''
    return (
        f'custom_imports: importing {name!r} failed in its own code{at}: '
        f'{type(err).__name__}: {err}'
    )
