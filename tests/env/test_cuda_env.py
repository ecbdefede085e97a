"""The process environment on CUDA (skipped without a GPU; ``make gpu`` runs it): the device a
strategy takes from ``LOCAL_RANK``, and NCCL chosen and initialised from an mmengine
``env_cfg`` as mmengine's FlexibleRunner hands it over."""

import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device'),
]


def test_the_device_is_cuda_local_rank(clean_env, tmp_path):
    from torch import nn

    from stratagem.env import default_device
    from stratagem.strategies import SingleDeviceStrategy

    last = torch.cuda.device_count() - 1
    assert default_device() == torch.device('cuda', torch.cuda.current_device())
    clean_env['LOCAL_RANK'] = str(last)  # what torchrun sets for the last process of a node
    assert default_device() == torch.device('cuda', last)
    s = SingleDeviceStrategy(work_dir=str(tmp_path))
    model, _ = s.prepare(nn.Linear(4, 2), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)))
    assert s.device == torch.device('cuda', last)
    assert next(model.parameters()).device == torch.device('cuda', last)


def _nccl_from_env_cfg(work_dir):
    """One rank started as torchrun starts it: the env_kwargs FlexibleRunner builds from an
    mmengine env_cfg saying nccl, through a DDPStrategy; no warning, nccl, a CUDA all-reduce."""
    import torch.distributed as dist

    from stratagem.env.backend import fit_runner_env_kwargs, resolve_backend
    from stratagem.strategies import DDPStrategy

    env_cfg = dict(cudnn_benchmark=False, dist_cfg=dict(backend='nccl'))
    runner_kwargs = dict(launcher='pytorch', randomness=dict(seed=0), **env_cfg)
    with warnings.catch_warnings():
        # nccl stays nccl where CUDA is: no fallback to gloo, no word about it
        warnings.filterwarnings('error', message='.*dist_cfg.backend')
        env_kwargs = fit_runner_env_kwargs(runner_kwargs, dict(log_level='INFO'))
        s = DDPStrategy(work_dir=work_dir, env_kwargs=env_kwargs, log_kwargs=dict(log_level='INFO'))
    x = torch.ones(3, device=s.device)
    dist.all_reduce(x)
    return dict(
        chosen=resolve_backend(None),
        kwargs=env_kwargs['dist_cfg'],
        backend=dist.get_backend(),
        device=str(s.device),
        sum=x.tolist(),
    )


def test_nccl_from_an_mmengine_env_cfg(tmp_path):
    from dist_harness import run_distributed

    (r,) = run_distributed(_nccl_from_env_cfg, nproc=1, args=(str(tmp_path),), timeout=180)
    assert r == dict(
        chosen='nccl',
        kwargs={'backend': 'nccl'},
        backend='nccl',
        device='cuda:0',
        sum=[1.0, 1.0, 1.0],
    )
