"""The model API a host trainer's loop calls (mmengine's ``train_step`` / ``val_step`` /
``test_step``): ``prepare`` gives it to the backend's wrapper once, for every backend, also
under ``torch.compile``."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stratagem.strategies.model_api import expose_model_api, split_compile

OPTIM = dict(optimizer=dict(type='SGD', lr=0.1))


class Net(nn.Module):
    """mmengine's model conventions, duck-typed: ``data_preprocessor``, ``parse_losses``,
    ``forward(..., mode=)`` and its own steps (which a wrapper must not call for training)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 1)
        self.own_train_steps = 0

    def data_preprocessor(self, data, training=False):
        return {'x': data['x'] * 2, 'y': data['y']}

    def parse_losses(self, losses):
        return losses['loss'], {'loss': losses['loss'].detach()}

    def forward(self, x, y=None, mode='tensor'):
        out = self.fc(x)
        return {'loss': F.mse_loss(out, y)} if mode == 'loss' else out

    def train_step(self, data, optim_wrapper):
        self.own_train_steps += 1
        return {}

    def val_step(self, data):
        return ('val', float(data['x'].sum()))

    def test_step(self, data):
        return ('test', float(data['x'].sum()))


DATA = {'x': torch.arange(6.0).reshape(2, 3) / 6, 'y': torch.ones(2, 1)}


def _expected_weight():
    net = Net()
    with torch.no_grad():
        x = net.data_preprocessor(DATA)['x']
    loss = F.mse_loss(net.fc(x), DATA['y'])
    loss.backward()
    return net.fc.weight.detach() - 0.1 * net.fc.weight.grad


@pytest.fixture
def one_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / 'store'), 1)
    dist.init_process_group('gloo', store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _forward_calls(module):
    calls = []
    module.register_forward_pre_hook(lambda m, args: calls.append(type(m).__name__))
    return calls


def test_ddp_wrapper_steps_through_itself(one_rank_group, tmp_path):
    from stratagem.strategies import DDPStrategy

    s = DDPStrategy(work_dir=str(tmp_path))
    model, ow = s.prepare(Net(), optim_wrapper=OPTIM)
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    calls = _forward_calls(model)
    log_vars = model.train_step(DATA, optim_wrapper=ow)
    # the forward ran through DDP (its gradient hooks), not the module's own train_step
    assert calls == ['DistributedDataParallel'] and model.module.own_train_steps == 0
    assert set(log_vars) == {'loss'}
    torch.testing.assert_close(model.module.fc.weight, _expected_weight())
    assert model.val_step(DATA) == ('val', 2.5) and model.test_step(DATA) == ('test', 2.5)


def test_whole_model_compile_keeps_the_api_on_the_ddp_wrapper(one_rank_group, tmp_path):
    from stratagem.strategies import DDPStrategy

    s = DDPStrategy(work_dir=str(tmp_path))
    model, ow = s.prepare(Net(), optim_wrapper=OPTIM, compile=dict(backend='eager'))
    assert type(model).__name__ == 'OptimizedModule'
    ddp = vars(model)['_modules']['_orig_mod']
    assert isinstance(ddp, nn.parallel.DistributedDataParallel)
    assert 'train_step' in vars(ddp) and 'train_step' not in vars(model)
    assert model.train_step.__self__ is ddp
    model.train_step(DATA, optim_wrapper=ow)
    torch.testing.assert_close(ddp.module.fc.weight, _expected_weight())


def test_compile_target_train_step_compiles_the_wrappers_method(one_rank_group, tmp_path):
    """mmengine's runner compiles ``train_step``; under DDP that is the wrapper's (exposed)
    one, so the target is compiled once the API is there."""
    from stratagem.strategies import DDPStrategy

    s = DDPStrategy(work_dir=str(tmp_path))
    model, ow = s.prepare(
        Net(), optim_wrapper=OPTIM, compile=dict(target='train_step', backend='eager')
    )
    step = vars(model)['train_step']
    assert not hasattr(step, '__self__')  # torch.compile's function, no longer the method
    calls = _forward_calls(model)
    model.train_step(DATA, optim_wrapper=ow)
    assert calls == ['DistributedDataParallel'] and model.module.own_train_steps == 0
    torch.testing.assert_close(model.module.fc.weight, _expected_weight())


def test_one_device_keeps_the_modules_own_steps(tmp_path):
    from stratagem.strategies import SingleDeviceStrategy

    for compile in (False, dict(backend='eager')):
        s, net = SingleDeviceStrategy(work_dir=str(tmp_path)), Net()
        model, ow = s.prepare(net, optim_wrapper=OPTIM, compile=compile)
        model.train_step(DATA, optim_wrapper=ow)
        assert net.own_train_steps == 1, compile


def test_expose_adds_only_what_the_wrapper_lacks():
    net = Net()
    assert expose_model_api(net, net) == []

    class Wrapper(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def val_step(self, data):  # the wrapper's own: kept
            return 'wrapper'

    wrapped = Wrapper(copy.deepcopy(net))
    assert expose_model_api(wrapped, wrapped.module) == ['train_step', 'test_step']
    assert wrapped.val_step(DATA) == 'wrapper'
    assert type(wrapped) is Wrapper  # an instance attribute, not a class change
    assert expose_model_api(wrapped, wrapped.module) == []  # already there: nothing twice


def test_split_compile():
    assert split_compile(True) == (True, False)
    assert split_compile(dict(target='forward')) == (dict(target='forward'), False)
    assert split_compile(dict(target='train_step')) == (False, dict(target='train_step'))
    assert split_compile(False) == (False, False)
