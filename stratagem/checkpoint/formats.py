"""The formats a checkpoint can have on disk, detected in one place for every reader:
``resume`` and ``load_checkpoint`` of every strategy, and ``stratagem convert``.

``FORMATS`` maps a name to ``(detect(path) -> bool, read(path, progress) -> dict)``, the
first match winning: ``read`` returns the whole checkpoint as one mmengine-layout dict on the
CPU (``progress(done, total)`` is called as files are verified). Ours: ``'sharded'`` (a DCP
directory with a stratagem manifest) and ``'file'`` (one file, verified when it has a
manifest). A backend with a layout of its own adds it with :func:`register_format`
(``stratagem.strategies`` registers DeepSpeed's directories as ``'zero'``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .errors import NotACheckpointError
from .load import load_checkpoint_file
from .sharded import is_sharded_checkpoint, read_sharded_checkpoint

__all__ = ['FORMATS', 'register_format', 'detect_format', 'read_whole']

Progress = Callable[[int, int], None]
Reader = Callable[[Path, Progress | None], dict]


def _read_file(path: Path, progress: Progress | None) -> dict:
    checkpoint = load_checkpoint_file(path, map_location='cpu')
    if not isinstance(checkpoint, dict):
        raise NotACheckpointError(
            f'{path} holds a {type(checkpoint).__name__}, not a checkpoint '
            "dict (expected keys like 'state_dict', 'meta')"
        )
    return checkpoint


FORMATS: dict[str, tuple[Callable[[Path], bool], Reader]] = {
    'sharded': (
        is_sharded_checkpoint,
        lambda p, progress: read_sharded_checkpoint(p, progress=progress),
    ),
    'file': (Path.is_file, _read_file),
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


def detect_format(path: str | Path) -> str | None:
    """The name of ``path``'s format, or None when no format matches (or it is missing)."""
    path = Path(path)
    for name, (detect, _) in FORMATS.items():
        if detect(path):
            return name
    return None


def read_whole(path: str | Path, name: str, progress: Progress | None = None) -> dict:
    """The checkpoint at ``path`` in format ``name`` as one mmengine-layout dict (CPU)."""
    return FORMATS[name][1](Path(path), progress)
