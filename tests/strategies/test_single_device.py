"""SingleDeviceStrategy and the BaseStrategy sequence: prepare, state dicts, checkpoints, errors."""

import logging
import os

import pytest
import torch
from torch import nn

from stratagem.strategies import BaseStrategy, SingleDeviceStrategy, build_strategy


def make_strategy(tmp_path, **kwargs):
    kwargs.setdefault('env_kwargs', dict(randomness=dict(seed=7)))
    return SingleDeviceStrategy(work_dir=str(tmp_path), **kwargs)


OPTIM = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))


def test_prepare_shapes_and_keeps_components(tmp_path):
    s = make_strategy(tmp_path)
    model = s.prepare(nn.Linear(2, 2))
    assert isinstance(model, nn.Linear) and s.model is model
    s = make_strategy(tmp_path)
    model, ow = s.prepare(nn.Linear(2, 2), optim_wrapper=OPTIM)
    assert s.optim_wrapper is ow and ow.get_lr() == {'lr': [0.1]}
    s = make_strategy(tmp_path)
    model, ow, scheds = s.prepare(
        dict(type='MLPClassifier', in_features=4, num_classes=2, hidden=8),
        optim_wrapper=OPTIM,
        param_scheduler=dict(type='MultiStepLR', milestones=[1], gamma=0.5, by_epoch=False),
        dispatch_kwargs=dict(max_iters=4),
    )
    assert len(scheds) == 1 and s.param_schedulers is scheds
    scheds[0].step()
    assert ow.get_lr()['lr'] == [pytest.approx(0.05)]
    # a second prepare returns what the first built
    again = s.prepare(nn.Linear(1, 1))
    assert again[0] is model and again[1] is ow


def test_properties_and_seed(tmp_path):
    s = make_strategy(tmp_path, experiment_name='exp')
    assert (s.seed, s.rank, s.world_size, s.distributed, s.launcher) == (7, 0, 1, False, 'none')
    assert s.experiment_name == 'exp' and s.work_dir == str(tmp_path)
    assert s.log_dir == os.path.join(str(tmp_path), s.timestamp)
    assert s.randomness == {'seed': 7}
    assert os.path.isfile(os.path.join(s.log_dir, f'{s.timestamp}.log'))
    a = torch.rand(3)
    make_strategy(tmp_path)
    assert torch.equal(torch.rand(3), a)


def test_bad_inputs_name_what_is_wrong(tmp_path):
    with pytest.raises(
        KeyError, match="unknown type 'SingleDevise'.*did you mean 'SingleDeviceStrategy'"
    ):
        build_strategy(dict(type='SingleDevise'))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['launchr'\] in env_kwargs"):
        make_strategy(tmp_path, env_kwargs=dict(launchr='none'))
    s = make_strategy(tmp_path)
    with pytest.raises((KeyError, TypeError), match="optimizer must be a dict with a 'type' key"):
        s.prepare(nn.Linear(2, 2), optim_wrapper=dict(optimizer=dict(lr=0.1)))
    s = make_strategy(tmp_path)
    with pytest.raises(ValueError, match='param_scheduler was given without optim_wrapper'):
        s.prepare(nn.Linear(2, 2), param_scheduler=[dict(type='ConstantLR')])
    s = make_strategy(tmp_path)
    with pytest.raises(TypeError, match='should be an nn.Module or a MODELS cfg dict'):
        s.prepare('resnet')
    s = make_strategy(tmp_path)
    s.prepare(nn.Linear(2, 2), optim_wrapper=OPTIM)
    with pytest.raises(FileNotFoundError, match='nope.pth'):
        s.load_checkpoint(str(tmp_path / 'nope.pth'))
    text = tmp_path / 'notes.pth'
    text.write_text('hello, not a checkpoint')
    with pytest.raises(ValueError, match='notes.pth'):
        s.load_checkpoint(str(text))


def test_auto_strategy_picks_single_device(tmp_path):
    s = build_strategy(dict(type='auto', work_dir=str(tmp_path)))
    assert type(s) is SingleDeviceStrategy and isinstance(s, BaseStrategy)


def test_auto_scale_lr_counts_accumulation_once(tmp_path):
    s = make_strategy(tmp_path, auto_scale_lr=dict(enable=True, base_batch_size=16))
    _, ow = s.prepare(
        nn.Linear(2, 2),
        optim_wrapper=dict(OPTIM, accumulative_counts=2),
        dispatch_kwargs=dict(max_iters=10, train_micro_batch_size_per_gpu=4),
    )
    # real batch = 1 process x 4 x 2 accumulated = 8 -> 0.1 * 8 / 16
    assert ow.get_lr()['lr'] == [pytest.approx(0.05)]
    path = s.save_checkpoint('a.pth', extra_ckpt={'meta': {'iter': 0}})
    s2 = make_strategy(tmp_path, auto_scale_lr=dict(enable=True, base_batch_size=16))
    _, ow2 = s2.prepare(
        nn.Linear(2, 2),
        optim_wrapper=dict(OPTIM, accumulative_counts=2),
        dispatch_kwargs=dict(max_iters=10, train_micro_batch_size_per_gpu=4),
    )
    s2.resume(path)
    assert ow2.get_lr()['lr'] == [pytest.approx(0.05)]  # not scaled a second time
    with pytest.raises(ValueError, match='train_micro_batch_size_per_gpu'):
        make_strategy(tmp_path, auto_scale_lr=dict(enable=True, base_batch_size=16)).prepare(
            nn.Linear(2, 2), optim_wrapper=OPTIM
        )


def test_accumulation_without_length_is_an_error(tmp_path):
    with pytest.raises(ValueError, match='max_iters'):
        make_strategy(tmp_path).prepare(
            nn.Linear(2, 2), optim_wrapper=dict(OPTIM, accumulative_counts=4)
        )


def test_sync_batchnorm_is_reverted(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))
    with torch.no_grad():
        model[1].running_mean.fill_(2.0)
        model[1].weight.fill_(3.0)
    s = make_strategy(tmp_path)
    model = s.prepare(model)
    bn = model[1]
    assert not isinstance(bn, nn.SyncBatchNorm) and isinstance(bn, nn.modules.batchnorm._BatchNorm)
    assert torch.equal(bn.running_mean, torch.full((4,), 2.0))
    assert torch.equal(bn.weight.detach(), torch.full((4,), 3.0))
    out = model(torch.randn(5, 4))
    assert out.shape == (5, 4)


def test_checkpoint_round_trip_and_ddp_prefix(tmp_path):
    s = make_strategy(tmp_path)
    model, ow = s.prepare(nn.Linear(3, 2), optim_wrapper=OPTIM)
    model(torch.randn(4, 3)).sum().backward()
    ow.step()
    path = s.save_checkpoint('ck.pth', extra_ckpt={'meta': {'iter': 5, 'epoch': 1}})
    assert path == str(tmp_path / 'ck.pth')
    sd = torch.load(path, weights_only=True)
    assert sd['meta']['iter'] == 5 and sd['meta']['seed'] == 7
    assert set(sd) >= {'meta', 'state_dict', 'optimizer', 'rng_states'}
    s2 = make_strategy(tmp_path)
    model2, ow2 = s2.prepare(nn.Linear(3, 2), optim_wrapper=OPTIM)
    s2.load_checkpoint(path)
    assert torch.equal(model2.weight, model.weight)
    # a DDP-style checkpoint ('module.' prefixes) loads through the default revise_keys
    prefixed = {'state_dict': {f'module.{k}': v for k, v in model.state_dict().items()}}
    torch.save(prefixed, tmp_path / 'ddp.pth')
    s3 = make_strategy(tmp_path)
    model3 = s3.prepare(nn.Linear(3, 2))
    with pytest.warns(UserWarning):
        s3.load_checkpoint(str(tmp_path / 'ddp.pth'), strict=True)
    assert torch.equal(model3.bias, model.bias)


def test_strict_load_reports_missing_unexpected_and_shapes(tmp_path):
    s = make_strategy(tmp_path)
    s.prepare(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)))
    path = s.save_checkpoint('x.pth')
    s2 = make_strategy(tmp_path)
    s2.prepare(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 1)))
    with pytest.raises(RuntimeError) as info:
        s2.load_checkpoint(path, strict=True)
    msg = str(info.value)
    assert '2.weight' in msg and '0.weight' in msg and 'missing' in msg.lower()


def test_compile_target_method(tmp_path):
    s = make_strategy(tmp_path)
    model = s.prepare(nn.Linear(2, 2), compile=dict(target='forward', backend='eager'))
    x = torch.randn(3, 2)
    assert torch.allclose(model(x), x @ model.weight.T + model.bias)
    with pytest.raises(ValueError, match="compile target 'nope'"):
        make_strategy(tmp_path).prepare(nn.Linear(2, 2), compile=dict(target='nope'))


def test_load_or_resume_latest(tmp_path):
    s = make_strategy(tmp_path)
    model, ow = s.prepare(nn.Linear(2, 2), optim_wrapper=OPTIM)
    assert s.load_or_resume(resume=True) is None  # nothing to resume: fresh start
    s.save_checkpoint('iter_1.pth', extra_ckpt={'meta': {'iter': 1}})
    with torch.no_grad():
        model.weight.add_(1.0)
    s.save_checkpoint('iter_2.pth', extra_ckpt={'meta': {'iter': 2}})
    s2 = make_strategy(tmp_path)
    model2, _ = s2.prepare(nn.Linear(2, 2), optim_wrapper=OPTIM)
    ckpt = s2.load_or_resume(resume=True)
    assert ckpt['meta']['iter'] == 2 and torch.equal(model2.weight, model.weight)
    assert s2.resumed_from == str(tmp_path / 'iter_2.pth')


def test_prebuilt_optimizer_stays_connected_to_the_model(tmp_path):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = make_strategy(tmp_path)
    model, ow = s.prepare(model, optim_wrapper=dict(optimizer=opt))
    assert ow.optimizer is opt
    before = model.weight.detach().clone()
    ow.update_params(model(torch.ones(1, 2)).sum())
    assert torch.allclose(model.weight, before - 0.1)


def test_resume_without_optimizer_still_aligns_accumulation(tmp_path):
    def build():
        s = make_strategy(tmp_path)
        model, ow = s.prepare(
            nn.Linear(2, 1, bias=False),
            optim_wrapper=dict(OPTIM, accumulative_counts=2),
            dispatch_kwargs=dict(max_iters=5),
        )
        return s, model, ow

    s, model, ow = build()
    for _ in range(2):
        ow.update_params(model(torch.ones(1, 2)).sum())
    path = s.save_checkpoint('a.pth', extra_ckpt={'meta': {'iter': 2}})
    s2, model2, ow2 = build()
    s2.resume(path, resume_optimizer=False)
    assert ow2.inner_count == 2
    for _ in range(3):  # iterations 2, 3 (a full window) and 4 (the 1-long tail): all stepped
        ow2.update_params(model2(torch.ones(1, 2)).sum())
    assert all(p.grad is None for p in model2.parameters())


def test_resume_checks_keys_before_loading_anything(tmp_path):
    s = make_strategy(tmp_path)
    model, _ = s.prepare(nn.Linear(2, 2), optim_wrapper=OPTIM)
    torch.save(
        {'state_dict': {k: v + 1 for k, v in model.state_dict().items()}},
        tmp_path / 'weights_only.pth',
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning), pytest.raises(KeyError, match=r"has no \['optimizer'\]"):
        s.resume(str(tmp_path / 'weights_only.pth'))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # an mmengine-style checkpoint without 'meta' resumes when the parts asked for are there
    torch.save(
        {'state_dict': model.state_dict(), 'optimizer': s.optim_state_dict()},
        tmp_path / 'nometa.pth',
    )
    with pytest.warns(UserWarning):
        ck = s.resume(str(tmp_path / 'nometa.pth'))
    assert 'meta' not in ck


def test_bad_checkpoint_content_fails_before_writing(tmp_path):
    s = make_strategy(tmp_path)
    s.prepare(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"checkpoint\['meta'\]\['fn'\] is a function"):
        s.save_checkpoint('bad.pth', extra_ckpt={'meta': {'fn': lambda: 1}})
    assert not (tmp_path / 'bad.pth').exists()


class WithInitWeights(nn.Linear):
    def init_weights(self):
        with torch.no_grad():
            self.weight.fill_(0.25)


def test_prepare_calls_init_weights_and_collect_env_shape(tmp_path):
    s = make_strategy(tmp_path)
    model = s.prepare(WithInitWeights(3, 3))
    assert torch.equal(model.weight, torch.full((3, 3), 0.25))
    system, runtime = s.collect_env()
    assert 'Python' in ' '.join(system) or any('python' in k.lower() for k in system)
    assert runtime['seed'] == 7 and runtime['world_size'] == 1


def test_whole_model_compile_keeps_plain_checkpoint_keys(tmp_path):
    s = make_strategy(tmp_path)
    s.prepare(nn.Linear(2, 2), compile=dict(backend='eager'))
    path = s.save_checkpoint('c.pth')
    assert sorted(torch.load(path, weights_only=True)['state_dict']) == ['bias', 'weight']


def test_demo_refuses_a_work_dir_with_foreign_files(tmp_path, capsys):
    from stratagem.cli import main

    precious = tmp_path / 'precious'
    precious.mkdir()
    (precious / 'my_notes.txt').write_text('data')
    assert main(['demo', '--work-dir', str(precious)]) == 1  # the CLI prints the error
    err = capsys.readouterr().err
    assert err.startswith('stratagem: error: ') and 'my_notes.txt' in err
    assert 'FileExistsError' in err
    assert (precious / 'my_notes.txt').read_text() == 'data'


def test_a_device_this_machine_lacks_is_refused_before_setup(tmp_path):
    work = tmp_path / 'never_created'
    with pytest.raises(ValueError) as info:
        SingleDeviceStrategy(device='gpu', work_dir=str(work))
    message = str(info.value)
    assert "device='gpu' is not a device name (did you mean 'cuda'?)" in message
    assert "'cpu', 'cuda', 'cuda:N' or 'mps'" in message and 'this machine has: cpu' in message
    beyond = f'cuda:{torch.cuda.device_count()}'
    pattern = (
        f"device='{beyond}': there are only"
        if torch.cuda.is_available()
        else f"device='{beyond}', but (this torch was built without CUDA|torch .* sees no GPU)"
    )
    with pytest.raises(ValueError, match=pattern):
        SingleDeviceStrategy(device=beyond, work_dir=str(work))
    assert not work.exists()  # refused before the environment, the logger or any file
    assert SingleDeviceStrategy(device='cpu', work_dir=str(tmp_path)).device.type == 'cpu'


def test_eval_step_is_the_loss_without_a_step(tmp_path):
    s = make_strategy(tmp_path)
    model, ow = s.prepare(nn.Linear(4, 3), optim_wrapper=OPTIM)
    x, y = torch.randn(6, 4), torch.randint(3, (6,))
    before = [p.detach().clone() for p in model.parameters()]
    loss = s.eval_step(x, y, nn.functional.cross_entropy)
    with torch.no_grad():
        assert torch.equal(loss, nn.functional.cross_entropy(model(x), y))
    assert not loss.requires_grad and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # without loss_fn the model's own loss, as train_step takes it
    s = make_strategy(tmp_path)
    own = s.prepare(dict(type='MLPClassifier', in_features=4, num_classes=3, hidden=8))
    with torch.no_grad():
        assert torch.equal(s.eval_step(x, y), own(x, y)['loss'])


def test_runs_of_one_second_keep_their_own_logs(tmp_path, monkeypatch):
    """A quick restart in the same second gets its own log folder, never the earlier run's
    (whose .log it would truncate)."""
    import time

    monkeypatch.setattr(time, 'strftime', lambda fmt, *a: '20261128_101010')
    first = make_strategy(tmp_path)
    logging.getLogger('stratagem').warning('first run')
    second = make_strategy(tmp_path)
    logging.getLogger('stratagem').warning('second run')
    assert (first.timestamp, second.timestamp) == ('20261128_101010', '20261128_101010_1')
    with open(os.path.join(first.log_dir, f'{first.timestamp}.log')) as log:
        assert 'first run' in log.read()
