"""Run a test function in N fresh processes, started as ``torchrun`` starts its workers.

Usage (in a test module; the function must be defined at module level)::

    from dist_harness import run_distributed

    def _check(scale):                  # runs in every rank, in a new interpreter
        from stratagem.env import init_dist, get_rank
        init_dist('pytorch')
        return get_rank() * scale

    def test_ranks():
        assert run_distributed(_check, nproc=2, args=(10,)) == [0, 10]

What each rank gets, as torchrun gives it: a new ``python`` process whose environment
holds ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``ROLE_RANK``, ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT=<a free port>``, plus
``OMP_NUM_THREADS=1`` and ``GLOO_SOCKET_IFNAME=lo`` (when a loopback ``lo`` exists), and
none of the Slurm / MPI / torchelastic variables of the calling shell (the list:
``launcher_env``). ``sys.path``
is the caller's (through ``PYTHONPATH``), so the function's module and its arguments
unpickle in the child.

Contract:
1. ``run_distributed`` returns the ranks' return values in rank order (they must pickle).
2. When a rank raises, the others get ``grace`` seconds to finish, are killed, and
   :class:`RankFailure` is raised for the first rank that failed, carrying its traceback
   and output; the rank's exception (when it unpickles) is chained as the cause.
3. When ``timeout`` passes first, every rank is killed (with its child processes) and
   ``TimeoutError`` names the ranks still running. Nothing is left behind to hang.
4. Each rank's stdout and stderr are echoed, prefixed ``[rank r]``, to the caller's
   stdout afterwards, where pytest shows them for a failing test.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from launcher_env import without_launcher

__all__ = ['run_distributed', 'RankFailure', 'free_port', 'torchrun_env']

_BOOTSTRAP = (
    'import importlib.util, sys\n'
    "spec = importlib.util.spec_from_file_location('_stratagem_dist_harness', sys.argv[1])\n"
    'module = importlib.util.module_from_spec(spec)\n'
    'sys.modules[spec.name] = module\n'
    'spec.loader.exec_module(module)\n'
    'module._child_main(sys.argv[2], int(sys.argv[3]))\n'
)
_PORT_IN_USE = ('address already in use', 'EADDRINUSE')


class RankFailure(RuntimeError):
    """A rank of :func:`run_distributed` raised or died.

    Attributes: ``rank``; ``remote_traceback`` (the rank's formatted traceback, or ''
    when it died without one); ``output`` (its stdout and stderr); ``exitcode``.
    """

    def __init__(
        self, rank: int, remote_traceback: str, output: str, exitcode: int | None, others: str = ''
    ) -> None:
        self.rank, self.remote_traceback, self.output = rank, remote_traceback, output
        self.exitcode = exitcode
        what = (
            f'raised:\n{remote_traceback}'
            if remote_traceback
            else f'died with exit code {exitcode} and no traceback; output tail:\n{_tail(output)}'
        )
        super().__init__(f'rank {rank} {what}{others}')


def free_port(host: str = '127.0.0.1') -> int:
    """A TCP port that was free a moment ago (the OS picks it; a race is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def torchrun_env(
    rank: int, nproc: int, port: int, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment torchrun gives worker ``rank`` of ``nproc`` on one node."""
    env = without_launcher(base)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK='0',
        GROUP_WORLD_SIZE='1',
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(nproc),
        ROLE_NAME='default',
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT=str(port),
        OMP_NUM_THREADS='1',
    )
    if any(name == 'lo' for _, name in socket.if_nameindex()):
        env['GLOO_SOCKET_IFNAME'] = 'lo'  # gloo otherwise may pick an interface it cannot reach
    return env


def run_distributed(
    fn: Callable[..., Any],
    nproc: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    env: Mapping[str, Any] | None = None,
    grace: float = 3.0,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` in ``nproc`` processes; return their results by rank.

    Args:
        fn: a module-level function (found again in the child by module and name).
        nproc: number of ranks, all on this machine.
        args, kwargs: passed to ``fn`` in every rank; they must pickle.
        timeout: seconds for the whole run, interpreter start-up included.
        env: extra environment variables for every rank; a ``None`` value removes one, a
            callable value is called with the rank (``str`` gives each rank its number).
        grace: seconds the other ranks get to finish after one fails.
    """
    if nproc < 1:
        raise ValueError(f'nproc must be >= 1, got {nproc}')
    qualname, module = getattr(fn, '__qualname__', ''), getattr(fn, '__module__', None)
    if not module or '<locals>' in qualname or '<lambda>' in qualname:
        raise ValueError(
            f'{fn!r} must be a function defined at module level, so the '
            'child process can import it by module and name'
        )
    payload = pickle.dumps(
        (
            module,
            qualname,
            getattr(sys.modules.get(module), '__file__', None),
            tuple(args),
            dict(kwargs or {}),
        )
    )
    for attempt in range(2):
        try:
            return _run_once(payload, nproc, timeout, env or {}, grace)
        except RankFailure as failure:
            # The free port can be taken between our probe and rank 0's bind: retry once.
            if attempt or not any(s in failure.output for s in _PORT_IN_USE):
                raise
    raise AssertionError('unreachable')


def _run_once(
    payload: bytes, nproc: int, timeout: float, extra: Mapping[str, Any], grace: float
) -> list[Any]:
    workdir = tempfile.mkdtemp(prefix='stratagem-dist-')
    procs: list[subprocess.Popen] = []
    try:
        with open(os.path.join(workdir, 'payload.pkl'), 'wb') as f:
            f.write(payload)
        port = free_port()
        pythonpath = [os.getcwd() if p == '' else p for p in sys.path]
        for rank in range(nproc):
            env = torchrun_env(rank, nproc, port)
            env['PYTHONPATH'] = os.pathsep.join(p for p in pythonpath if os.path.exists(p))
            for key, value in extra.items():
                if callable(value):
                    value = value(rank)
                if value is None:
                    env.pop(key, None)
                else:
                    env[key] = str(value)
            with open(os.path.join(workdir, f'rank{rank}.log'), 'wb') as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            '-c',
                            _BOOTSTRAP,
                            os.path.abspath(__file__),
                            workdir,
                            str(rank),
                        ],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        failed_order = _wait(procs, timeout, grace, workdir)
        return _collect(procs, failed_order, workdir)
    finally:
        for proc in procs:
            _kill(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait(procs: list[subprocess.Popen], timeout: float, grace: float, workdir: str) -> list[int]:
    """Poll until all ranks exit; return the failed ranks in the order they failed."""
    deadline = time.monotonic() + timeout
    failed: list[int] = []
    first_failure = None
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in failed:
                failed.append(rank)
                first_failure = first_failure or time.monotonic()
        running = [rank for rank, code in enumerate(codes) if code is None]
        if not running:
            return failed
        now = time.monotonic()
        if first_failure is not None and now - first_failure > grace:
            for rank in running:
                _kill(procs[rank])
            return failed
        if now > deadline:
            for proc in procs:
                _kill(proc)
            outputs = ''.join(
                f'\n--- rank {r} output tail ---\n{_tail(_read_log(workdir, r))}'
                for r in range(len(procs))
            )
            _echo(workdir, len(procs))
            raise TimeoutError(
                f'run_distributed timed out after {timeout:g} s; ranks still '
                f'running: {running} (killed){outputs}'
            )
        time.sleep(0.02)


def _collect(procs: list[subprocess.Popen], failed: list[int], workdir: str) -> list[Any]:
    _echo(workdir, len(procs))
    results = [_read_result(workdir, rank) for rank in range(len(procs))]
    if not failed:
        return [value for _, value, _ in results]
    # Report the rank that raised first (its result file is the oldest): the others often
    # fail only because it left a collective (a "connection reset" in gloo).
    raised = [r for r in failed if results[r][0] == 'error']
    first = min(raised, key=lambda r: _result_mtime(workdir, r)) if raised else failed[0]
    others = [r for r, p in enumerate(procs) if p.returncode != 0 and r != first]
    status, exc, tb = results[first]
    also = ''.join(
        f'\n  rank {r}: {_tail(results[r][2], 1).strip()}'
        for r in others
        if results[r][0] == 'error'
    )
    note = f'\n(ranks {others} also failed or were stopped){also}' if others else ''
    failure = RankFailure(
        first,
        tb if status == 'error' else '',
        _read_log(workdir, first),
        procs[first].returncode,
        note,
    )
    raise failure from (exc if isinstance(exc, BaseException) else None)


def _result_mtime(workdir: str, rank: int) -> int:
    try:
        return os.stat(os.path.join(workdir, f'rank{rank}.result')).st_mtime_ns
    except OSError:
        return 2**63


def _read_result(workdir: str, rank: int) -> tuple[str, Any, str]:
    path = os.path.join(workdir, f'rank{rank}.result')
    if not os.path.exists(path):
        return 'missing', None, ''
    with open(path, 'rb') as f:
        status, blob, tb = pickle.load(f)
    try:
        value = pickle.loads(blob) if blob is not None else None
    except Exception:  # noqa: BLE001 - an exception class the parent cannot import
        value = None
    return status, value, tb


def _read_log(workdir: str, rank: int) -> str:
    with contextlib.suppress(OSError):
        with open(os.path.join(workdir, f'rank{rank}.log'), 'rb') as f:
            return f.read().decode('utf-8', 'replace')
    return ''


def _echo(workdir: str, nproc: int) -> None:
    for rank in range(nproc):
        for line in _read_log(workdir, rank).splitlines():
            print(f'[rank {rank}] {line}')


def _tail(text: str, lines: int = 30) -> str:
    return '\n'.join(text.splitlines()[-lines:])


def _kill(proc: subprocess.Popen) -> None:
    """Kill a rank and whatever it started (its own session), then reap it.

    The group is killed even when the rank itself has exited: processes it started (data
    loader workers, helpers) stay in its group and would outlive the test otherwise. The
    group id cannot be reused while any member is alive, so this hits only ours.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _child_main(workdir: str, rank: int) -> None:
    """Entry point of a rank (run through ``_BOOTSTRAP``)."""
    status, blob, tb = 'ok', None, ''
    try:
        with open(os.path.join(workdir, 'payload.pkl'), 'rb') as f:
            module_name, qualname, file, args, kwargs = pickle.load(f)
        fn = _import_function(module_name, qualname, file)
        blob = pickle.dumps(fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        status, tb = 'error', traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            blob = None
    # the result file first: its mtime orders the failures, and destroying the group makes
    # the other ranks fail ("connection closed") at once, which must not look earlier
    tmp = os.path.join(workdir, f'rank{rank}.result.tmp')
    with open(tmp, 'wb') as f:
        pickle.dump((status, blob, tb), f)
    os.replace(tmp, os.path.join(workdir, f'rank{rank}.result'))
    _destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a stuck gloo/NCCL thread must not keep a rank alive.
    os._exit(0 if status == 'ok' else 1)


def _import_function(module_name: str, qualname: str, file: str | None) -> Callable[..., Any]:
    try:
        if module_name == '__main__':
            raise ImportError('a script run as __main__ is loaded from its file')
        module = importlib.import_module(module_name)
    except ImportError:
        if not file:
            raise
        # pytest's importlib mode, or a script: load the file itself. A script gets another
        # name so that its `if __name__ == '__main__':` block does not run again.
        if module_name == '__main__':
            module_name = '__stratagem_dist_main__'
        spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split('.'):
        obj = getattr(obj, part)
    return obj


def _destroy_process_group() -> None:
    dist = sys.modules.get('torch.distributed')
    if dist is not None and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
