"""DeepSpeedStrategy on CUDA: fp16 (refused on CPU) with ZeRO-2, exact resume, also from an
asynchronous save staged from GPU memory (GPU only).

Run on a machine with a GPU:
    PYTHONPATH=$PWD python -m pytest -q -m gpu tests/strategies/test_deepspeed_cuda.py
"""

import os

import pytest
import torch

pytest.importorskip('deepspeed', reason='DeepSpeed is an optional extra (stratagem[deepspeed])')
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device'),
]

from dist_harness import RankFailure, run_distributed  # noqa: E402

MAX_ITERS, SAVE_AT = 8, 4


def _net():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))


def _run(work, start, stop, resume=None, async_checkpoint=False):
    from torch.nn import functional as F

    from stratagem.strategies import build_strategy

    s = build_strategy(
        dict(
            type='DeepSpeedStrategy',
            work_dir=work,
            inputs_to_half=[0],
            fp16=dict(enabled=True, initial_scale_power=8),
            zero_optimization=dict(stage=2),
            async_checkpoint=async_checkpoint,
            env_kwargs=dict(randomness=dict(seed=3)),
        )
    )
    model, ow, scheds = s.prepare(
        _net(),
        optim_wrapper=dict(
            optimizer=dict(type='AdamW', lr=1e-2),
            accumulative_counts=2,
            clip_grad=dict(max_norm=1.0),
        ),
        param_scheduler=[dict(type='LinearLR', start_factor=0.5, by_epoch=False, end=4)],
        dispatch_kwargs=dict(max_iters=MAX_ITERS, train_micro_batch_size_per_gpu=8),
    )
    if resume:
        s.resume(resume)

    def train(first, last):
        for it in range(first, last):
            g = torch.Generator().manual_seed(it)
            x = torch.randn(8, 6, generator=g).cuda()
            y = torch.randint(3, (8,), generator=g).cuda()
            ow.update_params(F.cross_entropy(model(x).float(), y))
            for sch in scheds:
                sch.step()

    train(start, stop)
    path = s.save_checkpoint(f'iter_{stop}.pth', extra_ckpt={'meta': {'iter': stop}})
    weights = {k: v.float().cpu() for k, v in s.model_state_dict().items()}
    if async_checkpoint:  # the GPU state changes while the staged copy is written
        train(stop, stop + 2)
        s.wait_for_checkpoints()
    return path, weights, str(next(s.model.module.parameters()).dtype), s.model.global_steps


def _checks(tmp):
    _, full, dtype, updates = _run(os.path.join(tmp, 'a'), 0, MAX_ITERS)
    path, _, _, _ = _run(os.path.join(tmp, 'b'), 0, SAVE_AT)
    _, resumed, _, resumed_updates = _run(os.path.join(tmp, 'c'), SAVE_AT, MAX_ITERS, resume=path)
    path, _, _, _ = _run(os.path.join(tmp, 'd'), 0, SAVE_AT, async_checkpoint=True)
    _, from_async, _, _ = _run(os.path.join(tmp, 'e'), SAVE_AT, MAX_ITERS, resume=path)
    return dict(
        dtype=dtype,
        updates=(updates, resumed_updates),
        exact=all(torch.equal(full[k], resumed[k]) for k in full),
        exact_async=all(torch.equal(full[k], from_async[k]) for k in full),
    )


def test_fp16_zero2_trains_and_resumes_exactly(tmp_path):
    try:
        out = run_distributed(_checks, nproc=1, args=(str(tmp_path),), timeout=300)[0]
    except RankFailure as e:
        pytest.fail(f'{e}\n{e.output[-4000:]}')
    assert out['dtype'] == 'torch.float16'
    assert out['updates'] == (MAX_ITERS // 2, MAX_ITERS // 2)
    assert out['exact'] and out['exact_async']
