"""Sharded (DCP) checkpoints: one directory, committed through ``directory.py``'s protocol.

Layout of ``NAME/`` (every file listed in ``NAME/manifest.json`` with size and digest):

- ``.metadata``, ``__{rank}_{i}.distcp``: ``torch.distributed.checkpoint`` (DCP) files of
  ``{'state_dict': model, 'optimizer': {'state', 'param_groups'}}``, keyed by parameter FQN
  (``'fqn'``) or, in a checkpoint converted from a single file, by flat parameter index
  (``'index'``); the manifest's ``optimizer_keys`` says which.
- ``extra.pth`` (rank 0): everything else, a ``torch.save`` dict of plain values loadable with
  ``weights_only=True``: ``meta``, ``param_schedulers``, ``rng_states``, the optimizer's
  non-tensor keys (``optimizer_extra``: counters, loss scaler) and any ``extra_ckpt`` keys.
- ``partial_grads/rank_{r}.pth`` (each rank, only when saved inside an accumulation window):
  that rank's unsynchronised gradients.

Every rank verifies before anything is read (``verify_directory``); DCP's own unpickler only
ever sees files whose hashes matched.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .content import SAFE_GLOBALS_KEY, validate_checkpoint_content
from .directory import save_directory, verify_directory
from .load import load_checkpoint_file

__all__ = ['save_sharded_checkpoint', 'read_sharded_checkpoint', 'load_dcp_into',
           'is_sharded_checkpoint', 'optim_state_to_fqn', 'optim_state_to_index',
           'EXTRA_FILE', 'DCP_KEYS']

EXTRA_FILE = 'extra.pth'
PARTIAL_DIR = 'partial_grads'
DCP_KEYS = ('state_dict', 'optimizer')
_OPTIM_TENSOR_KEYS = ('state', 'param_groups')


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory holding DCP metadata (ours or a raw ``dcp.save``)."""
    return Path(path).is_dir() and (Path(path) / '.metadata').is_file()


def save_sharded_checkpoint(final_dir: str | os.PathLike, checkpoint: Mapping, *,
                            step: int | None = None, extra_manifest: dict | None = None,
                            partial_grads: dict | None = None, optimizer_keys: str = 'fqn',
                            collective: bool = True) -> Path:
    """Collectively save ``checkpoint`` (mmengine's layout) as a sharded directory.

    ``checkpoint['state_dict']`` and ``checkpoint['optimizer']``'s ``state``/``param_groups``
    go to DCP (DTensors are saved shard by shard); everything else to ``extra.pth`` (rank 0).
    ``partial_grads``: this rank's pending gradients, written to its own file. Every rank
    calls this (``collective=False``: a single process without a process group, as
    ``stratagem convert`` does). Returns the committed path.
    """
    import torch.distributed.checkpoint as dcp

    rank = _rank() if collective else 0
    optimizer = dict(checkpoint.get('optimizer') or {})
    tensors = {'state_dict': checkpoint['state_dict']}
    if optimizer:
        tensors['optimizer'] = {k: optimizer.pop(k) for k in _OPTIM_TENSOR_KEYS if k in optimizer}
    extra = {k: v for k, v in checkpoint.items() if k not in DCP_KEYS}
    if optimizer:
        extra['optimizer_extra'] = optimizer

    def write(staging: Path) -> list[Path]:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(staging, thread_count=1),
                 no_dist=not collective)
        mine = [p for p in staging.iterdir() if re.fullmatch(rf'__{rank}_\d+\.distcp', p.name)]
        if partial_grads is not None:
            (staging / PARTIAL_DIR).mkdir(exist_ok=True)
            mine.append(staging / PARTIAL_DIR / f'rank_{rank}.pth')
            torch.save(partial_grads, mine[-1])
        if rank == 0:
            torch.save(extra, staging / EXTRA_FILE)
            mine += [staging / '.metadata', staging / EXTRA_FILE]
        return mine

    held = validate_checkpoint_content(extra)  # allow-listed classes: named to a loader lacking one
    manifest = {'state_dict_type': 'sharded', 'optimizer_keys': optimizer_keys,
                **({SAFE_GLOBALS_KEY: held} if held else {}), **(extra_manifest or {})}
    if collective:
        return save_directory(final_dir, write, step=step, extra_manifest=manifest)
    from .commit import commit_directory
    with commit_directory(final_dir, step=step, extra_manifest={'world_size': 1, **manifest}) \
            as staging:
        write(staging)
    return Path(final_dir).absolute()


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def read_sharded_checkpoint(path: str | os.PathLike, *, collective: bool = False,
                            progress: Callable[[int, int], None] | None = None) -> dict:
    """Verify, then read a sharded directory into one full (unsharded) mmengine-layout dict.

    The optimizer comes back keyed by flat parameter index (``torch.optim``'s format), so a
    SingleDeviceStrategy / DDPStrategy / plain optimizer loads it. Needs no process group
    (each caller reads everything itself); ``collective=True`` shares the hashing across ranks.
    ``progress(done, total)`` is called per file verified (for a progress bar).
    """
    path = Path(path).absolute()
    manifest = verify_directory(path, collective=collective)
    if progress is not None:
        progress(len(manifest['files']), len(manifest['files']))
    full = _read_dcp_full(path)
    extra = _read_extra(path)
    checkpoint = {'meta': extra.pop('meta', {}), 'state_dict': full.get('state_dict', {})}
    if 'optimizer' in full:
        optim = {**full['optimizer'], **extra.pop('optimizer_extra', {})}
        if manifest.get('optimizer_keys', 'fqn') == 'fqn':
            optim = optim_state_to_index(optim)
        else:  # DCP flattening turned the int keys into strings
            optim['state'] = {int(k): v for k, v in optim.get('state', {}).items()}
        checkpoint['optimizer'] = optim
    partial = read_partial_grads(path)
    if partial:
        checkpoint['partial_grads_fqn'] = partial
    checkpoint.update(extra)
    return checkpoint


def _read_dcp_full(path: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    state: dict = {}
    # as format_utils.dcp_to_torch_save does: the public dcp.load only fills existing keys
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(path),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def _read_extra(path: Path) -> dict:
    if not (path / EXTRA_FILE).is_file():
        return {}
    return dict(load_checkpoint_file(path / EXTRA_FILE, map_location='cpu', verify=False))


def read_partial_grads(path: str | os.PathLike) -> list[dict]:
    """Every saving rank's pending gradients (``{fqn: tensor}``), in rank order; [] if none."""
    folder = Path(path) / PARTIAL_DIR
    if not folder.is_dir():
        return []
    files = sorted(folder.glob('rank_*.pth'), key=lambda p: int(p.stem.split('_')[1]))
    return [load_checkpoint_file(f, map_location='cpu', verify=False) for f in files]


def load_dcp_into(path: str | os.PathLike, state: dict) -> dict:
    """Load the DCP part of a verified directory in place into ``state`` (whose DTensors
    give the current sharding: this reshards N → M ranks). Collective. Returns
    ``extra.pth``'s dict."""
    import torch.distributed.checkpoint as dcp
    dcp.load(state, storage_reader=dcp.FileSystemReader(Path(path)))
    return _read_extra(Path(path))


def optim_state_to_index(optim: Mapping) -> dict:
    """An FQN-keyed optimizer state (``get_optimizer_state_dict``) → ``torch.optim``'s flat
    parameter indices, numbered in ``param_groups`` order."""
    groups, index = [], {}
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
    if len(groups) != len(names) or any(len(g['params']) != len(n)
                                        for g, n in zip(groups, names)):
        raise ValueError(f'the checkpoint\'s optimizer has param groups of sizes '
                         f'{[len(g["params"]) for g in groups]}, this one '
                         f'{[len(n) for n in names]}; it was saved for another model/optimizer')
    mapping = {i: n for g, ns in zip(groups, names) for i, n in zip(g['params'], ns)}
    rest = {k: v for k, v in optim.items() if k not in _OPTIM_TENSOR_KEYS}
    return {**rest, 'state': {mapping[i]: v for i, v in optim.get('state', {}).items()},
            'param_groups': [{**g, 'params': list(ns)} for g, ns in zip(groups, names)]}
