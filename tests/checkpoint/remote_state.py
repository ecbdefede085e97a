"""The small model both object-storage test files train, save and compare
(test_ckpt_remote.py: one file at a URL; test_ckpt_remote_dirs.py: directories)."""

import io

import torch
from torch import nn

from stratagem.strategies import SingleDeviceStrategy

OPTIM = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))


def prepared(work_dir):
    s = SingleDeviceStrategy(work_dir=str(work_dir), env_kwargs=dict(randomness=dict(seed=1)))
    torch.manual_seed(0)
    out = s.prepare(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        optim_wrapper=OPTIM,
        param_scheduler=[dict(type='ConstantLR')],
        dispatch_kwargs=dict(max_iters=10),
    )
    return s, out[0], out[1]


def train(model, optim_wrapper, steps):
    for _ in range(steps):
        optim_wrapper.update_params(model(torch.randn(3, 4)).square().mean())


def state_bytes(model, optim_wrapper):
    buffer = io.BytesIO()
    torch.save({'model': model.state_dict(), 'optim': optim_wrapper.state_dict()}, buffer)
    return buffer.getvalue()
