"""The scalars ``stratagem train`` writes for a person to watch and compare runs.

Every ``log_interval`` iterations (and at the end), rank 0 writes one row: ``iter``, ``epoch``
(1-based: the epoch the row's last iteration belongs to, as the log line shows it), ``loss``
(mean over the interval), ``lr`` (the first param group's), ``grad_norm`` (the last update's,
when the optim wrapper clips), ``samples_per_s`` (all data-parallel ranks together),
``tokens_per_s`` (rank 0's tokens x the data-parallel size, per second: the tokens a batch
holds as its hook says, ``stratagem.throughput``; empty for data that holds none), ``mfu``
(the model FLOPs utilisation of rank 0's device: ``flops_per_iter`` / ``step_time_s`` /
the device's peak, ``stratagem.throughput``), ``step_time_s`` (mean over the interval),
``peak_memory_mib`` (this process: the accelerator's allocator peak, else the resident set's
high-water mark),
``checkpoint_stall_s`` (time the loop spent inside ``save_checkpoint`` during the interval;
for an asynchronous save, the snapshot), ``flops_per_iter`` (one iteration's forward and
backward on rank 0, counted once), ``samples_per_s_avg``, ``tokens_per_s_avg`` and
``mfu_avg`` (the run's averages so far, the first row, which holds the warm-up, left out once
there is a second), then every other scalar the model returned in
training (e.g. ``acc``; mean over the interval). Each validation writes a row of its own:
``iter``, ``epoch`` and ``val/<name>`` for every scalar of the model's validation output
(means over the whole validation set). Each row goes to:

- ``<log_dir>/metrics.csv`` (a header, then one line per row; flushed at most once a
  second, at each checkpoint save and at the end, also when the run fails). A column that
  appears later (a model's output, a validation value) widens the header: the file is
  rewritten once with the new column, earlier rows left empty there;
- TensorBoard event files in ``<log_dir>/tensorboard`` (the file ``torch.utils.
  tensorboard``'s ``SummaryWriter`` writes, by ``stratagem.event_file``; ``pip install
  tensorboard``): every row, one event each, tags
  ``train/<name>`` and ``val/<name>`` at step ``iter``, never dropped;
  ``tensorboard --logdir work_dirs`` shows every run;
- the log line and the progress bar (throughput and ETA) stay the loop's.

Both writers run on a thread of their own (:class:`RowWriter`): the training thread hands a
row over (a queue's put) and goes on; the thread writes what it was handed at most once a
second, and :meth:`RunMetrics.flush` / :meth:`RunMetrics.close` wait until every row so far
is written (a write's error is raised there, naming the file). Nothing is done per iteration
but adding the loss (and the other scalars) to tensors (no host sync) and counting the
batch's tokens (its shape); a row costs one sync per ``log_interval``. Other ranks write
nothing. ``train_cfg.metrics``: ``csv`` and ``tensorboard`` (bools, default True: the
writers), ``flops`` (bool, default True: count the FLOPs for ``mfu``), ``peak_flops`` (FLOP/s
of the device, for a card the table lacks), ``num_tokens`` (the tokens hook).
"""

from __future__ import annotations

import csv
import logging
import os
import queue
import resource
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from stratagem.event_file import EventFile
from stratagem.throughput import FlopCount, Peak, num_tokens_hook

__all__ = [
    'METRICS_KEYS',
    'RowWriter',
    'RunMetrics',
    'check_metrics_cfg',
    'format_row',
    'peak_memory_mib',
]

#: the keys ``train_cfg.metrics`` accepts
METRICS_KEYS = frozenset({'csv', 'tensorboard', 'flops', 'peak_flops', 'num_tokens'})
_BOOL_KEYS = ('csv', 'tensorboard', 'flops')
COLUMNS = (
    'iter',
    'epoch',
    'loss',
    'lr',
    'grad_norm',
    'samples_per_s',
    'tokens_per_s',
    'mfu',
    'step_time_s',
    'peak_memory_mib',
    'checkpoint_stall_s',
    'flops_per_iter',
    'samples_per_s_avg',
    'tokens_per_s_avg',
    'mfu_avg',
)


def check_metrics_cfg(cfg: Mapping | None) -> dict:
    """``train_cfg.metrics`` as a dict; a ValueError for a key it does not have (read by
    ``loop.check_train_config``, before anything is built)."""
    cfg = dict(cfg or {})
    unknown = sorted(set(cfg) - METRICS_KEYS)
    if unknown:
        raise ValueError(
            f'train_cfg.metrics: unknown key(s) {unknown}; valid: csv, tensorboard, flops '
            '(bools), peak_flops (FLOP/s), num_tokens (a function (batch) -> tokens or its '
            'import path)'
        )
    for key in _BOOL_KEYS:
        if not isinstance(cfg.get(key, True), bool):
            raise TypeError(f'train_cfg.metrics.{key} must be True or False, got {cfg[key]!r}')
    peak = cfg.get('peak_flops')
    if peak is not None and (
        isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak > 0
    ):
        raise ValueError(
            f'train_cfg.metrics.peak_flops must be the device peak in FLOP/s (a number > 0, '
            f'e.g. 989e12), got {peak!r}'
        )
    hook = cfg.get('num_tokens')
    if hook is not None and not (callable(hook) or isinstance(hook, str)):
        raise TypeError(
            'train_cfg.metrics.num_tokens must be a function (batch) -> tokens or its import '
            f"path 'package.module.function', got {type(hook).__name__}"
        )
    return cfg


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory in MiB: the CUDA allocator's peak on a CUDA device, else
    the peak resident set (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == 'darwin' else rss / 2**10


def format_row(row: Mapping, mfu_label: str = 'mfu') -> str:
    """A row as the log line's tail: ``loss 2.5000 [acc 0.7500 ...] lr 0.01 grad_norm 1.5
    160 samples/s (1600 tokens/s) mfu 41.2% 0.200 s/it peak 812 MiB [checkpoint 0.25 s]``
    (the model's other training scalars after the loss; ``mfu_label``: the peak's,
    ``mfu(cpu-measured)`` on a CPU)."""
    text = f'loss {row["loss"]:.4f}'
    for name, value in row.items():
        if name not in COLUMNS and value is not None:
            text += f' {name} {value:.4f}'
    text += f' lr {row["lr"]:.4g}'
    if row.get('grad_norm') is not None:
        text += f' grad_norm {row["grad_norm"]:.4g}'
    text += f' {row["samples_per_s"]:.1f} samples/s'
    if row.get('tokens_per_s') is not None:
        text += f' ({row["tokens_per_s"]:.0f} tokens/s)'
    if row.get('mfu') is not None:
        text += f' {mfu_label} {row["mfu"] * 100:.3g}%'
    text += f' {row["step_time_s"]:.3f} s/it peak {row["peak_memory_mib"]:.0f} MiB'
    if row.get('checkpoint_stall_s'):
        text += f' checkpoint {row["checkpoint_stall_s"]:.2f} s'
    return text


class RowWriter:
    """A thread that writes rows off the training thread: :meth:`put` hands a row over (a
    queue's put, a microsecond), the thread calls ``write(rows)`` with what it was handed at
    most every ``every_s`` seconds; :meth:`flush` and :meth:`close` wait until every row
    handed over before is written, and raise the error a write raised, if any (a failed
    write stops the writing; the rows after it stay unwritten)."""

    _STOP = object()

    def __init__(
        self,
        write: Callable[[list[dict]], None],
        sync: Callable[[], None],
        *,
        every_s: float = 1.0,
        what: str = 'metrics',
    ) -> None:
        self._write, self._sync, self.every_s, self.what = write, sync, every_s, what
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name='stratagem-metrics', daemon=True)
        self._thread.start()

    def put(self, row: dict) -> None:
        if self._error is not None:
            self._raise()
        self._queue.put(row)

    def flush(self) -> None:
        """Wait until every row put so far is written and the writers flushed."""
        if not self._thread.is_alive():
            return
        done = threading.Event()
        self._queue.put(done)
        self._wake.set()
        done.wait()
        if self._error is not None:
            self._raise()

    def close(self) -> None:
        """Write what is left, then end the thread."""
        if self._thread.is_alive():
            self._queue.put(self._STOP)
            self._wake.set()
            self._thread.join()
        if self._error is not None:
            self._raise()

    def _raise(self) -> None:
        err, self._error = self._error, None
        raise RuntimeError(f'writing the {self.what} failed: {err}') from err

    def _run(self) -> None:
        stop = False
        while not stop:
            # woken once a second, or at once by a flush or the close: a wake per row
            # would cost the training thread the GIL every log_interval
            self._wake.wait(self.every_s)
            self._wake.clear()
            rows: list[dict] = []
            waiting: list[threading.Event] = []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is self._STOP:
                    stop = True
                elif isinstance(item, threading.Event):
                    waiting.append(item)
                else:
                    rows.append(item)
            if self._error is None and (rows or waiting or stop):
                try:
                    if rows:
                        self._write(rows)
                    if waiting or stop:
                        self._sync()
                except Exception as err:  # noqa: BLE001 - raised on the training thread, at flush/close
                    self._error = err
            for done in waiting:
                done.set()


class RunMetrics:
    """One run's scalar writers (rank 0; on other ranks every method does nothing).

    Args:
        log_dir: the run's log directory (``strategy.log_dir``).
        samples_per_iter: samples one iteration reads over all data-parallel ranks.
        enabled: whether this process writes (rank 0).
        cfg: ``train_cfg.metrics`` (see the module's docstring).
        logger: where to say once that TensorBoard is not installed.
        data_parallel_size: ranks that each read as many tokens as this one.
        num_tokens: the tokens hook (default: ``cfg['num_tokens']``, else
            ``throughput.default_num_tokens``).
        peak: the device's peak for ``mfu`` (``throughput.device_peak``); None: no ``mfu``.
    """

    def __init__(
        self,
        log_dir: str,
        samples_per_iter: int,
        *,
        enabled: bool,
        cfg: Mapping | None = None,
        logger: logging.Logger | None = None,
        data_parallel_size: int = 1,
        num_tokens: Callable[[Any], Any] | None = None,
        peak: Peak | None = None,
    ) -> None:
        cfg = check_metrics_cfg(cfg)
        self.samples_per_iter = samples_per_iter
        self.data_parallel_size = data_parallel_size
        self.num_tokens = num_tokens or num_tokens_hook(cfg.get('num_tokens'))[0]
        self.peak = peak
        self.flops: FlopCount | None = None
        self.tokens = 0  # this rank's, since the last row
        self._token_tensor: torch.Tensor | None = None  # a hook's tensors, summed on device
        self._counting_tokens, self._saw_tokens = True, False
        self._first_row = True
        self._totals = [0, 0.0, 0]  # iterations, seconds, tokens: the rows after the first
        self.stall = 0.0
        self.last_row: dict | None = None
        self._path = os.path.join(log_dir, 'metrics.csv')
        self._columns = list(COLUMNS)
        self._csv: Any = None
        self._file: Any = None
        self._tb: Any = None
        self._writer: RowWriter | None = None
        self.flush_every_s = 1.0
        if not enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        if cfg.get('csv', True):
            if os.path.exists(self._path):  # a resumed run appends under the file's header
                with open(self._path, newline='') as f:
                    header = next(csv.reader(f), None)
                if header:
                    self._columns = header + [c for c in COLUMNS if c not in header]
                    if self._columns != header:
                        self._widen()
            self._open()
        if cfg.get('tensorboard', True):
            try:
                self._tb = EventFile(os.path.join(log_dir, 'tensorboard'))
            except ImportError:
                if logger is not None:
                    logger.info(
                        'TensorBoard is not installed (pip install tensorboard): scalars go '
                        f'to {self._path} and the log only'
                    )
        if self._csv is not None or self._tb is not None:
            self._writer = RowWriter(
                self._write_rows, self._sync, every_s=self.flush_every_s, what=self._path
            )

    def _open(self) -> None:
        new = not os.path.exists(self._path)
        self._file = open(self._path, 'a', newline='')  # noqa: SIM115 - closed in close()
        self._csv = csv.DictWriter(self._file, fieldnames=self._columns, restval='')
        if new:
            self._csv.writeheader()

    def _widen(self) -> None:
        """Rewrite the CSV under ``self._columns`` (a temp file renamed over it): a column
        that appears mid-run gets a header entry, and the earlier rows keep their values."""
        if self._file is not None:
            self._file.close()
        with open(self._path, newline='') as f:
            rows = list(csv.DictReader(f))
        tmp = self._path + '.tmp'
        with open(tmp, 'w', newline='') as f:
            writer = csv.DictWriter(f, fieldnames=self._columns, restval='', extrasaction='ignore')
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self._path)

    def saw_batch(self, batch: Any) -> None:
        """Count one iteration's batch's tokens (every iteration; its hook's ``int``, or a
        tensor summed where it is and read at the row). The default hook, finding no token
        data in the first batch, is asked no more."""
        if not self._counting_tokens:
            return
        n = self.num_tokens(batch)
        if n is None:
            self._counting_tokens = self._saw_tokens
            return
        self._saw_tokens = True
        if isinstance(n, torch.Tensor):
            if self._token_tensor is None:
                self._token_tensor = torch.zeros((), dtype=torch.int64, device=n.device)
            self._token_tensor.add_(n.detach().reshape(()))
        else:
            self.tokens += int(n)

    def set_flops(self, count: FlopCount) -> None:
        """One iteration's FLOPs on this rank (``throughput.count_flops``): ``mfu`` from now."""
        self.flops = count

    def add_stall(self, seconds: float) -> None:
        """Time the loop spent in ``save_checkpoint``."""
        self.stall += seconds

    def _take_tokens(self) -> int | None:
        tokens = self.tokens
        if self._token_tensor is not None:
            tokens += int(self._token_tensor.item())
            self._token_tensor.zero_()
        self.tokens = 0
        return tokens if self._saw_tokens else None

    def write(
        self,
        it: int,
        epoch: int,
        loss: float,
        lr: float,
        grad_norm: Any,
        iters: int,
        seconds: float,
        device: torch.device,
        extras: Mapping[str, float] | None = None,
    ) -> dict:
        """One row for the ``iters`` iterations that took ``seconds``; ``extras``: the model's
        other training scalars (means over the interval). Returns the row."""
        rate = iters / seconds if seconds > 0 else float('nan')
        tokens = self._take_tokens()
        row = {
            'iter': it,
            'epoch': epoch,
            'loss': loss,
            'lr': lr,
            'grad_norm': None if grad_norm is None else float(grad_norm),
            'samples_per_s': rate * self.samples_per_iter,
            'tokens_per_s': None,
            'mfu': self._mfu(rate),
            'step_time_s': seconds / iters if iters else float('nan'),
            'peak_memory_mib': peak_memory_mib(device),
            'checkpoint_stall_s': self.stall,
            'flops_per_iter': None if self.flops is None else self.flops.total,
        }
        if tokens is not None and seconds > 0:
            row['tokens_per_s'] = tokens * self.data_parallel_size / seconds
        row.update(self._averages(row, iters, seconds, tokens))
        for name, value in (extras or {}).items():
            row.setdefault(name, value)
        self.stall = 0.0
        self.last_row = row
        self._add(row)
        return row

    def _mfu(self, rate: float) -> float | None:
        if self.flops is None or self.peak is None or not self.flops.total:
            return None
        return self.flops.total * rate / self.peak.flops

    def _averages(self, row: dict, iters: int, seconds: float, tokens: int | None) -> dict:
        """The run's figures so far: the first row's own, then the rows after it (the first
        holds the warm-up: allocations, compilation, the FLOP count)."""
        if self._first_row:
            self._first_row = False
            rate, tokens_per_s = row['samples_per_s'], row['tokens_per_s']
            mfu = row['mfu']
        else:
            totals = self._totals
            totals[0] += iters
            totals[1] += seconds
            totals[2] += tokens or 0
            it_rate = totals[0] / totals[1] if totals[1] > 0 else float('nan')
            rate = it_rate * self.samples_per_iter
            tokens_per_s = None
            if tokens is not None and totals[1] > 0:
                tokens_per_s = totals[2] * self.data_parallel_size / totals[1]
            mfu = self._mfu(it_rate)
        return {'samples_per_s_avg': rate, 'tokens_per_s_avg': tokens_per_s, 'mfu_avg': mfu}

    def write_val(self, it: int, epoch: int, values: Mapping[str, float]) -> dict:
        """One validation's row: ``iter``, ``epoch`` and ``val/<name>`` per value."""
        row: dict[str, Any] = {'iter': it, 'epoch': epoch}
        row.update((f'val/{name}', value) for name, value in values.items())
        self._add(row)
        return row

    def _add(self, row: dict) -> None:
        if self._writer is not None:
            self._writer.put(row)

    def _write_rows(self, rows: list[dict]) -> None:
        """On the writer's thread: the rows into the CSV (widened for a new column) and to
        TensorBoard, then the file flushed (at most once a second)."""
        if self._csv is not None:
            for row in rows:
                new = [k for k in row if k not in self._columns]
                if new:
                    self._columns += new
                    self._widen()
                    self._open()
                self._csv.writerow({k: '' if v is None else v for k, v in row.items()})
            self._file.flush()
        if self._tb is not None:
            self._to_tensorboard(rows)
            self._tb.flush()

    def _sync(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def _to_tensorboard(self, rows: list[dict]) -> None:
        # one event per row, all its scalars in it, every row
        for row in rows:
            scalars = {
                k if '/' in k else f'train/{k}': float(v)
                for k, v in row.items()
                if k not in ('iter', 'epoch') and v is not None
            }
            self._tb.add(row['iter'], scalars)

    def flush(self) -> None:
        """Wait until every row so far is in the CSV file and TensorBoard's (a checkpoint's
        save calls it: the rows are as complete as the checkpoint)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Write every row left, close the files (also when the run failed: the rows up to
        the failure are kept)."""
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            self._writer = None
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None
