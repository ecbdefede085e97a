"""One failure message for a multi-process ``stratagem train`` (``--nproc``, ``--nnodes``).

Without it, a config mistake prints the same ``stratagem: error (rank r): ...`` once per rank,
then torchrun's agent adds its own report: log lines, a ``ChildFailedError`` traceback and a
box of per-rank fields. Instead (unless ``--debug``):

1. the parent gives the workers a directory (``STRATAGEM_ERROR_DIR``); a worker that fails
   with an error a user can act on writes it there (``rank_<r>.json``: rank, type, message)
   instead of printing it;
2. the parent reads torchrun's stderr (the workers' too) line by line and passes it on,
   except the agent's failure report: its elastic log lines and the traceback through
   ``torch/distributed/run.py`` with the report box after it;
3. when torchrun fails, the parent prints each distinct message once, naming the ranks that
   had it (the first failure first), then the exit status.

Everything else a worker prints (logs, warnings, a bug's traceback) passes through unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO

__all__ = [
    'ERROR_DIR_ENV',
    'AgentReportFilter',
    'record',
    'record_interrupt',
    'run_with_one_message',
    'summarize',
]

ERROR_DIR_ENV = 'STRATAGEM_ERROR_DIR'
# torch's logging format for the elastic agent: W1125 18:13:46.728000 22356 .../elastic/...]
_AGENT_LOG = re.compile(r'^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/\S*\] ')
_RUN_PY = 'torch/distributed/run.py'
_INTERRUPTED = 'interrupted'


def record(err: BaseException, message: str) -> bool:
    """In a worker whose parent collects errors: write ``message`` for this rank and return
    True (the caller prints nothing); else False."""
    where = os.environ.get(ERROR_DIR_ENV)
    if not where or not os.path.isdir(where):
        return False
    rank = os.environ.get('RANK', '0')
    entry = {'rank': int(rank), 'type': type(err).__name__, 'message': message}
    tmp = os.path.join(where, f'.rank_{rank}.json.tmp')
    with open(tmp, 'w') as f:
        json.dump(entry, f)
    os.replace(tmp, os.path.join(where, f'rank_{rank}.json'))
    return True


def record_interrupt() -> bool:
    """In a worker whose parent collects errors: note that Ctrl-C (SIGINT) stopped it and
    return True (the parent says it once, also when only the agent got the signal)."""
    where = os.environ.get(ERROR_DIR_ENV)
    if not where or not os.path.isdir(where):
        return False
    with open(os.path.join(where, _INTERRUPTED), 'w'):
        pass
    return True


def _read(where: str) -> list[tuple[int, str, dict]]:
    """(mtime, file name, entry) of every recorded error, oldest first."""
    entries = []
    for name in os.listdir(where):
        if name.startswith('rank_') and name.endswith('.json'):
            path = os.path.join(where, name)
            with contextlib.suppress(OSError, ValueError), open(path) as f:
                entries.append((os.stat(path).st_mtime_ns, name, json.load(f)))
    return sorted(entries, key=lambda x: (x[0], x[2]['rank']))


def summarize(where: str, entries: list[dict] | None = None) -> str | None:
    """The recorded errors (``entries``, default: all in ``where``), identical messages
    merged: ``stratagem: error (ranks 0, 1): <message>``, the first failure first. None when
    there is none."""
    if entries is None:
        entries = [e for _, _, e in _read(where)]
    if not entries:
        return None
    groups: dict[tuple[str, str], list[int]] = {}
    for e in entries:
        groups.setdefault((e['type'], e['message']), []).append(e['rank'])
    lines = []
    for (kind, message), ranks in groups.items():
        who = f'rank {ranks[0]}' if len(ranks) == 1 else f'ranks {_ranges(sorted(set(ranks)))}'
        lines.append(f'stratagem: error ({who}): {message}\n({kind})')
    return '\n'.join(lines)


class _Watcher(threading.Thread):
    """Prints the errors ranks record while torchrun runs: once no new one has come for
    ``settle`` seconds, the new ones merged (a restarted attempt's errors print again)."""

    def __init__(self, where: str, out: IO[str], settle: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.where, self.out, self.settle = where, out, settle
        self.seen: dict[str, int] = {}
        self.printed = 0
        self.done = threading.Event()

    def poll(self, final: bool = False) -> None:
        fresh = [(t, e) for t, name, e in _read(self.where) if self.seen.get(name) != t]
        if not fresh:
            return
        newest = max(t for t, _ in fresh)
        if not final and time.time_ns() - newest < self.settle * 1e9:
            return  # more ranks may be failing right now: wait to merge them
        text = summarize(self.where, [e for _, e in fresh])
        for t, name, _ in _read(self.where):
            self.seen[name] = t
        if text:
            self.out.write(text + '\n')
            self.out.flush()
            self.printed += 1

    def run(self) -> None:
        while not self.done.wait(0.25):
            self.poll()


def _ranges(ranks: list[int]) -> str:
    """``0-3, 5``: runs of three or more consecutive ranks as ranges."""
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f'{ranks[i]}-{ranks[j]}')
        else:
            out += [str(r) for r in ranks[i : j + 1]]
        i = j + 1
    return ', '.join(out)


class AgentReportFilter:
    """Passes lines on to ``out`` except torchrun's failure report (see the module docstring).

    A traceback is held until it ends: one that runs through ``torch/distributed/run.py`` is
    the agent's, and it and everything after it (the report box) are dropped; any other is
    passed on whole.
    """

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.held: list[str] | None = None
        self.dropping = False

    def feed(self, line: str) -> None:
        if self.dropping:
            return
        if self.held is not None:
            self.held.append(line)
            if line.startswith((' ', '\t')) or line.strip() == '':
                return
            block, self.held = self.held, None  # the exception line ends the traceback
            if any(_RUN_PY in x for x in block):
                self.dropping = True
                return
            self.out.write(''.join(block))
            self.out.flush()
            return
        if line.startswith('Traceback (most recent call last):'):
            self.held = [line]
            return
        if _AGENT_LOG.match(line):
            return
        self.out.write(line)
        self.out.flush()

    def close(self) -> None:
        if self.held and not any(_RUN_PY in x for x in self.held):
            self.out.write(''.join(self.held))
        self.held = None


@contextlib.contextmanager
def _error_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix='stratagem-errors-') as where:
        previous = os.environ.get(ERROR_DIR_ENV)
        os.environ[ERROR_DIR_ENV] = where
        try:
            yield where
        finally:
            if previous is None:
                os.environ.pop(ERROR_DIR_ENV, None)
            else:
                os.environ[ERROR_DIR_ENV] = previous


def run_with_one_message(
    cmd: list[str],
    on_purpose: Callable[[], bool] | None = None,
    interrupted: list[int] | None = None,
) -> int:
    """Run torchrun's ``cmd`` (stdout as it is, stderr through :class:`AgentReportFilter`),
    printing the ranks' errors as they come (merged); on failure the exit status last, unless
    ``on_purpose()`` says the run was stopped (a preemption, Ctrl-C: the caller says so).
    A worker stopped by Ctrl-C (``record_interrupt``) appends SIGINT to ``interrupted``.
    Returns torchrun's status."""
    with _error_dir() as where:
        watcher = _Watcher(where, sys.stderr)
        watcher.start()
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors='replace')
        assert proc.stderr is not None
        report = AgentReportFilter(sys.stderr)
        for line in proc.stderr:
            report.feed(line)
        report.close()
        code = proc.wait()
        watcher.done.set()
        watcher.join()
        watcher.poll(final=True)
        if interrupted is not None and os.path.exists(os.path.join(where, _INTERRUPTED)):
            interrupted.append(signal.SIGINT)
        if code != 0 and not (on_purpose is not None and on_purpose()):
            if not watcher.printed:
                sys.stderr.write(
                    'stratagem train: a worker failed without an error message of its own '
                    "(its output, if any, is above; --debug shows torchrun's report)\n"
                )
            sys.stderr.write(
                f"(run with --debug or STRATAGEM_DEBUG=1 for every traceback and torchrun's "
                f'report)\nstratagem train: exit status {code}\n'
            )
            sys.stderr.flush()
    return code
