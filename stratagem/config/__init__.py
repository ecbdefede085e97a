"""Strict config dicts and config files.

:class:`ConfigDict` is an ``addict.Dict`` with attribute and item access where
reading a missing key raises (``AttributeError`` / ``KeyError`` naming the key)
instead of silently creating an empty dict. :class:`Config` loads ``.py``,
``.json`` and ``.yaml``/``.yml`` files with ``_base_`` inheritance, applies
``--cfg-options`` style overrides and dumps back to any of those formats.

The numbers-as-strings rule is in ``stratagem.config.numeric``. Modules:

- ``configdict.py``: the strict :class:`ConfigDict`;
- ``configfile.py``: :class:`Config` (``fromfile`` with ``_base_`` as mmengine reads it:
  ``{{_base_.x}}`` placeholders and a ``.py`` file's ``_base_.x``; ``merge_from_dict``, ``dump``);
- ``formats.py``: config file suffixes, running ``.py`` configs (their modules, classes,
  functions and imported objects are no keys), writing python text;
- ``overrides.py``: :func:`merge_dicts` and ``--cfg-options`` parsing (:func:`parse_cfg_options`);
- ``numeric.py``: :data:`NUMERIC_KEYS` and :func:`normalize_numbers`;
- ``keys.py``: :func:`check_keys` and the "did you mean" hint for overrides;
- ``imports.py``: ``custom_imports`` (:func:`import_custom_modules`) and the import path
  of a config's own code;
- ``errors.py``: the exceptions and :class:`ConfigWarning`.
"""

from .configdict import ConfigDict
from .configfile import BASE_KEY as BASE_KEY
from .configfile import Config, config_search_dirs
from .errors import (
    ConfigAttributeError,
    ConfigError,
    ConfigErrors,
    ConfigKeyError,
    ConfigWarning,
)
from .imports import import_custom_modules
from .keys import check_keys
from .numeric import NUMERIC_KEYS, normalize_numbers
from .overrides import DELETE_KEY as DELETE_KEY
from .overrides import merge_dicts, parse_cfg_options

__all__ = [
    'ConfigDict',
    'Config',
    'ConfigError',
    'ConfigErrors',
    'ConfigKeyError',
    'ConfigAttributeError',
    'ConfigWarning',
    'check_keys',
    'config_search_dirs',
    'import_custom_modules',
    'parse_cfg_options',
    'merge_dicts',
    'normalize_numbers',
    'NUMERIC_KEYS',
]
