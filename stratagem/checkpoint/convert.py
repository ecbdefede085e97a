"""A checkpoint from one layout to another, in one process (``stratagem convert SRC DST``).

Dispatch on the source's format, detected by ``formats.detect_format`` (the one detection
every reader shares; a backend registers its own formats there). Targets:
``file`` (one verified single-file checkpoint with its manifest), ``sharded`` (a directory of
DCP files, committed with a manifest), ``hf`` (a directory ``transformers``' ``from_pretrained``
loads: the weights as ``model.safetensors`` or shards with their index, and ``config.json``
when the checkpoint records the model's config) or ``safetensors`` (the full model weights
alone, one file). The last two are written by the ``safetensors`` library
(``huggingface.py``). No process group is needed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from .errors import NotACheckpointError
from .formats import FORMATS, detect_format, read_whole
from .huggingface import save_hf_directory, save_safetensors_file
from .location import is_url
from .sharded import save_sharded_checkpoint
from .single_file import save_checkpoint

__all__ = ['TARGETS', 'convert_checkpoint', 'detect_source']

TARGETS = ('file', 'sharded', 'hf', 'safetensors')


def detect_source(path: Path) -> str:
    """``path``'s format (``formats.FORMATS``), or an error naming the formats known."""
    name = detect_format(path)
    if name is not None:
        return name
    if not path.exists():
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
) -> Path:
    """Convert ``src`` (any format in ``formats.FORMATS``) to ``dst`` (``to='file'``,
    ``'sharded'``, ``'hf'`` or ``'safetensors'``: the weights only).

    ``max_shard_size`` (``to='hf'`` only; ``save_pretrained``'s: ``'5GB'``, ``'500MB'``, an
    int of bytes; default: one ``model.safetensors``): the weights go to shards of at most
    this size, listed in ``model.safetensors.index.json``.

    An existing ``dst`` is refused unless ``overwrite``: then it (and its sidecar manifest)
    is removed once ``src`` has been read and verified, and the new one written in its
    place. ``dst`` may never be ``src``, nor inside it, nor hold it."""
    if to not in TARGETS:
        raise ValueError(f'to={to!r}; use one of {", ".join(map(repr, TARGETS))}')
    if max_shard_size is not None and to != 'hf':
        raise ValueError(
            f'max_shard_size (--max-shard-size) shards a Hugging Face directory; it needs '
            f"to='hf' (--to hf), not {to!r}"
        )
    remote = [str(p) for p in (src, dst) if is_url(os.fspath(p))]
    if remote:  # never a local directory named 's3:'
        raise NotImplementedError(
            f'convert reads and writes local or shared paths only for now, not {remote[0]}; '
            'copy the checkpoint and its .manifest.json locally first'
        )
    src, dst = Path(src).absolute(), Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(
            f'{dst} exists; choose a new name, or pass --overwrite (API: overwrite=True) '
            'to replace it'
        )
    if dst == src or src in dst.parents or dst in src.parents:
        raise ValueError(f'cannot convert {src} into {dst}: the target would replace the source')
    source = detect_source(src)
    checkpoint = read_whole(src, source, progress)
    if dst.exists():  # overwrite: only now that the source read whole and verified
        _remove_target(dst)
    step = (checkpoint.get('meta') or {}).get('iter')
    step = step if type(step) is int else None
    extra = {'converted_from': str(src), 'source_format': source}
    if not isinstance(checkpoint.get('state_dict'), Mapping):
        raise NotACheckpointError(
            f"{src} has no model weights under 'state_dict' (its keys: "
            f'{sorted(map(str, checkpoint))[:12]}); a {to} checkpoint is written from '
            "mmengine's layout: {'state_dict': weights, 'optimizer': ..., 'meta': ...}"
        )
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
