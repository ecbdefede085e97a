"""The formats a checkpoint can have on disk, detected in one place for every reader:
``resume`` and ``load_checkpoint`` of every strategy, and ``stratagem convert``.

``FORMATS`` maps a name to ``(detect(path) -> bool, read(path, progress) -> dict)``, the
first match winning: ``read`` returns the whole checkpoint as one mmengine-layout dict on the
CPU (``progress(done, total)`` is called as files are verified). Ours: ``'hf'`` (a Hugging
Face directory: ``model.safetensors`` or shards with their index, ``huggingface.py``),
``'safetensors'`` (one ``.safetensors`` file), ``'sharded'`` (a DCP directory with a
stratagem manifest) and ``'file'`` (one file, verified when it has a manifest). A backend
with a layout of its own adds it with :func:`register_format` (``stratagem.strategies``
registers DeepSpeed's directories as ``'zero'``).

``PIECEWISE`` maps the formats whose files a rank can read in pieces to ``read(path,
model_state) -> dict``: only this rank's block of each tensor the live ``model_state``
holds sharded (:func:`read_like`; a sharding strategy's weights-only load).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import NotACheckpointError
from .huggingface import is_hf_directory, is_safetensors_file, read_hf, read_hf_like
from .load import load_checkpoint_file
from .location import is_url
from .sharded import is_sharded_checkpoint, read_sharded_checkpoint

__all__ = [
    'FORMATS',
    'PIECEWISE',
    'register_format',
    'detect',
    'detect_format',
    'read_whole',
    'read_like',
]

Progress = Callable[[int, int], None]
Reader = Callable[[Path, Progress | None], dict]


def _read_file(path: Path, progress: Progress | None) -> dict:
    return _read_file_result(path, load_checkpoint_file(path, map_location='cpu'))


def _read_file_result(path: Path | str, checkpoint: Any) -> dict:
    if not isinstance(checkpoint, dict):
        raise NotACheckpointError(
            f'{path} holds a {type(checkpoint).__name__}, not a checkpoint '
            "dict (expected keys like 'state_dict', 'meta')"
        )
    return checkpoint


FORMATS: dict[str, tuple[Callable[[Path], bool], Reader]] = {
    'hf': (is_hf_directory, read_hf),
    'safetensors': (is_safetensors_file, read_hf),
    'sharded': (
        is_sharded_checkpoint,
        lambda p, progress: read_sharded_checkpoint(p, progress=progress),
    ),
    'file': (Path.is_file, _read_file),
}

PIECEWISE: dict[str, Callable[[Path, Mapping[str, Any]], dict]] = {
    'hf': read_hf_like,
    'safetensors': read_hf_like,
}


def register_format(name: str, detect: Callable[[Path], bool], read: Reader) -> None:
    """Add a format, tried before ours (a backend's directories are more specific than a
    DCP directory or a file); registering a name again replaces it in place."""
    if name in FORMATS:
        FORMATS[name] = (detect, read)
        return
    items = list(FORMATS.items())
    FORMATS.clear()
    FORMATS.update({name: (detect, read), **dict(items)})


def detect_format(path: str | Path, backend_args: Mapping | None = None) -> str | None:
    """The name of ``path``'s format, or None when no format matches (or it is missing).
    A URL (``backend_args``: its storage options): from its objects and manifest
    (``remote_directory.remote_detect``)."""
    return detect(path, backend_args)[0]


def detect(
    path: str | Path, backend_args: Mapping | None = None
) -> tuple[str | None, tuple[dict, str] | None]:
    """``detect_format``'s name, and for a directory at a URL the manifest it read with that
    manifest's sha256 (else None): pass it on to the verification (``found=``), so that one
    load reads the manifest once."""
    if is_url(path):
        from .remote_directory import remote_detect

        return remote_detect(str(path), backend_args)
    local = Path(path)
    for name, (matches, _) in FORMATS.items():
        if matches(local):
            return name, None
    return None, None


def read_whole(
    path: str | Path,
    name: str,
    progress: Progress | None = None,
    backend_args: Mapping | None = None,
    found: tuple[dict, str] | None = None,
) -> dict:
    """The checkpoint at ``path`` in format ``name`` as one mmengine-layout dict (CPU).

    A URL (``backend_args``: its storage options): a file or a sharded directory is read
    from the store, verified, into memory; a directory whose reader reads only local files
    (DeepSpeed's, Hugging Face's) is downloaded, verified, to a temporary directory first.
    ``found``: its manifest, read already (``detect``)."""
    if not is_url(path):
        return FORMATS[name][1](Path(path), progress)
    url = str(path)
    if name == 'file':
        from .location import load_file

        return _read_file_result(url, load_file(url, backend_args=backend_args))
    if name == 'sharded':
        return read_sharded_checkpoint(
            url, progress=progress, backend_args=backend_args, found=found
        )
    if name not in FORMATS:
        raise NotACheckpointError(
            f'{url} is a directory checkpoint in no format this reader knows (formats: '
            f'{", ".join(FORMATS)})'
        )
    import shutil

    from .remote_directory import download_directory

    local = download_directory(url, backend_args=backend_args, progress=progress, found=found)
    try:
        return FORMATS[name][1](local, None)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def read_like(path: str | Path, name: str, model_state: Mapping[str, Any]) -> dict:
    """The checkpoint at ``path`` in format ``name`` (one of ``PIECEWISE``), each tensor that
    ``model_state`` holds sharded read as this rank's piece only (collective: every rank
    calls it)."""
    return PIECEWISE[name](Path(path), model_state)
