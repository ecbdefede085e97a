"""DCP's reads of a verified sharded directory, through ``ShardReader`` (``dcp_reader.py``):
the whole DCP state (``_read_dcp_full``), into live state dicts in place on every rank, with
any rank's failure raised on every rank (``_dcp_read``), and its metadata's top-level keys
(``_dcp_keys``). Verifying first, and assembling mmengine's layout, is ``sharded.py``'s.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from .directory import _all_ok, _raise_first, dcp_failures, describe_error


def _reader(path: Path, metadata: Any = None) -> Any:
    """A ``ShardReader`` (imported here: DCP takes ~0.4 s to import)."""
    from .dcp_reader import ShardReader

    return ShardReader(path, metadata=metadata)


def _read_dcp_full(path: Path) -> dict:
    from stratagem._torch import load_whole_dcp

    return load_whole_dcp(_reader(path))


def _dcp_read(path: Path, state: dict, *, metadata: Any = None, what: str = '') -> None:
    """``dcp.load(state)`` of ``path`` on every rank (collective), through ``ShardReader``.

    Each rank plans and reads on its own (``no_dist``): a load's global plan is just the
    ranks' own plans, and DCP's three planning and reporting collectives cost more than
    the read of a small model. One exchange afterwards raises any rank's failure on every
    rank (DCP's ``CheckpointException``, a ``BaseException``, becomes a ``RuntimeError``
    that names the file and the rank)."""
    import torch.distributed.checkpoint as dcp

    error = None
    try:
        with warnings.catch_warnings():  # no_dist under a process group is meant here
            warnings.filterwarnings('ignore', message='torch.distributed is disabled')
            dcp.load(state, storage_reader=_reader(path, metadata), no_dist=True)
    except BaseException as err:
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        error = err
        # no_dist: DCP wraps this rank's own error in a CheckpointException that calls
        # this rank 'rank 0': unwrap it
        failures = list(dcp_failures(err).values())
        if len(failures) == 1 and isinstance(failures[0], BaseException):
            error = failures[0]
    if _all_ok(error is not None):
        return
    from stratagem import env  # imported on use: see checkpoint/__init__.py

    outcomes = env.all_gather_object(None if error is None else describe_error(error))
    if error is not None and not isinstance(error, Exception):
        # a BaseException: this rank raises the message the others see
        error = RuntimeError(f'reading {path} {what} failed: {describe_error(error)}')
    _raise_first(outcomes, error, f'reading {path} {what}'.rstrip())


def _dcp_keys(path: Path) -> set[str]:
    """Top-level keys of the DCP state (a checkpoint whose manifest predates ``dcp_keys``)."""
    metadata = _reader(path).read_metadata()
    return {key.split('.', 1)[0] for key in metadata.state_dict_metadata}
