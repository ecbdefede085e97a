"""#42 in the reference loop: mmengine's ``default_hooks.checkpoint.out_dir`` (+
``backend_args``) on a real local S3 server. Checkpoints go to ``out_dir/<work_dir name>``
with a pointer there and one in the work_dir; logs stay local; a run ended by a preemption
resumes from the bucket alone in an EMPTY new work_dir, to the same tensors as the
uninterrupted run; retention deletes old checkpoints in the bucket, never the newest."""

import os
import signal

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from stratagem.checkpoint import CheckpointLocationError, location
from stratagem.loop import train


class Regression(nn.Module):
    """A linear model; ``signal_at``: the forward call that sends this process SIGUSR1 (a
    preemption: the loop saves after that iteration and stops)."""

    def __init__(self, signal_at=None):
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.calls, self.signal_at = 0, signal_at

    def forward(self, inputs, targets):
        self.calls += 1
        if self.calls == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        return F.mse_loss(self.fc(inputs).squeeze(1), targets)


def _cfg(work_dir, out_dir, signal_at=None):
    g = torch.Generator().manual_seed(1)
    return dict(
        model=dict(type=Regression, signal_at=signal_at),
        train_dataloader=dict(
            dataset=TensorDataset(torch.randn(16, 2, generator=g), torch.randn(16, generator=g)),
            batch_size=4,
            shuffle=True,
        ),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9)),
        train_cfg=dict(by_epoch=False, max_iters=6, metrics=dict(tensorboard=False)),
        default_hooks=dict(
            checkpoint=dict(
                type='CheckpointHook',
                interval=2,
                by_epoch=False,
                max_keep_ckpts=2,
                out_dir=out_dir,
            )
        ),  # fmt: skip
        randomness=dict(seed=3),
        work_dir=str(work_dir),
    )


def _final(result):
    model = result['strategy'].unwrap_model().state_dict()
    return {k: v.clone() for k, v in model.items()}


def test_out_dir_on_s3_resumes_from_the_bucket_alone(s3, tmp_path):
    out_dir = f'{s3}/runs'
    reference = _final(train(_cfg(tmp_path / 'a' / 'exp', f'{s3}/reference'), progress=False))

    first = tmp_path / 'b' / 'exp'
    ended = train(_cfg(first, out_dir, signal_at=4), progress=False)
    assert ended['preempted'] == 'SIGUSR1' and ended['iter'] == 4
    # the checkpoints and their pointer in the bucket, under the work_dir's name; the pointer
    # in the work_dir too; logs and metrics local
    prefix = f'{out_dir}/exp'
    assert [c.url for c in location.list_checkpoints(prefix)] == [
        f'{prefix}/iter_4.pth',
        f'{prefix}/iter_2.pth',
    ]
    assert location.read_pointer(prefix) == f'{prefix}/iter_4.pth'
    assert (first / 'last_checkpoint').read_text() == f'{prefix}/iter_4.pth'
    assert not list(first.rglob('*.pth')) and list(first.rglob('metrics.csv'))

    fresh = tmp_path / 'c' / 'exp'  # a new machine: an empty work_dir of the same name
    resumed = train(_cfg(fresh, out_dir), resume=True, progress=False)
    assert resumed['strategy'].resumed_from == f'{prefix}/iter_4.pth'
    final = _final(resumed)
    assert all(torch.equal(final[k], v) for k, v in reference.items())
    # retention in the bucket: the newest two, the one resumed from among them
    assert [c.step for c in location.list_checkpoints(prefix)] == [6, 4]


def test_a_local_out_dir_holds_the_checkpoints_and_both_pointers_name_them(tmp_path):
    cfg = _cfg(tmp_path / 'work' / 'exp', str(tmp_path / 'shared'))
    cfg['train_cfg']['max_iters'] = 2
    train(cfg, progress=False)
    final = tmp_path / 'shared' / 'exp' / 'iter_2.pth'
    assert (tmp_path / 'shared' / 'exp' / 'last_checkpoint').read_text() == str(final)
    assert (tmp_path / 'work' / 'exp' / 'last_checkpoint').read_text() == str(final)
    assert not list((tmp_path / 'work').rglob('*.pth'))


def test_out_dir_and_backend_args_are_checked(tmp_path):
    cfg = _cfg(tmp_path / 'w', 'memory://x')
    cfg['default_hooks']['checkpoint']['backend_args'] = dict(backend='petrel')
    with pytest.raises(ValueError, match=r"backend_args.backend='petrel' is mmengine's"):
        train(cfg, progress=False)
    cfg['default_hooks']['checkpoint'].update(out_dir=3, backend_args=None)
    with pytest.raises(TypeError, match='out_dir must be a path or a URL'):
        train(cfg, progress=False)


def test_an_unusable_out_dir_is_named_before_training(s3, s3_server, tmp_path):
    missing = 's3://no-such-bucket-for-stratagem/runs'
    with pytest.raises(CheckpointLocationError) as caught:
        train(_cfg(tmp_path / 'w', missing), progress=False)
    message = str(caught.value)
    assert f'{missing}/w' in message and 'bucket does not exist' in message
    cfg = _cfg(tmp_path / 'w', f'{s3}/runs')
    cfg['default_hooks']['checkpoint']['backend_args'] = dict(key='wrong', secret='wrong')
    with pytest.raises(CheckpointLocationError, match='check the credentials'):
        train(cfg, progress=False)
    # credentials that may read but not write: named now, not at the first save
    cfg['default_hooks']['checkpoint']['backend_args'] = dict(s3_server.read_only)
    with pytest.raises(CheckpointLocationError, match=r'permission denied .* may not write'):
        train(cfg, progress=False)
    assert not (tmp_path / 'w' / 'last_checkpoint').exists()
    fs, path = location.filesystem(f'{s3}/runs')
    assert not fs.exists(path)  # no probe object left behind


@pytest.mark.slow
def test_a_killed_cli_run_resumes_from_the_bucket_in_an_empty_work_dir(s3, tmp_path):
    """`stratagem train` with out_dir on S3, SIGKILLed once a checkpoint is committed there,
    then `--resume` in an empty work_dir of the same name on a "new machine": the final
    checkpoint equals the uninterrupted run's, bit for bit."""
    import time

    from failure_helpers import CONFIG, clean_env, equal, finish, start, write_config

    def config(out_dir):
        hook = f"default_hooks = dict(checkpoint=dict(type='CheckpointHook', out_dir='{out_dir}'))"
        return write_config(tmp_path, CONFIG + hook + '\n')

    def final(prefix, it=64):
        got = location.load_file(f'{prefix}/iter_{it}.pth')
        return {k: got[k] for k in ('state_dict', 'optimizer', 'param_schedulers')}

    code, out = finish(start(config(f'{s3}/reference'), tmp_path / 'a' / 'exp'))
    assert code == 0, out[-3000:]
    reference = final(f'{s3}/reference/exp')

    cfg = config(f'{s3}/runs')
    run = start(cfg, tmp_path / 'b' / 'exp', env=clean_env(SLOW='0.02'))
    prefix = f'{s3}/runs/exp'
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and run.poll() is None:
            pointed = location.read_pointer(prefix)
            if pointed is not None and pointed.endswith(('iter_20.pth', 'iter_25.pth')):
                break
            time.sleep(0.05)
    finally:
        run.kill()
    code, out = finish(run)
    assert code == -9, f'the run ended before it was killed: {out[-2000:]}'
    assert location.find_latest(prefix) is not None

    code, out = finish(start(cfg, tmp_path / 'c' / 'exp', '--resume'))
    assert code == 0, out[-3000:]
    assert 'resumed from s3://' in out, out[-3000:]
    assert equal(final(prefix), reference)


def test_the_ctrl_c_line_names_the_checkpoint_in_out_dir(s3, tmp_path):
    """After Ctrl-C, `stratagem train` names the checkpoint `--resume` continues from: with
    out_dir, the one in the bucket (the work_dir holds none), or says nothing is there."""
    from stratagem import checkpoint as ckpt
    from stratagem.cli.launch import interrupted_line
    from stratagem.cli.train import _checkpoints_at

    cfg = _cfg(tmp_path / 'exp', f'{s3}/runs')
    where = _checkpoints_at(cfg)
    assert where == (f'{s3}/runs/exp', None)
    line = interrupted_line(str(tmp_path / 'exp'), *where)
    assert line == f'stratagem train: interrupted (SIGINT); nothing was saved in {s3}/runs/exp'
    local = ckpt.save_checkpoint({'w': torch.ones(2)}, tmp_path / 'stage' / 'iter_2.pth', step=2)
    location.upload_file(local, f'{s3}/runs/exp/iter_2.pth')
    line = interrupted_line(str(tmp_path / 'exp'), *where)
    assert line.endswith(f'--resume continues from {s3}/runs/exp/iter_2.pth')
    del cfg['default_hooks']['checkpoint']['out_dir']
    assert _checkpoints_at(cfg) == (None, None)
