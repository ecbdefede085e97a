"""Helpers shared by the checkpoint tests (a module of its own: conftest names collide
across test folders)."""

import torch


def make_state(value: float = 1.0, size: int = 64) -> dict:
    """A small mmengine-shaped checkpoint whose tensors all carry ``value``."""
    return {
        'meta': {
            'epoch': 3,
            'iter': 120,
            'cfg': 'model = dict(type="Net")',
            'seed': 7,
            'dtype': torch.float32,
            'shape': torch.Size([2, 3]),
            'tags': ('a', 'b'),
        },
        'state_dict': {
            'fc.weight': torch.full((size, size), value),
            'fc.bias': torch.full((size,), value),
            'bn.num_batches_tracked': torch.tensor(5),
        },
        'optimizer': {
            'state': {0: {'momentum_buffer': torch.full((size, size), value)}},
            'param_groups': [{'lr': 0.1, 'momentum': 0.9, 'params': [0, 1]}],
        },
        'rng': {'torch': torch.get_rng_state(), 'python': [3, (1, 2, 3), None]},
    }
