"""Sharded (DCP) checkpoints: one directory, committed through ``directory.py``'s protocol.

Layout of ``NAME/`` (every file listed in ``NAME/manifest.json`` with size and digest):

- ``.metadata``, ``__{rank}_{i}.distcp``: ``torch.distributed.checkpoint`` (DCP) files of
  ``{'state_dict': model, 'optimizer': {'state', 'param_groups'}}``, keyed by parameter FQN
  (``'fqn'``) or, in a checkpoint converted from a single file, by flat parameter index
  (``'index'``); the manifest's ``optimizer_keys`` says which.
- ``extra.pth`` (rank 0): everything else, a ``torch.save`` dict of plain values loadable with
  ``weights_only=True``: ``meta``, ``param_schedulers``, the optimizer's non-tensor keys
  (``optimizer_extra``: counters, loss scaler) and any ``extra_ckpt`` keys.
- ``{key}/rank_{r}.pth`` for each key saved per rank (``PER_RANK_KEYS``), each rank's own
  value in its own file, read back as ``checkpoint[key]``, the list over the saving ranks:
  ``rng_states/`` (every rank's RNG state; before, a list in ``extra.pth``, which is still
  read) and ``partial_grads/`` (only when saved inside an accumulation window: that rank's
  unsynchronised gradients).

Every rank verifies before anything is read (``verify_directory``); DCP's own unpickler only
ever sees files whose hashes matched.

This module owns the layout, the save (the files DCP writes are sized beforehand and
checked against the free space; ``dcp_writer.DirectoryWriter`` hashes them on their way to
disk, so the manifest costs no second read, and carries the directory commit in DCP's own
collectives: ``directory.CollectiveCommit``), the reads
(verified, through ``ShardReader``, ``dcp_reader.py``, into mmengine's layout), and the state
dicts they move: an optimizer state converted between FQN keys (what is saved) and
``torch.optim``'s flat parameter indices, and the walks over a state's tensors.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ._fs import process_pool
from .content import SAFE_GLOBALS_KEY, validate_checkpoint_content
from .directory import CollectiveCommit, directory_vote, save_directory, verify_directory
from .disk import OVERHEAD_BYTES, check_free_space, payload_bytes
from .errors import CheckpointCorruptError
from .load import load_checkpoint_file
from .location import is_url
from .rank_errors import all_ok, dcp_failures, describe_error, raise_first, raised_here
from .torch_file import crc32_option, write_torch_file

if TYPE_CHECKING:  # remote_directory (and fsspec behind it) loads when a URL is used
    from typing_extensions import TypeIs

    from .remote_directory import RemoteDirectory

    Source = Path | RemoteDirectory  # a verified sharded directory: on disk, or at a URL

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
    'PER_RANK_KEYS',
]

EXTRA_FILE = 'extra.pth'
GROUPS_KEY = 'optimizer_param_groups'  # extra.pth: a copy of the param groups (small)
#: keys saved per rank, each rank's value to ``{key}/rank_{r}.pth``: no gather at the save
PER_RANK_KEYS = ('partial_grads', 'rng_states')
DCP_KEYS = ('state_dict', 'optimizer')
_OPTIM_TENSOR_KEYS = ('state', 'param_groups')  # an optimizer state's part saved by DCP


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory holding DCP metadata (ours or a raw ``dcp.save``)."""
    return Path(path).is_dir() and (Path(path) / '.metadata').is_file()


def save_sharded_checkpoint(
    final_dir: str | os.PathLike,
    checkpoint: Mapping,
    *,
    step: int | None = None,
    extra_manifest: dict | None = None,
    per_rank: Mapping[str, Any] | None = None,
    optimizer_keys: str = 'fqn',
    collective: bool = True,
    vote: Any = None,
    process_group: Any = None,
    backend_args: Mapping | None = None,
    also_point: str | os.PathLike | None = None,
) -> Path:
    """Collectively save ``checkpoint`` (mmengine's layout) as a sharded directory.

    ``checkpoint['state_dict']`` and ``checkpoint['optimizer']``'s ``state``/``param_groups``
    go to DCP (DTensors are saved shard by shard); everything else to ``extra.pth`` (rank 0).
    ``per_rank``: this rank's own value of keys saved per rank (``PER_RANK_KEYS``: its
    pending gradients, its RNG state), each written to its own file. Every rank
    calls this (``collective=False``: a single process without a process group, as
    ``stratagem convert`` does). ``vote``: the save's ``SaveVote`` (else one is opened
    for it, ``directory_vote``); ``process_group``: the group DCP's planning runs on
    (default: the default group; an asynchronous save passes a group of its writer's own).
    ``final_dir`` may be a URL (``remote_directory.py``: each rank's files staged locally
    and uploaded; ``backend_args`` its storage options, ``also_point`` a local directory
    whose pointer names it too).
    Returns the committed path (a URL: the URL).
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

    per_rank = dict(per_rank or {})
    unknown = sorted(set(per_rank) - set(PER_RANK_KEYS))
    if unknown:
        raise ValueError(
            f'per_rank keys {unknown} are not saved per rank; valid keys: {list(PER_RANK_KEYS)}'
        )
    side = [(value, Path(key, f'rank_{rank}.pth')) for key, value in per_rank.items()]
    if rank == 0:
        side.append((extra, Path(EXTRA_FILE)))

    def start_side(directory: Path) -> list[futures.Future]:
        # rank 0's extra.pth and each rank's own files (its RNG state, its pending
        # gradients), written on a thread while DCP writes the shards
        aside = process_pool('side', 1)
        return [aside.submit(_write_side, obj, directory / name) for obj, name in side]

    def check_space(where: Path) -> None:
        # a full disk is refused before anything is written (at a URL: the local disk that
        # stages the files)
        check_free_space(
            where, _bytes_needed(tensors, [obj for obj, _ in side]) * _ranks_sharing_disk()
        )

    held = validate_checkpoint_content(extra)  # allow-listed classes: named to a loader lacking one
    manifest = {
        'state_dict_type': 'sharded',
        'optimizer_keys': optimizer_keys,
        'dcp_keys': sorted(tensors),
        **({SAFE_GLOBALS_KEY: held} if held else {}),
        **(extra_manifest or {}),
    }
    if not collective:
        manifest = {'world_size': 1, **manifest}

    def dcp_save(writer: Any) -> None:
        # torch's per-record zip CRC32 (DCP torch.saves each tensor) is off: our digest
        # covers every byte
        with crc32_option(False), warnings.catch_warnings():
            # one process on purpose (convert): not DCP's "assuming ..." guess
            warnings.filterwarnings('ignore', message='torch.distributed is disabled')
            dcp.save(
                tensors, storage_writer=writer, no_dist=not collective, process_group=process_group
            )

    from .dcp_writer import DirectoryWriter

    if is_url(os.fspath(final_dir)):  # each rank's files staged locally, then uploaded
        # as the vote says it (``directory_vote``'s own says the same)
        what = f'saving {final_dir}' if vote is None else vote.what

        def write(staging: Path) -> list[dict]:
            writer = DirectoryWriter(staging, side=start_side, check=lambda: check_space(staging))
            try:
                dcp_save(writer)
            except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is one
                raise raised_here(err, writer.own_error, rank, what)  # noqa: B904 - cause kept
            return writer.entries()

        return save_directory(
            final_dir,
            write,
            step=step,
            extra_manifest=manifest,
            vote=vote,
            collective=collective,
            backend_args=backend_args,
            also_point=also_point,
        )
    with directory_vote(final_dir, vote, collective=collective) as vote:
        commit = CollectiveCommit(
            final_dir, vote, step=step, extra_manifest=manifest, collective=collective
        )
        writer = DirectoryWriter(
            commit.final,
            side=start_side,
            check=lambda: check_space(commit.final),
            commit=commit,
        )
        try:
            dcp_save(writer)
        except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is one; fail re-raises
            commit.fail(err, writer.own_error)
        return commit.done()


def _write_side(obj: Any, path: Path) -> dict:
    """One of a rank's own files beside DCP's (``extra.pth``, ``{key}/rank_{r}.pth``):
    written and hashed (the writer fsyncs it with the rank's other files); its entry."""
    path.parent.mkdir(exist_ok=True)
    return {**write_torch_file(obj, path, fsync=False, pool=process_pool('hash', 2)), 'path': path}


def _is_remote(source: Any) -> TypeIs[RemoteDirectory]:
    """``source`` is a ``RemoteDirectory`` (its module is loaded only once a URL is read,
    so without it there is none)."""
    module = sys.modules.get(f'{__package__}.remote_directory')
    return module is not None and isinstance(source, module.RemoteDirectory)


def read_sharded_checkpoint(
    path: str | os.PathLike,
    *,
    collective: bool = False,
    progress: Callable[[int, int], None] | None = None,
    backend_args: Mapping | None = None,
    found: tuple[dict, str] | None = None,
) -> dict:
    """Verify, then read a sharded directory into one full (unsharded) mmengine-layout dict.

    The optimizer comes back keyed by flat parameter index (``torch.optim``'s format), so a
    SingleDeviceStrategy / DDPStrategy / plain optimizer loads it. Needs no process group
    (each caller reads everything itself); ``collective=True`` shares the hashing across ranks.
    ``progress(done, total)`` is called per file verified (for a progress bar). ``path`` may
    be a URL (``backend_args``: its storage options; ``found``: its manifest, read already):
    every file is read once.
    """
    if is_url(os.fspath(path)):
        from .remote_directory import verify_remote_directory

        remote = verify_remote_directory(
            os.fspath(path),
            backend_args=backend_args,
            collective=collective,
            progress=progress,
            found=found,
        )
        return _read_full(remote, remote.manifest)
    path = Path(path).absolute()
    manifest = verify_directory(path, collective=collective, progress=progress)
    return _read_full(path, manifest)


def _verified(
    path: str | os.PathLike, backend_args: Mapping | None, found: tuple[dict, str] | None = None
) -> tuple[Source, dict]:
    """Verify the sharded directory at ``path`` (collective): it and its manifest (at a URL,
    ``found``: the manifest read already, ``formats.detect``)."""
    if is_url(os.fspath(path)):
        from .remote_directory import verify_remote_directory

        remote = verify_remote_directory(os.fspath(path), backend_args=backend_args, found=found)
        return remote, remote.manifest
    local = Path(path).absolute()
    return local, verify_directory(local)


def _read_full(path: Source, manifest: dict) -> dict:
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
    checkpoint.update(extra)
    checkpoint.update(read_per_rank(path))
    return checkpoint


def _read_extra(path: Source, groups: list | None = None) -> dict:
    """``extra.pth`` (already verified); the param groups' copy goes to ``groups``."""
    if _is_remote(path):
        if not path.has(EXTRA_FILE):
            return {}
        extra = dict(path.load(EXTRA_FILE))
    elif not (path / EXTRA_FILE).is_file():
        return {}
    else:
        extra = dict(load_checkpoint_file(path / EXTRA_FILE, map_location='cpu', verify=False))
    saved = extra.pop(GROUPS_KEY, None)
    if groups is not None and saved is not None:
        groups.extend(saved)
    return extra


def read_sharded_header(
    path: str | os.PathLike,
    *,
    optimizer: bool,
    backend_args: Mapping | None = None,
    found: tuple[dict, str] | None = None,
) -> tuple[dict, Any] | None:
    """Verify a sharded directory (collective) and read all of it but the tensors, for a
    resume that reads them in place later (``load_sharded_in_place``), once every check
    passed. Returns ``(checkpoint, metadata)``: in ``checkpoint``, ``state_dict`` holds a
    ``meta``-device tensor of each saved shape and dtype (from DCP's metadata), ``optimizer``
    the saved param groups and the wrapper's counters (no ``state``); everything else is read
    as ``load_sharded_checkpoint`` reads it. ``metadata`` is DCP's, for the read (so it is
    not read twice). None when the checkpoint cannot be read that way (converted from a
    single file, saved before the param groups were kept in ``extra.pth``, or a model entry
    that is not a tensor): read it with ``load_sharded_checkpoint`` then. At a URL
    (``backend_args``: its storage options) ``metadata`` is the verified directory, its DCP
    metadata read (``RemoteDirectory.dcp_metadata``), and the files this rank verified kept
    in memory for the read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source, manifest = _verified(path, backend_args, found)
    if manifest.get('optimizer_keys', 'fqn') != 'fqn':
        return None
    dcp_metadata = _reader(source).read_metadata()
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
    extra = _read_extra(source, groups)
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
    checkpoint.update(extra)
    checkpoint.update(read_per_rank(source))
    if _is_remote(source):
        source.dcp_metadata = dcp_metadata
        return checkpoint, source
    return checkpoint, dcp_metadata


def load_sharded_in_place(path: str | os.PathLike, state: dict, *, metadata: Any = None) -> None:
    """DCP-read a verified sharded directory into ``state`` (``{'state_dict': ...,
    'optimizer': ...}``, this rank's live sharded state dicts) in place (collective);
    ``metadata``: DCP's, when already read (``read_sharded_header``).

    DCP plans the whole read before it reads a byte: a key or shape the checkpoint lacks
    fails there, with nothing changed. A read error after that (the files changed since they
    were verified, a failing disk) leaves the state partly read. At a URL ``metadata`` is
    what ``read_sharded_header`` returned (the verified directory)."""
    if _is_remote(metadata):
        _dcp_read(metadata, state, metadata=metadata.dcp_metadata, what='into the model')
        return
    _dcp_read(Path(path).absolute(), state, metadata=metadata, what='into the model')


def read_per_rank(path: str | os.PathLike | RemoteDirectory) -> dict[str, list]:
    """The keys saved per rank (``PER_RANK_KEYS``) found in a verified directory, each the
    list of every saving rank's value in rank order: ``{'rng_states': [...], ...}``."""
    found: dict[str, list[tuple[int, str]]] = {}
    load: Callable[[str], Any]
    if _is_remote(path):
        names, load = list(path.entries), path.load
    else:
        local = Path(path)
        names = [
            f'{key}/{p.name}'
            for key in PER_RANK_KEYS
            if (local / key).is_dir()
            for p in (local / key).iterdir()
        ]

        def load(name: str) -> Any:
            return load_checkpoint_file(local / name, map_location='cpu', verify=False)

    for name in names:
        match = re.fullmatch(r'([a-z_]+)/rank_(\d+)\.pth', name)
        if match is not None and match[1] in PER_RANK_KEYS:
            found.setdefault(match[1], []).append((int(match[2]), name))
    return {key: [load(name) for _, name in sorted(files)] for key, files in found.items()}


def load_sharded_checkpoint(
    path: str | os.PathLike,
    model_state: dict,
    optim_state: dict | None = None,
    *,
    backend_args: Mapping | None = None,
    found: tuple[dict, str] | None = None,
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
    asked for and saved), the keys saved per rank (``rng_states``; ``partial_grads``, if
    any: lists over the saving ranks) and the other keys of ``extra.pth``. A checkpoint
    converted from a single file (index-keyed optimizer) is read in full instead
    (``read_sharded_checkpoint``'s result). ``path`` may be a URL
    (``backend_args``: its storage options).
    """
    source, manifest = _verified(path, backend_args, found)
    if manifest.get('optimizer_keys', 'fqn') != 'fqn':
        return _read_full(source, manifest)
    state = {'state_dict': _fresh_tensors(model_state)}
    if optim_state is not None and 'optimizer' in (manifest.get('dcp_keys') or _dcp_keys(source)):
        state['optimizer'] = _fresh_tensors(optim_state)
    _dcp_read(source, state)
    extra = _read_extra(source)
    checkpoint = {'meta': extra.pop('meta', {}), 'state_dict': state['state_dict']}
    if 'optimizer' in state:
        checkpoint['optimizer'] = {**state['optimizer'], **extra.pop('optimizer_extra', {})}
    checkpoint.update(extra)
    checkpoint.update(read_per_rank(source))
    return checkpoint


# ------------------------------------------------------- the files DCP writes, hashed
def _bytes_needed(tensors: Mapping, side: list) -> int:
    """This rank's bytes of a sharded save: its shards, its side files, file overheads."""
    return payload_bytes(tensors) + sum(map(payload_bytes, side)) + OVERHEAD_BYTES * (1 + len(side))


def _ranks_sharing_disk() -> int:
    """How many ranks write to the disk this rank writes to, as far as it can tell: the
    ranks on its node (``LOCAL_WORLD_SIZE``), whose shards are about as large as its own. A
    filesystem shared by several nodes is assumed large enough for the other nodes' part;
    a shortfall there is still caught by the write (``CheckpointWriteError``)."""
    try:
        return max(1, int(os.environ.get('LOCAL_WORLD_SIZE', '1')))
    except ValueError:
        return 1


# ----------------------------------------------------------------------- DCP's reads
def _reader(path: Source, metadata: Any = None) -> Any:
    """A ``ShardReader`` (imported here: DCP takes ~0.4 s to import)."""
    from .dcp_reader import ShardReader

    if _is_remote(path):
        return ShardReader(path.url, metadata=metadata, files=path)
    return ShardReader(path, metadata=metadata)


def _read_dcp_full(path: Source) -> dict:
    from stratagem._torch import load_whole_dcp

    try:
        return load_whole_dcp(_reader(path))
    except BaseException as err:
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        # DCP wraps a read's error in a CheckpointException (a BaseException): unwrap it
        failures = list(dcp_failures(err).values())
        cause = failures[0] if len(failures) == 1 else err
        if isinstance(cause, CheckpointCorruptError):
            raise cause from None
        raise CheckpointCorruptError(
            f'{path} is damaged: reading its DCP shards failed: {describe_error(cause)}'
        ) from None


def _dcp_read(path: Source, state: dict, *, metadata: Any = None, what: str = '') -> None:
    """``dcp.load(state)`` of ``path`` on every rank (collective), through ``ShardReader``.

    Each rank plans and reads on its own (``no_dist``): a load's global plan is just the
    ranks' own plans, and DCP's three planning and reporting collectives cost more than
    the read of a small model. One exchange afterwards raises any rank's failure on every
    rank (DCP's ``CheckpointException``, a ``BaseException``, becomes a ``RuntimeError``
    that names the file and the rank)."""
    import torch.distributed.checkpoint as dcp

    error = None
    try:
        with warnings.catch_warnings():  # no_dist under a process group is meant here
            warnings.filterwarnings('ignore', message='torch.distributed is disabled')
            dcp.load(state, storage_reader=_reader(path, metadata), no_dist=True)
    except BaseException as err:
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        error = err
        # no_dist: DCP wraps this rank's own error in a CheckpointException that calls
        # this rank 'rank 0': unwrap it
        failures = list(dcp_failures(err).values())
        if len(failures) == 1 and isinstance(failures[0], BaseException):
            error = failures[0]
    if all_ok(error is not None):
        return
    from stratagem import env  # imported on use: see checkpoint/__init__.py

    outcomes = env.all_gather_object(None if error is None else describe_error(error))
    if error is not None and not isinstance(error, Exception):
        # a BaseException: this rank raises the message the others see
        error = RuntimeError(f'reading {path} {what} failed: {describe_error(error)}')
    raise_first(outcomes, error, f'reading {path} {what}'.rstrip())


def _dcp_keys(path: Source) -> set[str]:
    """Top-level keys of the DCP state (a checkpoint whose manifest predates ``dcp_keys``)."""
    metadata = _reader(path).read_metadata()
    return {key.split('.', 1)[0] for key in metadata.state_dict_metadata}


# -------------------------------------------------------------- the state dicts moved
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
