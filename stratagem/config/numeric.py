"""The numbers-as-strings rule: :data:`NUMERIC_KEYS` and :func:`normalize_numbers`.

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

import warnings
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError, ConfigWarning

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
#: config keys whose values must be numbers (plus every key ending in ``_mult``: paramwise_cfg);
#: a string there that reads as a number is converted, with a warning
NUMERIC_KEYS = _INT_KEYS | _FLOAT_KEYS
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
