"""A reusable fault harness for checkpoint tests: filesystem errors injected at the file layer.

``failing_io(directory, errno.ENOSPC, after_bytes=N)`` makes ``os.write`` fail with that errno
for any file under ``directory`` once N bytes were written to files there (``op='fsync'``:
``os.fsync`` fails instead, as a disk that reports EIO at flush time does). Every write path of
``stratagem.checkpoint`` (the torch.save writer, manifests, the pointer) goes through these two
calls, so the code under test runs unchanged. ``injected`` counts the failures raised.

SIGKILL at random instants is ``_crash_writer.py`` (a zygote forking saving children), driven
by ``test_ckpt_crash.py`` and, for 100+ kills, by ``benchmarks/checkpoint_soak.py``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


class _Injector:
    def __init__(self, directory: Path, err: int, after_bytes: int, op: str) -> None:
        self.directory = str(directory.resolve())
        self.err, self.after_bytes, self.op = err, after_bytes, op
        self.written = 0
        self.injected = 0

    def targets(self, fd: int) -> bool:
        try:
            path = os.readlink(f'/proc/self/fd/{fd}')
        except OSError:
            return False
        return path.startswith(self.directory + os.sep)

    def fail(self) -> None:
        self.injected += 1
        raise OSError(self.err, os.strerror(self.err))


@contextlib.contextmanager
def failing_io(
    directory: str | os.PathLike, err: int, *, after_bytes: int = 0, op: str = 'write'
) -> Iterator[_Injector]:
    """Inject ``OSError(err)`` into ``os.write`` (``op='write'``) or ``os.fsync``
    (``op='fsync'``) of files under ``directory`` after ``after_bytes`` bytes went there."""
    if op not in ('write', 'fsync'):
        raise ValueError(f"op must be 'write' or 'fsync', got {op!r}")
    inj = _Injector(Path(directory), err, after_bytes, op)
    real_write, real_fsync = os.write, os.fsync

    def write(fd, data):
        if inj.targets(fd):
            if op == 'write' and inj.written + memoryview(data).nbytes > after_bytes:
                inj.fail()
            count = real_write(fd, data)
            inj.written += count
            return count
        return real_write(fd, data)

    def fsync(fd):
        if op == 'fsync' and inj.written >= after_bytes and inj.targets(fd):
            inj.fail()
        return real_fsync(fd)

    os.write, os.fsync = write, fsync
    try:
        yield inj
    finally:
        os.write, os.fsync = real_write, real_fsync


def snapshot_dir(directory: str | os.PathLike) -> dict[str, bytes]:
    """{name: bytes} of every entry in ``directory`` (files only; not recursive)."""
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}
