"""Stragglers named: a rank whose own work is slower than the others', found before the
gradient all-reduce hides it.

DDP's all-reduce evens out the ranks' step times: the fast ranks wait in it for the slow one,
so a step timed after it (or a loop's step time) is the same on every rank. So on the step
that ends each ``log_interval`` (never the first step of a process: warm-up), every rank
times its own phases *before* the collective:

1. ``data``: from the iteration's start until the loader gave the batch (host time);
2. ``forward``: the model's own forward, from its forward pre-hook to its forward hook on the
   module the backend wraps (after DDP's buffer broadcast, a collective);
3. ``backward``: from the forward's end until the last parameter's gradient is ready (its
   post-accumulate-grad hook), when the rank hands its last bucket to the all-reduce.

The hooks are registered for that one step and removed after it; on CUDA the marks are
events on the computing stream, read after the step (the log interval already syncs the
host), so no other step pays anything. Where a backend's forward or backward holds
collectives of its own (``Capabilities.fully_shards``: FSDP's parameter all-gathers;
``engine_steps``: DeepSpeed's engine; a model with ``SyncBatchNorm``), the peers of a slow rank
wait inside their forward too and only ``data`` is compared.

Then each rank appends its phases to one key of the process group's store (the watchdog's
store, ``env/store.py``; no collective) and counts itself in; the last one marks the
interval done, and rank 0, waiting for that mark, reads them all and decides
(:class:`SlowCounts`): a rank whose total is ``factor`` × the median of the other ranks'
totals, and ``min_seconds`` more, is slow in that interval; slow in ``intervals``
consecutive intervals, it is named in a warning (its rank, host, phases and ratio) and a
metrics row (``straggler/rank``, ``straggler/ratio``) every interval it stays slow; a line
says when it no longer is.

``train_cfg.straggler``: ``dict(factor=1.5, intervals=3, min_seconds=0.01)`` (the default; on
in every run of two or more processes, off under a pipeline, whose stages do different
work); None or False: off.
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ['SlowCounts', 'StragglerConfig', 'Stragglers', 'straggler_config']

PHASES = ('data', 'forward', 'backward')
_KEYS = frozenset({'factor', 'intervals', 'min_seconds'})


@dataclass(frozen=True)
class StragglerConfig:
    """``factor``: how many times the other ranks' median time makes a rank slow (> 1);
    ``intervals``: how many consecutive log intervals it must be slow to be named (>= 1);
    ``min_seconds``: how much longer than that median it must take too (>= 0): a step of a
    few milliseconds on a busy host jitters by more than any factor."""

    factor: float = 1.5
    intervals: int = 3
    min_seconds: float = 0.01


def straggler_config(value: Any, key: str = 'train_cfg.straggler') -> StragglerConfig | None:
    """``value`` as settings: None/False: off; True: the defaults; a dict sets ``factor``,
    ``intervals`` and ``min_seconds``. Errors name ``key``."""
    if value is None or value is False:
        return None
    if value is True:
        return StragglerConfig()
    if not isinstance(value, Mapping):
        raise TypeError(
            f'{key} should be a dict such as dict(factor=1.5, intervals=3, min_seconds=0.01), '
            f'True (these defaults) or None (off); got {value!r}'
        )
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f'unknown key(s) {unknown} in {key}; valid keys: {sorted(_KEYS)}')
    factor = value.get('factor', StragglerConfig.factor)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(
            f"{key}.factor should be a number > 1 (times the other ranks' median), got {factor!r}"
        )
    intervals = value.get('intervals', StragglerConfig.intervals)
    if type(intervals) is not int or intervals < 1:
        raise ValueError(
            f'{key}.intervals should be an int >= 1 (consecutive log intervals), got {intervals!r}'
        )
    floor = value.get('min_seconds', StragglerConfig.min_seconds)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor >= 0:
        raise ValueError(
            f"{key}.min_seconds should be a number >= 0 (seconds over the other ranks' "
            f'median), got {floor!r}'
        )
    return StragglerConfig(float(factor), intervals, float(floor))


@dataclass(frozen=True)
class Slow:
    """A rank named in one interval: its ``ratio`` to the other ranks' median, the
    consecutive intervals it has been slow (``count``), and whether it is named for the
    first time in this run of slow intervals (``first``)."""

    rank: int
    ratio: float
    count: int
    first: bool


class SlowCounts:
    """The decision, on plain numbers: per rank, the consecutive intervals its time was at
    least ``factor`` × the median of the other ranks' times, and ``min_seconds`` more."""

    def __init__(self, config: StragglerConfig) -> None:
        self.config = config
        self.counts: dict[int, int] = {}
        self.recovered: list[int] = []  # named ranks whose last interval was not slow

    def medians(self, times: Sequence[float]) -> list[float]:
        """For each rank, the median of the other ranks' times (a lone rank: its own)."""
        return [
            statistics.median([x for i, x in enumerate(times) if i != r] or [t])
            for r, t in enumerate(times)
        ]

    def ratios(self, times: Sequence[float]) -> list[float]:
        """Each rank's time over the median of the others' (a lone rank: 1)."""
        return [
            t / m if m > 0 else (math.inf if t > 0 else 1.0)
            for t, m in zip(times, self.medians(times))
        ]

    def update(self, times: Sequence[float]) -> list[Slow]:
        """One interval's times by rank; returns the ranks named in it (slow in
        ``intervals`` consecutive intervals, this one included), by rank. ``recovered``
        then lists the named ranks that were not slow in it."""
        named, self.recovered = [], []
        need = self.config.intervals
        floor = self.config.min_seconds
        medians = self.medians(times)
        for r, ratio in enumerate(self.ratios(times)):
            before = self.counts.get(r, 0)
            if ratio >= self.config.factor and times[r] - medians[r] >= floor:
                count = self.counts[r] = before + 1
                if count >= need:
                    named.append(Slow(r, ratio, count, count == need))
            else:
                self.counts[r] = 0
                if before >= need:
                    self.recovered.append(r)
        return named


class _PhaseTimer:
    """One step's marks: host times on the CPU, events on the computing stream on CUDA;
    the hooks on the module and its parameters live for that step only."""

    def __init__(self, module: nn.Module, cuda: bool, compute: bool) -> None:
        self.module, self.cuda, self.compute = module, cuda, compute
        self.marks: dict[str, Any] = {}
        self.start = self.loaded = 0.0
        self.handles: list[Any] = []
        self.forward_handles: list[Any] = []

    def _mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def arm(self) -> None:
        self.marks.clear()
        self.start = time.perf_counter()
        if not self.compute:
            return
        self.forward_handles = [
            self.module.register_forward_pre_hook(self._forward_starts),
            self.module.register_forward_hook(self._forward_ends),
        ]
        self.handles = self.forward_handles + [
            p.register_post_accumulate_grad_hook(self._gradient_ready)
            for p in self.module.parameters()
            if p.requires_grad
        ]

    def got_batch(self) -> None:
        self.loaded = time.perf_counter()
        if self.compute:
            self._mark('loaded')

    def _forward_starts(self, *_: Any) -> None:
        if 'forward_start' not in self.marks:
            self._mark('forward_start')

    def _forward_ends(self, *_: Any) -> None:
        self._mark('forward_end')
        # a recomputation in backward (activation checkpointing) is not the forward
        for handle in self.forward_handles:
            handle.remove()

    def _gradient_ready(self, _: Any) -> None:
        self._mark('gradients_ready')

    def finish(self) -> dict[str, float | None]:
        """The step's phases in seconds (None: not measured); the hooks removed."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        m = self.marks
        phases: dict[str, float | None] = {
            'data': self.loaded - self.start,
            'forward': None,
            'backward': None,
        }
        if 'forward_start' in m and 'forward_end' in m:
            phases['forward'] = self._seconds(m['forward_start'], m['forward_end'])
        if 'gradients_ready' in m:
            since = m.get('forward_end', m.get('loaded'))
            if since is not None:
                phases['backward'] = self._seconds(since, m['gradients_ready'])
        return phases

    def _seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1000
        return b - a


def _collective_free_compute(strategy: Any, module: nn.Module) -> bool:
    """Whether the forward and backward hold no collective before the gradient all-reduce
    (otherwise a slow rank's peers wait inside theirs, and only ``data`` tells them apart)."""
    caps = strategy.capabilities
    if caps.fully_shards or caps.engine_steps:
        return False
    return not any(isinstance(m, nn.SyncBatchNorm) for m in module.modules())


class Stragglers:
    """The loop's collaborator (see the module doc). ``meter``: the run's :class:`Meter`
    (its ``metrics`` take the rows, rank 0); ``log_interval``: the rows' interval;
    ``start_iter``: the process's first iteration (not timed)."""

    def __init__(
        self,
        config: StragglerConfig | None,
        strategy: Any,
        meter: Any,
        *,
        log_interval: int,
        start_iter: int,
        epoch_length: int,
    ) -> None:
        self.config, self.strategy, self.meter = config, strategy, meter
        self.log_interval, self.start_iter = log_interval, start_iter
        self.epoch_length = epoch_length
        self.rank, self.world_size = strategy.rank, strategy.world_size
        self.active = (
            config is not None
            and self.world_size > 1
            and getattr(strategy, 'pipeline_spec', None) is None
        )
        # rank 0: each interval a rank was named, {iter, rank, ratio, host, data, forward,
        # backward} (seconds; None: not measured)
        self.named: list[dict[str, Any]] = []
        self._timing: int | None = None
        if not self.active:
            return
        assert config is not None
        self._config = config
        module = strategy.unwrap_model()
        self.compute = _collective_free_compute(strategy, module)
        cuda = strategy.device.type == 'cuda'
        self._timer = _PhaseTimer(module, cuda, self.compute)
        self._counts = SlowCounts(config)
        self._store: Any = None
        self._host = socket.gethostname()

    def start(self, it: int) -> None:
        """Before iteration ``it`` (1-based) loads its batch: times it when it ends a log
        interval."""
        if not self.active or it % self.log_interval or it == self.start_iter + 1:
            return
        self._timing = it
        self._timer.arm()

    def got_batch(self) -> None:
        """The loader gave the batch (the end of ``data``)."""
        if self._timing is not None:
            self._timer.got_batch()

    def cancel(self) -> None:
        """A timed step that will not be compared (``train_cfg.anomaly`` rolled back): its
        hooks removed, nothing posted."""
        if self._timing is not None:
            self._timing = None
            self._timer.finish()

    def due(self, it: int) -> bool:
        """After iteration ``it``: whether its step was timed (then :meth:`compare`)."""
        return self._timing == it

    def compare(self, it: int) -> None:
        """After the timed iteration ``it``: its phases to the store; rank 0 compares every
        rank's and names the slow ones."""
        assert self._timing == it, (self._timing, it)
        self._timing = None
        phases = self._timer.finish()
        store = self._client()
        key = f'stratagem/straggler/{it}'
        # one key for all ranks, and a count: rank 0's round trips do not grow with the world
        store.append(f'{key}/times', f'{self.rank} {_encode(phases, self._host)}\n')
        if store.add(f'{key}/posted', 1) == self.world_size:
            store.set(f'{key}/done', '1')
        if self.rank != 0:
            return
        # every rank reaches this iteration's end: a wait of at most one step's imbalance
        store.wait([f'{key}/done'])
        lines = store.get(f'{key}/times').decode().splitlines()
        for name in ('times', 'posted', 'done'):
            store.delete_key(f'{key}/{name}')
        posted = dict(line.split(' ', 1) for line in lines)
        self._decide(it, [_decode(posted[str(r)]) for r in range(self.world_size)])

    def _client(self) -> Any:
        if self._store is None:
            from stratagem.env.store import store_client

            self._store = store_client()
        return self._store

    def _total(self, phases: Mapping[str, float | None]) -> float:
        used = PHASES if self.compute else ('data',)
        return sum(phases[p] or 0.0 for p in used)

    def _decide(self, it: int, posted: list[tuple[dict[str, float | None], str]]) -> None:
        totals = [self._total(phases) for phases, _ in posted]
        log = self.strategy.logger
        epoch = (it - 1) // self.epoch_length + 1
        for slow in self._counts.update(totals):
            phases, host = posted[slow.rank]
            self.named.append(dict(iter=it, rank=slow.rank, ratio=slow.ratio, host=host, **phases))
            self.meter.metrics.write_scalars(
                it, epoch, {'straggler/rank': slow.rank, 'straggler/ratio': slow.ratio}
            )
            if slow.first:
                others = statistics.median(t for r, t in enumerate(totals) if r != slow.rank)
                log.warning(
                    f'straggler: rank {slow.rank} (host {host}) took {slow.ratio:.2f}x the '
                    f"other ranks' median ({others:.4f} s) in {slow.count} log intervals in "
                    f'a row, at iteration {it}: {_phase_text(phases, self.compute)} '
                    f'(train_cfg.straggler: factor {self._config.factor:g}, intervals '
                    f'{self._config.intervals}, min_seconds {self._config.min_seconds:g})'
                )
        for rank in self._counts.recovered:
            log.info(f'straggler: rank {rank} is no longer slow at iteration {it}')


def _phase_text(phases: Mapping[str, float | None], compute: bool) -> str:
    parts = [f'{p} {phases[p]:.4f} s' for p in PHASES if phases[p] is not None]
    where = 'before the gradient all-reduce' if compute else '(data compared only: its '
    if not compute:
        where += "backend's forward holds collectives)"
    return ', '.join(parts) + ' ' + where


def _encode(phases: Mapping[str, float | None], host: str) -> str:
    return ' '.join('nan' if phases[p] is None else repr(phases[p]) for p in PHASES) + ' ' + host


def _decode(value: str) -> tuple[dict[str, float | None], str]:
    *numbers, host = value.split(' ', len(PHASES))
    phases = {p: None if v == 'nan' else float(v) for p, v in zip(PHASES, numbers)}
    return phases, host
