"""Checkpoint files: atomic commit, manifests, safe load, the latest pointer, retention, and
putting a state dict into a module.

This package decides how a checkpoint is written, committed, verified, found and loaded; the
strategy decides what is in it: ``Checkpointer.save(path, state)`` / ``load(path, state)``
(``checkpointer.py``) take the state as a mapping of ``Stateful`` parts and write it through
a ``CheckpointStorage`` (``storage.py``). The save protocol is numbered in ``commit.py`` (a
file, and the commit every directory ends in), the load sequence in ``load.py``, the
multi-rank directory protocol in ``directory.py``, DCP's sharded directories in
``sharded.py``, where manifests live in ``manifest.py``. Importing it imports torch, xxhash
and the standard library only.

The names here are what a program calls; the package's own modules, and strategies, import
from the module that defines a name.

Ranks, collectives and rank-aware warnings come from ``stratagem.env`` (``env.get_rank``,
``env.all_gather_object``, ``env.warn_rank_zero``, ...), never from a local copy. The modules
import it inside the functions that use it (``from stratagem import env``, marked by a
comment): at module level it would add ~7 ms, a fifth, to ``import stratagem.checkpoint``,
which needs nothing of it until a checkpoint is written or read. There is no cycle:
``stratagem.env`` imports nothing of this package.
"""

from .checkpointer import Checkpointer, LoadContext, Stateful, StatePart
from .commit import save_checkpoint
from .content import add_safe_globals, get_safe_globals, safe_globals
from .convert import convert_checkpoint
from .errors import (
    CheckpointCorruptError,
    CheckpointWarning,
    CheckpointWriteError,
    NotACheckpointError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
)
from .latest import POINTER_NAME, CheckpointInfo, find_latest_checkpoint, list_checkpoints
from .load import load_checkpoint_file
from .manifest import verify_checkpoint
from .retention import apply_retention, delete_checkpoint, sweep_debris
from .sharded import read_sharded_checkpoint
from .state_dict import (
    LoadReport,
    PartialLoadWarning,
    StateDictMismatchError,
    load_state_dict,
    revise_keys,
)
from .storage import CheckpointStorage, SaveCommit

__all__ = [
    # the sequences over explicit state, and where the content goes
    'Checkpointer',
    'Stateful',
    'StatePart',
    'LoadContext',
    'CheckpointStorage',
    'SaveCommit',
    # save, find, verify, load, convert
    'save_checkpoint',
    'find_latest_checkpoint',
    'list_checkpoints',
    'CheckpointInfo',
    'POINTER_NAME',
    'verify_checkpoint',
    'load_checkpoint_file',
    'read_sharded_checkpoint',
    'apply_retention',
    'delete_checkpoint',
    'sweep_debris',
    'convert_checkpoint',
    # what a checkpoint may hold besides tensors and plain values
    'add_safe_globals',
    'get_safe_globals',
    'safe_globals',
    # a state dict into a module
    'load_state_dict',
    'revise_keys',
    'LoadReport',
    # errors and warnings
    'CheckpointCorruptError',
    'NotACheckpointError',
    'UnsafeCheckpointError',
    'CheckpointWriteError',
    'StateDictMismatchError',
    'CheckpointWarning',
    'UnverifiedCheckpointWarning',
    'PartialLoadWarning',
]
