"""TensorBoard's event file, written by the caller's thread (the metrics writer's): the file
``torch.utils.tensorboard.SummaryWriter`` writes, without its own thread and with a faster
checksum.

The format is TFRecord: each record is the data's length (uint64, little-endian), the masked
CRC-32C of those 8 bytes, the data (a serialized ``Event`` protocol buffer), the masked
CRC-32C of the data. TensorBoard's own writer computes CRC-32C in pure Python, a byte at a
time (about 50 µs for a row's event, more than the rest of the event together); here a table
per byte position turns it into one numpy gather and one XOR reduction (CRC is linear in the
message bytes). The first event names the file version, as every writer's does.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import time
from collections.abc import Mapping

import numpy as np

__all__ = ['EventFile', 'masked_crc32c']

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected
_MAX_FAST = 4096  # longest message the position tables cover (a row's event is ~300 bytes)


@functools.cache
def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The byte table; ``shift[j][b]``: byte ``b`` followed by ``j`` zero bytes from a zero
    register; ``zeros[n]``: ``n`` zero bytes from the initial register."""
    table = np.zeros(256, dtype=np.uint32)
    for b in range(256):
        crc = b
        for _ in range(8):
            crc = (crc >> 1) ^ (_POLY if crc & 1 else 0)
        table[b] = crc
    shift = np.empty((_MAX_FAST, 256), dtype=np.uint32)
    shift[0] = table
    for j in range(1, _MAX_FAST):
        prev = shift[j - 1]
        shift[j] = table[prev & 0xFF] ^ (prev >> 8)
    zeros = np.empty(_MAX_FAST + 1, dtype=np.uint32)
    crc = 0xFFFFFFFF
    for n in range(_MAX_FAST + 1):
        zeros[n] = crc
        crc = int(table[crc & 0xFF]) ^ (crc >> 8)
    return table, shift, zeros


def _crc32c(data: bytes) -> int:
    table, shift, zeros = _tables()
    n = len(data)
    if n > _MAX_FAST:
        crc = 0xFFFFFFFF
        for b in data:
            crc = int(table[(crc ^ b) & 0xFF]) ^ (crc >> 8)
        return crc ^ 0xFFFFFFFF
    if n == 0:
        return 0
    raw = np.bitwise_xor.reduce(shift[np.arange(n - 1, -1, -1), np.frombuffer(data, np.uint8)])
    return int(raw ^ zeros[n]) ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of ``data``."""
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class EventFile:
    """One TensorBoard event file in ``log_dir``
    (``events.out.tfevents.<time>.<host>.<pid>.<n>``, the name ``SummaryWriter`` gives).

    :meth:`add` writes one event of scalars at a step into the file's buffer; :meth:`flush`
    and :meth:`close` put it on disk. Not thread-safe: one thread writes.

    ``purge_step``: the step a resumed run goes on from; the file starts with the events
    ``SummaryWriter(purge_step=)`` writes (the file version and a ``SessionLog.START`` at
    that step), on which TensorBoard hides the events of the same run directory at that
    step and after (the iterations the resume re-does)."""

    _count = 0

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary
        os.makedirs(log_dir, exist_ok=True)
        EventFile._count += 1
        name = (
            f'events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.'
            f'{os.getpid()}.{EventFile._count}'
        )
        self.path = os.path.join(log_dir, name)
        self._file = open(self.path, 'wb')  # noqa: SIM115 - closed in close()
        self._record(Event(wall_time=time.time(), file_version='brain.Event:2'))
        if purge_step is not None:
            now = time.time()
            self._record(Event(wall_time=now, step=purge_step, file_version='brain.Event:2'))
            start = SessionLog(status=SessionLog.START)
            self._record(Event(wall_time=now, step=purge_step, session_log=start))
        self._file.flush()

    def add(self, step: int, scalars: Mapping[str, float]) -> None:
        """One event at ``step`` holding every scalar (``tag: value``)."""
        value = self._summary.Value
        summary = self._summary(value=[value(tag=k, simple_value=v) for k, v in scalars.items()])
        self._record(self._event(wall_time=time.time(), step=step, summary=summary))

    def _record(self, event: object) -> None:
        data = event.SerializeToString()  # type: ignore[attr-defined]
        header = struct.pack('<Q', len(data))
        self._file.write(
            header
            + struct.pack('<I', masked_crc32c(header))
            + data
            + struct.pack('<I', masked_crc32c(data))
        )

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
