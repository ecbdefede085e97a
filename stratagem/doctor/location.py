"""Check 6b of ``stratagem doctor``: the checkpoint location of mmengine's
``default_hooks.checkpoint.out_dir`` (``out_dir/<the work_dir's last component>``, as the run
resolves it: ``loop.plan.CheckpointPlan.directory``).

At a URL: one small probe object written there and removed (``store_debris.probe_writable``);
a missing bucket, refused credentials, a permission denied or an unreachable endpoint is a
finding, named as the run would name it at its first save. Then the debris of interrupted
uploads there (objects no manifest lists, orphan manifests, directories a directory save
left without its manifest, incomplete multipart uploads) is listed as notes, each with
whether retention removes it. A local ``out_dir``: a probe file
written and removed in the nearest existing directory.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ['LocationChecks']

_LISTED = 10  # debris named one by one; the rest counted


class LocationChecks:
    """The location check of ``checks.Doctor`` (which provides ``cfg``, ``plan``, ``add``
    and ``notes``)."""

    cfg: Any
    plan: Any
    notes: list[str]
    add: Callable[[str, str, str], None]

    def check_location(self) -> None:
        if self.plan is None or self.plan.checkpoints.out_dir is None:
            return
        from stratagem.checkpoint.location import is_url
        from stratagem.loop.plan import run_work_dir

        directory = self.plan.checkpoints.directory(run_work_dir(self.cfg))
        if is_url(directory):
            self._check_url(directory, self.plan.checkpoints.backend_args)
        else:
            self._check_local(directory)

    def _check_url(self, directory: str, backend_args: Any) -> None:
        from stratagem.checkpoint import CheckpointLocationError
        from stratagem.checkpoint.store_debris import find_debris, probe_writable

        where = 'default_hooks.checkpoint.out_dir'
        try:
            probe_writable(directory, backend_args)
            debris = find_debris(directory, backend_args)
        except CheckpointLocationError as err:
            problem, _, fix = str(err).partition('; ')
            self.add(where, problem, fix or 'fix the location or its credentials')
            return
        except ImportError as err:
            self.add(where, str(err), 'install the package it names')
            return
        self.notes.append(f'checkpoints go to {directory}: written and removed a probe object')
        if not debris:
            return
        self.notes.append(
            f'{len(debris)} piece(s) of upload debris at {directory} (no checkpoint, never '
            'loaded; retention removes those of its series older than the newest commit): '
            + ', '.join(d.describe() for d in debris[:_LISTED])
            + (f', and {len(debris) - _LISTED} more' if len(debris) > _LISTED else '')
        )

    def _check_local(self, directory: str) -> None:
        path = Path(directory).absolute()
        existing = next(p for p in [path, *path.parents] if p.exists())
        try:
            fd, name = tempfile.mkstemp(prefix='.stratagem-probe-', dir=existing)
        except OSError as err:
            self.add(
                'default_hooks.checkpoint.out_dir',
                f'checkpoints go to {directory}, but {existing} cannot be written ({err})',
                'fix its permissions, or set out_dir to a directory this user may write',
            )
            return
        os.close(fd)
        os.unlink(name)
