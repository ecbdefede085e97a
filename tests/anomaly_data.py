"""A dataset for the anomaly tests (``train_cfg.anomaly``): deterministic samples, some of
them poisoned (NaN inputs, or a loss spike through huge inputs) on one rank only, or left
out altogether (the oracle runs). Imported by test configs by name (tests/ on
``PYTHONPATH``; in-process runs pass the class)."""

import os

import torch
from torch.utils.data import Dataset


class PoisonedDataset(Dataset):
    """``n`` samples of 8 features and 3 classes. ``poison``: sample indices whose inputs
    are NaN (``scale`` None) or multiplied by ``scale`` (a loss spike), on rank ``rank``
    only (None: every rank; the rank is ``RANK`` of the environment); ``drop``: indices left
    out of the dataset (the later ones move up)."""

    def __init__(self, n=64, poison=(), rank=None, scale=None, drop=()):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(3, (n,), generator=g)
        self.index = [i for i in range(n) if i not in set(drop)]
        self.poison, self.rank, self.scale = set(poison), rank, scale

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        i = self.index[i]
        x = self.x[i]
        here = self.rank is None or int(os.environ.get('RANK', '0')) == self.rank
        if i in self.poison and here:
            x = torch.full_like(x, float('nan')) if self.scale is None else x * self.scale
        return x, self.y[i]
