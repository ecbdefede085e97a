"""A dataset that records every index it serves (one file per process), for tests that count
the samples a run reads. Imported by test configs by name (tests/ on ``PYTHONPATH``)."""

import os

import torch
from torch.utils.data import Dataset


class CountingDataset(Dataset):
    """``n`` deterministic samples (8 features, 3 classes); each read appends its index to
    ``$COUNT_DIR/<pid>.txt``."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        with open(os.path.join(os.environ['COUNT_DIR'], f'{os.getpid()}.txt'), 'a') as f:
            f.write(f'{i}\n')
        return self.x[i], self.y[i]


def read_counts(count_dir: str) -> list[list[int]]:
    """The indices each process read, in order, one list per file."""
    out = []
    for name in sorted(os.listdir(count_dir)):
        with open(os.path.join(count_dir, name)) as f:
            out.append([int(line) for line in f if line.strip()])
    return out
