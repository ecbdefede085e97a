"""Hugging Face checkpoints, both ways, through the ``safetensors`` library (the ``hf`` extra).

A Hugging Face directory is what ``transformers``' ``save_pretrained`` writes and
``from_pretrained`` reads: ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes},
"weight_map": {name: shard}}``), plus ``config.json`` for a ``PreTrainedModel``.

Write (``stratagem convert SRC OUT --to hf``, :func:`save_hf_directory`):
    1. The weights' keys lose the wrappers' prefixes (``module.``, activation checkpointing's,
       ``torch.compile``'s); tensors that share memory are copied apart (safetensors refuses
       shared ones; ``from_pretrained`` ties them again).
    2. Tensors go to shards in order, a new shard when the next tensor would pass
       ``max_shard_size`` (one tensor larger than that gets a shard of its own).
    3. Every file is written into a fresh staging directory and committed like any directory
       checkpoint of ours (``directory.save_directory`` in one process: fsync, a
       ``manifest.json`` of digests, one rename), so the directory exists whole or not at
       all and is verified when read.
Read (``load_checkpoint`` of every strategy, ``stratagem convert``; ``formats.py`` detects
``'hf'``, a directory, and ``'safetensors'``, one ``.safetensors`` file):
    1. With our ``manifest.json``, every file is verified first; a directory ``save_pretrained``
       wrote has none and is read as it is.
    2. The index (or the one file) says which file holds each tensor.
    3. :func:`read_hf` reads everything; :func:`read_hf_like` reads, for each tensor the live
       model holds as a DTensor (FSDP), only this rank's piece (``safe_open``'s slices), so a
       rank reads only the bytes of its shards.
A file the library refuses (damaged, foreign) is a ``CheckpointCorruptError`` naming it.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from stratagem._torch import WRAPPER_PREFIXES

from .errors import CheckpointCorruptError, NotACheckpointError

__all__ = [
    'WEIGHTS_NAME',
    'INDEX_NAME',
    'CONFIG_NAME',
    'is_hf_directory',
    'is_safetensors_file',
    'read_hf',
    'read_hf_like',
    'read_safetensors',
    'save_hf_directory',
    'save_safetensors_file',
    'parse_size',
    'model_config_json',
]

WEIGHTS_NAME = 'model.safetensors'
INDEX_NAME = 'model.safetensors.index.json'
CONFIG_NAME = 'config.json'
SUFFIX = '.safetensors'
Progress = Callable[[int, int], None]

# the prefixes a wrapper adds to parameter names, removed before a Hugging Face model sees
# them: DDP / DeepSpeed / mmengine's ``module.``, and activation checkpointing's and
# ``torch.compile``'s anywhere in a name
_PREFIX_RULES = ((r'^module\.', ''),) + tuple(
    (rf'(^|\.){re.escape(prefix)}', r'\1') for prefix in WRAPPER_PREFIXES
)


def _safetensors() -> Any:
    """The ``safetensors`` package, or an ImportError saying which extra installs it."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError as err:
        raise ImportError(
            'Hugging Face checkpoints (.safetensors files, --to hf) need the safetensors '
            'package: pip install "stratagem[hf]"'
        ) from err
    return safetensors


# ------------------------------------------------------------------------- detection
def is_hf_directory(path: str | os.PathLike) -> bool:
    """A directory holding ``model.safetensors`` or ``model.safetensors.index.json``."""
    p = Path(path)
    return p.is_dir() and ((p / INDEX_NAME).is_file() or (p / WEIGHTS_NAME).is_file())


def is_safetensors_file(path: str | os.PathLike) -> bool:
    """A file whose name ends in ``.safetensors``."""
    p = Path(path)
    return p.is_file() and p.name.endswith(SUFFIX)


# ------------------------------------------------------------------------------ read
def _corrupt(file: Path, err: BaseException) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f'{file}: not a readable safetensors file ({err}); it is damaged, truncated or in '
        'another format: write it again (stratagem convert SRC OUT --to hf, or '
        'save_pretrained)'
    )


class _Open:
    """``safe_open`` of one file, the library's errors turned into ours (naming the file)."""

    def __init__(self, file: Path) -> None:
        self.file = file
        st = _safetensors()
        try:
            self.handle = st.safe_open(os.fspath(file), framework='pt', device='cpu')
        except st.SafetensorError as err:
            raise _corrupt(file, err) from None
        except OSError as err:
            raise _os_error(file, err) from None
        self.error = st.SafetensorError

    def names(self) -> list[str]:
        return list(self.handle.keys())

    def metadata(self) -> dict[str, str]:
        return dict(self.handle.metadata() or {})

    def tensor(self, key: str) -> torch.Tensor:
        try:
            return self.handle.get_tensor(key)
        except self.error as err:
            raise _corrupt(self.file, err) from None

    def shape(self, key: str) -> list[int]:
        try:
            return list(self.handle.get_slice(key).get_shape())
        except self.error as err:
            raise _corrupt(self.file, err) from None

    def piece(self, key: str, offsets: Any, sizes: Any) -> torch.Tensor:
        """The block ``[offsets, offsets + sizes)`` of tensor ``key``: only its bytes read."""
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        try:
            return self.handle.get_slice(key)[index]
        except self.error as err:
            raise _corrupt(self.file, err) from None


def _os_error(file: Path, err: OSError) -> OSError:
    if isinstance(err, FileNotFoundError):
        return FileNotFoundError(f'{file}: no such file')
    return err


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of one ``.safetensors`` file, on the CPU; a file the library
    refuses raises ``CheckpointCorruptError`` (a ``ValueError``) naming it."""
    opened = _Open(Path(path))
    return {key: opened.tensor(key) for key in opened.names()}, opened.metadata()


def _weight_files(path: Path) -> dict[str, Path]:
    """Which file holds each tensor: the index's ``weight_map``, else every key of the one
    file (a directory's ``model.safetensors``, or ``path`` itself)."""
    if path.is_dir() and (path / INDEX_NAME).is_file():
        index_file = path / INDEX_NAME
        try:
            index = json.loads(index_file.read_text())
            weight_map = index['weight_map']
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise TypeError('weight_map must map tensor names to file names')
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointCorruptError(
                f'{index_file}: not a safetensors index ({type(err).__name__}: {err}); '
                'expected {"metadata": {...}, "weight_map": {"tensor name": "shard file"}}'
            ) from None
        files = {}
        for key, name in weight_map.items():
            file = (path / name).absolute()
            if file.parent != path.absolute():
                raise CheckpointCorruptError(
                    f'{index_file}: {key!r} is in {name!r}, outside the directory'
                )
            files[key] = file
        missing = sorted({f.name for f in files.values() if not f.is_file()})
        if missing:
            raise FileNotFoundError(
                f'{path}: the shard(s) {missing} that {INDEX_NAME} lists are missing; copy '
                'the whole directory'
            )
        return files
    file = path / WEIGHTS_NAME if path.is_dir() else path
    return dict.fromkeys(_Open(file).names(), file)


def _verify(path: Path, *, collective: bool, progress: Progress | None) -> None:
    """Our own directory (written by ``save_hf_directory``) is verified against its manifest;
    one ``save_pretrained`` wrote has none and cannot be."""
    from .directory import verify_directory
    from .manifest import DIR_MANIFEST

    if path.is_dir() and (path / DIR_MANIFEST).is_file():
        verify_directory(path, collective=collective, progress=progress)


def _meta(path: Path, files: Mapping[str, Path]) -> dict:
    """What a Hugging Face checkpoint says besides its tensors: ``config.json`` (as
    ``meta['hf_config']``, the text ``convert --to hf`` writes back) and the step ours
    record in the files' metadata."""
    meta: dict[str, Any] = {}
    config = path / CONFIG_NAME if path.is_dir() else None
    if config is not None and config.is_file():
        meta['hf_config'] = config.read_text()
    first = next(iter(files.values()), None)
    step = _Open(first).metadata().get('iter') if first is not None else None
    if step is not None and step.isdigit():
        meta['iter'] = int(step)
    return meta


def read_hf(path: str | os.PathLike, progress: Progress | None = None) -> dict:
    """A Hugging Face directory or one ``.safetensors`` file, whole, in mmengine's layout:
    ``{'state_dict': {name: tensor}, 'meta': {...}}`` (CPU tensors). ``progress(done,
    total)`` is called per file read."""
    path = Path(path).absolute()
    _verify(path, collective=False, progress=None)
    files = _weight_files(path)
    by_file: dict[Path, list[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    weights: dict[str, torch.Tensor] = {}
    for i, (file, keys) in enumerate(by_file.items()):
        opened = _Open(file)
        present = set(opened.names())
        for key in keys:
            if key not in present:
                raise CheckpointCorruptError(
                    f'{file} has no tensor {key!r}, which {INDEX_NAME} puts there'
                )
            weights[key] = opened.tensor(key)
        if progress is not None:
            progress(i + 1, len(by_file))
    return {'state_dict': weights, 'meta': _meta(path, files)}


def read_hf_like(path: str | os.PathLike, model_state: Mapping[str, Any]) -> dict:
    """Like :func:`read_hf`, but a tensor the live ``model_state`` holds as a DTensor of the
    same global shape (under its name, or with a wrapper's ``module.`` prefix) comes back
    as a new DTensor of the same sharding, of which this rank read only its own piece.
    Every rank calls it (a manifest is verified collectively). The others are read whole:
    names the model lacks (reported as unexpected when loaded), other shapes."""
    from torch.distributed.tensor import DTensor

    path = Path(path).absolute()
    _verify(path, collective=True, progress=None)
    files = _weight_files(path)
    opened: dict[Path, _Open] = {}
    weights: dict[str, torch.Tensor] = {}
    for key, file in files.items():
        handle = opened.get(file) or opened.setdefault(file, _Open(file))
        target = model_state.get(key, model_state.get(re.sub(r'^module\.', '', key)))
        if (
            isinstance(target, DTensor)
            and target.dim() > 0
            and handle.shape(key) == list(target.shape)
        ):
            # the DCP protocol's description of this rank's block of the global tensor
            (chunk,) = target.__create_chunk_list__()
            local = handle.piece(key, chunk.offsets, chunk.sizes)
            weights[key] = DTensor.from_local(
                local.to(target.device),
                target.device_mesh,
                target.placements,
                run_check=False,
                shape=target.shape,
                stride=target.stride(),
            )
        else:
            weights[key] = handle.tensor(key)
    return {'state_dict': weights, 'meta': _meta(path, files)}


# ----------------------------------------------------------------------------- write
def parse_size(size: str | int) -> int:
    """Bytes of a size written as ``save_pretrained``'s ``max_shard_size``: an int, or
    digits and a unit: ``KB``/``MB``/``GB``/``TB`` (powers of 1000), ``KiB``/``MiB``/
    ``GiB``/``TiB`` (powers of 1024), ``B``. ``'5GB'`` is 5_000_000_000."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        units = {'': 1, 'B': 1, 'KB': 10**3, 'MB': 10**6, 'GB': 10**9, 'TB': 10**12}
        units.update({'KIB': 2**10, 'MIB': 2**20, 'GIB': 2**30, 'TIB': 2**40})
        match = re.fullmatch(r'\s*(\d+)\s*([A-Za-z]*)\s*', str(size))
        if match is None or match.group(2).upper() not in units:
            raise ValueError(
                f'max shard size {size!r} is not a size; write digits and a unit, e.g. '
                "'5GB', '500MB', '2GiB' (units: KB, MB, GB, TB, KiB, MiB, GiB, TiB, B)"
            )
        value = int(match.group(1)) * units[match.group(2).upper()]
    if value <= 0:
        raise ValueError(f'max shard size {size!r} must be positive')
    return value


def _clean(weights: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors only, keys without the wrappers' prefixes, contiguous, none sharing memory."""
    from .state_dict import revise_keys

    tensors = revise_keys(
        {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}, _PREFIX_RULES
    )
    seen: set[int] = set()
    out = {}
    for key, t in tensors.items():
        t = t.detach().to('cpu').contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:  # tied weights: safetensors refuses shared memory
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def _shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


def _config_text(config_json: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """``config.json`` with ``dtype`` the weights' floating dtype (as ``save_pretrained``
    records the model's), so ``from_pretrained`` builds the model in the weights' dtype."""
    config = json.loads(config_json)
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    if floats:
        config['dtype'] = str(max(set(floats), key=floats.count)).removeprefix('torch.')
    return json.dumps(config, indent=2, sort_keys=True) + '\n'


def save_hf_directory(
    weights: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    max_shard_size: str | int | None = None,
    config_json: str | None = None,
    step: int | None = None,
    extra_manifest: dict | None = None,
) -> Path:
    """Write ``weights`` (name → tensor) as a directory ``from_pretrained`` loads: one
    ``model.safetensors``, or (when they pass ``max_shard_size``, e.g. ``'5GB'``; default:
    one file) shards and ``model.safetensors.index.json``; ``config_json`` (a
    ``PretrainedConfig.to_json_string()``) becomes ``config.json``. Committed atomically
    with a manifest (``step`` and ``extra_manifest`` go there). Returns the path."""
    from .directory import save_directory

    st = _safetensors()
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    tensors = _clean(weights)
    if not tensors:
        raise NotACheckpointError(f'no tensors to write to {path}')
    shards = _shards(tensors, limit) if limit is not None else [list(tensors)]
    names = (
        [WEIGHTS_NAME]
        if len(shards) == 1
        else [f'model-{i:05d}-of-{len(shards):05d}{SUFFIX}' for i in range(1, len(shards) + 1)]
    )
    metadata = {'format': 'pt', **({'iter': str(step)} if step is not None else {})}

    def write(staging: Path) -> None:  # None: the commit fsyncs and hashes every file
        for name, keys in zip(names, shards):
            st.torch.save_file({k: tensors[k] for k in keys}, staging / name, metadata=metadata)
        if len(shards) > 1:
            index = {
                'metadata': {
                    'total_size': sum(t.numel() * t.element_size() for t in tensors.values()),
                    'total_parameters': sum(t.numel() for t in tensors.values()),
                },
                'weight_map': {k: name for name, keys in zip(names, shards) for k in keys},
            }
            (staging / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + '\n')
        if config_json is not None:
            (staging / CONFIG_NAME).write_text(_config_text(config_json, tensors))

    if config_json is None:
        warnings.warn(
            f'{path}: the checkpoint records no model config (the model was no '
            'transformers PreTrainedModel), so no config.json was written: pass '
            'from_pretrained(..., config=...)',
            stacklevel=3,
        )
    return save_directory(
        path,
        write,
        step=step,
        extra_manifest=extra_manifest,
        update_pointer=False,
        collective=False,
    )


def save_safetensors_file(
    weights: Mapping[str, Any], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``weights`` as one ``.safetensors`` file (keys as ``save_hf_directory`` cleans
    them), atomically: a temporary name, fsync, rename. Returns the path."""
    from ._fs import fsync_dir, fsync_file, temp_name

    st = _safetensors()
    path = Path(path).absolute()
    tmp = temp_name(path)
    try:
        st.torch.save_file(_clean(weights), tmp, metadata=dict(metadata or {}))
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


# ------------------------------------------------------------------- the model's config
def model_config_json(model: torch.nn.Module) -> str | None:
    """The JSON of ``model.config`` when it has ``to_json_string`` (a transformers
    ``PreTrainedModel``; duck-typed, nothing imported), with ``architectures`` naming the
    model's class as ``save_pretrained`` records it; else None."""
    to_json = getattr(getattr(model, 'config', None), 'to_json_string', None)
    if not callable(to_json):
        return None
    config = json.loads(to_json())
    if not config.get('architectures'):
        # FSDP2 makes the model an instance of a class of its own (FSDP<Name>), a torch one
        cls = next(c for c in type(model).__mro__ if not c.__module__.startswith('torch.'))
        config['architectures'] = [cls.__name__]
    return json.dumps(config, sort_keys=True)
