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
(means over the whole validation set). A straggler named (``stratagem.loop.stragglers``)
writes ``iter``, ``epoch``, ``straggler/rank`` and ``straggler/ratio``. Each update
``train_cfg.anomaly`` refused writes a row of its own: ``iter``, ``epoch`` and
``anomaly/<name>`` (``stratagem.loop.anomaly``). Each row goes to:

- ``<log_dir>/metrics.csv`` (the log directory of the run's first part: a resumed run
  appends to the metrics of the run it resumes, its rows after the resumed iteration dropped;
  a header, then one line per row; flushed at most once a second, at each checkpoint save
  and at the end, also when the run fails). A column that appears later (a model's output,
  a validation value) widens the header: the file is rewritten once with the new column,
  earlier rows left empty there;
- TensorBoard event files in ``<log_dir>/tensorboard`` (the file ``torch.utils.
  tensorboard``'s ``SummaryWriter`` writes, by ``stratagem.event_file``; ``pip install
  tensorboard``): every row, one event each, tags ``train/<name>`` and ``val/<name>`` at
  step ``iter``, never dropped (one run across resumes: a resumed run's file starts with
  the ``SessionLog.START`` event at the step after the resumed iteration, which
  ``SummaryWriter(purge_step=)`` writes, so TensorBoard purges the events from that step on
  that the run before wrote); ``tensorboard --logdir work_dirs`` shows every run;
- the log line and the progress bar (throughput and ETA) stay the loop's.

Both writers run on a thread of their own (:class:`RowWriter`): the training thread hands a
row over (a queue's put) and goes on; the thread opens the files with the first row (a run
that fails before it writes none), writes what it was handed at most once a second, and
:meth:`RunMetrics.flush` / :meth:`RunMetrics.close` wait until every row so far is written
(a write's error is raised there, naming the file). A row the training thread does not read
(no log line, no bar: :meth:`RunMetrics.write` with ``later``) is only its values there, and
is built on the writers' thread. Nothing is done per iteration but keeping the loss (and the other
scalars) and counting the batch's tokens (its shape); a row costs one sync per
``log_interval`` (``stratagem.loop.meter``). Other ranks write nothing.
``train_cfg.metrics``: ``csv`` and ``tensorboard`` (bools, default True: the writers),
``flops`` (bool, default True: count the FLOPs for ``mfu``), ``peak_flops`` (FLOP/s of the
device, for a card the table lacks), ``num_tokens`` (the tokens hook).

Read back (``stratagem plot metrics WORK_DIR``): :func:`find_metrics_csv` (the newest run's
file), :func:`metrics_curves` (loss, lr and each validation value over iterations), drawn by
:func:`plot_metrics_png` (matplotlib) or :func:`metrics_ascii` (a terminal).
"""

from __future__ import annotations

import csv
import logging
import math
import os
import queue
import resource
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from stratagem.event_file import EventFile
from stratagem.throughput import FlopCount, Peak, num_tokens_hook

__all__ = [
    'METRICS_KEYS',
    'RowWriter',
    'RunMetrics',
    'check_metrics_cfg',
    'find_metrics_csv',
    'format_row',
    'metrics_ascii',
    'metrics_curves',
    'peak_memory_mib',
    'plot_metrics_png',
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


# Linux gives the process's high-water mark (its memory map's) for the calling thread too,
# without adding up every thread's CPU times as RUSAGE_SELF does
_RUSAGE = getattr(resource, 'RUSAGE_THREAD', resource.RUSAGE_SELF)


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory in MiB: the CUDA allocator's peak on a CUDA device, else
    the peak resident set (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(_RUSAGE).ru_maxrss
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
        write: Callable[[list[Any]], None],
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

    def put(self, row: dict | tuple) -> None:
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
        resumed_at: the iteration a resumed run continues from, whose metrics go on in the
            log directory of the run it resumes: the CSV's rows after it are dropped and
            TensorBoard's events after it purged (the resume re-does those iterations).
            None: a fresh run.

    The files are opened (by the writer's thread) with the first row, so a run that fails
    before it writes none.
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
        resumed_at: int | None = None,
    ) -> None:
        cfg = check_metrics_cfg(cfg)
        self.samples_per_iter = samples_per_iter
        self.data_parallel_size = data_parallel_size
        self.num_tokens = num_tokens or num_tokens_hook(cfg.get('num_tokens'))[0]
        self.peak = peak
        self.flops: FlopCount | None = None
        self.tokens = 0  # this rank's, since the last row
        # a hook's tensors, summed on the device (float64: exact to 2**53, and read with the
        # row's float scalars in one tensor)
        self._token_tensor: torch.Tensor | None = None
        self._counting_tokens, self._saw_tokens = True, False
        self._first_row = True
        self._totals = [0, 0.0, 0]  # iterations, seconds, tokens: the rows after the first
        self.stall = 0.0
        self._last_row: dict | None = None
        self._deferred = False  # rows handed to the writer unbuilt (later=True) since a flush
        self.log_dir = log_dir
        self.resumed_at = resumed_at
        self._path = os.path.join(log_dir, 'metrics.csv')
        self._columns = list(COLUMNS)
        self._csv: Any = None
        self._file: Any = None
        self._tb: Any = None
        self._writer: RowWriter | None = None
        self.flush_every_s = 1.0
        # the writers open with the first row: a run that fails before it leaves no files
        self._want_csv = enabled and bool(cfg.get('csv', True))
        self._want_tb = enabled and bool(cfg.get('tensorboard', True))
        self._opened = False
        self._logger = logger

    def _open_writers(self) -> None:
        """The CSV (appended to, under its header, when it exists: a resumed run's rows go
        on in the file of the run it resumes, rows after ``resumed_at`` dropped, as they are
        re-done) and the TensorBoard writer (its events from ``resumed_at + 1`` on purged)."""
        self._opened = True
        if not (self._want_csv or self._want_tb):
            return
        os.makedirs(self.log_dir, exist_ok=True)
        if self._want_csv:
            if os.path.exists(self._path):
                with open(self._path, newline='') as f:
                    header = next(csv.reader(f), None)
                if header:
                    self._columns = header + [c for c in COLUMNS if c not in header]
                    if self._columns != header or self.resumed_at is not None:
                        self._widen(until=self.resumed_at)
            self._open()
        if self._want_tb:
            # the events of the iterations a resume re-does: hidden, as SummaryWriter's
            # purge_step hides them (a SessionLog.START at the step, TensorBoard's mechanism)
            purge = None if self.resumed_at is None else self.resumed_at + 1
            try:
                self._tb = EventFile(os.path.join(self.log_dir, 'tensorboard'), purge_step=purge)
            except ImportError:
                if self._logger is not None:
                    self._logger.info(
                        'TensorBoard is not installed (pip install tensorboard): scalars go '
                        f'to {self._path} and the log only'
                    )

    def _open(self) -> None:
        new = not os.path.exists(self._path)
        self._file = open(self._path, 'a', newline='')  # noqa: SIM115 - closed in close()
        self._csv = csv.DictWriter(self._file, fieldnames=self._columns, restval='')
        if new:
            self._csv.writeheader()

    def _widen(self, until: int | None = None) -> None:
        """Rewrite the CSV under ``self._columns`` (a temp file renamed over it): a column
        that appears mid-run gets a header entry, and the earlier rows keep their values;
        ``until``: the rows of later iterations dropped (a resume re-does them)."""
        if self._file is not None:
            self._file.close()
        with open(self._path, newline='') as f:
            rows = list(csv.DictReader(f))
        if until is not None:
            rows = [r for r in rows if not _after(r.get('iter'), until)]
        tmp = self._path + '.tmp'
        with open(tmp, 'w', newline='') as f:
            writer = csv.DictWriter(f, fieldnames=self._columns, restval='', extrasaction='ignore')
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self._path)

    def saw_batch(self, batch: Any) -> bool:
        """Count one iteration's batch's tokens (every iteration; its hook's ``int``, or a
        tensor summed where it is and read at the row). The default hook, finding no token
        data in the first batch, is asked no more. Returns whether to call again (False:
        the batches hold no tokens)."""
        if not self._counting_tokens:
            return False
        n = self.num_tokens(batch)
        if n is None:
            self._counting_tokens = self._saw_tokens
            return self._counting_tokens
        self._saw_tokens = True
        if isinstance(n, torch.Tensor):
            if self._token_tensor is None:
                self._token_tensor = torch.zeros((), dtype=torch.float64, device=n.device)
            self._token_tensor.add_(n.detach().reshape(()))
        else:
            self.tokens += int(n)
        return True

    @property
    def token_sum(self) -> torch.Tensor | None:
        """The tokens a hook gave as tensors since the last row, summed on the device (None:
        none given so): whoever reads the row's values may read it with them and hand the
        value to :meth:`write` (``token_sum``), so the row costs one host read."""
        return self._token_tensor

    def set_flops(self, count: FlopCount) -> None:
        """One iteration's FLOPs on this rank (``throughput.count_flops``): ``mfu`` from now."""
        self.flops = count

    def add_stall(self, seconds: float) -> None:
        """Time the loop spent in ``save_checkpoint``."""
        self.stall += seconds

    def drop_tokens(self) -> None:
        """Forget the tokens counted since the last row (a rollback: its iterations are
        trained again, timed from the rollback on)."""
        self._take_tokens()

    def _take_tokens(self, read: float | None = None) -> int | None:
        tokens = self.tokens
        if self._token_tensor is not None:
            tokens += int(self._token_tensor.item() if read is None else read)
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
        *,
        token_sum: float | None = None,
        later: bool = False,
    ) -> dict | None:
        """One row for the ``iters`` iterations that took ``seconds``; ``extras``: the model's
        other training scalars (means over the interval); ``token_sum``: :attr:`token_sum`'s
        value, read by the caller (None: read here). Returns the row; with ``later`` (a row
        nobody on the training thread reads: no log line, no bar) its values are taken here
        and the row is built on the writers' thread, and None is returned (without writers
        it is built here, as without ``later``)."""
        deferred = later and (self._want_csv or self._want_tb)
        if self._deferred and not deferred:  # the rows handed over unbuilt first: in order
            self.flush()
        # the row's values, taken now (the rest is arithmetic: _build)
        tokens = self._take_tokens(token_sum)
        norm = None if grad_norm is None else float(grad_norm)
        stall, self.stall = self.stall, 0.0
        capture = (it, epoch, loss, lr, norm, iters, seconds, peak_memory_mib(device), stall,
                   tokens, self.flops, extras)  # fmt: skip
        if deferred:
            self._deferred = True
            self._add(capture)
            return None
        row = self._build(capture)
        self._add(row)
        return row

    @property
    def last_row(self) -> dict | None:
        """The last training row (the rows handed over unbuilt are built first)."""
        if self._deferred:
            self.flush()
        return self._last_row

    def _build(self, capture: tuple) -> dict:
        """The row of the values :meth:`write` took (the run's averages moved on by it)."""
        it, epoch, loss, lr, norm, iters, seconds, peak, stall, tokens, flops, extras = capture
        rate = iters / seconds if seconds > 0 else float('nan')
        row = {
            'iter': it,
            'epoch': epoch,
            'loss': loss,
            'lr': lr,
            'grad_norm': norm,
            'samples_per_s': rate * self.samples_per_iter,
            'tokens_per_s': None,
            'mfu': self._mfu(rate, flops),
            'step_time_s': seconds / iters if iters else float('nan'),
            'peak_memory_mib': peak,
            'checkpoint_stall_s': stall,
            'flops_per_iter': None if flops is None else flops.total,
        }
        if tokens is not None and seconds > 0:
            row['tokens_per_s'] = tokens * self.data_parallel_size / seconds
        row.update(self._averages(row, iters, seconds, tokens, flops))
        for name, value in (extras or {}).items():
            row.setdefault(name, value)
        self._last_row = row
        return row

    def _mfu(self, rate: float, flops: FlopCount | None) -> float | None:
        if flops is None or self.peak is None or not flops.total:
            return None
        return flops.total * rate / self.peak.flops

    def _averages(
        self, row: dict, iters: int, seconds: float, tokens: int | None, flops: FlopCount | None
    ) -> dict:
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
            mfu = self._mfu(it_rate, flops)
        return {'samples_per_s_avg': rate, 'tokens_per_s_avg': tokens_per_s, 'mfu_avg': mfu}

    def write_val(self, it: int, epoch: int, values: Mapping[str, float]) -> dict:
        """One validation's row: ``iter``, ``epoch`` and ``val/<name>`` per value."""
        row: dict[str, Any] = {'iter': it, 'epoch': epoch}
        row.update((f'val/{name}', value) for name, value in values.items())
        self._add(row)
        return row

    def write_scalars(self, it: int, epoch: int, values: Mapping[str, float]) -> dict:
        """A row of other scalars under their own tags (``straggler/rank``, ...): ``iter``,
        ``epoch`` and ``values`` as given."""
        row: dict[str, Any] = {'iter': it, 'epoch': epoch, **values}
        self._add(row)
        return row

    def write_anomaly(self, it: int, epoch: int, values: Mapping[str, float]) -> dict:
        """A refused update's row (``train_cfg.anomaly``): ``iter``, ``epoch`` and
        ``anomaly/<name>`` per value (``anomaly/nonfinite`` or ``anomaly/spike``, the action's
        ``anomaly/skip`` / ``rollback`` / ``stop``, ``anomaly/loss``, ...)."""
        row: dict[str, Any] = {'iter': it, 'epoch': epoch}
        row.update((f'anomaly/{name}', value) for name, value in values.items())
        self._add(row)
        return row

    def _add(self, row: dict | tuple) -> None:
        if self._writer is None:
            if not (self._want_csv or self._want_tb):
                return
            self._writer = RowWriter(
                self._write_rows, self._sync, every_s=self.flush_every_s, what=self._path
            )
        self._writer.put(row)

    def _write_rows(self, rows: list[dict | tuple]) -> None:
        """On the writer's thread: the files opened with the first rows, then the rows into
        the CSV (widened for a new column) and to TensorBoard, then the files flushed (at
        most once a second)."""
        if not self._opened:
            self._open_writers()
        built = [self._build(r) if isinstance(r, tuple) else r for r in rows]
        if self._csv is not None:
            for row in built:
                new = [k for k in row if k not in self._columns]
                if new:
                    self._columns += new
                    self._widen()
                    self._open()
                self._csv.writerow({k: '' if v is None else v for k, v in row.items()})
            self._file.flush()
        if self._tb is not None:
            self._to_tensorboard(built)
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
        self._deferred = False

    def close(self) -> None:
        """Write every row left, close the files (also when the run failed: the rows up to
        the failure are kept)."""
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            self._writer = None
            self._want_csv = self._want_tb = False  # a row after the close is not written
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None


def _after(value: str | None, iteration: int) -> bool:
    """Whether a CSV row's ``iter`` is past ``iteration`` (a row without one is kept)."""
    try:
        return int(float(value or '')) > iteration
    except ValueError:
        return False


def find_metrics_csv(path: str | os.PathLike) -> Path:
    """The ``metrics.csv`` that ``path`` names: the file itself, a run's log directory
    holding one, or a work_dir: the one of its log directories written last (a resumed run
    writes into the folder of the run it resumed). FileNotFoundError naming what was looked
    for."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / 'metrics.csv').is_file():
        return path / 'metrics.csv'
    found = sorted(path.glob('*/metrics.csv'), key=lambda p: (p.stat().st_mtime, str(p)))
    if not found:
        where = 'does not exist' if not path.exists() else 'holds no */metrics.csv'
        raise FileNotFoundError(
            f'{path} {where}: give the work_dir of a `stratagem train` run (its metrics are '
            'in work_dir/<timestamp>/metrics.csv), a log directory, or a metrics.csv'
        )
    return found[-1]


def metrics_curves(csv_path: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """The curves of a ``metrics.csv``: ``loss``, ``lr`` and every ``val/<name>``, each a
    list of ``(iter, value)`` in file order (empty cells skipped)."""
    with open(csv_path, newline='') as f:
        rows = list(csv.DictReader(f))
    names = ['loss', 'lr'] + sorted({k for r in rows for k in r if k.startswith('val/')})
    curves: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    for row in rows:
        try:
            it = int(float(row.get('iter') or ''))
        except ValueError:
            continue
        for name in names:
            value = row.get(name)
            if value not in (None, ''):
                curves[name].append((it, float(value)))
    return {name: points for name, points in curves.items() if points}


def plot_metrics_png(
    curves: Mapping[str, Sequence[tuple[int, float]]], out: str | os.PathLike, title: str = ''
) -> Path:
    """Draw ``curves`` (:func:`metrics_curves`) to the PNG ``out``, one panel each over the
    iterations: the loss (with ``val/loss`` on it), the lr, then each other validation
    value; needs matplotlib."""
    import matplotlib

    matplotlib.use('Agg')  # files only: never open a window or need a display
    import matplotlib.pyplot as plt

    panels: list[list[str]] = []
    if 'loss' in curves or 'val/loss' in curves:
        panels.append([n for n in ('loss', 'val/loss') if n in curves])
    panels += [[n] for n in curves if n not in ('loss', 'val/loss')]
    if not panels:
        raise ValueError('no loss, lr or validation values to draw')
    fig, grid = plt.subplots(
        len(panels), 1, sharex=True, figsize=(10, 2.6 * len(panels) + 0.6), squeeze=False
    )
    for ax, names in zip((a[0] for a in grid), panels):
        for name in names:
            xs, ys = zip(*curves[name])
            marker = 'o' if name.startswith('val/') else None
            ax.plot(xs, ys, lw=1.4, marker=marker, ms=3, label=name)
        ax.set_ylabel(names[0] if len(names) == 1 else 'loss')
        ax.grid(True, axis='y', alpha=0.3)
        if len(names) > 1:
            ax.legend(loc='best', fontsize='small')
    grid[-1][0].set_xlabel('iteration')
    if title:
        fig.suptitle(title, fontsize='medium')
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def metrics_ascii(
    curves: Mapping[str, Sequence[tuple[int, float]]], width: int = 72, height: int = 10
) -> str:
    """Each of ``curves`` as a terminal chart over the iterations (one column spans
    several iterations when there are more than ``width``; a column draws its points'
    range), with the last value in its title."""
    charts = []
    for name, points in curves.items():
        charts.append(_ascii_points(points, width, height, f'{name} (last {points[-1][1]:.4g})'))
    return '\n\n'.join(charts)


def _ascii_points(points: Sequence[tuple[int, float]], width: int, height: int, title: str) -> str:
    xs = [x for x, _ in points]
    ys = [y for _, y in points if math.isfinite(y)] or [0.0]
    first, last = min(xs), max(xs)
    lo, hi = min(ys), max(ys)
    cols = max(1, min(width, last - first + 1))
    grid = [[' '] * cols for _ in range(height)]

    def row(v: float) -> int:
        return height // 2 if hi == lo else round((v - lo) / (hi - lo) * (height - 1))

    spans: dict[int, tuple[float, float]] = {}
    for x, y in points:
        if not math.isfinite(y):
            continue
        c = 0 if last == first else (x - first) * (cols - 1) // (last - first)
        low, high = spans.get(c, (y, y))
        spans[c] = (min(low, y), max(high, y))
    for c, (low, high) in spans.items():
        for r in range(row(low), row(high) + 1):
            grid[r][c] = '*'
    lines = [title]
    for r in range(height - 1, -1, -1):
        label = f'{hi:.4g}' if r == height - 1 else f'{lo:.4g}' if r == 0 else ''
        lines.append(f'{label:>10} |' + ''.join(grid[r]))
    lines.append(' ' * 10 + ' +' + '-' * cols)
    lines.append(f'{"":>10}  iterations {first}..{last}')
    return '\n'.join(lines)
