"""A work_dir belongs to one run at a time: ``work_dir/.stratagem.lock``.

The file is the claim: JSON naming the holder's host, pid, the process's start time
(``/proc``, so a reused pid is not mistaken for the holder), the wall-clock start, the Slurm
job id and restart count, torchrun's run id, and a token the holder gives its own child
processes (``STRATAGEM_WORKDIR_LOCK``). An absent (or empty) file is a free work_dir.

1. ``WorkDirLock(work_dir).acquire()`` creates ``work_dir`` (only the directory) and opens
   the file.
2. ``fcntl.flock(LOCK_EX | LOCK_NB)``:

   - taken: the previous claim, if any, belonged to a process that is gone (the kernel drops
     a flock when its holder dies, SIGKILL included). A claim of this host is taken over,
     with a warning naming it unless it was this same run (a torchrun restart, a requeued
     Slurm job). A claim of **another host** is refused: on NFS or Lustre a flock is often
     local to one client, so its holder may be alive (``force=True`` takes it; the same
     Slurm job, requeued, takes it by itself).
   - busy: a live process holds it. Refused, naming host and pid, unless the claim carries
     this process's ``STRATAGEM_WORKDIR_LOCK`` token (a worker of the run whose launching
     parent holds the lock): the lock is then shared, and this process releases nothing.

3. Where ``flock`` is refused by the filesystem (``ENOLCK``, ``EOPNOTSUPP``: some NFS and
   Lustre mounts), the claim alone decides: the file is created with ``O_EXCL``; an existing
   claim of this host is alive while its pid runs with the recorded start time; a claim of
   another host is never judged alive or dead (refused, or taken with ``force``).
4. ``release()``: the file is removed, then the flock dropped (a contender that opened it
   meanwhile checks, once it holds the flock, that the path is still its file). A released
   work_dir holds no lock file; one that a killed run left is the claim step 2 reads.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import os.path as osp
import socket
import time
import uuid
import warnings
from typing import Any

__all__ = ['LOCK_NAME', 'TOKEN_ENV', 'WorkDirBusyError', 'WorkDirLock']

LOCK_NAME = '.stratagem.lock'
#: the holder's token, in the environment of the processes it starts (torchrun's workers)
TOKEN_ENV = 'STRATAGEM_WORKDIR_LOCK'

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


class WorkDirBusyError(RuntimeError):
    """Another run holds this work_dir (the message names it and the ways out)."""


def _proc_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (Linux ``/proc``), else None."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(')', 1)[-1].split()[19]


def _pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists (another user's): alive, unless its start time says the pid was reused
    now = _proc_start(pid)
    return start is None or now is None or now == start


def describe(claim: dict[str, Any]) -> str:
    """``host H pid P (started T, Slurm job J)``."""
    started = claim.get('started')
    when = (
        time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))
        if isinstance(started, int | float)
        else '?'
    )
    extra = ''
    if claim.get('slurm_job_id'):
        extra += f', Slurm job {claim["slurm_job_id"]}'
    if claim.get('torchrun_run_id'):
        extra += f', torchrun run {claim["torchrun_run_id"]}'
    return f'host {claim.get("host")} pid {claim.get("pid")} (started {when}{extra})'


class WorkDirLock:
    """The claim of one run on ``work_dir``; ``force`` takes another host's claim.

    Use as a context manager, or ``acquire()`` / ``release()``. ``shared`` is True when the
    lock is held by another process of this run (nothing to release here). ``run_token``:
    the token every process of one run derives alike (the elastic agents of one rendezvous,
    which start separately), so each joins the run's lock instead of being refused by it;
    default: a fresh one, known to this holder's children only.
    """

    def __init__(self, work_dir: str, *, force: bool = False, run_token: str | None = None) -> None:
        self.work_dir = osp.abspath(work_dir)
        self.path = osp.join(self.work_dir, LOCK_NAME)
        self.force = force
        self.shared = False
        self.token = run_token or uuid.uuid4().hex
        self._run_token = run_token
        self._fd: int | None = None
        self._created: list[str] = []  # the directories acquire made, deepest first

    # the claim -----------------------------------------------------------------------------
    def _claim(self) -> dict[str, Any]:
        pid = os.getpid()
        return {
            'host': socket.gethostname(),
            'pid': pid,
            'proc_start': _proc_start(pid),
            'started': time.time(),
            'slurm_job_id': os.environ.get('SLURM_JOB_ID'),
            'slurm_restart_count': os.environ.get('SLURM_RESTART_COUNT'),
            'torchrun_run_id': os.environ.get('TORCHELASTIC_RUN_ID'),
            'token': self.token,
        }

    @staticmethod
    def _parse(text: str) -> dict[str, Any] | None:
        if not text.strip():
            return None
        try:
            claim = json.loads(text)
        except ValueError:
            return {'host': '?', 'pid': '?', 'unreadable': text[:80]}
        return claim if isinstance(claim, dict) else {'host': '?', 'pid': '?'}

    @staticmethod
    def _same_run(claim: dict[str, Any]) -> bool:
        """A requeued Slurm job or a restarted torchrun attempt of the run that claimed it."""
        job = os.environ.get('SLURM_JOB_ID')
        if job and claim.get('slurm_job_id') == job:
            return True
        run_id = os.environ.get('TORCHELASTIC_RUN_ID')
        return bool(run_id) and claim.get('torchrun_run_id') == run_id and _here(claim)

    def _refuse(self, claim: dict[str, Any], why: str) -> WorkDirBusyError:
        return WorkDirBusyError(
            f'work_dir {self.work_dir} is in use by another run: {describe(claim)}; {why}. '
            f'Use another --work-dir, or wait for that run to end; if it is certainly gone, '
            f'`stratagem train ... --force-unlock` takes the lock ({self.path})'
        )

    # acquire / release ---------------------------------------------------------------------
    def acquire(self) -> WorkDirLock:
        """Take the lock, or raise :class:`WorkDirBusyError` naming the holder."""
        token = self._run_token or os.environ.get(TOKEN_ENV)
        self._created = []
        d = self.work_dir
        while not osp.isdir(d) and d != osp.dirname(d):
            self._created.append(d)
            d = osp.dirname(d)
        os.makedirs(self.work_dir, exist_ok=True)
        try:
            return self._acquire(token)
        except BaseException:
            self._remove_created()
            raise

    def _acquire(self, token: str | None) -> WorkDirLock:
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fcntl is None:
                    raise OSError(errno.ENOLCK, 'no fcntl')
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                claim = self._holders_claim(fd)
                os.close(fd)
                if token and claim.get('token') == token:
                    self.shared = True
                    return self
                raise self._refuse(claim, 'it holds the lock now') from None
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                return self._acquire_by_claim(token)
            try:
                if _same_file(fd, self.path):
                    previous = self._parse(_read(fd))
                    if previous is not None:
                        self._take_over(previous, alive=False)
                    _write(fd, self._claim())
                    self._fd = fd
                    return self
                # else its holder removed it at its release: lock the path's new file
            finally:
                if self._fd != fd:
                    os.close(fd)  # a refused take-over leaves the claim as it found it
        raise WorkDirBusyError(f'could not lock {self.path}: other runs take and release it')

    def _holders_claim(self, fd: int, wait_s: float = 5.0) -> dict[str, Any]:
        """The claim of the process that holds the flock on ``fd``'s file. The holder writes
        it just after it takes the lock: a claim that is empty or half-written is read again
        for up to ``wait_s`` (two elastic agents of one run start together, and the second
        must see the first's token, not a blank that reads as another run's lock)."""
        deadline = time.monotonic() + wait_s
        claim = self._parse(_read(fd))
        while (claim is None or 'unreadable' in claim) and time.monotonic() < deadline:
            time.sleep(0.02)
            claim = self._parse(_read(fd))
        return claim or {'host': '?', 'pid': '?'}

    def _acquire_by_claim(self, token: str | None) -> WorkDirLock:
        """Without flock: the O_EXCL-created file is the claim."""
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                with open(self.path) as f:
                    previous = self._parse(f.read())
                if previous is None:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(self.path)  # an empty file: a release under flock
                    continue
                if token and previous.get('token') == token:
                    self.shared = True
                    return self
                alive = _here(previous) and _pid_alive(
                    int(previous.get('pid', -1)), previous.get('proc_start')
                )
                self._take_over(previous, alive=alive)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
                continue
            self._fd = fd
            _write(fd, self._claim())
            return self
        raise WorkDirBusyError(f'could not claim {self.path}: another run claims it at once')

    def _take_over(self, previous: dict[str, Any], *, alive: bool) -> None:
        if alive:
            raise self._refuse(previous, 'it is running on this host')
        if self._same_run(previous):
            return
        if not _here(previous) and not self.force and 'unreadable' not in previous:
            raise self._refuse(
                previous,
                'it is on another host, where this process cannot tell whether it still runs',
            )
        warnings.warn(
            f'work_dir {self.work_dir}: taking over the lock of a run that '
            + ('may still run on another host (--force-unlock)' if not _here(previous) else
               'ended without releasing it')
            + f': {describe(previous)}',
            stacklevel=3,
        )  # fmt: skip

    def release(self) -> None:
        """Give the lock up (idempotent); a shared lock is the parent's to release."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            # removed while still locked: a contender that opened it meanwhile finds, once it
            # has the flock, that the path is no longer its file, and opens the path again
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        finally:
            os.close(fd)  # drops the flock
        self._remove_created()

    def _remove_created(self) -> None:
        """A run that ended before writing anything leaves no work_dir behind."""
        for d in self._created:
            try:
                os.rmdir(d)
            except OSError:
                break
        self._created = []

    def child_env(self) -> dict[str, str]:
        """What a process this run starts needs to share the lock."""
        return {TOKEN_ENV: self.token}

    def __enter__(self) -> WorkDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _here(claim: dict[str, Any]) -> bool:
    return claim.get('host') == socket.gethostname()


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b''.join(chunks).decode('utf-8', 'replace')


def _write(fd: int, claim: dict[str, Any]) -> None:
    data = json.dumps(claim).encode()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, data)
    os.fsync(fd)
