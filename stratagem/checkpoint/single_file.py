"""One-file checkpoints: ``save_checkpoint`` (rank 0) writes a file atomically, with its
sidecar manifest ``{name}.manifest.json``; a checkpoint exists completely under its final
name, or not at all. The steps, what a crash at each leaves, and how a write error is
undone are told once, in docs/architecture.md, 'Save' (the file commit)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from . import _fs
from .content import SAFE_GLOBALS_KEY, validate_checkpoint_content
from .digest import entry_digest, file_entry, hash_file
from .disk import OVERHEAD_BYTES, check_free_space, payload_bytes, write_error
from .latest import update_pointer as _update_pointer
from .location import is_url
from .manifest import (
    SIDECAR_SUFFIX,
    _identity,
    build_manifest,
    check_extra_manifest,
    dump_manifest,
    read_manifest,
    remember_verified,
)
from .names import check_final_name, check_step
from .torch_file import write_torch_file

PathLike = str | os.PathLike


def save_checkpoint(
    checkpoint: dict,
    filename: PathLike,
    *,
    step: int | None = None,
    extra_manifest: dict | None = None,
    update_pointer: bool = True,
    zip_crc32: bool = False,
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """Atomically save ``checkpoint`` to ``filename`` with a sidecar manifest (the steps:
    docs/architecture.md, 'Save').

    Args:
        checkpoint: a dict of tensors and plain values (``validate_checkpoint_content``).
        filename: the final path; parent directories are created. Relative paths are made
            absolute against the current directory.
        step: the training step (or epoch) recorded in the manifest; orders checkpoints for
            ``find_latest_checkpoint`` and ``apply_retention``. None if unknown.
        extra_manifest: JSON-serialisable extras merged into the manifest, e.g.
            ``{'world_size': 8, 'strategy': 'DDPStrategy'}``; reserved keys are refused.
        update_pointer: write ``last_checkpoint`` in the same directory after committing.
        zip_crc32: let torch compute the zip format's per-record CRC32. Default False: the
            manifest's digest already covers every byte, and skipping the CRC saves about
            0.25 s/GB. Every torch version reads such files (torch builds miniz with
            ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS``, so its reader never checks the CRC);
            only zip tools (``unzip -t``, ``zipfile.testzip``) report CRC errors. Pass True
            for files that other zip readers must accept.
        before_commit: called once the file is written and fsynced, before its manifest and
            rename; raising abandons the save (the temp file is removed, nothing changes).

    Returns:
        The absolute path of the committed checkpoint.

    Raises:
        CheckpointWriteError: the filesystem refused the write (checked up front for free
            space; ENOSPC, EDQUOT, EIO while writing); nothing of this save remains.
    """
    if not isinstance(checkpoint, dict):
        raise TypeError(f'checkpoint must be a dict, got {type(checkpoint).__name__}')
    if is_url(os.fspath(filename)):  # never a local directory named 's3:'
        raise ValueError(
            f'save_checkpoint writes a local file, not {filename}: save to a URL with '
            'strategy.save_checkpoint(url), or save here and upload the committed file with '
            'stratagem.checkpoint.location.upload_file(path, url)'
        )
    check_step(step)
    check_extra_manifest(extra_manifest)
    held = validate_checkpoint_content(checkpoint)
    if held:  # a loader lacking one of these can then name it (load.py)
        extra_manifest = {**(extra_manifest or {}), SAFE_GLOBALS_KEY: held}
    final = check_final_name(filename)
    if final.is_dir():
        raise IsADirectoryError(f'cannot save checkpoint file {final}: a directory has that name')
    final.parent.mkdir(parents=True, exist_ok=True)
    needed = payload_bytes(checkpoint) + OVERHEAD_BYTES
    check_free_space(final, needed)
    try:
        return _save_file(
            checkpoint, final, step, extra_manifest, update_pointer, zip_crc32, before_commit
        )
    except OSError as err:
        converted = write_error(err, final, needed)
        if converted is err:
            raise
        raise converted from err


def _save_file(
    checkpoint: dict,
    final: Path,
    step: int | None,
    extra: dict | None,
    update_pointer: bool,
    zip_crc32: bool,
    before_commit: Callable[[], None] | None,
) -> Path:
    tmp = _fs.temp_name(final)
    sidecar = final.with_name(final.name + SIDECAR_SUFFIX)
    previous_sidecar = None  # bytes of the sidecar we overwrite, restored if we fail
    sidecar_written = False
    try:
        entry = write_torch_file(checkpoint, tmp, zip_crc32)
        size, (algo, digest) = entry['size'], entry_digest(entry)
        if before_commit is not None:
            before_commit()
        old = _old_manifest(final)
        manifest = build_manifest(
            'file', final.name, [file_entry(final.name, size, digest, algo)], step, extra
        )
        try:
            previous_sidecar = sidecar.read_bytes()
        except FileNotFoundError:
            previous_sidecar = None
        if old is not None:
            _fs.write_atomic(sidecar, dump_manifest({**manifest, 'replaces': old}))
        else:
            _fs.write_atomic(sidecar, dump_manifest(manifest))
        sidecar_written = True  # (write_atomic leaves the old sidecar in place if it fails)
        # The manifest must be durable before the file it describes appears under its name.
        _fs.fsync_dir(final.parent)
        identity = _identity(tmp)  # a rename keeps it; taken now, it is surely our file's
        os.replace(tmp, final)
    except BaseException:
        _fs.unlink_quietly(tmp)  # first: frees the space a restore below may need
        if sidecar_written:  # the old file is still in place: give it back its manifest
            if previous_sidecar is None:
                _fs.unlink_quietly(sidecar)
            else:
                _fs.write_atomic(sidecar, previous_sidecar)
        raise
    _fs.fsync_dir(final.parent)
    remember_verified(final, digest, identity, algo)
    if old is not None:  # committed: the old file is gone, so drop its record
        _fs.write_atomic(sidecar, dump_manifest(manifest))
    if update_pointer:
        _update_pointer(final.parent, final)
    return final


def _old_manifest(final: Path) -> dict | None:
    """A manifest that describes the file now at ``final`` (the one a save will replace).

    Recorded as ``replaces`` in the new manifest, so that if we die before our rename the
    file still on disk verifies. Of the current sidecar and its own ``replaces`` (left by an
    earlier save that died) we keep the one matching the file; a file without a manifest
    (mmengine, plain torch.save) is hashed and described afresh. None if no file is there.
    """
    if not final.is_file():
        return None
    try:
        current = read_manifest(final.with_name(final.name + SIDECAR_SUFFIX))
    except ValueError:
        current = None
    candidates = []
    if current is not None:
        nested = current.pop('replaces', None)
        candidates = [current] + ([nested] if isinstance(nested, dict) else [])
    size = final.stat().st_size
    matching = [
        m
        for m in candidates
        if any(f.get('path') == final.name and f.get('size') == size for f in m.get('files', []))
    ]
    if len(matching) == 1:
        return matching[0]
    digests: dict[str, str] = {}  # per algorithm: the old manifests may use either
    for m in matching:
        for f in m.get('files', []):
            if f.get('path') != final.name:
                continue
            algo, expected = entry_digest(f)
            if algo not in digests:
                digests[algo] = hash_file(final, algo=algo)[1]
            if digests[algo] == expected:
                return m
    actual_size, digest = hash_file(final)
    return build_manifest(
        'file', final.name, [file_entry(final.name, actual_size, digest)], None, None
    )
