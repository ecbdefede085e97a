"""One ``torch.save`` file written the way every checkpoint file is: created new, hashed as
its bytes go to disk (no second read for the manifest), fsynced; torch's own per-record zip
CRC32, which our digest makes redundant, switched off meanwhile."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .digest import HashingWriter, file_entry


def write_torch_file(
    checkpoint: Any,
    path: Path,
    zip_crc32: bool = False,
    *,
    fsync: bool = True,
    pool: ThreadPoolExecutor | None = None,
) -> dict:
    """``torch.save`` to a new file at ``path``, hashed as written, fsynced (``fsync=False``:
    the caller fsyncs it, with others at once); its manifest entry (``file_entry``: path as
    given, size, digest). ``pool``: the hashing thread (default: one of its own)."""
    with contextlib.ExitStack() as stack:
        if pool is None:
            pool = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix='stratagem-hash'))
        size, digest, algo = _write_torch_file(checkpoint, Path(path), zip_crc32, fsync, pool)
    return file_entry(str(path), size, digest, algo)


def _write_torch_file(
    checkpoint: Any, path: Path, zip_crc32: bool, fsync: bool, pool: ThreadPoolExecutor
) -> tuple[int, str, str]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with crc32_option(zip_crc32):
            writer = HashingWriter(fd, pool)
            try:
                torch.save(checkpoint, writer)  # type: ignore[arg-type]
            except Exception:
                if writer.error is not None:  # the real cause (ENOSPC, EIO), not torch's echo
                    raise writer.error from None
                raise
        writer.flush()
        if fsync:
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
def crc32_option(enabled: bool) -> Iterator[None]:
    """torch's per-record zip CRC32 costs ~0.25 s per GB and duplicates our digest; it is a
    process-wide torch setting, so it is switched off while at least one of our saves runs
    (counted under a lock: overlapping saves, e.g. DCP's shards and extra.pth on two
    threads, share the switch) and restored after the last."""
    get = getattr(torch.serialization, 'getcrc32_options', None)
    set_ = getattr(torch.serialization, 'setcrc32_options', None)
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
