"""Checkpoint files: atomic commit, manifests, safe load, the latest pointer, retention, and
putting a state dict into a module.

This package decides how a checkpoint is written, committed, verified, found and loaded; the
strategy decides what is in it: ``Checkpointer.save(path, state)`` / ``load(path, state)``
(``checkpointer.py``) take the state as a mapping of ``Stateful`` parts and write it through
a ``CheckpointStorage`` (``storage.py``). The save and load sequences are numbered once, in
docs/architecture.md ('Save', 'Load and resume'). A file is committed by ``single_file.py``,
a directory (on every rank, or in one process) by ``directory.py``, DCP's sharded
directories laid out by ``sharded.py``; one file is read by ``load.py``; manifests are
``manifest.py``'s, every error ``errors.py``'s (all exported here). Importing it imports
torch, xxhash and the standard library only.

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
from .content import add_safe_globals, get_safe_globals, safe_globals
from .convert import convert_checkpoint
from .errors import (
    CheckpointCorruptError,
    CheckpointLocationError,
    CheckpointNotShared,
    CheckpointVoteError,
    CheckpointWarning,
    CheckpointWriteError,
    NotACheckpointError,
    PartialLoadWarning,
    RankError,
    StateDictMismatchError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
)
from .latest import POINTER_NAME, CheckpointInfo, find_latest_checkpoint, list_checkpoints
from .load import load_checkpoint_file
from .manifest import ManifestOrder, verify_checkpoint
from .retention import apply_retention, delete_checkpoint, sweep_debris
from .sharded import read_sharded_checkpoint
from .single_file import save_checkpoint
from .state_dict import LoadReport, load_state_dict, revise_keys
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
    'ManifestOrder',
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
    # errors and warnings (errors.py)
    'CheckpointCorruptError',
    'NotACheckpointError',
    'UnsafeCheckpointError',
    'CheckpointWriteError',
    'CheckpointLocationError',
    'CheckpointVoteError',
    'CheckpointNotShared',
    'RankError',
    'StateDictMismatchError',
    'CheckpointWarning',
    'UnverifiedCheckpointWarning',
    'PartialLoadWarning',
]
