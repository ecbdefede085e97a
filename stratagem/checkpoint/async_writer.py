"""Asynchronous saves: snapshot the state now, write and commit it in a background thread.

``AsyncCheckpointWriter`` is the mechanism behind a strategy's ``async_checkpoint=True``; it
knows nothing about strategies or layouts. A save goes:

1. ``wait()``: the previous save finishes (and its error, if any, is raised here), because its
   writer still reads the staging buffers the next snapshot fills.
2. ``snapshot(checkpoint, defer=...)``: every tensor is copied into a CPU staging buffer kept
   from the previous save when shape and dtype match (pinned memory for CUDA tensors, one
   device synchronisation at the end); containers are rebuilt, plain values shared
   (immutable) or copied (``bytearray``). Tensors that alias the same memory stay one tensor.
   A DTensor (FSDP's shards) stages its local shard and keeps its sharding spec.
   Tensors for which ``defer(tensor)`` is true (a strategy passes its parameters and
   optimizer state) get their buffer now but are copied by the writer thread, before it
   serialises anything, while the caller's forward and backward passes (which only read
   them) run; ``wait_staged()`` blocks until that copy is done (copying what the writer
   has not reached yet itself, so two threads copy), and the strategy calls it from an
   optimizer step pre-hook, the first thing that writes them. Everything else may change
   as soon as ``snapshot`` returns.
3. ``submit(job, *args)``: the deferred copies, then ``job`` (serialise, hash, fsync,
   manifest, rename, pointer: the same steps and order as a synchronous save; a directory
   save's file writes and ``finalize_directory`` likewise) run on the single writer thread.
4. The next ``wait()`` (the next save, ``resume``, ``wait_for_checkpoints``) raises the job's
   error. At interpreter exit pending jobs still finish (the thread pool joins them), and an
   error nobody collected is logged rather than lost.

Memory: one staged copy of the checkpoint's tensors (their ``nbytes`` summed), kept between
saves so the copy never page-faults after the first; ``release()`` frees it.
"""

from __future__ import annotations

import atexit
import copy
import logging
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ['AsyncCheckpointWriter']

_log = logging.getLogger('stratagem.checkpoint')
_IMMUTABLE = frozenset(
    (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
)
_LIVE: weakref.WeakSet = weakref.WeakSet()


class AsyncCheckpointWriter:
    """One background writer thread and the staging buffers it reads (see module doc)."""

    def __init__(self) -> None:
        self._defer: Callable[[torch.Tensor], bool] | None = None
        self._staging: dict[str, torch.Tensor] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, live source)
        self._copies: _DeferredCopies | None = None  # the pending save's deferred copies
        _LIVE.add(self)

    # ------------------------------------------------------------------ public
    @property
    def pending(self) -> bool:
        """True while a submitted job has not been collected by ``wait``."""
        return self._pending is not None

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

    def wait_staged(self) -> None:
        """Block until the deferred copies of the pending save are done (at once if none).

        The caller helps: CPU tensors not yet claimed by the writer thread are copied on this
        thread meanwhile, so both copy at once and the wait (an optimizer step's) is about
        halved. A copy that fails here is left to the writer's job to report."""
        copies = self._copies
        if copies is not None:
            copies.help()
            copies.done.wait()

    def snapshot(
        self,
        checkpoint: Any,
        defer: Callable[[torch.Tensor], bool] | None = None,
        *,
        key: str = 'ckpt',
    ) -> Any:
        """A copy of ``checkpoint`` whose tensors live in this writer's CPU staging buffers;
        tensors selected by ``defer`` are filled by the writer thread (see module doc), so
        the next ``submit`` must follow.

        ``key`` names this snapshot's buffers: a save of several files snapshots each under
        its own key (e.g. its file name), so their buffers coexist and each is reused by the
        next save's snapshot under the same key; buffers under other keys are kept. A save
        that defers copies takes one snapshot (a second one would drop them).
        Call ``wait()`` first: the buffers of the previous save are overwritten.
        """
        if self._pending is not None:
            raise RuntimeError(
                'snapshot() while a save is still being written would overwrite '
                'its staging buffers; call wait() first'
            )
        used: dict[str, torch.Tensor] = {}
        aliases: dict[tuple, torch.Tensor] = {}
        cuda = [False]
        self._deferred = []
        self._defer = defer
        try:
            copied = self._copy(checkpoint, key, used, aliases, cuda)
        finally:
            self._defer = None
        self._copies = _DeferredCopies(self._deferred) if self._deferred else None
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
            self._deferred = []
            copies = self._copies
            if copies is not None:
                copies.submitted = True
            self._pending = self._pool.submit(self._run, copies, job, args, kwargs)
            return self._pending

    def _run(
        self, copies: _DeferredCopies | None, job: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        if copies is not None:
            copies.run()
            copies.done.wait()  # the caller's share too: every buffer is filled from here
            if copies.error is not None:  # training went on; this save fails
                raise copies.error
        return job(*args, **kwargs)

    def release(self) -> None:
        """Wait for the pending job (raising its error) and free the staging buffers."""
        try:
            self.wait()
        finally:
            self._staging = {}

    # ----------------------------------------------------------------- copying
    def _copy(self, obj: Any, key: str, used: dict, aliases: dict, cuda: list) -> Any:
        kind = type(obj)
        if isinstance(obj, torch.Tensor):
            dtensor = _dtensor_type()
            if dtensor is not None and isinstance(obj, dtensor):
                # this rank's shard is staged; the copy keeps the sharding (spec: mesh,
                # placements, global shape), which is all DCP plans and writes from
                local = self._copy_tensor(obj._local_tensor, key, used, aliases, cuda)  # type: ignore[attr-defined]
                return dtensor(local, obj._spec, requires_grad=False)  # type: ignore[attr-defined]
            return self._copy_tensor(obj, key, used, aliases, cuda)
        if kind in (dict, OrderedDict):
            out = kind()
            for k, v in obj.items():
                out[k] = self._copy(v, f'{key}/{k!r}', used, aliases, cuda)
            return out
        if kind is list or kind is tuple:
            items = [self._copy(v, f'{key}/{i}', used, aliases, cuda) for i, v in enumerate(obj)]
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
        self, tensor: torch.Tensor, key: str, used: dict, aliases: dict, cuda: list
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
        if self._defer is not None and self._defer(tensor):
            self._deferred.append((buffer, tensor))
        else:
            buffer.copy_(tensor, non_blocking=on_cuda)
            cuda[0] = cuda[0] or on_cuda
        used[key] = buffer
        aliases[alias] = buffer
        return buffer


class _DeferredCopies:
    """The deferred copies of one snapshot, claimed one tensor at a time by the writer
    thread (``run``) and by a thread waiting for them (``help``: CPU sources only; CUDA
    copies stay on the writer's side stream). ``done`` is set once every copy has finished
    or failed (``error``: the first failure; the writer's job raises it)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs, self.submitted = pairs, False
        self.cuda = any(src.device.type == 'cuda' for _, src in pairs)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self._left = len(pairs)

    def run(self) -> None:
        """The writer thread's share (all of it for CUDA sources, on a side stream)."""
        if not self.cuda:
            self._copy_claimed()
            return
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            self._copy_claimed(non_blocking=True, sync=stream.synchronize)

    def help(self) -> None:
        """A waiting thread's share: CPU copies, or every copy if nothing was submitted (the
        writer will never run them)."""
        if not self.cuda or not self.submitted:
            self._copy_claimed()

    def _copy_claimed(
        self, non_blocking: bool = False, sync: Callable[[], None] | None = None
    ) -> None:
        claimed = 0
        while True:
            with self._lock:
                index, self._next = self._next, self._next + 1
            if index >= len(self.pairs):
                break
            buffer, src = self.pairs[index]
            try:
                buffer.copy_(src, non_blocking=non_blocking and src.device.type == 'cuda')
            except BaseException as err:  # noqa: BLE001 - reported by the writer's job
                self.error = self.error or err
            claimed += 1
        if sync is not None and claimed:
            try:
                sync()  # the non-blocking device-to-host copies must land
            except BaseException as err:  # noqa: BLE001
                self.error = self.error or err
        with self._lock:
            self._left -= claimed
            if self._left <= 0:
                self.done.set()


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
        future = writer._pending
        if future is not None and future.done() and future.exception() is not None:
            _log.error(
                'a background checkpoint save failed and the program ended before '
                'wait_for_checkpoints() collected it: %s',
                future.exception(),
            )
