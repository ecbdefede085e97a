"""mmengine configs as they are: the top-level ``env_cfg`` (its nccl default on a machine
without CUDA), ``auto_scale_lr``, ``launcher``, ``log_level`` and ``experiment_name`` reach the
strategy under ``stratagem train``."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from stratagem.env import backend as launcher


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    monkeypatch.setattr(launcher, '_SAID_BACKEND_FALLBACK', set())


def test_nccl_default_becomes_gloo_said_once(no_cuda):
    cfg = dict(cudnn_benchmark=False, dist_cfg=dict(backend='nccl', timeout=60))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        first = launcher.mmengine_env_kwargs(cfg)
        second = launcher.mmengine_env_kwargs(cfg)
    assert first == second == dict(cudnn_benchmark=False, dist_cfg=dict(backend='gloo', timeout=60))
    assert cfg['dist_cfg']['backend'] == 'nccl'  # the config itself is not edited
    said = [str(w.message) for w in caught]
    assert len(said) == 1
    assert "env_cfg.dist_cfg.backend='nccl' (mmengine's default) needs CUDA" in said[0]


def test_other_backends_and_cuda_machines_are_left_alone(no_cuda, monkeypatch):
    gloo = dict(dist_cfg=dict(backend='gloo'))
    assert launcher.mmengine_env_kwargs(gloo) == gloo
    assert launcher.mmengine_env_kwargs(None) == {}
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    nccl = dict(dist_cfg=dict(backend='nccl'))
    assert launcher.mmengine_env_kwargs(nccl) == nccl


def test_a_backend_given_to_a_strategy_is_the_users_choice(no_cuda):
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA"):
        launcher.resolve_backend('nccl')


MMENGINE_STYLE = """
model = dict(type='MLPClassifier', in_features=16, num_classes=4, hidden=32)
train_dataloader = dict(
    dataset=dict(type='SyntheticClassification', num_samples=64, num_features=16,
                 num_classes=4),
    batch_size=8, shuffle=True)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
train_cfg = dict(max_iters=4)
# mmengine's default_runtime.py, unchanged
default_scope = 'mmengine'
env_cfg = dict(cudnn_benchmark=False, mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
               dist_cfg=dict(backend='nccl'))
auto_scale_lr = dict(enable=True, base_batch_size=4)
launcher = 'none'
log_level = 'WARNING'
experiment_name = 'mm_exp'
"""


def test_stratagem_train_reads_the_top_level_keys(tmp_path, no_cuda):
    from stratagem.config import Config
    from stratagem.loop import train

    path = tmp_path / 'mm_cfg.py'
    path.write_text(MMENGINE_STYLE)
    cfg = Config.fromfile(str(path))
    cfg['work_dir'] = str(tmp_path / 'work')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        result = train(cfg, progress=False)
    strategy = result['strategy']
    # launcher, log_level and experiment_name are the strategy's
    assert (strategy.launcher, strategy.experiment_name) == ('none', 'mm_exp')
    assert strategy.logger.level == logging.WARNING
    # one process x 8 samples / base 4: every lr doubled, once
    lrs = [g['lr'] for g in strategy.optim_wrapper.param_groups]
    assert lrs == [pytest.approx(0.2)]
    said = [str(w.message) for w in caught if 'needs CUDA' in str(w.message)]
    assert len(said) == 1 and "using 'gloo'" in said[0]  # the template's nccl, replaced
    # both given, differently: the strategy's wins, with a warning
    cfg['strategy'] = dict(type='auto', auto_scale_lr=dict(enable=False, base_batch_size=4))
    cfg['work_dir'] = str(tmp_path / 'work2')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        result = train(cfg, progress=False)
    assert [g['lr'] for g in result['strategy'].optim_wrapper.param_groups] == [0.1]
    assert any('auto_scale_lr is given twice' in str(w.message) for w in caught)
    # mmengine's top-level resume=True: continue from the newest checkpoint of work_dir
    cfg['resume'] = True
    cfg['train_cfg'] = dict(max_iters=6)
    result = train(cfg, progress=False)
    assert result['iter'] == 6 and result['losses'][0][0] > 4
    assert str(result['strategy'].resumed_from).endswith('iter_4.pth')


def _runner_shaped(backend: str) -> dict:
    """The kwargs mmengine's FlexibleRunner.build_strategy adds to a strategy dict."""
    return dict(
        env_kwargs=dict(launcher='none', randomness=dict(seed=3), dist_cfg=dict(backend=backend)),
        log_kwargs=dict(log_level='WARNING'),
    )


def _strategy_type(form: str):
    from stratagem.strategies import SingleDeviceStrategy

    class MySingleDevice(SingleDeviceStrategy):
        pass

    return {
        'scoped name': 'stratagem.SingleDeviceStrategy',
        'class object': SingleDeviceStrategy,
        'subclass': MySingleDevice,
    }[form]


@pytest.mark.parametrize('form', ['scoped name', 'class object', 'subclass'])
def test_flexible_runner_env_cfg_fitted_however_the_strategy_is_named(no_cuda, tmp_path, form):
    pytest.importorskip('mmengine')
    from mmengine.registry import STRATEGIES

    import stratagem.integrations.mmengine  # noqa: F401  (scoped names)

    cfg = dict(type=_strategy_type(form), work_dir=str(tmp_path), **_runner_shaped('nccl'))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        strategy = STRATEGIES.build(cfg)
    assert type(strategy).__name__ in ('SingleDeviceStrategy', 'MySingleDevice')
    said = [str(w.message) for w in caught if 'needs CUDA' in str(w.message)]
    assert len(said) == 1 and "using 'gloo'" in said[0], said
    # the strategy's own env_kwargs are the user's: never fitted, not even through mmengine
    own = dict(type=_strategy_type(form), work_dir=str(tmp_path), env_kwargs=dict(launcher='none'))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        STRATEGIES.build(own)
    assert not [w for w in caught if 'needs CUDA' in str(w.message)]


def test_runner_shape_is_what_is_fitted(no_cuda):
    shaped = _runner_shaped('nccl')
    with warnings.catch_warnings(record=True):
        warnings.simplefilter('always')
        fitted = launcher.fit_runner_env_kwargs(shaped['env_kwargs'], shaped['log_kwargs'])
    assert fitted['dist_cfg'] == dict(backend='gloo')
    # a backend the user wrote into the strategy's env_kwargs stays theirs, and an error
    mine = dict(dist_cfg=dict(backend='nccl'))
    for log_kwargs in (None, dict(log_level='INFO', file_mode='a')):
        assert launcher.fit_runner_env_kwargs(mine, log_kwargs) == mine
    mine = dict(launcher='pytorch', randomness=dict(seed=1), dist_cfg=dict(backend='nccl'))
    assert launcher.fit_runner_env_kwargs(mine, None) == mine
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA"):
        launcher.resolve_backend(mine['dist_cfg']['backend'])
