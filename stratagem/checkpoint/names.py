"""What a save may be called and numbered, checked before anything is written: a final name
that is none of the names the layout reserves (the pointer, a manifest, a temp name), and a
step that orders checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import _fs
from .manifest import SIDECAR_SUFFIX

PathLike = str | os.PathLike


def check_step(step: Any) -> None:
    if step is not None and (type(step) is not int or step < 0):
        raise TypeError(f'step must be a non-negative int or None, got {step!r}')


def check_final_name(path: PathLike) -> Path:
    final = Path(os.fspath(path)).absolute()
    name = final.name
    if not name or name in ('.', '..'):
        raise ValueError(f'checkpoint path {str(path)!r} has no file name')
    if name == 'last_checkpoint' or name.endswith(SIDECAR_SUFFIX) or _fs.is_temp_name(name):
        raise ValueError(
            f'checkpoint name {name!r} is reserved (the pointer file, a manifest, or '
            f'a temp name); choose another, e.g. "epoch_3.pth"'
        )
    return final
