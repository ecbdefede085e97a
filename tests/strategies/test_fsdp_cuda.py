"""FSDPStrategy on CUDA with nccl (GPU only; one process: FSDP2 over a 1-GPU mesh).

bf16 parameters through ``MixedPrecisionPolicy`` (fp32 sharded master weights, fp32 reduce),
and fp16 parameters with an AmpOptimWrapper whose GradScaler works on sharded (DTensor)
gradients: overflowing steps are skipped, the scale backs off, training matches fp32, and a
sharded checkpoint taken mid-run resumes exactly; an asynchronous sharded save (pinned
staging, DCP on the writer's gloo group) holds the state at the save. Run on a machine with a
GPU:

    PYTHONPATH=$PWD python -m pytest -q -m gpu tests/strategies/test_fsdp_cuda.py
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device'),
]

from dist_harness import run_distributed  # noqa: E402

STEPS, SAVE_AT = 12, 6


def _net():
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            return torch.tanh(self.fc(x)) + x

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), Block(), Block(), nn.Linear(32, 3))


def _batch(it):
    g = torch.Generator().manual_seed(it)
    return torch.randn(16, 6, generator=g).cuda(), torch.randint(3, (16,), generator=g).cuda()


def _build(work, dtype, amp, **kwargs):
    from stratagem.strategies import build_strategy

    s = build_strategy(
        dict(
            type='FSDPStrategy',
            work_dir=work,
            **kwargs,
            model_wrapper=dict(
                auto_wrap_policy=['Block'],
                mixed_precision=dict(param_dtype=dtype, reduce_dtype='float32'),
            ),
            env_kwargs=dict(dist_cfg=dict(backend='nccl'), randomness=dict(seed=3)),
        )
    )
    optim = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9), clip_grad=dict(max_norm=1.0))
    if amp:  # a first scale of 2**20 overflows fp16: the first steps must be skipped
        optim.update(type='AmpOptimWrapper', dtype='float16', loss_scale=dict(init_scale=2.0**20))
    return (s, *s.prepare(_net(), optim_wrapper=optim, dispatch_kwargs=dict(max_iters=STEPS)))


def _full(s):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(s.model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().cpu().clone() for k, v in sd.items()}


def _train(s, model, ow, start, stop, record=None):
    from torch.nn import functional as F

    for it in range(start, stop):
        x, y = _batch(it)
        before = _full(s) if record is not None else None
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x).float(), y)
        ow.update_params(loss)
        if record is not None:
            after = _full(s)
            record.append(all(torch.equal(before[k], after[k]) for k in after))


def _reference():
    """fp32, plain CUDA module, same steps: the oracle."""
    from torch.nn import functional as F

    net = _net().cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for it in range(STEPS):
        x, y = _batch(it)
        F.cross_entropy(net(x), y).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().float().cpu() for k, v in net.state_dict().items()}


def _cuda_checks(work):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    out = {}
    ref = _reference()
    # bf16 compute, fp32 sharded parameters, no GradScaler
    s, model, ow = _build(work, 'bfloat16', amp=False)
    seen = []
    model[1].fc.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    _train(s, model, ow, 0, STEPS)
    p = next(model.parameters())
    out['bf16'] = dict(
        backend=dist.get_backend(),
        param=(type(p).__name__, str(p.dtype), str(p.device)),
        compute=str(seen[0]),
        err=_max_err(_full(s), ref),
    )
    # fp16 compute + GradScaler on sharded grads: skipped steps change nothing
    s, model, ow = _build(work, 'float16', amp=True)
    skipped = []
    _train(s, model, ow, 0, STEPS, record=skipped)
    out['fp16'] = dict(
        scaler=type(ow.loss_scaler).__name__,
        skipped=skipped,
        scale=float(ow.loss_scaler.get_scale()),
        dtype=str(next(model.parameters()).dtype),
    )
    final = _full(s)
    out['fp16']['err'] = _max_err(final, _reference_skipping(skipped))
    # fp16: a sharded checkpoint taken mid-run resumes exactly (scale and counters too)
    s1, m1, o1 = _build(work + '/part', 'float16', amp=True)
    _train(s1, m1, o1, 0, SAVE_AT)
    path = s1.save_checkpoint(f'iter_{SAVE_AT}', extra_ckpt={'meta': {'iter': SAVE_AT}})
    s2, m2, o2 = _build(work + '/part', 'float16', amp=True)
    s2.resume(path)
    out['fp16']['resumed_scale'] = float(o2.loss_scaler.get_scale())
    out['fp16']['scale_at_save'] = float(o1.loss_scaler.get_scale())
    _train(s2, m2, o2, SAVE_AT, STEPS)
    resumed = _full(s2)
    out['fp16']['resume_exact'] = all(torch.equal(resumed[k], final[k]) for k in final)
    out['sharded'] = all(isinstance(q, DTensor) for q in m2.parameters())
    # async sharded save on CUDA: the shards are staged in pinned memory before the call
    # returns (checkpoint/async_writer.py: no copy is deferred past it) and DCP runs on a
    # gloo group of the writer's own while training goes on under nccl
    s3, m3, o3 = _build(work + '/async', 'float16', amp=True, async_checkpoint=True)
    _train(s3, m3, o3, 0, SAVE_AT)
    at_save = _full(s3)
    path = s3.save_checkpoint(f'iter_{SAVE_AT}', extra_ckpt={'meta': {'iter': SAVE_AT}})
    _train(s3, m3, o3, SAVE_AT, STEPS)
    s3.wait_for_checkpoints()
    staged = s3.checkpointer.writer._staging.values()
    out['async'] = dict(
        pinned=all(t.is_pinned() for t in staged if t.numel()),
        final_exact=all(torch.equal(_full(s3)[k], final[k]) for k in final),
    )
    s4, m4, o4 = _build(work + '/async', 'float16', amp=True)
    s4.resume(path)
    loaded = _full(s4)
    out['async']['saved_exact'] = all(torch.equal(loaded[k], at_save[k]) for k in at_save)
    return out


def _reference_skipping(skipped):
    """The fp32 oracle with the steps the GradScaler skipped left out (their momentum too)."""
    from torch.nn import functional as F

    net = _net().cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for it in range(STEPS):
        x, y = _batch(it)
        F.cross_entropy(net(x), y).backward()
        if not skipped[it]:
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
        opt.zero_grad()
    return {k: v.detach().float().cpu() for k, v in net.state_dict().items()}


def _max_err(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def test_fsdp_bf16_and_fp16_gradscaler_on_cuda(tmp_path):
    (out,) = run_distributed(_cuda_checks, nproc=1, args=(str(tmp_path),), timeout=300)
    bf16, fp16 = out['bf16'], out['fp16']
    assert bf16['backend'] == 'nccl'
    assert bf16['param'] == ('DTensor', 'torch.float32', 'cuda:0')  # fp32 master shards
    assert bf16['compute'] == 'torch.bfloat16'
    assert bf16['err'] < 5e-2, bf16['err']  # bf16 compute: ~3 significant digits
    assert fp16['scaler'] == 'GradScaler' and fp16['dtype'] == 'torch.float32'
    # 2**20 overflows fp16: the first step(s) skipped (nothing changed), then training ran
    assert fp16['skipped'][0] and not all(fp16['skipped'])
    assert fp16['scale'] < 2.0**20
    assert fp16['err'] < 2e-2, fp16['err']
    assert fp16['resumed_scale'] == fp16['scale_at_save']
    assert fp16['resume_exact'] and out['sharded']
    assert out['async'] == dict(pinned=True, final_exact=True, saved_exact=True), out['async']
