"""A checkpoint from one layout to another, in one process (``stratagem convert SRC DST``).

Dispatch on the source's format, detected by ``formats.detect_format`` (the one detection
every reader shares; a backend registers its own formats there). Targets:
``file`` (one verified single-file checkpoint with its manifest), ``sharded`` (a directory of
DCP files, committed with a manifest), ``hf`` (a directory ``transformers``' ``from_pretrained``
loads: the weights as ``model.safetensors`` or shards with their index, and ``config.json``
when the checkpoint records the model's config) or ``safetensors`` (the full model weights
alone, one file). The last two are written by the ``safetensors`` library
(``huggingface.py``). No process group is needed. A source or target may be an fsspec URL
(``s3://...``): read verified from the store, written by its commit without rename.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from .errors import NotACheckpointError
from .formats import FORMATS, detect_format, read_whole
from .huggingface import save_hf_directory, save_safetensors_file
from .location import absolute, is_url
from .sharded import save_sharded_checkpoint
from .single_file import save_checkpoint

__all__ = ['TARGETS', 'convert_checkpoint', 'detect_source']

TARGETS = ('file', 'sharded', 'hf', 'safetensors')


def detect_source(path: Path | str, backend_args: Mapping | None = None) -> str:
    """``path``'s format (``formats.FORMATS``), or an error naming the formats known."""
    name = detect_format(path, backend_args)
    if name is not None and name in FORMATS:
        return name
    if name is None and (is_url(path) or not Path(path).exists()):
        raise FileNotFoundError(f'checkpoint not found: {path}')
    raise NotACheckpointError(
        f'{path} is not a checkpoint this command can read (formats: '
        f'{", ".join(FORMATS)}); a directory needs DCP .metadata and '
        f'a stratagem manifest.json'
    )


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str = 'file',
    progress: Callable[[int, int], None] | None = None,
    overwrite: bool = False,
    max_shard_size: str | int | None = None,
    backend_args: Mapping | None = None,
) -> Path | str:
    """Convert ``src`` (any format in ``formats.FORMATS``) to ``dst`` (``to='file'``,
    ``'sharded'``, ``'hf'`` or ``'safetensors'``: the weights only).

    ``max_shard_size`` (``to='hf'`` only; ``save_pretrained``'s: ``'5GB'``, ``'500MB'``, an
    int of bytes; default: one ``model.safetensors``): the weights go to shards of at most
    this size, listed in ``model.safetensors.index.json``.

    ``src`` and ``dst`` may be fsspec URLs (``s3://...``; ``backend_args``: the store's
    options, else the environment's): a source is read from the store, verified; a target
    is written by the commit of a store without rename (``location.py``,
    ``remote_directory.py``; a ``safetensors`` target, which has no manifest, is one
    object). The result is the path, or the URL.

    An existing ``dst`` is refused unless ``overwrite``: then it (and its sidecar manifest)
    is removed once ``src`` has been read and verified, and the new one written in its
    place (at a URL only a file can be replaced, by the same-name upload that keeps the old
    one verifiable; a directory there is refused: delete it first). ``dst`` may never be
    ``src``, nor inside it, nor hold it."""
    if to not in TARGETS:
        raise ValueError(f'to={to!r}; use one of {", ".join(map(repr, TARGETS))}')
    if max_shard_size is not None and to != 'hf':
        raise ValueError(
            f'max_shard_size (--max-shard-size) shards a Hugging Face directory; it needs '
            f"to='hf' (--to hf), not {to!r}"
        )
    src_at, dst_at = _where(src), _where(dst)
    _check_target(src_at, dst_at, to, overwrite, backend_args)
    source = detect_source(src_at, backend_args)
    checkpoint = read_whole(src_at, source, progress, backend_args)
    step = (checkpoint.get('meta') or {}).get('iter')
    step = step if type(step) is int else None
    extra = {'converted_from': str(src_at), 'source_format': source}
    if not isinstance(checkpoint.get('state_dict'), Mapping):
        raise NotACheckpointError(
            f"{src_at} has no model weights under 'state_dict' (its keys: "
            f'{sorted(map(str, checkpoint))[:12]}); a {to} checkpoint is written from '
            "mmengine's layout: {'state_dict': weights, 'optimizer': ..., 'meta': ...}"
        )
    if isinstance(dst_at, str):
        return _write_remote(checkpoint, dst_at, to, step, extra, max_shard_size, backend_args)
    if dst_at.exists():  # overwrite: only now that the source read whole and verified
        _remove_target(dst_at)
    return _write(checkpoint, dst_at, to, step, extra, max_shard_size)


def _where(path: str | os.PathLike) -> Path | str:
    """A URL as its text; a local path (or ``file://`` URL) made absolute."""
    text = os.fspath(path)
    return absolute(text) if is_url(text) else Path(absolute(text))


def _check_target(
    src: Path | str, dst: Path | str, to: str, overwrite: bool, backend_args: Mapping | None
) -> None:
    """Refuse, before anything is read or written: a target that exists (without
    ``overwrite``; a directory at a URL even with it), the source as its own target."""
    if isinstance(dst, Path) and dst.exists() and not overwrite:
        raise FileExistsError(
            f'{dst} exists; choose a new name, or pass --overwrite (API: overwrite=True) '
            'to replace it'
        )
    same = str(dst) == str(src)
    nested = str(dst).startswith(str(src).rstrip('/') + '/') or str(src).startswith(
        str(dst).rstrip('/') + '/'
    )
    if same or nested:
        raise ValueError(f'cannot convert {src} into {dst}: the target would replace the source')
    if isinstance(dst, Path):
        return
    found = detect_format(dst, backend_args)
    if found is None:
        return
    if not overwrite:
        raise FileExistsError(
            f'{dst} exists; choose a new name, or pass --overwrite (API: overwrite=True) '
            'to replace it'
        )
    if found != 'file' or to != 'file':
        raise FileExistsError(
            f'{dst} exists and cannot be replaced at a URL: a store has no rename, so a '
            'directory (or a file by another layout) there is never overwritten; delete it '
            'first (stratagem.checkpoint.location.delete_checkpoint), or choose a new name'
        )


def _write(
    checkpoint: dict,
    dst: Path,
    to: str,
    step: int | None,
    extra: dict,
    max_shard_size: str | int | None,
) -> Path:
    """Write ``checkpoint`` to the local ``dst`` in layout ``to``."""
    if to == 'file':
        for key in ('partial_grads', 'partial_grads_fqn'):  # per-rank: meaningful only sharded
            checkpoint.pop(key, None)
        return save_checkpoint(
            checkpoint, dst, step=step, extra_manifest=extra, update_pointer=False
        )
    if to == 'hf':
        config = (checkpoint.get('meta') or {}).get('hf_config')
        return save_hf_directory(
            checkpoint['state_dict'],
            dst,
            max_shard_size=max_shard_size,
            config_json=config if isinstance(config, str) else None,
            step=step,
            extra_manifest=extra,
        )
    if to == 'safetensors':
        meta = {'format': 'pt', **extra, **({'iter': str(step)} if step is not None else {})}
        return save_safetensors_file(checkpoint['state_dict'], dst, metadata=meta)
    return save_sharded_checkpoint(
        dst, checkpoint, step=step, extra_manifest=extra, optimizer_keys='index', collective=False
    )


def _write_remote(
    checkpoint: dict,
    url: str,
    to: str,
    step: int | None,
    extra: dict,
    max_shard_size: str | int | None,
    backend_args: Mapping | None,
) -> str:
    """Write ``checkpoint`` to ``url`` in layout ``to``: a sharded directory straight through
    the directory commit at a URL; the others written into a local staging directory, then
    uploaded (a file with its manifest, a directory's files then its manifest)."""
    import shutil
    import tempfile

    from . import transfer
    from .location import filesystem, store_errors, upload_file
    from .remote_directory import upload_directory

    if to == 'sharded':
        return str(
            save_sharded_checkpoint(
                url,
                checkpoint,
                step=step,
                extra_manifest=extra,
                optimizer_keys='index',
                collective=False,
                backend_args=backend_args,
            )
        )
    staging = Path(tempfile.mkdtemp(prefix='stratagem-convert-'))
    try:
        local = _write(
            checkpoint, staging / url.rsplit('/', 1)[-1], to, step, extra, max_shard_size
        )
        if to == 'file':
            return upload_file(local, url, backend_args=backend_args, update_pointer=False)
        if to == 'hf':
            return upload_directory(local, url, backend_args=backend_args)
        fs, path = filesystem(url, backend_args)
        with store_errors(url, 'saving'):
            transfer.put_file(fs, local, path)  # safetensors: one object, complete or absent
        return url
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_target(dst: Path) -> None:
    """Remove ``dst`` (a file or a sharded directory) and its sidecar manifest."""
    import shutil

    from .manifest import SIDECAR_SUFFIX

    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)
    else:
        dst.unlink()
    sidecar = dst.with_name(dst.name + SIDECAR_SUFFIX)
    if sidecar.exists():
        sidecar.unlink()
