"""The commit of a directory checkpoint (every directory layout ends here): a fresh staging
directory beside the final name, then ``finalize_directory``: fsync and hash every file its
writers did not hash, write ``manifest.json`` inside, rename the directory into place (an
atomic exchange where the OS has one), fsync the parent, update the pointer.

Two entry points reach it: ``directory.save_directory`` (every rank writes, the ranks agree
through the store vote, rank 0 finalizes) and, in one process, ``commit_directory`` (a
context manager: the block writes into the staging directory). Names are checked here for
single files too (``check_final_name``, ``check_step``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import _fs
from .latest import update_pointer as _update_pointer
from .manifest import (
    DIR_MANIFEST,
    SIDECAR_SUFFIX,
    build_manifest,
    check_extra_manifest,
    dump_manifest,
    entry_digest,
    file_entry,
    hash_file,
)

__all__ = ['new_staging_dir', 'finalize_directory', 'commit_directory']

PathLike = str | os.PathLike


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
