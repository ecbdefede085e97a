import warnings

import pytest
import torch
from torch import nn

from stratagem.optim import AmpOptimWrapper, build_optim_wrapper


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def loss_fn(model, x, y):
    return ((model(x).float() - y) ** 2).mean()


def test_bf16_uses_autocast_and_no_scaler_matching_hand_loop():
    data = batches(5)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x, y in data:
        ref_opt.zero_grad()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            loss = loss_fn(ref, x, y)
        loss.backward()
        ref_opt.step()
    model = make_model()
    wrapper = AmpOptimWrapper(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05), dtype='bfloat16'
    )
    assert wrapper.loss_scaler is None and wrapper.cast_dtype == torch.bfloat16
    for x, y in data:
        with wrapper.optim_context(model):
            assert model[0](x).dtype == torch.bfloat16
            loss = loss_fn(model, x, y)
        wrapper.update_params(loss)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert 'loss_scaler' not in wrapper.state_dict()


def test_dtype_none_is_the_device_default_and_bf16_ignores_loss_scale():
    model = make_model()
    with pytest.warns(UserWarning, match='ignored'):
        wrapper = AmpOptimWrapper(
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=512.0
        )
    assert wrapper.cast_dtype == torch.get_autocast_dtype('cpu') == torch.bfloat16
    assert wrapper.loss_scaler is None


def test_fp16_with_clip_matches_hand_loop_with_grad_scaler():
    data = batches(6)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0**10, growth_interval=2)
    ref_norms = []
    for x, y in data:
        ref_opt.zero_grad()
        with torch.autocast('cpu', dtype=torch.float16):
            loss = loss_fn(ref, x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(ref_opt)
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5))
        scaler.step(ref_opt)
        scaler.update()
    model = make_model()
    wrapper = AmpOptimWrapper(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        dtype='float16',
        loss_scale=dict(init_scale=2.0**10, growth_interval=2),
        clip_grad=dict(max_norm=0.5),
    )
    for x, y in data:
        with wrapper.optim_context(model):
            loss = loss_fn(model, x, y)
        wrapper.update_params(loss)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    torch.testing.assert_close(wrapper.last_grad_norm, ref_norms[-1])  # unscaled norm
    assert wrapper.loss_scaler.get_scale() == scaler.get_scale() == 2.0**13
    assert wrapper.skipped_steps == 0


def test_fp16_overflow_step_is_skipped_and_counted(weights_only_roundtrip):
    model = make_model()
    wrapper = AmpOptimWrapper(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        dtype=torch.float16,
        loss_scale=dict(init_scale=2.0**8),
    )
    before = [p.detach().clone() for p in model.parameters()]
    ((x, y),) = batches(1)
    with wrapper.optim_context(model):
        loss = loss_fn(model, x, y) * float('inf')
    wrapper.update_params(loss)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert wrapper.skipped_steps == 1
    assert wrapper.loss_scaler.get_scale() == 2.0**8 * 0.5
    with wrapper.optim_context(model):
        loss = loss_fn(model, x, y)
    wrapper.update_params(loss)
    assert not torch.equal(next(model.parameters()), before[0])
    assert wrapper.skipped_steps == 1

    sd = weights_only_roundtrip(wrapper.state_dict())
    assert sd['skipped_steps'] == 1 and sd['loss_scaler']['scale'] == 2.0**7
    other = AmpOptimWrapper(
        optimizer=torch.optim.SGD(make_model().parameters(), lr=0.1), dtype='float16'
    )
    other.load_state_dict(sd)
    assert other.skipped_steps == 1 and other.loss_scaler.get_scale() == 2.0**7


def test_static_loss_scale_stays_fixed():
    model = make_model()
    wrapper = AmpOptimWrapper(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype='float16', loss_scale=256.0
    )
    ((x, y),) = batches(1)
    for factor in (float('inf'), 1.0):
        with wrapper.optim_context(model):
            loss = loss_fn(model, x, y) * factor
        wrapper.update_params(loss)
        assert wrapper.loss_scaler.get_scale() == 256.0
    assert wrapper.skipped_steps == 1


def test_fp16_accumulation_matches_hand_loop():
    data = batches(4)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler('cpu')
    for i, (x, y) in enumerate(data):
        with torch.autocast('cpu', dtype=torch.float16):
            loss = loss_fn(ref, x, y) / 2
        scaler.scale(loss).backward()
        if i % 2 == 1:
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad()
    model = make_model()
    wrapper = build_optim_wrapper(
        model,
        dict(
            type='AmpOptimWrapper',
            dtype='float16',
            accumulative_counts=2,
            optimizer=dict(type='SGD', lr=0.05),
        ),
    )
    for x, y in data:
        with wrapper.optim_context(model):
            loss = loss_fn(model, x, y)
        wrapper.update_params(loss)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_argument_errors():
    opt = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'float16', 'bfloat16'"):
        AmpOptimWrapper(optimizer=opt, dtype='float8')
    with pytest.raises(TypeError, match="'dynamic', a positive float"):
        AmpOptimWrapper(optimizer=opt, dtype='float16', loss_scale='static')
    # a typo is an error even where the scale would be ignored (bf16)
    with pytest.raises(TypeError, match="got 'dynamc'"):
        AmpOptimWrapper(optimizer=opt, dtype='bfloat16', loss_scale='dynamc')
    # mmengine configs pass use_fsdp; FSDP2's DTensor grads need no other scaler
    assert AmpOptimWrapper(optimizer=opt, dtype='float16', use_fsdp=True).use_fsdp is True
    assert AmpOptimWrapper(optimizer=opt, use_fsdp=False).use_fsdp is False


def test_pending_grads_change_scale_between_fp16_and_bf16():
    torch.manual_seed(0)
    model = make_model()
    x = torch.randn(4, model[0].in_features)
    fp16 = AmpOptimWrapper(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        dtype='float16',
        loss_scale=1024.0,
        accumulative_counts=2,
    )
    with fp16.optim_context(model):
        loss = model(x).float().square().mean()
    fp16.update_params(loss)
    scaled = [p.grad.clone() for p in model.parameters()]
    state = fp16.state_dict()
    assert state['optim_wrapper']['pending_grads_scale'] == 1024.0
    for p in model.parameters():
        p.grad = None
    bf16 = AmpOptimWrapper(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        dtype='bfloat16',
        accumulative_counts=2,
    )
    bf16.load_state_dict(state)
    for p, g in zip(model.parameters(), scaled):
        assert torch.allclose(p.grad, g / 1024.0)  # unscaled: bf16 has no scaler


def test_mmengine_state_dict_without_counters_loads():
    model = make_model()
    wrapper = AmpOptimWrapper(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype='float16'
    )
    sd = wrapper.optimizer.state_dict()
    sd['loss_scaler'] = {
        'scale': 8.0,
        'growth_factor': 2.0,
        'backoff_factor': 0.5,
        'growth_interval': 2000,
        '_growth_tracker': 0,
    }
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        wrapper.load_state_dict(sd)
    assert wrapper.loss_scaler.get_scale() == 8.0 and 'loss_scaler' in sd


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')
def test_cuda_fp16_default_dtype():
    model = make_model().cuda()
    wrapper = AmpOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert wrapper.cast_dtype == torch.float16 and wrapper.loss_scaler is not None
    x = torch.randn(4, 6, device='cuda')
    with wrapper.optim_context(model):
        assert model[0](x).dtype == torch.float16
        loss = model(x).float().mean()
    wrapper.update_params(loss)
    assert wrapper.skipped_steps == 0
