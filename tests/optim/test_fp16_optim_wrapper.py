import pytest
import torch
from torch import nn

from stratagem.optim import Fp16MasterWeightsOptimWrapper, build_optim_wrapper, wrap_fp16_model


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))


def data(n=6):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 1, generator=g)
    xs = [torch.randn(16, 8, generator=g) for _ in range(n)]
    return [(x, x @ w) for x in xs]


def loss_fn(model, x, y):
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def build(model, **kw):
    return build_optim_wrapper(
        model,
        dict(
            type='Fp16MasterWeightsOptimWrapper',
            optimizer=dict(type='SGD', lr=0.05, momentum=0.9),
            **kw,
        ),
    )


def test_master_weights_track_fp32_training():
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for x, y in data():
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
    model = make_model()
    wrapper = build(model, loss_scale=512.0)
    wrap_fp16_model(model, half=True)
    assert model[0].weight.dtype == torch.half
    assert all(m.dtype == torch.float32 for m in wrapper.master_params)
    for x, y in data():
        wrapper.update_params(loss_fn(model, x, y))
    assert wrapper.skipped_steps == 0
    for master, r, p in zip(wrapper.master_params, ref.parameters(), model.parameters()):
        torch.testing.assert_close(master, r.detach(), atol=5e-3, rtol=0)
        torch.testing.assert_close(p.detach(), master.detach().half())  # copied back


def test_overflow_is_skipped_and_scale_lowered(weights_only_roundtrip):
    model = make_model()
    wrapper = build(model, loss_scale=dict(init_scale=2.0**10, mode='dynamic'))
    wrap_fp16_model(model, half=True)
    before = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in wrapper.master_params]
    ((x, y),) = data(1)
    wrapper.update_params(loss_fn(model, x, y) * float('inf'))
    assert wrapper.skipped_steps == 1 and wrapper.loss_scaler.loss_scale == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(torch.equal(a, b) for a, b in zip(wrapper.master_params, masters))
    assert all(p.grad is None for p in model.parameters())
    wrapper.update_params(loss_fn(model, x, y))
    assert not torch.equal(model[0].weight, before[0])

    sd = weights_only_roundtrip(wrapper.state_dict())
    assert sd['skipped_steps'] == 1 and sd['loss_scaler']['cur_scale'] == 2.0**9
    assert sd['fp32_master_weights'][0].dtype == torch.float32
    other_model = make_model()
    other = build(other_model, loss_scale='dynamic')
    wrap_fp16_model(other_model, half=True)
    other.load_state_dict(sd)
    assert other.skipped_steps == 1 and other.loss_scaler.loss_scale == 2.0**9
    for a, b in zip(other.master_params, wrapper.master_params):
        assert torch.equal(a, b)
    for a, b in zip(other_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    # and the next step is identical
    for w, m in ((wrapper, model), (other, other_model)):
        w.update_params(loss_fn(m, x, y))
    for a, b in zip(other_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_accumulation_keeps_pending_model_grads(weights_only_roundtrip):
    model = make_model()
    wrapper = build(model, accumulative_counts=2, clip_grad=dict(max_norm=1.0))
    wrap_fp16_model(model, half=True)
    ((x, y),) = data(1)
    wrapper.update_params(loss_fn(model, x, y))
    sd = weights_only_roundtrip(wrapper.state_dict())
    pending = sd['optim_wrapper']['pending_grads']
    assert len(pending) == 6 and pending[0].dtype == torch.half
    wrapper.update_params(loss_fn(model, x, y))
    assert wrapper.last_grad_norm is not None and wrapper.inner_count == 2


def test_loss_scale_type_error():
    with pytest.raises(TypeError, match="'dynamic', a float"):
        Fp16MasterWeightsOptimWrapper(
            torch.optim.SGD(make_model().parameters(), lr=0.1), loss_scale='auto'
        )
