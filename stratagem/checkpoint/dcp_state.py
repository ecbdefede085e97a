"""The state dicts a sharded (DCP) checkpoint saves and loads: converting an optimizer state
between FQN keys (``get_optimizer_state_dict``, what ``sharded.py`` saves) and ``torch.optim``'s
flat parameter indices (``optim_state_to_fqn``, ``optim_state_to_index``), and walking a state's
tensors (``local_tensors``: this rank's shards; ``_fresh_tensors``: new ones to load into).
Reading and writing the checkpoint is ``sharded.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

_OPTIM_TENSOR_KEYS = ('state', 'param_groups')


def local_tensors(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by this rank's local shard (for validation)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):  # an OrderedDict stays one (validation checks the type)
        return type(obj)((k, local_tensors(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(local_tensors(v) for v in obj)
    return obj


def _fresh_tensors(obj: Any) -> Any:
    """``obj`` with every tensor (DTensors keep their sharding) replaced by a new,
    uninitialised one of the same shape and dtype: DCP's load overwrites each of them whole
    (a key the checkpoint lacks is an error), so copying the old values would be wasted."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj.detach())
    if isinstance(obj, dict):
        return type(obj)((k, _fresh_tensors(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_fresh_tensors(v) for v in obj)
    return obj


def optim_state_to_index(optim: Mapping) -> dict:
    """An FQN-keyed optimizer state (``get_optimizer_state_dict``) → ``torch.optim``'s flat
    parameter indices, numbered in ``param_groups`` order."""
    groups: list = []
    index: dict = {}
    for group in optim['param_groups']:
        ids = []
        for name in group['params']:
            index.setdefault(name, len(index))
            ids.append(index[name])
        groups.append({**group, 'params': ids})
    state = {index[name]: value for name, value in optim.get('state', {}).items()}
    rest = {k: v for k, v in optim.items() if k not in _OPTIM_TENSOR_KEYS}
    return {**rest, 'state': state, 'param_groups': groups}


def optim_state_to_fqn(optim: Mapping, names: list[list[str]]) -> dict:
    """A ``torch.optim`` (index-keyed) state → FQN keys; ``names[g]`` are group ``g``'s
    parameter FQNs in order. Raises ``ValueError`` if the group sizes differ."""
    groups = optim['param_groups']
    if len(groups) != len(names) or any(len(g['params']) != len(n) for g, n in zip(groups, names)):
        raise ValueError(
            f"the checkpoint's optimizer has param groups of sizes "
            f'{[len(g["params"]) for g in groups]}, this one '
            f'{[len(n) for n in names]}; it was saved for another model/optimizer'
        )
    mapping = {i: n for g, ns in zip(groups, names) for i, n in zip(g['params'], ns)}
    rest = {k: v for k, v in optim.items() if k not in _OPTIM_TENSOR_KEYS}
    return {
        **rest,
        'state': {mapping[i]: v for i, v in optim.get('state', {}).items()},
        'param_groups': [{**g, 'params': list(ns)} for g, ns in zip(groups, names)],
    }
