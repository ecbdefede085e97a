"""A checkpoint from one layout to another, in one process (``stratagem convert SRC DST``).

Dispatch on the detected source format (``SOURCES``: a predicate and a reader returning one
full mmengine-layout dict); a backend with a layout of its own adds its source with
``register_source`` (``stratagem.strategies`` registers DeepSpeed's directories). Targets:
``file`` (one verified single-file checkpoint with its manifest) or ``sharded`` (a directory of
DCP files, committed with a manifest). No process group is needed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from .commit import save_checkpoint
from .errors import NotACheckpointError
from .load import load_checkpoint_file
from .sharded import is_sharded_checkpoint, read_sharded_checkpoint, save_sharded_checkpoint

__all__ = ['convert_checkpoint', 'SOURCES', 'register_source']

Reader = Callable[[Path, Callable[[int, int], None] | None], dict]


def _read_file(path: Path, progress: Callable[[int, int], None] | None) -> dict:
    checkpoint = load_checkpoint_file(path, map_location='cpu')
    if not isinstance(checkpoint, dict):
        raise NotACheckpointError(
            f'{path} holds a {type(checkpoint).__name__}, not a checkpoint '
            "dict (expected keys like 'state_dict', 'meta')"
        )
    return checkpoint


# name -> (detect(path) -> bool, read(path, progress) -> dict); first match wins
SOURCES: dict[str, tuple[Callable[[Path], bool], Reader]] = {
    'sharded': (
        is_sharded_checkpoint,
        lambda p, progress: read_sharded_checkpoint(p, progress=progress),
    ),
    'file': (Path.is_file, _read_file),
}


def register_source(name: str, detect: Callable[[Path], bool], read: Reader) -> None:
    """Add a source format, tried before ours (a backend's directories are more specific than
    a DCP directory or a file); registering a name again replaces it in place."""
    if name in SOURCES:
        SOURCES[name] = (detect, read)
        return
    items = list(SOURCES.items())
    SOURCES.clear()
    SOURCES.update({name: (detect, read), **dict(items)})


def detect_source(path: Path) -> str:
    for name, (detect, _) in SOURCES.items():
        if detect(path):
            return name
    if not path.exists():
        raise FileNotFoundError(f'checkpoint not found: {path}')
    raise NotACheckpointError(
        f'{path} is not a checkpoint this command can read (formats: '
        f'{", ".join(SOURCES)}); a directory needs DCP .metadata and '
        f'a stratagem manifest.json'
    )


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str = 'file',
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Convert ``src`` (any format in ``SOURCES``) to ``dst`` (``to='file'`` or ``'sharded'``)."""
    if to not in ('file', 'sharded'):
        raise ValueError(f"convert: to={to!r}; use 'file' or 'sharded'")
    src, dst = Path(src).absolute(), Path(dst).absolute()
    if dst.exists():
        raise FileExistsError(
            f'convert: {dst} exists; choose a new name (a conversion never overwrites a checkpoint)'
        )
    source = detect_source(src)
    checkpoint = SOURCES[source][1](src, progress)
    step = (checkpoint.get('meta') or {}).get('iter')
    step = step if type(step) is int else None
    extra = {'converted_from': str(src), 'source_format': source}
    if to == 'sharded' and not isinstance(checkpoint.get('state_dict'), Mapping):
        raise NotACheckpointError(
            f"convert: {src} has no model weights under 'state_dict' (its keys: "
            f'{sorted(map(str, checkpoint))[:12]}); a sharded checkpoint is written from '
            "mmengine's layout: {'state_dict': weights, 'optimizer': ..., 'meta': ...}"
        )
    if to == 'file':
        checkpoint.pop('partial_grads_fqn', None)  # per-rank, meaningful only sharded
        return save_checkpoint(
            checkpoint, dst, step=step, extra_manifest=extra, update_pointer=False
        )
    return save_sharded_checkpoint(
        dst, checkpoint, step=step, extra_manifest=extra, optimizer_keys='index', collective=False
    )
