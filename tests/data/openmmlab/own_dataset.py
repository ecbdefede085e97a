# a dataset of the config's own, registered from the config file itself
import torch
from torch.utils.data import Dataset

from stratagem.registry import DATASETS

_base_ = ['_base_/models/mlp.py', '_base_/default_runtime.py']


@DATASETS.register_module(force=True)
class OwnConfigBlobs(Dataset):
    def __init__(self, num_samples=16):
        g = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(num_samples, 8, generator=g)
        self.targets = torch.randint(4, (num_samples,), generator=g)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.inputs[i], self.targets[i]


def _double(x):
    return 2 * x


train_dataloader = dict(batch_size=_double(2), dataset=dict(type='OwnConfigBlobs'))
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1))
train_cfg = dict(max_iters=2)
