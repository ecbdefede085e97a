"""A resume whose checkpoint was saved with another optimizer type stops before it changes
anything (torch would load SGD's groups into AdamW and fail at the first step with
KeyError: 'step', the model already overwritten)."""

import pytest
import torch
from torch import nn

from stratagem.strategies import SingleDeviceStrategy


def _prepared(tmp_path, optimizer):
    torch.manual_seed(0)
    s = SingleDeviceStrategy(work_dir=str(tmp_path))
    model, ow = s.prepare(nn.Linear(3, 2), optim_wrapper=dict(optimizer=optimizer))
    return s, model, ow


def test_resume_with_another_optimizer_type_changes_nothing(tmp_path):
    s, model, ow = _prepared(tmp_path, dict(type='SGD', lr=0.1, momentum=0.9))
    ow.update_params(model(torch.randn(4, 3)).sum())
    path = s.save_checkpoint('a.pth')
    s2, model2, _ = _prepared(tmp_path, dict(type='AdamW', lr=0.1))
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(ValueError, match=r"lack \['betas', 'eps'.*another optimizer type"):
        s2.resume(path)
    assert all(torch.equal(before[k], v) for k, v in model2.state_dict().items())


def test_resume_with_the_same_optimizer_type_passes(tmp_path):
    s, model, ow = _prepared(tmp_path, dict(type='AdamW', lr=0.1))
    ow.update_params(model(torch.randn(4, 3)).sum())
    path = s.save_checkpoint('a.pth')
    s2, model2, ow2 = _prepared(tmp_path, dict(type='AdamW', lr=0.1))
    s2.resume(path)
    ow2.update_params(model2(torch.randn(4, 3)).sum())
