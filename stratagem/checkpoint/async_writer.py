"""Asynchronous saves: copy the state now, write and commit the copy in a background thread.

``AsyncCheckpointWriter`` is the mechanism behind a strategy's ``async_checkpoint=True``; it
knows nothing about strategies or layouts. A save goes:

1. ``wait()``: the previous save finishes (and its error, if any, is raised here), because its
   writer still reads the staging buffers the next snapshot fills.
2. ``snapshot(checkpoint)``: every tensor is copied, before ``snapshot`` returns, into a CPU
   staging buffer kept from the previous save when shape and dtype match (pinned memory for
   CUDA tensors, copied without blocking and then one device synchronisation); large CPU
   copies are split over a few threads. Containers are rebuilt, plain values shared
   (immutable) or copied (``bytearray``, allow-listed objects). Tensors that alias the same
   memory stay one tensor. A DTensor (FSDP's shards) stages its local shard and keeps its
   sharding spec. **The snapshot is the state at the call**: nothing the program does after
   ``snapshot`` returns (in-place edits, an optimizer step, ``load_state_dict``, an EMA
   update) reaches it, since the writer only ever reads the staging buffers.
3. ``submit(job, *args)``: ``job`` (the write and commit of a synchronous save, the same
   steps in the same order: docs/architecture.md, 'Save') runs on the single writer thread.
4. The next ``wait()`` (the next save, ``resume``, ``wait_for_checkpoints``) raises the job's
   error. At interpreter exit pending jobs still finish (the thread pool joins them), and an
   error nobody collected is logged rather than lost.

Why nothing is copied later: a copy deferred past the call (e.g. overlapped with the next
forward pass) would need proof that no tensor changed before it was copied. Version counters
cannot give it: a write through ``tensor.data``, or through another tensor sharing the storage
(a flat buffer, DeepSpeed's partitions), leaves the counter alone. So every byte is copied
before the call returns, into buffers that are reused (faulted in once, at the first save).

Memory: one staged copy of the checkpoint's tensors (their ``nbytes`` summed), kept between
saves so the copy never page-faults after the first; ``release()`` frees it.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from stratagem._torch import dtensor_like

__all__ = ['AsyncCheckpointWriter', 'copy_threads']

_log = logging.getLogger('stratagem.checkpoint')
_IMMUTABLE = frozenset(
    (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
)
_LIVE: weakref.WeakSet = weakref.WeakSet()
# below this many bytes the copy stays on the calling thread (a hand-off costs more)
_SPLIT_BYTES = 32 << 20


def copy_threads() -> int:
    """Threads that copy a large snapshot: the process's CPUs (its affinity mask), at most 4;
    memory bandwidth, not the thread count, bounds a copy beyond that."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


class AsyncCheckpointWriter:
    """One background writer thread and the staging buffers it reads (see module doc)."""

    def __init__(self) -> None:
        self._staging: dict[str, torch.Tensor] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._copiers: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._lock = threading.Lock()
        _LIVE.add(self)

    # ------------------------------------------------------------------ public
    @property
    def pending(self) -> bool:
        """True while a submitted job has not been collected by ``wait``."""
        return self._pending is not None

    def uncollected_error(self) -> BaseException | None:
        """The error of a finished job that no ``wait()`` collected yet, else None."""
        future = self._pending
        if future is None or not future.done():
            return None
        return future.exception()

    @property
    def staged_bytes(self) -> int:
        """Bytes held by the staging buffers (the extra memory of async saves)."""
        return sum(t.numel() * t.element_size() for t in self._staging.values())

    def wait(self) -> Any:
        """Block until the pending job is done; return its result or raise its error.

        The error is raised once; the writer is usable again afterwards.
        """
        with self._lock:
            future, self._pending = self._pending, None
        if future is None:
            return None
        return future.result()

    def snapshot(self, checkpoint: Any, *, key: str = 'ckpt') -> Any:
        """A copy of ``checkpoint`` whose tensors live in this writer's CPU staging buffers,
        complete when this returns (see module doc).

        ``key`` names this snapshot's buffers: a save of several files snapshots each under
        its own key (e.g. its file name), so their buffers coexist and each is reused by the
        next save's snapshot under the same key; buffers under other keys are kept.
        Call ``wait()`` first: the buffers of the previous save are overwritten.
        """
        if self._pending is not None:
            raise RuntimeError(
                'snapshot() while a save is still being written would overwrite '
                'its staging buffers; call wait() first'
            )
        used: dict[str, torch.Tensor] = {}
        aliases: dict[tuple, torch.Tensor] = {}
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, CPU source)
        cuda = [False]
        copied = self._copy(checkpoint, key, used, aliases, pairs, cuda)
        self._copy_cpu(pairs)
        if cuda[0]:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies must land
        # this key's buffers that the state no longer has are freed here
        self._staging = {
            k: v for k, v in self._staging.items() if k != key and not k.startswith(key + '/')
        }
        self._staging.update(used)
        return copied

    def submit(self, job: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run ``job(*args, **kwargs)`` on the writer thread; ``wait()`` collects it."""
        with self._lock:
            if self._pending is not None:
                raise RuntimeError(
                    'a save is still pending; call wait() before submitting the next one'
                )
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix='stratagem-ckpt-writer')
            self._pending = self._pool.submit(job, *args, **kwargs)
            return self._pending

    def release(self) -> None:
        """Wait for the pending job (raising its error) and free the staging buffers."""
        try:
            self.wait()
        finally:
            self._staging = {}

    # ----------------------------------------------------------------- copying
    def _copy(self, obj: Any, key: str, used: dict, aliases: dict, pairs: list, cuda: list) -> Any:
        kind = type(obj)
        if isinstance(obj, torch.Tensor):
            dtensor = _dtensor_type()
            if dtensor is not None and isinstance(obj, dtensor):
                # this rank's shard is staged; the copy keeps the sharding (spec: mesh,
                # placements, global shape), which is all DCP plans and writes from
                with torch.no_grad():  # the shard itself, not an autograd view of it
                    shard = obj.to_local()  # type: ignore[attr-defined]
                local = self._copy_tensor(shard, key, used, aliases, pairs, cuda)
                return dtensor_like(obj, local)
            return self._copy_tensor(obj, key, used, aliases, pairs, cuda)
        if kind in (dict, OrderedDict):
            out = kind()
            for k, v in obj.items():
                out[k] = self._copy(v, f'{key}/{k!r}', used, aliases, pairs, cuda)
            return out
        if kind is list or kind is tuple:
            items = [
                self._copy(v, f'{key}/{i}', used, aliases, pairs, cuda) for i, v in enumerate(obj)
            ]
            return items if kind is list else tuple(items)
        if kind is set:
            return set(obj)  # members are hashable plain values (validated by the caller)
        if kind is bytearray:
            return bytearray(obj)
        if kind in _IMMUTABLE:
            return obj
        # an allow-listed class instance (e.g. mmengine's HistoryBuffer): training may change
        # it after save_checkpoint returns, so the writer gets its own copy
        return copy.deepcopy(obj)

    def _copy_tensor(
        self, tensor: torch.Tensor, key: str, used: dict, aliases: dict, pairs: list, cuda: list
    ) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == 'meta':
            return tensor.clone().cpu()  # rare layouts: a plain copy, not staged
        alias = (
            tensor.device,
            tensor.data_ptr(),
            tensor.dtype,
            tuple(tensor.shape),
            tensor.stride(),
        )
        if tensor.numel() and alias in aliases:
            return aliases[alias]  # the same memory twice (tied weights): one tensor, as saved
        buffer = self._staging.get(key)
        on_cuda = tensor.device.type == 'cuda'
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device='cpu', pin_memory=on_cuda)
        if on_cuda or tensor.device.type != 'cpu':
            buffer.copy_(tensor, non_blocking=on_cuda)  # queued behind the work that wrote it
            cuda[0] = cuda[0] or on_cuda
        else:
            pairs.append((buffer, tensor))
        used[key] = buffer
        aliases[alias] = buffer
        return buffer

    def _copy_cpu(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy every (buffer, source) pair before returning; above ``_SPLIT_BYTES`` the bytes
        are cut into equal shares (contiguous tensors into flat slices) for ``copy_threads()``
        copier threads while this one waits (2 threads: 0.037 s for 768 MB where one takes 0.056 s
        and torch's own intra-op split 0.049 s, on this repository's 2-core machine)."""
        total = sum(src.numel() * src.element_size() for _, src in pairs)
        threads = copy_threads()
        if threads == 1 or total < _SPLIT_BYTES:
            for buffer, src in pairs:
                buffer.copy_(src)
            return
        share = -(-total // threads)
        shares: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
        filled = 0
        for buffer, src in pairs:
            if not (src.is_contiguous() and buffer.is_contiguous()):
                shares[-1].append((buffer, src))  # a strided source is copied whole
                filled += src.numel() * src.element_size()
            else:
                flat_buf, flat_src = buffer.view(-1), src.view(-1)
                size, start = src.element_size(), 0
                while start < flat_src.numel():
                    room = max(1, (share - filled) // size)
                    stop = min(flat_src.numel(), start + room)
                    shares[-1].append((flat_buf[start:stop], flat_src[start:stop]))
                    filled += (stop - start) * size
                    start = stop
                    if filled >= share and len(shares) < threads:
                        shares.append([])
                        filled = 0
                continue
            if filled >= share and len(shares) < threads:
                shares.append([])
                filled = 0
        if self._copiers is None:
            self._copiers = _copier_pool(threads)
        for future in [self._copiers.submit(_copy_share, part) for part in shares if part]:
            future.result()


def _copier_pool(size: int) -> ThreadPoolExecutor:
    """``size`` started threads that copy with one intra-op thread each (the shares already
    run in parallel; nested OpenMP teams would oversubscribe the cores: measured 2x slower).
    ``torch.set_num_threads`` also sets the default of threads started later, so the
    caller's own count is set back once every copier has taken its own."""
    own = torch.get_num_threads()
    pool = ThreadPoolExecutor(
        size,
        thread_name_prefix='stratagem-ckpt-copy',
        initializer=torch.set_num_threads,
        initargs=(1,),
    )
    started = threading.Barrier(size)
    for future in [pool.submit(started.wait, 30) for _ in range(size)]:
        future.result()
    torch.set_num_threads(own)
    return pool


def _copy_share(part: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for buffer, src in part:
        buffer.copy_(src)


def _dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor`` if that module is loaded, else None: no DTensor
    can exist before it is (and importing it costs seconds)."""
    module = sys.modules.get('torch.distributed.tensor')
    return getattr(module, 'DTensor', None)


@atexit.register
def _report_uncollected() -> None:
    """At exit (the writer threads have finished their jobs by now): log failures that no
    ``wait()`` collected, so a failed background save is never silent."""
    for writer in list(_LIVE):
        error = writer.uncollected_error()
        if error is not None:
            _log.error(
                'a background checkpoint save failed and the program ended before '
                'wait_for_checkpoints() collected it: %s',
                error,
            )
