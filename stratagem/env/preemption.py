"""Preemption: a signal (Slurm's ``--signal=USR1@120``, a ``SIGTERM``) ends a run in one
committed checkpoint, every rank stopping after the same iteration.

``Preemption`` is a context manager; a training loop (ours, a hand-written one, mmengine's
through ``integrations.mmengine_preemption.PreemptionHook``) uses it in this sequence:

1. ``with Preemption(signals=('SIGTERM', 'SIGUSR1')) as preemption:`` installs a handler for
   each signal on entry (main thread only) and restores the previous ones on exit; nothing is
   installed at import. A handler only records the signal, so a step is never interrupted.
2. After every completed iteration the loop calls ``preemption.should_stop(done)``, ``done``
   being the number of iterations completed. In one process it is True right after a signal.
   In a process group the first rank that saw a signal proposes ``stop = done + lead`` under
   one key of the process group's store (``compare_set``: the first proposal wins); every rank
   reads that key after each iteration (one non-blocking store request, tens of
   microseconds: a background thread would learn it too late when steps are short) and
   answers True once ``done >= stop``. ``lead`` must exceed how far ranks can drift
   apart between two collectives: 2 for plain data parallel, the accumulation window + 1
   when gradients are synchronised only once per window.
3. The loop saves a checkpoint (its vote makes a rank that died meanwhile fail the save on
   every rank within ``checkpoint_timeout``, nothing committed, never a hang) and waits for
   it, then calls ``preemption.finish(work_dir, checkpoint)``: with ``requeue=True`` under
   Slurm rank 0 runs ``scontrol requeue $SLURM_JOB_ID``, and rank 0 writes
   ``work_dir/preempted.json`` (how ``stratagem train`` under torchrun learns that its
   workers, which exit 0 so that torchrun does not restart them, stopped for a preemption).
4. The process exits with ``exit_code`` (default 75, ``EX_TEMPFAIL``: "try again").
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import os.path as osp
import signal
import subprocess
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    'Preemption',
    'PreemptionConfig',
    'preemption_config',
    'read_marker',
    'MARKER_NAME',
    'DEFAULT_SIGNALS',
    'DEFAULT_EXIT_CODE',
]

DEFAULT_SIGNALS = ('SIGTERM', 'SIGUSR1')
DEFAULT_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, run it again
MARKER_NAME = 'preempted.json'
_KEYS = {'signals', 'requeue', 'exit_code'}
_UNCATCHABLE = {'SIGKILL', 'SIGSTOP'}
_SESSIONS = itertools.count()  # every rank enters its Preemption contexts in the same order
log = logging.getLogger('stratagem')


@dataclass(frozen=True)
class PreemptionConfig:
    """Validated preemption settings (``preemption_config`` builds it from a config value)."""

    signals: tuple[str, ...] = DEFAULT_SIGNALS
    requeue: bool = False
    exit_code: int = DEFAULT_EXIT_CODE


def preemption_config(value: Any, key: str = 'train_cfg.preemption') -> PreemptionConfig | None:
    """``value`` as settings: None/False disables, True takes the defaults, a dict sets
    ``signals`` (names, e.g. ``['SIGTERM', 'SIGUSR1']``), ``requeue`` (bool: ``scontrol
    requeue`` under Slurm) and ``exit_code`` (0-255). Errors name ``key``."""
    if value is None or value is False:
        return None
    if value is True:
        return PreemptionConfig()
    if not isinstance(value, Mapping):
        raise TypeError(
            f'{key} should be a dict such as dict(signals=["SIGTERM", "SIGUSR1"], '
            f'requeue=False, exit_code={DEFAULT_EXIT_CODE}), True (these defaults) or None '
            f'(off); got {value!r}'
        )
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f'unknown key(s) {unknown} in {key}; valid keys: {sorted(_KEYS)}')
    signals = value.get('signals', DEFAULT_SIGNALS)
    if isinstance(signals, str):
        signals = [signals]
    if not isinstance(signals, Iterable) or not signals:
        raise ValueError(
            f'{key}.signals should be a non-empty list of signal names, got {signals!r}'
        )
    names = tuple(_signal_name(s, f'{key}.signals') for s in signals)
    requeue = value.get('requeue', False)
    if type(requeue) is not bool:
        raise TypeError(f'{key}.requeue should be True or False, got {requeue!r}')
    code = value.get('exit_code', DEFAULT_EXIT_CODE)
    if type(code) is not int or not 0 <= code <= 255:
        raise ValueError(
            f'{key}.exit_code should be an int in 0..255 (an exit status), got {code!r}'
        )
    return PreemptionConfig(tuple(dict.fromkeys(names)), requeue, code)


def _signal_name(sig: Any, key: str) -> str:
    name = sig.name if isinstance(sig, signal.Signals) else str(sig).upper()
    if not name.startswith('SIG'):
        name = 'SIG' + name
    if name in _UNCATCHABLE:
        raise ValueError(f'{key}: {name} cannot be caught by any process; use SIGTERM or SIGUSR1')
    if not isinstance(getattr(signal, name, None), signal.Signals) or name.startswith('SIG_'):
        valid = ', '.join(s.name for s in signal.Signals if s.name not in _UNCATCHABLE)
        raise ValueError(f'{key}: unknown signal {sig!r}; valid names: {valid}')
    return name


class Preemption:
    """Stop every rank after the same iteration once any rank received one of ``signals``
    (see module doc for the sequence). Use it as a context manager around the loop."""

    def __init__(
        self,
        signals: Iterable[str] = DEFAULT_SIGNALS,
        *,
        requeue: bool = False,
        exit_code: int = DEFAULT_EXIT_CODE,
        lead: int = 2,
    ) -> None:
        cfg = preemption_config(
            dict(signals=list(signals), requeue=requeue, exit_code=exit_code), 'Preemption'
        )
        assert cfg is not None
        self.config = cfg
        if type(lead) is not int or lead < 1:
            raise ValueError(f'Preemption lead should be an int >= 1 (iterations), got {lead!r}')
        self.lead = lead
        self.received: str | None = None  # the first signal this process got
        self.stop_at: int | None = None  # the iteration every rank stops after, once agreed
        self._previous: dict[int, Any] = {}
        self._store: Any = None
        self._key = ''
        self._proposed = False
        self._wakeup: tuple[int, int] | None = None

    @classmethod
    def from_config(cls, cfg: PreemptionConfig, lead: int = 2) -> Preemption:
        return cls(cfg.signals, requeue=cfg.requeue, exit_code=cfg.exit_code, lead=lead)

    @property
    def exit_code(self) -> int:
        return self.config.exit_code

    # ----------------------------------------------------------------- handlers
    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                'Preemption installs signal handlers, which Python allows only in the main '
                'thread; enter it there'
            )
        for name in self.config.signals:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)
        self._wakeup = _wakeup_pipe()
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def pending(self) -> str | None:
        """The signal this process got, from any thread, also while the main thread is
        blocked in C (a collective, a store wait), where Python runs no handler: read from
        the signal module's wakeup pipe (set when no one else had set one, e.g. an event
        loop). The watchdog asks it."""
        if self.received is None and self._wakeup is not None:
            try:
                data = os.read(self._wakeup[0], 512)
            except OSError:  # nothing there (non-blocking)
                data = b''
            ours = {int(getattr(signal, n)): n for n in self.config.signals}
            got = next((ours[b] for b in data if b in ours), None)
            if got is not None and self.received is None:
                self.received = got
        return self.received

    def _handle(self, signum: int, frame: Any) -> None:
        # only a flag: the loop decides where to stop, never the middle of a step
        if self.received is None:
            self.received = signal.Signals(signum).name

    def request(self, name: str = 'request') -> None:
        """Ask for a stop as a signal would (e.g. from a hook or a scheduler's API)."""
        if self.received is None:
            self.received = name

    # ---------------------------------------------------------------- agreement
    def should_stop(self, done: int) -> bool:
        """True on every rank after the same completed iteration once any rank got a signal;
        call it after each iteration with the number completed."""
        if self.stop_at is None:
            from stratagem.env.dist import get_world_size

            if get_world_size() == 1:
                if self.received is not None:
                    self.stop_at = done
            else:
                self._watch()
                if self.received is not None and not self._proposed:
                    self._proposed = True
                    proposal = f'{done + self.lead} {self.received}'
                    self._agreed(self._store.compare_set(self._key, '', proposal))
        if self.stop_at is not None and done > self.stop_at:
            raise RuntimeError(
                f'preemption: the ranks agreed to stop after iteration {self.stop_at}, but this '
                f'rank learned it only after iteration {done}: ranks drifted more than '
                f'lead={self.lead} iterations apart; raise lead'
            )
        return self.stop_at is not None and done >= self.stop_at

    def _agreed(self, value: bytes | str) -> None:
        """The store's ``'<stop> <signal>'``: every rank reports the signal that stopped it."""
        stop, _, name = (value.decode() if isinstance(value, bytes) else value).partition(' ')
        if self.stop_at is None:
            self.stop_at = int(stop)
            self.received = name or self.received

    def _watch(self) -> None:
        """Learn the agreed stop (one non-blocking store request)."""
        if self._store is None:
            from stratagem.env.store import store_client

            self._store = store_client()
            self._key = f'stratagem/preempt/{next(_SESSIONS)}/stop'
        if self._store.check([self._key]):
            self._agreed(self._store.get(self._key))

    # ------------------------------------------------------------------ the end
    def finish(self, work_dir: str, checkpoint: str | None, rank: int = 0) -> None:
        """After the committed save: requeue under Slurm (``requeue=True``, rank 0) and write
        ``work_dir/preempted.json`` (rank 0). Call it on every rank."""
        if rank != 0:
            return
        requeued = self.config.requeue and _requeue()
        info = dict(
            signal=self.received, iteration=self.stop_at, checkpoint=checkpoint,
            requeued=bool(requeued), exit_code=self.exit_code,
        )  # fmt: skip
        os.makedirs(work_dir, exist_ok=True)
        tmp = osp.join(work_dir, f'.{MARKER_NAME}.tmp')
        with open(tmp, 'w') as f:
            json.dump(info, f)
        os.replace(tmp, osp.join(work_dir, MARKER_NAME))


def _wakeup_pipe() -> tuple[int, int] | None:
    """A non-blocking pipe the C signal handler writes each signal's number to (main thread
    only); None when a wakeup fd was already set (it stays) or none can be."""
    try:
        read, write = os.pipe()
    except OSError:
        return None
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except (ValueError, OSError):
        previous = None
    if previous == -1:
        return read, write
    if previous is not None:
        signal.set_wakeup_fd(previous)
    os.close(read)
    os.close(write)
    return None


def _requeue() -> bool:
    job = os.environ.get('SLURM_JOB_ID')
    if not job:
        log.warning('preemption.requeue=True, but this is not a Slurm job (no SLURM_JOB_ID)')
        return False
    try:
        done = subprocess.run(
            ['scontrol', 'requeue', job], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        log.error(f'scontrol requeue {job} failed: {err}')
        return False
    if done.returncode != 0:
        log.error(f'scontrol requeue {job} failed ({done.returncode}): {done.stderr.strip()}')
        return False
    log.info(f'Slurm job {job} requeued')
    return True


def read_marker(work_dir: str, remove: bool = False) -> dict | None:
    """What ``finish`` recorded in ``work_dir`` (None when the last run was not preempted)."""
    path = osp.join(work_dir, MARKER_NAME)
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    if remove:
        os.remove(path)
    return info


def clear_marker(work_dir: str) -> None:
    """Remove a previous run's marker (a run that starts is not preempted yet)."""
    try:
        os.remove(osp.join(work_dir, MARKER_NAME))
    except OSError:
        pass
