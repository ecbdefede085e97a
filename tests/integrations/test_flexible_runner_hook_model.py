"""The toy model and data of the PreemptionHook test (``tests/env/test_preemption.py``)."""

import torch
from torch import nn


def model():
    from mmengine.model import BaseModel

    class Toy(BaseModel):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, inputs, labels, mode='tensor'):
            out = self.linear(inputs)
            return {'loss': ((out - labels) ** 2).mean()} if mode == 'loss' else out

    torch.manual_seed(0)
    return Toy()


def dataset():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)
    return [dict(inputs=x[i], labels=y[i]) for i in range(32)]
