"""Checkpoint files: atomic commit, manifests, safe load, the latest pointer, retention, and
putting a state dict into a module.

This package decides how a checkpoint is written, committed, verified, found and loaded; the
strategy decides what is in it. The save protocol is numbered in ``commit.py``, the load
sequence in ``load.py``, the multi-rank directory protocol in
``directory.py``, where manifests live in ``manifest.py``. Importing it imports torch,
xxhash and the standard library only.

Ranks, collectives and rank-aware warnings come from ``stratagem.env`` (``env.get_rank``,
``env.all_gather_object``, ``env.warn_rank_zero``, ...), never from a local copy. The modules
import it inside the functions that use it (``from stratagem import env``, marked by a
comment): at module level it would add ~7 ms, a fifth, to ``import stratagem.checkpoint``,
which needs nothing of it until a checkpoint is written or read. There is no cycle:
``stratagem.env`` imports nothing of this package.
"""

from .commit import commit_directory, finalize_directory, new_staging_dir, save_checkpoint
from .content import add_safe_globals, get_safe_globals, safe_globals, validate_checkpoint_content
from .directory import (
    DirectoryWriteResult,
    begin_directory_save,
    finish_directory_save,
    save_directory,
    verify_directory,
    write_directory_files,
)
from .dist import CheckpointNotShared, agree_on_checkpoint, agree_on_path, checkpoint_identity
from .errors import (
    CheckpointCorruptError,
    CheckpointWarning,
    NotACheckpointError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
)
from .latest import (
    POINTER_NAME,
    CheckpointInfo,
    find_latest_checkpoint,
    list_checkpoints,
    read_pointer,
    update_pointer,
)
from .load import load_checkpoint_file
from .manifest import manifest_path, verify_checkpoint
from .retention import apply_retention
from .sharded import (
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    load_sharded_in_place,
    local_tensors,
    optim_state_to_fqn,
    optim_state_to_index,
    read_partial_grads,
    read_sharded_checkpoint,
    read_sharded_header,
    save_sharded_checkpoint,
)
from .state_dict import (
    WEIGHT_ENTRIES,
    LoadReport,
    PartialLoadWarning,
    StateDictMismatchError,
    check_state_dict,
    describe_keys,
    find_model_weights,
    load_state_dict,
    revise_keys,
    unwrap_model,
)

__all__ = [
    'save_checkpoint',
    'commit_directory',
    'new_staging_dir',
    'finalize_directory',
    'agree_on_path',
    'agree_on_checkpoint',
    'checkpoint_identity',
    'CheckpointNotShared',
    'validate_checkpoint_content',
    'save_directory',
    'begin_directory_save',
    'write_directory_files',
    'finish_directory_save',
    'verify_directory',
    'DirectoryWriteResult',
    'save_sharded_checkpoint',
    'read_sharded_checkpoint',
    'load_sharded_checkpoint',
    'read_sharded_header',
    'load_sharded_in_place',
    'local_tensors',
    'read_partial_grads',
    'is_sharded_checkpoint',
    'optim_state_to_fqn',
    'optim_state_to_index',
    'add_safe_globals',
    'get_safe_globals',
    'safe_globals',
    'load_checkpoint_file',
    'verify_checkpoint',
    'manifest_path',
    'find_latest_checkpoint',
    'list_checkpoints',
    'read_pointer',
    'update_pointer',
    'POINTER_NAME',
    'CheckpointInfo',
    'apply_retention',
    'revise_keys',
    'load_state_dict',
    'unwrap_model',
    'LoadReport',
    'StateDictMismatchError',
    'PartialLoadWarning',
    'find_model_weights',
    'describe_keys',
    'check_state_dict',
    'WEIGHT_ENTRIES',
    'CheckpointCorruptError',
    'NotACheckpointError',
    'UnsafeCheckpointError',
    'CheckpointWarning',
    'UnverifiedCheckpointWarning',
]
