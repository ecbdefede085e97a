"""What a checkpoint may hold: tensors and plain Python values, nothing that needs code to load.

``validate_checkpoint_content`` walks the object before anything is written, so a state that
``torch.load(weights_only=True)`` could not read back fails the save with the key path, and the
previous checkpoint is untouched. The allowed types are those the weights-only unpickler of
torch >= 2.4 reads without ``add_safe_globals`` (checked against torch 2.13).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray,
            torch.dtype, torch.device, torch.Size)
_SCALAR_TYPES = frozenset(_SCALARS)
_CONTAINERS = frozenset((dict, OrderedDict, list, tuple, set))
_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))

_RULE = 'checkpoints hold only tensors and plain values so they load with weights_only=True'


def validate_checkpoint_content(obj: Any, root: str = 'checkpoint') -> None:
    """Raise ``TypeError`` naming the first key path whose value ``weights_only`` cannot load.

    Allowed: ``torch.Tensor`` / ``nn.Parameter`` (any dtype, layout, device), ``None``, bool,
    int, float, complex, str, bytes, bytearray, ``torch.dtype``, ``torch.device``,
    ``torch.Size``; and dict / OrderedDict / list / tuple / set of those, nested. Dict keys and
    set items must be scalars or tuples of scalars. Subclasses (namedtuples, ``ConfigDict``,
    ``defaultdict``, enums, tensor subclasses) are refused: the weights-only unpickler refuses
    them too.
    """
    _walk(obj, root, set())


def _walk(obj: Any, path: str, on_path: set[int]) -> None:
    kind = type(obj)
    if kind in _TENSOR_TYPES or kind in _SCALAR_TYPES:
        return
    if kind not in _CONTAINERS:
        raise TypeError(f'{path} is {_describe(obj)}; {_RULE}. {_fix(obj)}')
    if id(obj) in on_path:
        raise TypeError(f'{path} contains itself (a reference cycle); {_RULE}')
    on_path.add(id(obj))
    if kind in (dict, OrderedDict):
        for key, value in obj.items():
            if not _is_plain_key(key):
                raise TypeError(f'{path} has a key {_describe(key)}; dict keys in a checkpoint '
                                f'must be str, int, float, bool, None or tuples of those')
            _walk(value, f'{path}[{key!r}]', on_path)
    elif kind is set:
        for item in obj:
            if not _is_plain_key(item):
                raise TypeError(f'{path} holds {_describe(item)}; {_RULE}')
    else:
        for index, value in enumerate(obj):
            _walk(value, f'{path}[{index}]', on_path)
    on_path.discard(id(obj))


def _is_plain_key(key: Any) -> bool:
    if type(key) is tuple:
        return all(_is_plain_key(k) for k in key)
    return type(key) in (str, int, float, bool, type(None), bytes)


def _describe(obj: Any) -> str:
    kind = type(obj)
    qualname = f'{kind.__module__}.{kind.__qualname__}'
    if callable(obj) and hasattr(obj, '__qualname__') and not isinstance(obj, type):
        return f'a function ({getattr(obj, "__module__", "?")}.{obj.__qualname__})'
    if isinstance(obj, type):
        return f'a class ({obj.__module__}.{obj.__qualname__})'
    if isinstance(obj, torch.Tensor):
        return f'a tensor subclass ({qualname})'
    return f'a {qualname} ({_short_repr(obj)})'


def _short_repr(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:  # a broken __repr__ must not hide the real error
        text = '<unrepresentable>'
    return text if len(text) <= 60 else text[:57] + '...'


def _fix(obj: Any) -> str:
    module = type(obj).__module__.split('.')[0]
    if module == 'numpy':
        return 'Fix: convert numpy values with .item() / .tolist() or torch.from_numpy(...).'
    if isinstance(obj, torch.Tensor):
        return 'Fix: store a plain tensor (e.g. tensor.as_subclass(torch.Tensor)) or the local shard.'
    if hasattr(obj, 'state_dict') and callable(obj.state_dict):
        return 'Fix: store obj.state_dict() instead of the object.'
    if isinstance(obj, dict):
        return 'Fix: convert it to a plain dict (e.g. dict(x) or cfg.to_dict()).'
    if isinstance(obj, tuple):
        return 'Fix: convert it to a plain tuple or dict (e.g. tuple(x) or x._asdict()).'
    return 'Fix: convert it to a plain value or tensor, or leave it out of the checkpoint.'
