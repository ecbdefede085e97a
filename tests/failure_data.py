"""A dataset for failure tests: deterministic samples that can slow a run down, signal their
own process, or fail once, at a given read. Imported by test configs by name (tests/ on
``PYTHONPATH``).

Environment (read on each sample): ``SLOW`` seconds per sample (``FAST_FILE``: none once
that file exists, so a test paces a run while it needs time and lets it finish at full
speed); ``SIGNAL_AT=N`` and
``SIGNAL=SIGUSR1`` (default): the process that reads its N-th sample sends itself that
signal (``SIGNAL_RANK``: only that rank); ``FAIL_AT=N`` with ``FAIL_RANK=R``: rank R raises
at its N-th read in the first attempt of a torchrun job (``TORCHELASTIC_RESTART_COUNT=0``);
``COUNT_DIR``: every read appends its index to ``COUNT_DIR/<pid>.txt``, and the first one
writes ``COUNT_DIR/<pid>.world``: ``"<rank> <world size>"``; ``HOLD_AT=N`` with
``HOLD_WORLD=W``: a process of a world of W processes stops at its N-th read until it gets
a preemption signal (a run kept from finishing while a test changes its membership).
"""

import os
import signal
import time

import torch
from torch.utils.data import Dataset


class FailureDataset(Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(3, (n,), generator=g)
        self.reads = 0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        self.reads += 1
        env = os.environ
        rank = env.get('RANK', '0')
        if env.get('SLOW') and not (env.get('FAST_FILE') and os.path.exists(env['FAST_FILE'])):
            time.sleep(float(env['SLOW']))
        if env.get('COUNT_DIR'):
            if self.reads == 1:
                with open(os.path.join(env['COUNT_DIR'], f'{os.getpid()}.world'), 'w') as f:
                    f.write(f'{rank} {env.get("WORLD_SIZE", "1")}\n')
            with open(os.path.join(env['COUNT_DIR'], f'{os.getpid()}.txt'), 'a') as f:
                f.write(f'{i}\n')
        if env.get('HOLD_AT') == str(self.reads) and env.get('HOLD_WORLD') == env.get(
            'WORLD_SIZE', '1'
        ):
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not _preempted():
                time.sleep(0.02)
        if env.get('SIGNAL_AT') == str(self.reads) and env.get('SIGNAL_RANK', rank) == rank:
            if env.get('COUNT_DIR'):  # when, for the soak's timings
                with open(os.path.join(env['COUNT_DIR'], 'signal.time'), 'w') as f:
                    f.write(f'{time.time()}\n')
            os.kill(os.getpid(), getattr(signal, env.get('SIGNAL', 'SIGUSR1')))
        if (
            env.get('FAIL_AT') == str(self.reads)
            and env.get('FAIL_RANK', '0') == rank
            and env.get('TORCHELASTIC_RESTART_COUNT', '0') == '0'
        ):
            raise RuntimeError(f'injected failure on rank {rank} at read {self.reads}')
        return self.x[i], self.y[i]


def _preempted() -> bool:
    """Whether the loop's ``Preemption`` recorded a signal (its handler is a bound method)."""
    handler = signal.getsignal(signal.SIGTERM)
    return getattr(getattr(handler, '__self__', None), 'received', None) is not None
