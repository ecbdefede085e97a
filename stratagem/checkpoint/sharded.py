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

This module owns the layout, the save and the reads (verified, into mmengine's layout). The
files DCP writes, sized beforehand and hashed as written, are ``dcp_writer.py``'s; DCP's reads
``dcp_load.py``'s; the optimizer-state key conversions and tensor walks ``dcp_state.py``'s.
Those names are re-exported here.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .commit import (  # noqa: F401 - as .dcp_writer below
    _OVERHEAD_BYTES,
    _crc32_option,
    check_free_space,
    payload_bytes,
    write_torch_file,
)
from .content import SAFE_GLOBALS_KEY, validate_checkpoint_content
from .dcp_load import _dcp_keys, _dcp_read, _read_dcp_full, _reader
from .dcp_state import (
    _OPTIM_TENSOR_KEYS,
    _fresh_tensors,
    local_tensors,
    optim_state_to_fqn,
    optim_state_to_index,
)
from .dcp_writer import (  # noqa: F401 - re-exported: importers use them from here
    _OVERLAP_BYTES,
    _bytes_needed,
    _hashing_fs,
    _HashingStream,
    _ranks_sharing_disk,
)
from .directory import (  # noqa: F401 - as .dcp_writer above
    _all_ok,
    _raise_first,
    dcp_failures,
    describe_error,
    save_directory,
    verify_directory,
)
from .load import load_checkpoint_file
from .manifest import file_entry, new_hasher  # noqa: F401 - as .dcp_writer above

__all__ = [
    'save_sharded_checkpoint',
    'read_sharded_checkpoint',
    'load_sharded_checkpoint',
    'read_sharded_header',
    'load_sharded_in_place',
    'local_tensors',
    'is_sharded_checkpoint',
    'optim_state_to_fqn',
    'optim_state_to_index',
    'EXTRA_FILE',
    'DCP_KEYS',
]

EXTRA_FILE = 'extra.pth'
GROUPS_KEY = 'optimizer_param_groups'  # extra.pth: a copy of the param groups (small)
PARTIAL_DIR = 'partial_grads'
DCP_KEYS = ('state_dict', 'optimizer')


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory holding DCP metadata (ours or a raw ``dcp.save``)."""
    return Path(path).is_dir() and (Path(path) / '.metadata').is_file()


def save_sharded_checkpoint(
    final_dir: str | os.PathLike,
    checkpoint: Mapping,
    *,
    step: int | None = None,
    extra_manifest: dict | None = None,
    partial_grads: dict | None = None,
    optimizer_keys: str = 'fqn',
    collective: bool = True,
    vote: Any = None,
    process_group: Any = None,
) -> Path:
    """Collectively save ``checkpoint`` (mmengine's layout) as a sharded directory.

    ``checkpoint['state_dict']`` and ``checkpoint['optimizer']``'s ``state``/``param_groups``
    go to DCP (DTensors are saved shard by shard); everything else to ``extra.pth`` (rank 0).
    ``partial_grads``: this rank's pending gradients, written to its own file. Every rank
    calls this (``collective=False``: a single process without a process group, as
    ``stratagem convert`` does). ``vote``: the save's ``SaveVote`` (else ``save_directory``
    opens one); ``process_group``: the group DCP's planning runs on (default: the default
    group; an asynchronous save passes a group of its writer's own). Returns the committed
    path.
    """
    import torch.distributed.checkpoint as dcp

    from stratagem import env  # imported on use: see checkpoint/__init__.py

    rank = env.get_rank() if collective else 0
    optimizer = dict(checkpoint.get('optimizer') or {})
    tensors = {'state_dict': checkpoint['state_dict']}
    if optimizer:
        tensors['optimizer'] = {k: optimizer.pop(k) for k in _OPTIM_TENSOR_KEYS if k in optimizer}
    extra = {k: v for k, v in checkpoint.items() if k not in DCP_KEYS}
    if optimizer:
        extra['optimizer_extra'] = optimizer
    if 'param_groups' in tensors.get('optimizer', {}):  # checked before an in-place resume
        extra[GROUPS_KEY] = tensors['optimizer']['param_groups']

    side_objects = ([partial_grads] if partial_grads is not None else []) + (
        [extra] if rank == 0 else []
    )

    def write(staging: Path) -> list[dict]:
        # every file is hashed as it is written and fsynced once: no second read. torch's
        # per-record zip CRC32 (DCP torch.saves each tensor) is off: our digest covers every
        # byte. Rank 0's extra.pth (and a rank's pending gradients) are written on a thread
        # meanwhile, mostly overlapping DCP's planning collectives and its fsync.
        # a full disk is refused before anything is written (the staging dir is still empty)
        check_free_space(
            Path(final_dir).absolute(), _bytes_needed(tensors, side_objects) * _ranks_sharing_disk()
        )
        writer = dcp.FileSystemWriter(staging, thread_count=1)
        side = []
        if partial_grads is not None:
            (staging / PARTIAL_DIR).mkdir(exist_ok=True)
            side.append((partial_grads, staging / PARTIAL_DIR / f'rank_{rank}.pth'))
        if rank == 0:
            side.append((extra, staging / EXTRA_FILE))
        with (
            ThreadPoolExecutor(1, thread_name_prefix='stratagem-hash') as pool,
            ThreadPoolExecutor(1, thread_name_prefix='stratagem-extra') as aside,
        ):
            pending = [aside.submit(write_torch_file, obj, path) for obj, path in side]
            writer.fs = fs = _hashing_fs(pool)
            with _crc32_option(False), warnings.catch_warnings():
                # one process on purpose (convert): not DCP's "assuming ..." guess
                warnings.filterwarnings('ignore', message='torch.distributed is disabled')
                dcp.save(
                    tensors,
                    storage_writer=writer,
                    no_dist=not collective,
                    process_group=process_group,
                )
            mine = [
                _entry(p, *fs.written[os.fspath(p)])
                for p in staging.iterdir()
                if re.fullmatch(rf'__{rank}_\d+\.distcp', p.name)
                or (rank == 0 and p.name == '.metadata')
            ]
            mine += [{**job.result(), 'path': path} for job, (_, path) in zip(pending, side)]
        return mine

    held = validate_checkpoint_content(extra)  # allow-listed classes: named to a loader lacking one
    manifest = {
        'state_dict_type': 'sharded',
        'optimizer_keys': optimizer_keys,
        'dcp_keys': sorted(tensors),
        **({SAFE_GLOBALS_KEY: held} if held else {}),
        **(extra_manifest or {}),
    }
    if collective:
        return save_directory(final_dir, write, step=step, extra_manifest=manifest, vote=vote)
    from .commit import commit_directory

    with commit_directory(
        final_dir, step=step, extra_manifest={'world_size': 1, **manifest}
    ) as staging:
        write(staging)
    return Path(final_dir).absolute()


def _entry(path: Path, size: int, digest: str) -> dict:
    return file_entry(path, size, digest)  # type: ignore[arg-type]


def read_sharded_checkpoint(
    path: str | os.PathLike,
    *,
    collective: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Verify, then read a sharded directory into one full (unsharded) mmengine-layout dict.

    The optimizer comes back keyed by flat parameter index (``torch.optim``'s format), so a
    SingleDeviceStrategy / DDPStrategy / plain optimizer loads it. Needs no process group
    (each caller reads everything itself); ``collective=True`` shares the hashing across ranks.
    ``progress(done, total)`` is called per file verified (for a progress bar).
    """
    path = Path(path).absolute()
    manifest = verify_directory(path, collective=collective, progress=progress)
    return _read_full(path, manifest)


def _read_full(path: Path, manifest: dict) -> dict:
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
        checkpoint['partial_grads'] = partial
    checkpoint.update(extra)
    return checkpoint


def _read_extra(path: Path, groups: list | None = None) -> dict:
    """``extra.pth`` (already verified); the param groups' copy goes to ``groups``."""
    if not (path / EXTRA_FILE).is_file():
        return {}
    extra = dict(load_checkpoint_file(path / EXTRA_FILE, map_location='cpu', verify=False))
    saved = extra.pop(GROUPS_KEY, None)
    if groups is not None and saved is not None:
        groups.extend(saved)
    return extra


def read_sharded_header(path: str | os.PathLike, *, optimizer: bool) -> tuple[dict, Any] | None:
    """Verify a sharded directory (collective) and read all of it but the tensors, for a
    resume that reads them in place later (``load_sharded_in_place``), once every check
    passed. Returns ``(checkpoint, metadata)``: in ``checkpoint``, ``state_dict`` holds a
    ``meta``-device tensor of each saved shape and dtype (from DCP's metadata), ``optimizer``
    the saved param groups and the wrapper's counters (no ``state``); everything else is read
    as ``load_sharded_checkpoint`` reads it. ``metadata`` is DCP's, for the read (so it is
    not read twice). None when the checkpoint cannot be read that way (converted from a
    single file, saved before the param groups were kept in ``extra.pth``, or a model entry
    that is not a tensor): read it with ``load_sharded_checkpoint`` then."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path).absolute()
    manifest = verify_directory(path)
    if manifest.get('optimizer_keys', 'fqn') != 'fqn':
        return None
    dcp_metadata = _reader(path).read_metadata()
    metadata = dcp_metadata.state_dict_metadata
    weights = {}
    for key, item in metadata.items():
        if key.startswith('state_dict.'):
            if not isinstance(item, TensorStorageMetadata):
                return None
            weights[key[len('state_dict.') :]] = torch.empty(
                item.size, dtype=item.properties.dtype, device='meta'
            )
    groups: list = []
    extra = _read_extra(path, groups)
    saved_optimizer = any(key.startswith('optimizer.') for key in metadata)
    if optimizer and saved_optimizer and not groups:
        return None
    checkpoint = {'meta': extra.pop('meta', {}), 'state_dict': weights}
    if saved_optimizer:
        checkpoint['optimizer'] = {
            **extra.pop('optimizer_extra', {}),
            'param_groups': groups,
            'state': {},
        }
    partial = read_partial_grads(path)
    if partial:
        checkpoint['partial_grads'] = partial
    checkpoint.update(extra)
    return checkpoint, dcp_metadata


def load_sharded_in_place(path: str | os.PathLike, state: dict, *, metadata: Any = None) -> None:
    """DCP-read a verified sharded directory into ``state`` (``{'state_dict': ...,
    'optimizer': ...}``, this rank's live sharded state dicts) in place (collective);
    ``metadata``: DCP's, when already read (``read_sharded_header``).

    DCP plans the whole read before it reads a byte: a key or shape the checkpoint lacks
    fails there, with nothing changed. A read error after that (the files changed since they
    were verified, a failing disk) leaves the state partly read."""
    _dcp_read(Path(path).absolute(), state, metadata=metadata, what='into the model')


def read_partial_grads(path: str | os.PathLike) -> list[dict]:
    """Every saving rank's pending gradients (``{fqn: tensor}``), in rank order; [] if none."""
    folder = Path(path) / PARTIAL_DIR
    if not folder.is_dir():
        return []
    files = sorted(folder.glob('rank_*.pth'), key=lambda p: int(p.stem.split('_')[1]))
    return [load_checkpoint_file(f, map_location='cpu', verify=False) for f in files]


def load_sharded_checkpoint(
    path: str | os.PathLike, model_state: dict, optim_state: dict | None = None
) -> dict:
    """Verify a sharded directory (collective), then load it into the current sharding.

    ``model_state`` / ``optim_state``: this rank's sharded (DTensor) state dicts, FQN-keyed
    (``get_state_dict``), which give the current sharding: this reshards N → M ranks. DCP
    loads in place, so it loads into new tensors of the same sharding (one extra copy of
    this rank's shards, held until the caller loads them): the tensors the state dicts hold
    (usually the live model's parameters and the optimizer's buffers) are left as they were,
    and reading a checkpoint never changes the model before (or without) loading it, e.g.
    when a resume is refused after reading. Returns mmengine's layout: ``meta``,
    ``state_dict`` (shaped like ``model_state``), ``optimizer`` (like ``optim_state``, plus
    the wrapper's counters; only if
    asked for and saved),
    ``partial_grads`` (every saving rank's pending gradients, if any) and the other keys
    of ``extra.pth``. A checkpoint converted from a single file (index-keyed optimizer) is
    read in full instead (``read_sharded_checkpoint``'s result).
    """
    path = Path(path).absolute()
    manifest = verify_directory(path)
    if manifest.get('optimizer_keys', 'fqn') != 'fqn':
        return _read_full(path, manifest)
    state = {'state_dict': _fresh_tensors(model_state)}
    if optim_state is not None and 'optimizer' in (manifest.get('dcp_keys') or _dcp_keys(path)):
        state['optimizer'] = _fresh_tensors(optim_state)
    _dcp_read(path, state)
    extra = _read_extra(path)
    checkpoint = {'meta': extra.pop('meta', {}), 'state_dict': state['state_dict']}
    if 'optimizer' in state:
        checkpoint['optimizer'] = {**state['optimizer'], **extra.pop('optimizer_extra', {})}
    partial = read_partial_grads(path)
    if partial:
        checkpoint['partial_grads'] = partial
    checkpoint.update(extra)
    return checkpoint
