"""Checkpoint files: atomic commit, manifests, safe load, the latest pointer, retention, and
putting a state dict into a module.

This package decides how a checkpoint is written, committed, verified, found and loaded; the
strategy decides what is in it. The save protocol is numbered in ``commit.py``, the load
sequence in ``load.py``, where manifests live in ``manifest.py``. Importing it imports torch,
xxhash and the standard library only.
"""
from .commit import (
                     commit_directory,
                     finalize_directory,
                     new_staging_dir,
                     save_checkpoint,
)
from .content import validate_checkpoint_content
from .dist import agree_on_path
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
from .state_dict import LoadReport, load_state_dict, revise_keys, unwrap_model

__all__ = [
    'save_checkpoint', 'commit_directory', 'new_staging_dir', 'finalize_directory',
    'agree_on_path', 'validate_checkpoint_content',
    'load_checkpoint_file', 'verify_checkpoint', 'manifest_path',
    'find_latest_checkpoint', 'list_checkpoints', 'read_pointer', 'update_pointer',
    'POINTER_NAME', 'CheckpointInfo', 'apply_retention',
    'revise_keys', 'load_state_dict', 'unwrap_model', 'LoadReport',
    'CheckpointCorruptError', 'NotACheckpointError', 'UnsafeCheckpointError',
    'CheckpointWarning', 'UnverifiedCheckpointWarning',
]
