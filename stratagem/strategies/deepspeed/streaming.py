"""DeepSpeed's engine loading a checkpoint at a URL from memory: no local copy of its files.

DeepSpeed's ``engine.load_checkpoint(directory, tag)`` finds its files by local path (a glob
for the model states, ``os.path.exists`` of each ZeRO file) and reads each one through
``engine.checkpoint_engine.load(path, map_location)``. A load from a verified
:class:`~stratagem.checkpoint.remote_directory.RemoteDirectory` (each rank holding the bytes
of the files it reads, verified against the manifest: ``ZeroStorage._verify``):

1. :func:`file_names`: a new local directory with an empty file for each name the manifest
   lists under ``deepspeed/``: names for DeepSpeed's path checks, no byte of the checkpoint.
2. ``StreamingCheckpointEngine(original, remote, names).installed_on(engine)``: inside the
   block, ``load(path)`` maps the name to its object and unpickles the verified bytes from
   memory (read and verified then, if this rank did not hold them); the engine's own
   checkpoint engine is back after the block, also when it raises.
3. The caller removes the names directory and drops the bytes (DeepSpeed reads the model
   states twice: ``SDLoaderBase.check_ckpt_list``, then ``load``; they stay in memory until
   the load ends, as they would in the page cache after a read from disk).

What this engine does not define (``save``, ``makedirs``, ...) is the original engine's.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .files import DEEPSPEED_TAG

__all__ = ['StreamingCheckpointEngine', 'file_names']


def file_names(remote: Any) -> Path:
    """A new local directory holding an empty file for each of ``remote``'s files under
    ``deepspeed/`` (``remote``: a ``RemoteDirectory``). The caller removes it."""
    names = Path(tempfile.mkdtemp(prefix='stratagem-names-'))
    (names / DEEPSPEED_TAG).mkdir()
    for relative in remote.entries:
        if relative.startswith(f'{DEEPSPEED_TAG}/'):
            target = names / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
    return names


class StreamingCheckpointEngine:
    """``engine.checkpoint_engine`` for a load from a URL (module doc).

    Args:
        original: the engine's own checkpoint engine; methods not defined here are its.
        remote: the verified directory (a ``RemoteDirectory``).
        names: the directory of names DeepSpeed is given (``file_names(remote)``).
    """

    def __init__(self, original: Any, remote: Any, names: str | os.PathLike) -> None:
        self._original, self._remote, self._names = original, remote, Path(names)
        self.name = 'StratagemStreamingCheckpointEngine'
        #: the files DeepSpeed read, relative to the checkpoint, in order
        self.read: list[str] = []

    def __getattr__(self, name: str) -> Any:  # only for names not defined here
        if name.startswith('_'):
            raise AttributeError(name)
        return getattr(self._original, name)

    def load(self, path: str | os.PathLike, map_location: Any = None) -> Any:
        """The file DeepSpeed names by ``path`` (under ``names``), from its verified bytes.
        DeepSpeed's files hold its config objects, so they are unpickled freely: only ever
        after their digests matched the manifest."""
        import torch

        try:
            relative = Path(path).relative_to(self._names).as_posix()
        except ValueError:
            raise FileNotFoundError(
                f'DeepSpeed asked for {path}, outside the checkpoint it loads from '
                f'{self._remote.url} (given to it as {self._names})'
            ) from None
        if not self._remote.has(relative):
            raise FileNotFoundError(
                f'{self._remote.url}/{relative} is not in its manifest; DeepSpeed asked for it'
            )
        self.read.append(relative)
        with self._remote.open_verified(relative) as stream:
            return torch.load(stream, map_location=map_location, weights_only=False)

    @contextlib.contextmanager
    def installed_on(self, engine: Any) -> Iterator[StreamingCheckpointEngine]:
        """``engine.checkpoint_engine`` is this engine inside the block, the original again
        after it (also when the block raises)."""
        engine.checkpoint_engine = self
        try:
            yield self
        finally:
            engine.checkpoint_engine = self._original
