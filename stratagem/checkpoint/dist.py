"""Agreeing on a checkpoint name across ranks (step 1 of the save protocol).

``torch.distributed`` is used only when a process group is initialised; a single process gets
its own argument back, so callers need no branch.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def agree_on_path(path: str | os.PathLike | None, *, src: int = 0, group: Any = None) -> Path:
    """Return ``src``'s ``path`` on every rank (a broadcast); other ranks may pass None.

    Without an initialised process group this returns ``Path(path)``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if path is None:
            raise ValueError('agree_on_path(None) outside a process group: pass the path')
        return Path(path)
    box = [os.fspath(path) if path is not None else None]
    dist.broadcast_object_list(box, src=src, group=group)
    if box[0] is None:
        raise ValueError(f'agree_on_path: rank {src} passed None; the source rank must pass '
                         f'the path')
    return Path(box[0])
