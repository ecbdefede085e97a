"""Atomic saves: a checkpoint exists completely under its final name, or not at all.

Single file, ``save_checkpoint(checkpoint, filename, step=...)`` (rank 0 only):

1. Validate the content (tensors, plain values, allow-listed classes) and ``extra_manifest``;
   a bad state raises ``TypeError`` with the key path before any byte is written. The
   allow-listed globals the content references go into the manifest as ``safe_globals``.
   Check the free space of the target filesystem against the tensors' size: too little
   raises ``CheckpointWriteError`` (ENOSPC) before anything is touched.
2. ``torch.save`` into ``.{name}.tmp-{pid}-{rand}`` in the same directory through a writer
   that computes the digest while writing and starts disk writeback as it goes; fsync.
   ``before_commit()`` (if given) runs now: under a process group, the vote that every rank
   is still there; if it raises, the save is abandoned.
3. Write the sidecar manifest ``{name}.manifest.json`` (size, digest, step, versions, extras)
   by temp + fsync + rename; fsync the directory. If a file of the same name exists, the new
   manifest also records the old one (``replaces``), so the old file stays verifiable.
4. Rename the temp file to ``name``; fsync the directory. The checkpoint now exists.
5. Update ``last_checkpoint`` (the absolute path, mmengine's format) by temp + rename.
6. The caller may now call ``apply_retention``.

A crash before 4 leaves the previous checkpoints and pointer as they were, plus a temp file
(and possibly a manifest without its file) that ``apply_retention`` removes later; a crash
after 4 leaves the new checkpoint committed with the pointer on the old one or the new one.
A write error (ENOSPC, EDQUOT, EIO) before 4 removes the temp file, restores the previous
manifest and raises ``CheckpointWriteError`` naming the file, the cause and, for a full disk,
the space needed and free.

Directory checkpoint (every directory layout ends here):

1. ``new_staging_dir(final_dir)``: a fresh, empty ``.{name}.tmp-{pid}-{rand}`` beside the
   final name (rank 0 only).
2. The writers fill it.
3. ``finalize_directory(staging, final_dir, step=...)``: fsync and hash every file its
   writers did not hash, write ``manifest.json`` inside, rename the directory into place (an
   atomic exchange where the OS has one), fsync the parent, update the pointer.

Two entry points reach it: across ranks ``directory.save_directory`` (rank 0 creates the
staging directory and publishes it, every rank writes and hashes its files, the ranks agree
through the store vote, ``vote.py``, and rank 0 finalizes) and, in one process,
``with commit_directory(final_dir, step=...) as staging: ...write files...``. Names are
checked here for both kinds (``check_final_name``, ``check_step``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from . import _fs
from .content import SAFE_GLOBALS_KEY, validate_checkpoint_content
from .digest import HashingWriter, entry_digest, file_entry, hash_file
from .errors import CheckpointWriteError
from .latest import update_pointer as _update_pointer
from .manifest import (
    DIR_MANIFEST,
    SIDECAR_SUFFIX,
    _identity,
    build_manifest,
    check_extra_manifest,
    dump_manifest,
    read_manifest,
    remember_verified,
)

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
    """Atomically save ``checkpoint`` to ``filename`` with a sidecar manifest; see module doc.

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
    check_step(step)
    check_extra_manifest(extra_manifest)
    held = validate_checkpoint_content(checkpoint)
    if held:  # a loader lacking one of these can then name it (load.py)
        extra_manifest = {**(extra_manifest or {}), SAFE_GLOBALS_KEY: held}
    final = check_final_name(filename)
    if final.is_dir():
        raise IsADirectoryError(f'cannot save checkpoint file {final}: a directory has that name')
    final.parent.mkdir(parents=True, exist_ok=True)
    needed = payload_bytes(checkpoint) + _OVERHEAD_BYTES
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


# zip headers, pickle stream, alignment padding and the manifest, on top of the tensor bytes
_OVERHEAD_BYTES = 1 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_WRITE_ERRNOS = _FULL_ERRNOS + (errno.EIO, errno.EROFS)


def payload_bytes(obj: Any) -> int:
    """Bytes of tensor storage that ``torch.save(obj)`` writes (each storage once, whole)."""
    seen: dict[tuple, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            seen[(item.device, storage.data_ptr())] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
    return sum(seen.values())


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path``."""
    st = os.statvfs(path if path.is_dir() else path.parent)
    return st.f_bavail * st.f_frsize


def check_free_space(final: Path, needed: int) -> None:
    """Raise ``CheckpointWriteError`` (ENOSPC) if ``final``'s filesystem has less than
    ``needed`` bytes free; called before anything of a save is written."""
    try:
        free = free_bytes(final.parent)
    except OSError:
        return  # statvfs unsupported here: the write itself will tell
    if free < needed:
        raise CheckpointWriteError(
            errno.ENOSPC,
            _full_message(final, needed, free)
            + '; nothing was written: free space or lower max_keep_ckpts',
        )


def _full_message(path: Path, needed: int, free: int) -> str:
    return (
        f'no space left on device writing {path} (needed ~{needed / 2**20:.0f} MB, free '
        f'{free / 2**20:.0f} MB)'
    )


def write_error(err: OSError, path: Path, needed: int | None = None) -> OSError:
    """The error to raise for ``err`` while writing checkpoint ``path``: a filesystem failure
    (full, quota, EIO, read-only) becomes ``CheckpointWriteError`` naming the path and the
    cause; anything else is returned as it is."""
    if isinstance(err, CheckpointWriteError) or err.errno not in _WRITE_ERRNOS:
        return err
    cause = os.strerror(err.errno)
    if err.errno in _FULL_ERRNOS:
        try:
            free = free_bytes(path.parent)
        except OSError:
            free = 0
        message = (
            _full_message(path, needed or 0, free)
            if err.errno == errno.ENOSPC
            else f'{cause.lower()} writing {path} (needed ~{(needed or 0) / 2**20:.0f} MB, '
            f'free {free / 2**20:.0f} MB)'
        )
    else:
        message = f'{cause} writing {path} (errno {errno.errorcode.get(err.errno, err.errno)})'
    return CheckpointWriteError(err.errno, message + '; the previous checkpoint is unchanged')


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
        size, digest, algo = _write_torch_file(checkpoint, tmp, zip_crc32)
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


def write_torch_file(checkpoint: Any, path: Path, zip_crc32: bool = False) -> dict:
    """``torch.save`` to a new file at ``path``, hashed as written, fsynced; its manifest
    entry (``file_entry``: path as given, size, digest)."""
    size, digest, algo = _write_torch_file(checkpoint, Path(path), zip_crc32)
    return file_entry(str(path), size, digest, algo)


def _write_torch_file(checkpoint: Any, path: Path, zip_crc32: bool) -> tuple[int, str, str]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with (
            ThreadPoolExecutor(1, thread_name_prefix='stratagem-hash') as pool,
            _crc32_option(zip_crc32),
        ):
            writer = HashingWriter(fd, pool)
            try:
                torch.save(checkpoint, writer)  # type: ignore[arg-type]
            except Exception:
                if writer.error is not None:  # the real cause (ENOSPC, EIO), not torch's echo
                    raise writer.error from None
                raise
        writer.flush()
        os.fsync(fd)
    finally:
        os.close(fd)
    return writer.size, writer.hasher.hexdigest(), writer.algo


_CRC32_LOCK = threading.Lock()
_CRC32_OFF: list[Any] = [
    0,
    None,
]  # [saves in progress that switched it off, the setting before them]


@contextlib.contextmanager
def _crc32_option(enabled: bool) -> Iterator[None]:
    """torch's per-record zip CRC32 costs ~0.25 s per GB and duplicates our digest; it is a
    process-wide torch setting, so it is switched off while at least one of our saves runs
    (counted under a lock: overlapping saves, e.g. DCP's shards and extra.pth on two
    threads, share the switch) and restored after the last."""
    get = getattr(torch.serialization, 'get_crc32_options', None)
    set_ = getattr(torch.serialization, 'set_crc32_options', None)
    if enabled or get is None or set_ is None:  # torch < 2.6 always computes it
        yield
        return
    with _CRC32_LOCK:
        if _CRC32_OFF[0] == 0:
            _CRC32_OFF[1] = get()
            set_(False)
        _CRC32_OFF[0] += 1
    try:
        yield
    finally:
        with _CRC32_LOCK:
            _CRC32_OFF[0] -= 1
            if _CRC32_OFF[0] == 0:
                set_(_CRC32_OFF[1])


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


# ------------------------------------------------------------------ directory commit
def new_staging_dir(final_dir: PathLike) -> Path:
    """Create and return an empty staging directory next to ``final_dir`` (rank 0 only).

    Its name (``.{name}.tmp-{pid}-{rand}``) marks it as ours, so a crash leaves nothing that
    looks committed and retention can remove it later.
    """
    final = check_final_name(final_dir)
    if final.exists() and not final.is_dir():
        raise FileExistsError(f'cannot commit directory checkpoint {final}: a file has that name')
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = _fs.temp_name(final)
    staging.mkdir()
    return staging


def finalize_directory(
    staging_dir: PathLike,
    final_dir: PathLike,
    *,
    step: int | None = None,
    extra_manifest: dict | None = None,
    update_pointer: bool = True,
    known_files: list[dict] | None = None,
) -> Path:
    """Commit a staging directory filled by the strategy (rank 0 only, after a barrier).

    Fsyncs and hashes every file under ``staging_dir``, writes ``manifest.json`` inside,
    renames it to ``final_dir`` (atomically exchanging with an existing one where the OS can,
    then deleting the old), fsyncs the parent and updates ``last_checkpoint``. Returns the
    absolute final path.

    ``known_files``: ``file_entry`` dicts (path, size, digest[, 'rank']; paths relative to
    the staging dir) already fsynced and hashed by the ranks that wrote them; those are not
    read again (their size is still checked; ``rank``, the writer, is kept in the manifest),
    every other file is fsynced and hashed here.
    """
    staging = Path(staging_dir).absolute()
    final = check_final_name(final_dir)
    check_step(step)
    check_extra_manifest(extra_manifest)
    if (
        not staging.is_dir()
        or staging.parent != final.parent
        or _fs.TEMP_RE.match(staging.name) is None
    ):
        raise ValueError(
            f'staging_dir {staging} is not a staging directory for {final}; '
            f'create it with new_staging_dir({str(final)!r})'
        )
    if (staging / DIR_MANIFEST).exists():
        raise ValueError(
            f'{staging / DIR_MANIFEST} exists: the name {DIR_MANIFEST!r} is '
            f'reserved for the checkpoint manifest; rename that file'
        )
    if final.exists() and not final.is_dir():
        raise FileExistsError(f'cannot commit directory checkpoint {final}: a file has that name')
    files = _hash_tree(staging, {e['path']: e for e in known_files or ()})
    if not files:
        raise ValueError(f'staging directory {staging} is empty; nothing to commit for {final}')
    manifest = build_manifest('directory', final.name, files, step, extra_manifest)
    _fs.write_atomic(staging / DIR_MANIFEST, dump_manifest(manifest))
    _fs.fsync_dir(staging)
    _rename_dir_into_place(staging, final)
    if update_pointer:
        _update_pointer(final.parent, final)
    return final


@contextlib.contextmanager
def commit_directory(
    final_dir: PathLike,
    *,
    step: int | None = None,
    extra_manifest: dict | None = None,
    update_pointer: bool = True,
) -> Iterator[Path]:
    """Single-process directory commit: yields a staging dir; commits it if the block succeeds,
    removes it if the block raises."""
    check_extra_manifest(extra_manifest)
    check_step(step)
    staging = new_staging_dir(final_dir)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        finalize_directory(
            staging,
            final_dir,
            step=step,
            extra_manifest=extra_manifest,
            update_pointer=update_pointer,
        )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _hash_tree(root: Path, known: dict[str, dict] | None = None) -> list[dict]:
    known = known or {}
    files = []
    with ThreadPoolExecutor(1, thread_name_prefix='stratagem-hash') as pool:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath, name)
                if path.is_symlink():
                    raise ValueError(
                        f'{path} is a symlink; a checkpoint directory holds only regular files'
                    )
                rel = path.relative_to(root).as_posix()
                entry = known.get(rel)
                if entry is not None:
                    size = path.stat().st_size
                    if size != entry['size']:
                        raise ValueError(
                            f'{path} has {size} bytes but the rank that wrote it '
                            f'hashed {entry["size"]}; it changed after being written'
                        )
                    algo, digest = entry_digest(entry)
                    files.append(
                        {
                            **file_entry(rel, size, digest, algo),
                            **({'rank': entry['rank']} if 'rank' in entry else {}),
                        }
                    )
                    continue
                _fs.fsync_file(path)
                size, digest = hash_file(path, pool)
                files.append(file_entry(rel, size, digest))
            if Path(dirpath) != root:  # the root is fsynced once its manifest is in it
                _fs.fsync_dir(Path(dirpath))
    return files


def _rename_dir_into_place(staging: Path, final: Path) -> None:
    if not final.exists():
        os.replace(staging, final)
        _fs.fsync_dir(final.parent)
        return
    if _fs.exchange(staging, final):
        # `staging` now holds the old checkpoint under a temp name: retention would also
        # clean it up if we died here.
        _fs.fsync_dir(final.parent)
        shutil.rmtree(staging, ignore_errors=True)
        return
    # No atomic exchange on this platform: a crash between these two renames leaves the old
    # and the new checkpoint under temp names. Prefer unique names per step for directories.
    old = _fs.temp_name(final)
    os.replace(final, old)
    os.replace(staging, final)
    _fs.fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


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
