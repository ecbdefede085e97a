"""The progress display of ``stratagem train``: a bar on a terminal, periodic lines elsewhere.

A carriage-return redraw is right on a terminal and wrong in a log file or a CI console, where
every redraw lands as a fragment interleaved with the log lines. :func:`progress_bar` returns
a tqdm bar when the stream is a terminal, else a :class:`LineProgress` that prints one whole
line every ``interval_s`` seconds and a last one on close. Both have the subset of tqdm's
interface the loop uses: ``update``, ``set_postfix``, ``close``. :func:`count_progress` is
the same rule for a ``progress(done, total)`` callback (``stratagem convert``'s).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ['LineProgress', 'count_progress', 'progress_bar', 'logging_above']


def _clock(seconds: float) -> str:
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f'{hours}:{minutes:02d}:{sec:02d}' if hours else f'{minutes}:{sec:02d}'


class LineProgress:
    """Progress as whole lines: ``desc n/total pct | it/s | elapsed<eta | postfix``.

    Args:
        total: Iterations of the run.
        initial: Iterations already done (a resumed run); rates count from here.
        desc: Prefix of each line.
        file: Where lines go (a text stream; flushed after each line).
        interval_s: Seconds between lines (default 30). ``0``: a line per ``update``.
        clock: Monotonic time source in seconds (default ``time.monotonic``).
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        desc: str = 'train',
        *,
        file: TextIO,
        interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f'interval_s must be >= 0 seconds, got {interval_s!r}')
        self.total, self.n, self.initial, self.desc = total, initial, initial, desc
        self.file, self.interval_s, self._clock = file, interval_s, clock
        self._start = self._last = clock()
        self._printed_n: int | None = None
        self._postfix = ''
        self._closed = False

    def set_postfix(self, **kwargs: Any) -> None:
        """Values appended to the next lines, as ``key=value``."""
        self._postfix = ', '.join(f'{k}={v}' for k, v in kwargs.items())

    def update(self, n: int = 1) -> None:
        """Count ``n`` iterations; print a line if ``interval_s`` has passed since the last."""
        self.n += n
        now = self._clock()
        if now - self._last >= self.interval_s:
            self._print(now)

    def close(self) -> None:
        """Print the final line (unless the last line already showed this count)."""
        if not self._closed:
            self._closed = True
            if self._printed_n != self.n:
                self._print(self._clock())

    def _print(self, now: float) -> None:
        self._last, self._printed_n = now, self.n
        elapsed = now - self._start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        eta = _clock((self.total - self.n) / rate) if rate > 0 else '?'
        pct = f'{100 * self.n / self.total:3.0f}%' if self.total else ''
        line = (
            f'{self.desc} {self.n}/{self.total} {pct} | {rate:.2f} it/s | {_clock(elapsed)}<{eta}'
        )
        self.file.write(line + (f' | {self._postfix}' if self._postfix else '') + '\n')
        self.file.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress_bar(total: int, initial: int, file: TextIO, desc: str = 'train') -> Any:
    """A tqdm bar when ``file`` is a terminal, else a :class:`LineProgress` (lines every 30 s)."""
    if not _is_terminal(file):
        return LineProgress(total, initial, desc, file=file)
    from tqdm import tqdm

    return tqdm(
        total=total, initial=initial, desc=desc, dynamic_ncols=True, file=file, mininterval=0.5
    )


def logging_above(bar: Any, logger: logging.Logger) -> contextlib.AbstractContextManager:
    """While open, ``logger``'s lines print above a tqdm ``bar``; a no-op for line progress."""
    if isinstance(bar, LineProgress):
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm(loggers=[logger])


def count_progress(
    desc: str,
    file: TextIO,
    *,
    interval_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback: on a terminal a bar redrawn in place
    (``desc [####....] done/total``); elsewhere (a pipe, a file) whole lines only, no
    carriage return: one every ``interval_s`` seconds and one when ``done`` reaches
    ``total``."""
    terminal = _is_terminal(file)
    last = [clock()]

    def progress(done: int, total: int) -> None:
        finished = done >= total
        width = 30
        filled = width * done // max(total, 1)
        text = f'{desc} [{"#" * filled}{"." * (width - filled)}] {done}/{total}'
        if terminal:
            file.write('\r' + text + ('\n' if finished else ''))
        elif finished or clock() - last[0] >= interval_s:
            last[0] = clock()
            file.write(text + '\n')
        file.flush()

    return progress
