"""#42 under mmengine's FlexibleRunner: ``default_hooks.checkpoint.out_dir`` at an S3 URL (the
real local S3 server) with ``backend_args``, through ``stratagem train``'s route
(``mmengine_runner.train_with_flexible_runner``): the checkpoints, their manifests and the
pointer in the bucket, the pointer in the work_dir, mmengine's retention deleting object and
manifest, and a resume in an empty work_dir from the bucket alone, to the tensors of the
uninterrupted run."""

import pytest
import torch

from stratagem.checkpoint import location

pytest.importorskip('mmengine', reason='mmengine is not installed (pip install "stratagem[test]")')


def _model_type():
    from mmengine.model import BaseModel
    from mmengine.registry import MODELS

    class OutDirNet(BaseModel):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, inputs, targets=None, mode='tensor'):
            out = self.linear(inputs).squeeze(1)
            return {'loss': (out - targets).pow(2).mean()} if mode == 'loss' else out

    if 'OutDirNet' not in MODELS:
        MODELS.register_module(name='OutDirNet', module=OutDirNet)
    return 'OutDirNet'


def _cfg(work_dir, out_dir, max_iters, backend_args):
    g = torch.Generator().manual_seed(1)
    data = [
        dict(inputs=x, targets=y)
        for x, y in zip(torch.randn(8, 2, generator=g), torch.randn(8, generator=g))
    ]
    return dict(
        model=dict(type=_model_type()),
        work_dir=str(work_dir),
        strategy=dict(type='stratagem.SingleDeviceStrategy'),
        env_cfg=dict(dist_cfg=dict(backend='gloo')),
        train_dataloader=dict(
            dataset=data,
            batch_size=2,
            sampler=dict(type='DefaultSampler', shuffle=False),
            collate_fn=dict(type='default_collate'),
        ),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9)),
        train_cfg=dict(by_epoch=False, max_iters=max_iters),
        default_hooks=dict(
            checkpoint=dict(
                type='CheckpointHook',
                interval=2,
                by_epoch=False,
                max_keep_ckpts=2,
                out_dir=out_dir,
                backend_args=backend_args,
            )
        ),
        randomness=dict(seed=3),
        log_level='WARNING',
    )


def _weights(url):
    return location.load_file(url)['state_dict']


@pytest.mark.slow
def test_out_dir_on_s3_under_flexible_runner_resumes_from_the_bucket_alone(s3, s3_server, tmp_path):
    from stratagem.integrations.mmengine_runner import train_with_flexible_runner

    # explicit options (not only the environment's): they reach the hook and the strategy
    backend_args = dict(endpoint_url=s3_server.endpoint)
    out_dir = f'{s3}/runs'
    train_with_flexible_runner(_cfg(tmp_path / 'a' / 'exp', f'{s3}/ref', 6, backend_args))
    first = tmp_path / 'b' / 'exp'
    train_with_flexible_runner(_cfg(first, out_dir, 4, backend_args))
    prefix = f'{out_dir}/exp'
    fs, path = location.filesystem(prefix)
    names = sorted(p.rsplit('/', 1)[-1] for p in fs.ls(path, refresh=True))
    assert names == [
        'iter_2.pth',
        'iter_2.pth.manifest.json',
        'iter_4.pth',
        'iter_4.pth.manifest.json',
        'last_checkpoint',
    ]
    assert location.read_pointer(prefix) == f'{prefix}/iter_4.pth'
    assert (first / 'last_checkpoint').read_text() == f'{prefix}/iter_4.pth'
    assert not list(first.rglob('*.pth'))

    fresh = tmp_path / 'c' / 'exp'  # a new machine: an empty work_dir of the same name
    runner = train_with_flexible_runner(_cfg(fresh, out_dir, 6, backend_args), resume=True)
    assert runner.strategy.resumed_from == f'{prefix}/iter_4.pth' and runner.iter == 6
    # mmengine's max_keep_ckpts=2 deleted iter_2 with its manifest
    names = sorted(p.rsplit('/', 1)[-1] for p in fs.ls(path, refresh=True))
    assert names == [
        'iter_4.pth',
        'iter_4.pth.manifest.json',
        'iter_6.pth',
        'iter_6.pth.manifest.json',
        'last_checkpoint',
    ]
    final, reference = _weights(f'{prefix}/iter_6.pth'), _weights(f'{s3}/ref/exp/iter_6.pth')
    assert all(torch.equal(final[k], v) for k, v in reference.items())


def test_runner_config_routes_a_url_out_dir_through_fsspec(tmp_path):
    """The config `stratagem train` hands to FlexibleRunner: a URL out_dir's hook becomes
    ``stratagem.FsspecCheckpointHook`` with the ``'stratagem_fsspec'`` backend; with
    ``resume=True`` the newest committed checkpoint there is the one resumed. The backend
    deletes a checkpoint's object and its manifest."""
    import secrets

    from mmengine.fileio import get_file_backend

    from stratagem import checkpoint as ckpt
    from stratagem.integrations.mmengine_runner import runner_config

    out_dir = f'memory://mm-{secrets.token_hex(4)}'
    cfg = _cfg(tmp_path / 'exp', out_dir, 2, dict(skip_instance_cache=False))
    local = ckpt.save_checkpoint({'w': torch.ones(1)}, tmp_path / 'stage' / 'iter_2.pth', step=2)
    location.upload_file(local, f'{out_dir}/exp/iter_2.pth')
    out = runner_config(cfg, launcher='none', resume=True)
    hook = out['default_hooks']['checkpoint']
    assert hook['type'] == 'stratagem.FsspecCheckpointHook'
    assert hook['backend_args'] == dict(skip_instance_cache=False)
    assert out['resume'] is True and out['load_from'] == f'{out_dir}/exp/iter_2.pth'
    cfg['default_hooks']['checkpoint']['out_dir'] = str(tmp_path / 'shared')
    assert runner_config(cfg, launcher='none')['default_hooks']['checkpoint']['type'] == (
        'CheckpointHook'
    )

    backend = get_file_backend(out_dir, backend_args=dict(backend='stratagem_fsspec'))
    url = backend.join_path(out_dir, 'exp', 'iter_2.pth')
    assert url == f'{out_dir}/exp/iter_2.pth' and backend.isfile(url)
    assert not backend.isdir(url) and backend.isdir(f'{out_dir}/exp')
    backend.remove(url)
    assert not backend.exists(url) and not backend.exists(url + '.manifest.json')
