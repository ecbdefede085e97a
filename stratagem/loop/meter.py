"""What a person watches: the loss and the model's other training scalars of each iteration
(on an accelerator kept as they came, no device work, and every ``FOLD`` iterations summed
there; on a CPU, whose tensors' values are in host memory, read and added up as they come),
and, every ``log_interval`` iterations (and at the end and at a stop), their means (on an
accelerator read in one host sync, with the clipping's norm and a tokens hook's tensors): a
row for ``metrics.py`` (log line, ``metrics.csv``, TensorBoard; built on the writers' thread
when nobody here reads it: no log line at INFO, no bar), the progress bar's figures (rank 0),
and after it the validation's rows and lines. Log lines show positions as mmengine does:
``Epoch(train) [1][16/64]`` (epochs 1-based)."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from stratagem.metrics import RunMetrics, check_metrics_cfg, format_row
from stratagem.throughput import count_flops, device_peak, num_tokens_hook

if TYPE_CHECKING:
    from .validation import Validation

__all__ = ['Meter']

#: iterations whose loss and scalars are kept as they came; then they are summed on the device
#: (a few operations per this many iterations), so a long log interval holds little
FOLD = 64


class Meter:
    """A context manager: the metrics writers and the bar are open inside it.

    ``batch_size``: per rank; ``start_iter``: where the bar starts (a resumed run's
    position); ``metrics``: ``train_cfg.metrics``; ``progress``: a bar on rank 0 (a bar on a
    terminal, whole lines every 30 s when stderr is a file or a pipe); ``model`` (the plain
    module) and ``dataset`` (the training set): whose ``num_tokens`` may count a batch's
    tokens (``stratagem.throughput``); ``metrics_dir``: where the metrics go (default: the
    strategy's ``log_dir``; a resumed run's: the run's first part's, ``resumed``: its rows
    after ``start_iter`` dropped)."""

    def __init__(
        self,
        strategy: Any,
        optim_wrapper: Any,
        device: torch.device,
        *,
        batch_size: int,
        epoch_length: int,
        max_iters: int,
        start_iter: int,
        log_interval: int,
        by_epoch: bool,
        metrics: Any,
        progress: bool,
        model: Any = None,
        dataset: Any = None,
        metrics_dir: str | None = None,
        resumed: bool = False,
    ) -> None:
        self.strategy, self.optim_wrapper, self.device = strategy, optim_wrapper, device
        self.log = strategy.logger
        self.main = strategy.rank == 0
        self.batch_size, self.epoch_length, self.max_iters = batch_size, epoch_length, max_iters
        self.log_interval, self.by_epoch = log_interval, by_epoch
        self.metrics_cfg, self.progress = metrics, progress
        self.model, self.dataset = model, dataset
        self.metrics_dir = metrics_dir or strategy.log_dir
        self.resumed_at = start_iter if resumed else None
        wrappers = getattr(optim_wrapper, 'values', lambda: [optim_wrapper])()
        self.first_wrapper = next(iter(wrappers))
        self.losses: list[tuple[int, float]] = []
        # since the last row: each iteration's loss and other training scalars (acc, ...),
        # as they came (added up with the row's one read: no device work per iteration) ...
        self._pending: list[tuple[torch.Tensor, Mapping[str, Any]]] = []
        # ... and every FOLD iterations, per name, the sum on the device and the count
        self._folded: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        # scalars given as Python numbers, and on a CPU every scalar: summed here (a CPU
        # tensor's value is in host memory: reading it waits for nothing, and costs less
        # than any operation that would add it up)
        self._numbers: dict[str, float] = {}
        self._host = device.type == 'cpu'
        self._names: dict[str, None] = {}  # the scalars' names in the order first seen
        #: whether the batches' tokens are still counted (rank 0, until a batch has none):
        #: the loop calls saw_batch only then
        self.counting = self.main
        self.dropped = 0  # iterations since the last row whose loss is not in the sums
        self.logged_at, self.logged_t = start_iter, time.perf_counter()
        self.bar: Any = None
        self.metrics: RunMetrics
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Meter:
        cfg = check_metrics_cfg(self.metrics_cfg)
        hook, source = num_tokens_hook(cfg.get('num_tokens'), self.model, self.dataset)
        peak = None
        if self.main and cfg.get('flops', True):
            dtype = getattr(self.first_wrapper, 'cast_dtype', None)
            peak = device_peak(self.device, dtype, cfg.get('peak_flops'))
            self.log.info(
                f'throughput: tokens counted by {source}; MFU against '
                + (peak.source if peak is not None else 'no peak (a device the table of '
                   'stratagem.env.devices lacks: give train_cfg.metrics.peak_flops)')
            )  # fmt: skip
        with contextlib.ExitStack() as stack:
            self.metrics = RunMetrics(
                self.metrics_dir,
                self.strategy.data_parallel_size * self.batch_size,
                enabled=self.main,
                cfg=cfg,
                logger=self.log,
                data_parallel_size=self.strategy.data_parallel_size,
                num_tokens=hook,
                peak=peak,
                resumed_at=self.resumed_at,
            )
            stack.callback(self.metrics.close)
            if self.progress and self.main:
                from stratagem.progress import logging_above, progress_bar

                self.bar = progress_bar(self.max_iters, self.logged_at, file=sys.stderr)
                stack.enter_context(logging_above(self.bar, self.log))  # logs print above it
                stack.callback(self.bar.close)
            self._stack = stack.pop_all()
        self.logged_t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self._log_averages()
        try:
            self._stack.close()
        except RuntimeError as err:  # the metrics writer's: never in place of the run's error
            if exc[0] is None:
                raise
            self.log.error(f'{err} (the run failed too: its error follows)')

    def _log_averages(self) -> None:
        """The run's averages, from the last row (the first row, the warm-up, left out)."""
        row = self.metrics.last_row
        if row is None:
            return
        text = f"throughput, the run's average: {row['samples_per_s_avg']:.1f} samples/s"
        if row.get('tokens_per_s_avg') is not None:
            text += f' ({row["tokens_per_s_avg"]:.0f} tokens/s)'
        if row.get('mfu_avg') is not None:
            label = self.metrics.peak.label if self.metrics.peak is not None else 'mfu'
            text += f' {label} {row["mfu_avg"] * 100:.3g}%'
        self.log.info(text)

    def saw_batch(self, batch: Any) -> None:
        """Count the batch's tokens (rank 0; its shape, or the hook's count). The loop calls
        it only while :attr:`counting` (one call an iteration fewer once batches hold none)."""
        self.counting = self.metrics.saw_batch(batch)

    def counted(self, step: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``step``, its first call on rank 0 under the FLOP counter (``train_cfg.metrics.
        flops``, default on); the count goes to the rows' ``flops_per_iter`` and ``mfu``."""
        if not self.main or not check_metrics_cfg(self.metrics_cfg).get('flops', True):
            return step
        first = [True]

        def step_counted_once(batch: Any) -> Any:
            if not first[0]:
                return step(batch)
            first[0] = False
            result, count = count_flops(step, batch)
            self.metrics.set_flops(count)
            if count.method != 'counted':
                self.log.info(
                    f'throughput: no backward seen by the FLOP counter; flops_per_iter is '
                    f'{count.method} ({count.forward:.3g} FLOPs forward)'
                )
            return result

        return step_counted_once

    def flush(self) -> None:
        """Every row so far written (a checkpoint's save)."""
        self.metrics.flush()

    def after_step(self, loss: torch.Tensor, extras: Mapping[str, Any]) -> None:
        """Keep one iteration's loss (detached, ``strategy.train_step``'s) and scalars:
        no host sync, no device work (the row adds them up in one operation); on a CPU,
        their values added up here."""
        if self._host:
            self._add_values(loss, extras)
            return
        for value in extras.values():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                # a loss term keeps its graph's nodes alive while it is held
                extras = {k: _detached(v) for k, v in extras.items()}
                break
        self._pending.append((loss, extras))
        if len(self._pending) >= FOLD:
            self._fold()

    def add_stall(self, seconds: float) -> None:
        """Time the loop spent saving a checkpoint: the next row's ``checkpoint_stall_s``."""
        self.metrics.add_stall(seconds)

    def due(self, it: int, stop: bool) -> bool:
        """After iteration ``it``: every ``log_interval`` iterations, at the end, at a stop."""
        return it % self.log_interval == 0 or it == self.max_iters or stop

    def log_row(self, it: int) -> None:
        """The row of the iterations since the last one: its means (the one host sync), the
        metrics writers, the bar's figures, the log line."""
        grad_norm = getattr(self.first_wrapper, 'last_grad_norm', None)
        tokens = self.metrics.token_sum
        more = [t for t in (grad_norm, tokens) if type(t) is torch.Tensor]
        loss, extras, read = self._means(it, more)
        if type(grad_norm) is torch.Tensor:
            grad_norm = read.pop(0)
        self.losses.append((it, loss))
        lr0 = next(iter(self.optim_wrapper.get_lr().values()))[0]
        now = time.perf_counter()
        epoch = (it - 1) // self.epoch_length + 1  # the 1-based epoch of this iteration
        values = (it, epoch, loss, lr0, grad_norm, it - self.logged_at, now - self.logged_t,
                  self.device, extras)  # fmt: skip
        token_sum = read.pop(0) if type(tokens) is torch.Tensor else None
        self.logged_at, self.logged_t = it, now
        logs = self.log.isEnabledFor(logging.INFO)
        if self.bar is None and not logs:  # nobody here reads the row: built off this thread
            self.metrics.write(*values, token_sum=token_sum, later=True)
            return
        row = self.metrics.write(*values, token_sum=token_sum)
        assert row is not None
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f'{loss:.4f}',
                lr=f'{lr0:.3g}',
                epoch=epoch,
                samples_s=f'{row["samples_per_s"]:.0f}',
            )
        if logs:
            label = self.metrics.peak.label if self.metrics.peak is not None else 'mfu'
            self.log.info(self._position(it) + ' ' + format_row(row, label))

    def after_iteration(self, it: int, validation: Validation | None) -> None:
        """A validation of this iteration (rows and lines after its train row), the bar."""
        done = validation.take() if validation is not None else None
        if done is not None:
            values, lines = done
            self.metrics.write_val(it, (it - 1) // self.epoch_length + 1, values)
            for line in lines:
                self.log.info(line)
        if self.bar is not None:
            self.bar.update(1)

    def _means(
        self, it: int, more: Sequence[torch.Tensor] = ()
    ) -> tuple[float, dict[str, float], list[float]]:
        """The loss's and the other scalars' means since the last row, and the values of
        ``more`` (1-element tensors: the clipping's norm, the tokens' count), in one host
        read; the sums start again from zero."""
        groups = self._grouped()  # on a CPU none: every value already read and added up
        names, tensors = [], list(more)
        for name, values in groups.items():
            names += [name] * len(values)
            tensors += values
        read = _values(tensors, self._host)
        sums, counts = self._numbers, self._counts
        for name, value in zip(names, read[len(more) :], strict=True):
            sums[name] = sums.get(name, 0.0) + value
        trained = it - self.logged_at - self.dropped
        loss = sums.pop('loss', 0.0)
        loss = loss / trained if trained > 0 else float('nan')  # every update was dropped
        extras = {name: sums[name] / counts[name] for name in self._names if name in sums}
        self._reset()
        return loss, extras, read[: len(more)]

    def _reset(self) -> None:
        """The sums and counts start again from zero."""
        self._folded, self._counts, self._numbers = {}, {}, {}
        self.dropped = 0

    def _grouped(self) -> dict[str, list[torch.Tensor]]:
        """The kept iterations' tensors by name (with the folded sums; numbers added to
        ``_numbers``, every name counted); the kept iterations let go."""
        groups: dict[str, list[torch.Tensor]] = {k: [v] for k, v in self._folded.items()}
        counts, numbers, order = self._counts, self._numbers, self._names
        for loss, extras in self._pending:
            if isinstance(loss, torch.Tensor):
                groups.setdefault('loss', []).append(loss)
            else:
                numbers['loss'] = numbers.get('loss', 0.0) + float(loss)
            for name, value in extras.items():
                if name not in order:
                    order[name] = None
                counts[name] = counts.get(name, 0) + 1
                if isinstance(value, torch.Tensor):
                    groups.setdefault(name, []).append(value)
                else:
                    numbers[name] = numbers.get(name, 0.0) + float(value)
        self._pending = []
        return groups

    def _add_values(self, loss: Any, extras: Mapping[str, Any]) -> None:
        numbers, counts, order = self._numbers, self._counts, self._names
        value = loss.item() if isinstance(loss, torch.Tensor) else float(loss)
        numbers['loss'] = numbers.get('loss', 0.0) + value
        for name, v in extras.items():
            value = v.item() if isinstance(v, torch.Tensor) else float(v)
            numbers[name] = numbers.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
            if name not in order:
                order[name] = None

    def _fold(self) -> None:
        """The kept iterations summed on the device, per name: no host sync."""
        self._folded = {name: _sum(values) for name, values in self._grouped().items()}

    def write_anomaly(self, it: int, values: dict[str, float]) -> None:
        """A refused update's row (``train_cfg.anomaly``); its loss stays out of the means."""
        self.dropped += 1
        self.metrics.write_anomaly(it, (it - 1) // self.epoch_length + 1, values)

    def rewind(self, it: int) -> None:
        """A rollback went back to iteration ``it``: the next row counts from there."""
        self._grouped()  # the kept iterations let go (their scalars' names keep their order)
        self._reset()
        if self.main:
            self.metrics.drop_tokens()
        self.logged_at, self.logged_t = it, time.perf_counter()
        if self.bar is not None:
            self.bar.n = it

    def _position(self, it: int) -> str:
        """mmengine's ``Epoch(train) [2][4/6]`` (1-based epoch) or ``Iter(train) [10/24]``,
        with the run's iteration (or epoch) after it."""
        epoch = (it - 1) // self.epoch_length + 1
        if self.by_epoch:
            at = it - (epoch - 1) * self.epoch_length
            return f'Epoch(train) [{epoch}][{at}/{self.epoch_length}] iter {it}/{self.max_iters}'
        return f'Iter(train) [{it}/{self.max_iters}] epoch {epoch}'


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """1-element ``tensors`` as one 1-D tensor: one operation where they share a device
    and a shape (a loop's scalars do), else each moved to the first one's device; None
    where even that fails (a tensor subclass)."""
    try:
        return torch.stack(tensors)
    except (RuntimeError, TypeError):
        pass
    device = tensors[0].device
    try:
        return torch.stack([t.reshape(()).to(device, torch.float64) for t in tensors])
    except (RuntimeError, TypeError):
        return None


def _values(tensors: list[torch.Tensor], host: bool) -> list[float]:
    """The values of 1-element ``tensors``, in one host read (``host``: CPU tensors, each
    read where it is, in host memory: no operation needed)."""
    if not tensors:
        return []
    if host:
        return [t.item() for t in tensors]
    stacked = _stacked(tensors)
    return stacked.tolist() if stacked is not None else [float(t) for t in tensors]


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of 1-element ``tensors``, on the device (one read per tensor where they
    cannot be put together)."""
    stacked = _stacked(tensors)
    if stacked is None:
        return torch.tensor(sum(float(t) for t in tensors), dtype=torch.float64)
    return stacked.sum()
