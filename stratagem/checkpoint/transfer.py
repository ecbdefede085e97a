"""Moving a checkpoint's bytes to and from an object store, several requests in flight.

``location.py`` decides what goes up and in which order (the commit on a store without
rename); this module moves one object's bytes, as fast as the store allows, with the one
guarantee the commit needs: **an object is visible under its name only complete**.

Upload (``put_file``) on S3 (an ``s3fs`` filesystem: its coroutine API, botocore's calls):

1. An object smaller than ``MULTIPART_BYTES`` (100 MiB; or at most one part) goes up in one
   PUT (s3fs's ``put_file``).
2. A larger one: ``create_multipart_upload``; then parts of ``part_bytes`` (default
   ``PART_BYTES``, at least S3's 5 MiB floor, enough for S3's 10,000-part ceiling) are read
   from the local file and PUT with at most ``concurrency`` in flight (s3fs's
   ``max_concurrency``, a storage option: ``backend_args=dict(max_concurrency=4)``), so at most
   that many parts are in memory at once.
3. ``complete_multipart_upload`` with every part's ETag in part-number order, whatever order
   the parts finished in: only now does the object exist, under its final name.
4. Any failure we see (a refused part, a dropped connection, an error completing) cancels the
   parts in flight, aborts the upload (``abort_multipart_upload``: the store frees its parts,
   and no incomplete upload is left) and raises the first error. A process killed meanwhile
   leaves an incomplete upload that no reader sees (debris for retention to remove).

Any other protocol (GCS, ``memory://``) goes through its filesystem's own ``put_file``.

Download (``read_into``): the object's bytes into a caller's buffer, on S3 by ranged GETs
(s3fs's ``default_block_size``, 50 MiB, the ranges ``s3fs.get`` uses), ``concurrency`` in
flight, each written into its place; elsewhere through the filesystem's file object. The
buffer is a ``MemoryFile``: memory with a file name (Linux), so a load onto a device
(``map_location='cuda'``) maps the downloaded bytes (``torch.load(mmap=True)``) and copies
them to the device from there: no temporary file on disk, and one copy of the checkpoint in
host memory, not two. A load onto the CPU copies them into tensors of their own (a mapping
would stay alive as long as any tensor of it, e.g. an optimizer's state).
"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Callable
from typing import Any

__all__ = [
    'CONCURRENCY',
    'MIN_PART_BYTES',
    'MULTIPART_BYTES',
    'PART_BYTES',
    'MemoryFile',
    'part_size',
    'put_file',
    'read_into',
]

#: the default part of an upload (benchmarks/remote_checkpoint.py: 8 MiB parts, 4-8 in
#: flight, upload 256 MiB 1.4x as fast as s3fs's 50 MiB parts; 32 MiB parts were slower)
PART_BYTES = 8 << 20
#: objects this large or larger go up in parts; smaller ones in one PUT, as s3fs and S3's
#: own guidance have it (measured here: 64 MiB in one PUT 0.41 s, in 8 MiB parts 0.51 s)
MULTIPART_BYTES = 100 << 20
#: the default range of a download when the filesystem names no ``default_block_size``
RANGE_BYTES = 50 << 20
#: S3 refuses a part smaller than this, but the last
MIN_PART_BYTES = 5 << 20
#: requests in flight when the filesystem names no ``max_concurrency``
CONCURRENCY = 8
_MAX_PARTS = 10_000  # S3's ceiling per upload
_READ_CHUNK = 16 << 20  # the file-object path's reads


def part_size(size: int, part_bytes: int | None = None) -> int:
    """The part size for an object of ``size`` bytes: ``part_bytes`` (default
    ``PART_BYTES``), raised to S3's 5 MiB floor and to what fits ``size`` in 10,000 parts."""
    part = PART_BYTES if part_bytes is None else int(part_bytes)
    return max(part, MIN_PART_BYTES, -(-size // _MAX_PARTS))


def _s3_like(fs: Any) -> bool:
    """Whether ``fs`` speaks S3's API through s3fs's coroutines (multipart, ranged GETs)."""
    return bool(getattr(fs, 'async_impl', False)) and callable(getattr(fs, '_call_s3', None))


def _concurrency(fs: Any, concurrency: int | None) -> int:
    if concurrency is None:
        concurrency = getattr(fs, 'max_concurrency', None) or CONCURRENCY
    if int(concurrency) < 1:
        raise ValueError(f'concurrency must be at least 1, got {concurrency!r}')
    return int(concurrency)


def _run(fs: Any, coroutine: Callable[..., Any], *args: Any) -> Any:
    """Run ``coroutine(*args)`` on the filesystem's event loop (fsspec's I/O thread)."""
    from fsspec.asyn import sync

    return sync(fs.loop, coroutine, *args)


# ------------------------------------------------------------------------------ upload
def put_file(
    fs: Any,
    local: str | os.PathLike,
    path: str,
    *,
    part_bytes: int | None = None,
    concurrency: int | None = None,
) -> None:
    """Upload the local file ``local`` to ``path`` in ``fs``, visible there only complete
    (module doc); raises the store's error, with no incomplete upload left behind."""
    local = os.fspath(local)
    size = os.path.getsize(local)
    part = part_size(size, part_bytes)
    if not _s3_like(fs) or size <= part or (part_bytes is None and size < MULTIPART_BYTES):
        fs.put_file(local, path)
        return
    _run(fs, _multipart_upload, fs, local, path, size, part, _concurrency(fs, concurrency))
    fs.invalidate_cache(path)


async def _multipart_upload(
    fs: Any, local: str, path: str, size: int, part: int, concurrency: int
) -> None:
    bucket, key, _ = fs.split_path(path)
    call = fs._call_s3  # noqa: SLF001 - s3fs's coroutine API: botocore's calls, its retries
    upload = await call('create_multipart_upload', Bucket=bucket, Key=key)
    ids = dict(Bucket=bucket, Key=key, UploadId=upload['UploadId'])
    try:
        etags = await _put_parts(call, ids, local, size, part, concurrency)
        parts = [{'PartNumber': n, 'ETag': etags[n]} for n in sorted(etags)]
        await call('complete_multipart_upload', MultipartUpload={'Parts': parts}, **ids)
    except BaseException:
        # shielded: a cancelled upload (the caller's timeout) still frees its parts
        await asyncio.shield(_abort(call, ids))
        raise


async def _abort(call: Callable[..., Any], ids: dict) -> None:
    try:
        await call('abort_multipart_upload', **ids)
    except Exception:  # noqa: BLE001 - the upload's own error is the one to raise
        pass


async def _put_parts(
    call: Callable[..., Any], ids: dict, local: str, size: int, part: int, concurrency: int
) -> dict[int, str]:
    """PUT every part of ``local``, at most ``concurrency`` at once (each read from the file
    only when a slot is free, so at most that many are in memory); ``{part number: ETag}``."""
    slots = asyncio.Semaphore(concurrency)
    etags: dict[int, str] = {}
    failed: list[BaseException] = []
    tasks: list[asyncio.Task] = []

    async def send(fd: int, number: int, offset: int) -> None:
        try:
            body = await asyncio.to_thread(os.pread, fd, min(part, size - offset), offset)
            out = await call('upload_part', PartNumber=number, Body=body, **ids)
            etags[number] = out['ETag']
        except BaseException as err:
            failed.append(err)
            raise
        finally:
            slots.release()

    fd = os.open(local, os.O_RDONLY)
    try:
        for number, offset in enumerate(range(0, size, part), 1):
            await slots.acquire()
            if failed:  # stop sending once a part failed
                slots.release()
                break
            tasks.append(asyncio.create_task(send(fd, number, offset)))
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        os.close(fd)
    if len(etags) != -(-size // part):  # a part failed after the loop stopped sending
        raise failed[0] if failed else RuntimeError(f'upload of {local}: parts missing')
    return etags


# ---------------------------------------------------------------------------- download
def read_into(
    fs: Any,
    path: str,
    view: memoryview,
    *,
    part_bytes: int | None = None,
    concurrency: int | None = None,
) -> int:
    """Read the object at ``path`` into ``view`` (a writable byte view of its expected size);
    returns the bytes read (fewer when the object is shorter: the caller names that)."""
    size = view.nbytes
    if part_bytes is None:
        part_bytes = getattr(fs, 'default_block_size', None) or RANGE_BYTES
    part = part_size(size, part_bytes)
    if not _s3_like(fs) or size <= part:
        return _read_file(fs, path, view)
    part = -(-size // -(-size // part))  # as many ranges, of equal size: none lags the others
    return int(_run(fs, _ranged_read, fs, path, view, part, _concurrency(fs, concurrency)))


def _read_file(fs: Any, path: str, view: memoryview) -> int:
    size, done = view.nbytes, 0
    with fs.open(path, 'rb', block_size=_READ_CHUNK) as file:
        while done < size:
            n = file.readinto(view[done : done + _READ_CHUNK])
            if not n:
                break
            done += n
    return done


async def _ranged_read(fs: Any, path: str, view: memoryview, part: int, concurrency: int) -> int:
    bucket, key, version = fs.split_path(path)
    call = fs._call_s3  # noqa: SLF001 - see _multipart_upload
    extra = {'VersionId': version} if version else {}
    size = view.nbytes
    slots = asyncio.Semaphore(concurrency)

    async def get(offset: int) -> int:
        async with slots:
            stop = min(size, offset + part)
            out = await call(
                'get_object', Bucket=bucket, Key=key, Range=f'bytes={offset}-{stop - 1}', **extra
            )
            body = out['Body']
            try:
                done = offset
                while done < stop:  # each chunk into its place: no copy of the whole range
                    chunk = await body.read(min(1 << 20, stop - done))
                    if not chunk:
                        break
                    view[done : done + len(chunk)] = chunk
                    done += len(chunk)
            finally:
                body.close()
            return done - offset

    tasks = [asyncio.create_task(get(offset)) for offset in range(0, size, part)]
    try:
        counts = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    # a shorter object: the bytes up to the first short range are the ones that count
    total = 0
    for offset, count in zip(range(0, size, part), counts):
        total = offset + count
        if count < min(part, size - offset):
            break
    return total


class MemoryFile:
    """``size`` bytes of memory to download into, with a file name where the system gives one
    (Linux: a ``memfd``, named ``/proc/self/fd/N``; ``path`` is None elsewhere, and ``data`` a
    ``bytearray``). A ``torch.load(path, mmap=True)`` maps these pages: the tensors share them
    (copy-on-write) and keep them alive after ``close()``, which releases this object's own
    handles."""

    def __init__(self, size: int) -> None:
        self.path: str | None = None
        self._fd: int | None = None
        self.data: bytearray | mmap.mmap = bytearray(0)
        if size and hasattr(os, 'memfd_create') and os.path.isdir('/proc/self/fd'):
            fd = os.memfd_create('stratagem-checkpoint', os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                self.data = mmap.mmap(fd, size)
            except OSError:
                os.close(fd)
            else:
                self._fd, self.path = fd, f'/proc/self/fd/{fd}'
                return
        self.data = bytearray(size)

    def close(self) -> None:
        """Release the mapping and the descriptor (a tensor mapped from ``path`` keeps the
        memory it uses)."""
        if isinstance(self.data, mmap.mmap):
            try:
                self.data.close()
            except BufferError:  # a view still exported: the mapping goes with its last user
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> MemoryFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
