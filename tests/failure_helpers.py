"""Helpers for the failure tests (``tests/test_failures.py``, ``tests/test_elastic.py``), the
runs of several pods (``tests/test_pods.py``) and
``benchmarks/failure_soak.py``: a small 2-process ``stratagem train`` run, its worker
processes by rank, processes that must end together, and a comparison of final
checkpoints; a ``stratagem lighthouse`` for the replica groups' tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from launcher_env import without_launcher

TESTS = Path(__file__).resolve().parent
N, BATCH, EPOCHS, ACC = 64, 4, 4, 2
ITERS_2 = EPOCHS * N // (2 * BATCH)  # 32 iterations on 2 processes
CONFIG = f"""
model = dict(type='MLPClassifier', in_features=8, num_classes=3, hidden=16, dropout=0.2)
train_dataloader = dict(dataset=__import__('failure_data').FailureDataset({N}),
                        batch_size={BATCH}, shuffle=True, num_workers=0)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
                     accumulative_counts={ACC})
param_scheduler = [dict(type='LinearLR', start_factor=0.1, by_epoch=False, end=4),
                   dict(type='CosineAnnealingLR', by_epoch=False, eta_min=0.001)]
train_cfg = dict(max_epochs={EPOCHS}, checkpoint_interval=5, log_interval=4)
randomness = dict(seed=7)
strategy = dict(type='auto', checkpoint_timeout=30,
                env_kwargs=dict(dist_cfg=dict(backend='gloo', timeout=60)))
"""


def write_config(directory: Path, text: str = CONFIG) -> Path:
    path = Path(directory) / 'cfg.py'
    path.write_text(text)
    return path


def clean_env(**extra: str) -> dict:
    """This environment without launcher variables, with the repository and tests/ (the
    config's ``failure_data``) importable."""
    env = without_launcher()
    env.update(
        OMP_NUM_THREADS='1',
        GLOO_SOCKET_IFNAME='lo',
        PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), env.get('PYTHONPATH', '')]),
    )
    env.update(extra)
    return env


def start(
    cfg: Path,
    work_dir: Path,
    *args: str,
    env: dict | None = None,
    out: Path | None = None,
    **kw,
) -> subprocess.Popen:
    """``stratagem train cfg --work-dir work_dir *args`` started, its output in a pipe or in
    the file ``out`` (a long run's: a pipe nobody reads would fill and stall it)."""
    command = [sys.executable, '-m', 'stratagem', 'train', str(cfg), '--work-dir', str(work_dir)]
    with contextlib.ExitStack() as stack:
        stdout = subprocess.PIPE if out is None else stack.enter_context(Path(out).open('w'))
        return subprocess.Popen(
            [*command, *args],
            env=env or clean_env(),
            stdout=stdout,
            stderr=subprocess.STDOUT,
            text=True,
            **kw,
        )


class Lighthouse:
    """``stratagem lighthouse`` in a process of its own (a free port; a group that misses its
    heartbeats for 1 s is dropped); ``address`` once it serves (read on first use, so that
    several start at once)."""

    def __init__(self, min_replicas: int = 1) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, '-m', 'stratagem', 'lighthouse', '--port', '0']
            + ['--min-replicas', str(min_replicas), '--join-timeout', '0.5']
            + ['--heartbeat-timeout', '1'],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._address: str | None = None

    @property
    def address(self) -> str:
        if self._address is None:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            match = re.match(r'lighthouse: (\S+)', line)
            assert match, f'no address from the lighthouse: {line!r}'
            self._address = match.group(1)
        return self._address

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError('run did not end in time:\n' + out[-4000:]) from None
    return proc.returncode, out


def end_together(procs: dict, timeout: float = 240, grace: float = 5) -> dict:
    """Wait for every process of ``procs`` (key -> Popen, each in a session of its own) and
    return their exit codes by key (None: still running when the wait ended). One that fails
    ends the wait ``grace`` seconds later: the others would wait for it up to their
    rendezvous timeout. Every process group is killed at the end."""
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            if failed_at is None and any(p.poll() for p in procs.values()):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + grace:
                break
            time.sleep(0.1)
    finally:
        codes = {key: p.poll() for key, p in procs.items()}
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the process and what it started
            proc.wait()
    return codes


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f'/proc/{pid}/task'):
            with open(f'/proc/{pid}/task/{task}/children') as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def kill_tree(pid: int, sig: int = 9) -> None:
    for child in children(pid):
        kill_tree(child, sig)
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _environ(pid: int) -> dict:
    try:
        with open(f'/proc/{pid}/environ', 'rb') as f:
            items = f.read().split(b'\0')
    except OSError:
        return {}
    return dict(i.decode(errors='replace').split('=', 1) for i in items if b'=' in i)


def workers(root: int, count: int = 2, timeout: float = 120) -> dict[int, int]:
    """``{rank: pid}`` of the torchrun workers below process ``root`` (waits for ``count``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found: dict[int, int] = {}
        stack = [root]
        while stack:
            pid = stack.pop()
            env = _environ(pid)
            if 'LOCAL_RANK' in env and 'RANK' in env and env.get('TORCHELASTIC_RUN_ID'):
                found.setdefault(int(env['RANK']), pid)
                continue
            stack += children(pid)
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f'{count} workers did not start below {root}')


def reads(count_dir: Path, pid: int) -> int:
    """How many samples worker ``pid`` read so far."""
    try:
        with open(Path(count_dir) / f'{pid}.txt') as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def wait_reads(count_dir: Path, pid: int, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while reads(count_dir, pid) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f'worker {pid} did not read {n} samples')
        time.sleep(0.005)


def final_state(work_dir: Path, it: int = ITERS_2) -> dict:
    ckpt = torch.load(Path(work_dir) / f'iter_{it}.pth', weights_only=True)
    return {k: ckpt[k] for k in ('state_dict', 'optimizer', 'param_schedulers')} | {
        'iter': ckpt['meta']['iter']
    }


def equal(a, b) -> bool:
    """Bit-exact equality of nested checkpoint values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b
