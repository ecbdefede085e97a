import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

from stratagem.optim import OptimWrapper, build_optim_wrapper

K_FEATURES = 5


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(K_FEATURES, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def make_data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, K_FEATURES, generator=g, dtype=torch.float64), torch.randn(
        n, 1, generator=g, dtype=torch.float64
    )


def mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_params_close(a, b, atol=1e-6):
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=0)


def run_wrapper(wrapper, model, x, y, micro, iters, start=0):
    for i in range(start, start + iters):
        xs, ys = x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]
        with wrapper.optim_context(model):
            loss = mse(model, xs, ys)
        wrapper.update_params(loss)


def test_accumulation_equals_one_big_batch():
    k, micro, windows = 4, 2, 3
    x, y = make_data(k * micro * windows)
    ref = make_model()
    ref_opt = sgd(ref)
    for w in range(windows):  # the oracle: one step per k*micro batch
        xs, ys = x[w * k * micro : (w + 1) * k * micro], y[w * k * micro : (w + 1) * k * micro]
        ref_opt.zero_grad()
        mse(ref, xs, ys).backward()
        ref_opt.step()
    model = make_model()
    wrapper = OptimWrapper(sgd(model), accumulative_counts=k)
    run_wrapper(wrapper, model, x, y, micro, k * windows)
    assert wrapper.inner_count == k * windows
    assert_params_close(params_of(model), params_of(ref))


def hand_loop_windows(model, opt, x, y, micro, windows):
    """Oracle: each window's micro-batch losses averaged over the window's real length."""
    i = 0
    for length in windows:
        opt.zero_grad()
        losses = [
            mse(
                model,
                x[(i + j) * micro : (i + j + 1) * micro],
                y[(i + j) * micro : (i + j + 1) * micro],
            )
            for j in range(length)
        ]
        (sum(losses) / length).backward()
        opt.step()
        i += length


def test_tail_window_is_averaged_over_its_real_length():
    k, micro, max_iters = 4, 3, 10  # windows 4, 4, 2
    x, y = make_data(micro * max_iters)
    ref = make_model()
    hand_loop_windows(ref, sgd(ref), x, y, micro, [4, 4, 2])
    model = make_model()
    wrapper = OptimWrapper(sgd(model), accumulative_counts=k)
    wrapper.initialize_count_status(model, 0, max_iters)
    updates = []
    for i in range(max_iters):
        with wrapper.optim_context(model):
            loss = mse(model, x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro])
        wrapper.update_params(loss)
        updates.append(wrapper.should_update())
    assert updates == [False, False, False, True] * 2 + [False, True]
    assert_params_close(params_of(model), params_of(ref))
    with pytest.raises(ValueError, match='max_counts'):
        wrapper.scale_loss(torch.ones(()))


def test_resume_mid_window_gives_identical_next_steps(weights_only_roundtrip):
    k, micro, max_iters, stop = 4, 2, 10, 6
    x, y = make_data(micro * max_iters)
    full = make_model()
    full_w = OptimWrapper(sgd(full), accumulative_counts=k, clip_grad=dict(max_norm=0.5))
    full_w.initialize_count_status(full, 0, max_iters)
    run_wrapper(full_w, full, x, y, micro, max_iters)

    first = make_model()
    first_w = OptimWrapper(sgd(first), accumulative_counts=k, clip_grad=dict(max_norm=0.5))
    first_w.initialize_count_status(first, 0, max_iters)
    run_wrapper(first_w, first, x, y, micro, stop)
    ckpt = weights_only_roundtrip({'model': first.state_dict(), 'optim': first_w.state_dict()})
    assert ckpt['optim']['optim_wrapper']['inner_count'] == stop
    assert set(ckpt['optim']['optim_wrapper']['pending_grads']) == {0, 1, 2, 3}

    resumed = make_model(seed=123)
    resumed.load_state_dict(ckpt['model'])
    resumed_w = OptimWrapper(sgd(resumed), accumulative_counts=k, clip_grad=dict(max_norm=0.5))
    resumed_w.load_state_dict(ckpt['optim'])
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        resumed_w.initialize_count_status(resumed, stop, max_iters)
    run_wrapper(resumed_w, resumed, x, y, micro, max_iters - stop, start=stop)
    for a, b in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(a, b)


def test_state_dict_on_window_boundary_has_no_pending_grads_and_loads_in_torch():
    model = make_model()
    wrapper = OptimWrapper(sgd(model), accumulative_counts=2)
    x, y = make_data(8)
    run_wrapper(wrapper, model, x, y, 2, 2)
    sd = wrapper.state_dict()
    assert sd['optim_wrapper'] == {'inner_count': 2, 'max_counts': -1, 'accumulative_counts': 2}
    sgd(make_model()).load_state_dict(sd)  # a bare optimizer ignores the extra key


def test_grad_state_dict_round_trip():
    model = make_model()
    wrapper = OptimWrapper(sgd(model), accumulative_counts=3)
    x, y = make_data(4)
    run_wrapper(wrapper, model, x, y, 2, 2)
    gsd = wrapper.grad_state_dict()
    assert gsd['inner_count'] == 2
    other = make_model()
    other_w = OptimWrapper(sgd(other), accumulative_counts=3)
    other_w.load_grad_state_dict(gsd)
    assert other_w.inner_count == 2
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a.grad, b.grad) and a.grad is not b.grad
    with pytest.raises(ValueError, match='shape'):
        OptimWrapper(sgd(nn.Linear(2, 2).double())).load_grad_state_dict(
            {'inner_count': 1, 'grads': {0: torch.zeros(3, 3)}}
        )


def test_clip_grad_norm_matches_hand_loop_and_keeps_a_tensor():
    x, y = make_data(16)
    ref = make_model()
    ref_opt = sgd(ref)
    norms = []
    for i in range(4):
        ref_opt.zero_grad()
        (mse(ref, x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4]) * 10).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.3))
        ref_opt.step()
    model = make_model()
    wrapper = OptimWrapper(sgd(model), clip_grad=dict(type='norm', max_norm=0.3))
    for i in range(4):
        wrapper.update_params(mse(model, x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4]) * 10)
    assert isinstance(wrapper.last_grad_norm, torch.Tensor)
    torch.testing.assert_close(wrapper.last_grad_norm, norms[-1])
    assert norms[-1] > 0.3  # the clip was active
    assert_params_close(params_of(model), params_of(ref), atol=1e-12)


def test_clip_grad_value():
    model = nn.Linear(3, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    wrapper = OptimWrapper(
        torch.optim.SGD(model.parameters(), lr=1.0), clip_grad=dict(type='value', clip_value=0.1)
    )
    x = torch.tensor([[1.0, -50.0, 0.05]], dtype=torch.float64)
    wrapper.update_params(model(x).sum())  # grad = x
    torch.testing.assert_close(
        model.weight.detach(), torch.tensor([[-0.1, 0.1, -0.05]], dtype=torch.float64)
    )


@pytest.mark.parametrize(
    'clip_grad, match',
    [
        (dict(type='nrom', max_norm=1), "'norm'.*'value'"),
        (dict(type='norm'), 'missing max_norm'),
        (dict(type='value', clip_value=1, max_norm=2), 'unexpected max_norm'),
        ([1.0], 'non-empty dict'),
    ],
)
def test_clip_grad_errors(clip_grad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        OptimWrapper(sgd(make_model()), clip_grad=clip_grad)


def test_clip_grad_cfg_not_mutated():
    cfg = dict(type='norm', max_norm=1.0)
    OptimWrapper(sgd(make_model()), clip_grad=cfg)
    assert cfg == dict(type='norm', max_norm=1.0)


def test_hot_path_has_no_host_sync_and_no_loss_division(monkeypatch):
    model = make_model()
    # SGD: torch's own single-tensor Adam reads its CPU step counter with .item()
    wrapper = OptimWrapper(sgd(model), clip_grad=dict(max_norm=1.0))
    loss = mse(model, *make_data(4))
    assert wrapper.scale_loss(loss) is loss

    def no_sync(*a, **k):
        raise AssertionError('host sync in the hot path')

    for name in ('item', '__float__', '__bool__', 'tolist', 'cpu'):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    for _ in range(2):
        with wrapper.optim_context(model):
            loss = mse(model, *make_data(4))
        wrapper.update_params(loss)


def test_scale_loss_divides_only_when_accumulating():
    wrapper = OptimWrapper(sgd(make_model()), accumulative_counts=4)
    wrapper.initialize_count_status(make_model(), 0, 9)  # windows 4, 4, 1
    loss = torch.tensor(8.0)
    factors = []
    for _ in range(9):
        scaled = wrapper.scale_loss(loss)
        factors.append(None if scaled is loss else float(loss / scaled))
        wrapper._inner_count += 1
    assert factors == [4.0] * 8 + [None]


class FakeDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.no_sync_calls = 0

    def forward(self, x):
        return self.module(x)

    @contextlib.contextmanager
    def no_sync(self):
        self.no_sync_calls += 1
        yield


def test_optim_context_uses_no_sync_on_non_update_iterations():
    model = FakeDDP(make_model())
    wrapper = OptimWrapper(sgd(model), accumulative_counts=3)
    wrapper.initialize_count_status(model, 0, 7)  # windows 3, 3, 1
    syncs = []
    for _ in range(7):
        syncs.append(wrapper.should_sync())
        with wrapper.optim_context(model):
            loss = mse(model, *make_data(2))
        wrapper.update_params(loss)
    assert syncs == [False, False, True, False, False, True, True]
    assert model.no_sync_calls == 4


def test_get_lr_and_momentum():
    model = make_model()
    adam = OptimWrapper(torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.99)))
    assert adam.get_lr() == {'lr': [0.01]}
    assert adam.get_momentum() == {'momentum': [0.8]}
    sgd_w = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.7))
    assert sgd_w.get_momentum() == {'momentum': [0.7]}
    rprop = OptimWrapper(torch.optim.Rprop(model.parameters(), lr=0.1))
    assert rprop.get_momentum() == {'momentum': [0]}
    assert adam.param_groups is adam.optimizer.param_groups
    assert adam.defaults['lr'] == 0.01


def test_initialize_count_status_warnings():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    wrapper = OptimWrapper(sgd(model), accumulative_counts=2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter('always')
        wrapper.initialize_count_status(model, 3, 10)
    messages = ' | '.join(str(r.message) for r in record)
    assert 'first 1 micro-batches are lost' in messages and 'BatchNorm' in messages
    assert wrapper.inner_count == 3 and wrapper.max_counts == 10
    with pytest.raises(ValueError, match='init_counts'):
        wrapper.initialize_count_status(model, 11, 10)


def test_constructor_errors():
    with pytest.raises(TypeError, match='torch.optim.Optimizer'):
        OptimWrapper(object())
    with pytest.raises(ValueError, match='accumulative_counts must be an int >= 1, got 0'):
        OptimWrapper(sgd(make_model()), accumulative_counts=0)


def test_step_and_zero_kwargs_are_forwarded():
    model = make_model()
    wrapper = OptimWrapper(sgd(model))
    wrapper.update_params(mse(model, *make_data(2)), zero_kwargs=dict(set_to_none=False))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_built_from_cfg_equals_direct():
    model = make_model()
    cfg = dict(
        optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
        accumulative_counts=2,
        clip_grad=dict(max_norm=1.0),
    )
    before = copy.deepcopy(cfg)
    wrapper = build_optim_wrapper(model, cfg)
    assert cfg == before
    assert type(wrapper) is OptimWrapper and wrapper.accumulative_counts == 2
    assert wrapper.clip_grad_kwargs == {'max_norm': 1.0}


def test_loading_a_between_windows_state_clears_current_grads():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=2)
    for _ in range(2):
        wrapper.update_params(model(torch.ones(1, 2)).sum())
    saved = wrapper.state_dict()
    wrapper.update_params(model(torch.ones(1, 2)).sum())  # opens a window: grads present
    assert model.weight.grad is not None
    wrapper.load_state_dict(saved)  # roll back to the boundary
    assert model.weight.grad is None and wrapper.inner_count == 2


def test_clip_grad_values_must_be_positive_numbers():
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="max_norm must be a positive number, got '1'"):
        OptimWrapper(opt, clip_grad=dict(max_norm='1'))
    with pytest.raises(ValueError, match='clip_value must be a positive number, got -1'):
        OptimWrapper(opt, clip_grad=dict(type='value', clip_value=-1))


class WithUnused(nn.Module):
    """A model with a parameter the forward never uses: its grad stays None, which an
    optimizer (AdamW here) must see as None, not as zeros, to leave it untouched."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(K_FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize('opt', ['SGD', 'AdamW'])
@pytest.mark.parametrize('accumulate, clip', [(1, None), (3, 0.05)], ids=['plain', 'acc3-clip'])
@pytest.mark.parametrize('amp', [False, True], ids=['fp32', 'bf16'])
def test_results_are_bit_identical_to_a_hand_written_loop(opt, accumulate, clip, amp):
    from stratagem.optim import AmpOptimWrapper

    x, y = (t.float() for t in make_data(40))
    iters = 8  # windows of 3: two complete, then a tail of 2 averaged over its real length
    kwargs = dict(lr=0.05, momentum=0.9) if opt == 'SGD' else dict(lr=0.01, weight_decay=0.1)

    def autocast():
        return torch.autocast('cpu', dtype=torch.bfloat16) if amp else contextlib.nullcontext()

    ref = WithUnused()
    ref_opt = getattr(torch.optim, opt)(ref.parameters(), **kwargs)
    ref_params = []
    for i in range(iters):
        window = accumulate if i < iters // accumulate * accumulate else iters % accumulate
        with autocast():
            loss = ((ref(x[4 * i : 4 * i + 4]).float() - y[4 * i : 4 * i + 4]) ** 2).mean()
        (loss / window if window > 1 else loss).backward()
        if (i + 1) % accumulate == 0 or i + 1 == iters:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_params.append(params_of(ref))

    model = WithUnused()
    optimizer = getattr(torch.optim, opt)(model.parameters(), **kwargs)
    clip_grad = dict(max_norm=clip) if clip is not None else None
    wrapper = (
        AmpOptimWrapper(
            optimizer=optimizer,
            dtype='bfloat16',
            accumulative_counts=accumulate,
            clip_grad=clip_grad,
        )
        if amp
        else OptimWrapper(optimizer, accumulative_counts=accumulate, clip_grad=clip_grad)
    )
    wrapper.initialize_count_status(model, 0, iters)
    got = []
    for i in range(iters):
        with wrapper.optim_context(model):
            loss = ((model(x[4 * i : 4 * i + 4]).float() - y[4 * i : 4 * i + 4]) ** 2).mean()
        wrapper.update_params(loss)
        if wrapper.should_update():
            assert all(p.grad is None for p in model.parameters())  # as after zero_grad()
            got.append(params_of(model))
    assert len(got) == len(ref_params) == -(-iters // accumulate)
    for step, (a, b) in enumerate(zip(got, ref_params)):
        for n, (pa, pb) in enumerate(zip(a, b)):
            assert torch.equal(pa, pb), f'update {step}, parameter {n}'
    assert torch.equal(model.unused.weight, WithUnused().unused.weight)  # never stepped
    for sa, sb in zip(
        optimizer.state_dict()['state'].values(), ref_opt.state_dict()['state'].values()
    ):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert len(optimizer.state) == len(ref_opt.state) == 4  # no state for the unused layer


def test_gradient_memory_is_released_at_the_next_step_start():
    """zero_grad leaves p.grad None at once; the CPU gradients' memory goes when the next
    step starts (optim_context, or backward without one), where a hand-written loop's
    zero_grad() frees it, so the allocator sees the raw loop's order (benchmarks/overhead.py)."""
    import weakref

    x, y = make_data(8)
    model = make_model()
    wrapper = OptimWrapper(sgd(model))
    wrapper.update_params(mse(model, x[:4], y[:4]))
    assert all(p.grad is None for p in model.parameters())
    wrapper.update_params(mse(model, x[4:], y[4:]))
    # the gradients of the last update: None on the parameters, memory not yet released
    stale = [weakref.ref(g) for g in wrapper._stale_grads]
    assert len(stale) == 4 and all(r() is not None for r in stale)
    with wrapper.optim_context(model):
        assert all(r() is None for r in stale)
        loss = mse(model, x[:4], y[:4])
    wrapper.update_params(loss)
    stale = [weakref.ref(g) for g in wrapper._stale_grads]
    loss = mse(model, x[:4], y[:4])  # a loop without optim_context: released at backward
    assert all(r() is not None for r in stale)
    wrapper.backward(loss)
    assert all(r() is None for r in stale)
    wrapper.zero_grad(set_to_none=False)  # zeroed in place and kept: nothing to release later
    assert wrapper._stale_grads is None
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_optim_context_finds_no_sync_set_on_the_instance():
    model, calls = make_model(), []
    model.no_sync = lambda: calls.append(1) or contextlib.nullcontext()
    wrapper = OptimWrapper(sgd(model), accumulative_counts=2)
    with wrapper.optim_context(model):  # the first of a window of 2: no sync
        pass
    assert calls == [1]


def test_collaborators_are_supplied_through_public_seams():
    """A strategy hands the wrapper its gradient-sync control, clip function and optimizer
    loader explicitly: no private attribute is patched from outside."""
    import contextlib

    from stratagem.optim import AmpOptimWrapper, OptimWrapper

    model = nn.Linear(3, 2)
    entered = []

    @contextlib.contextmanager
    def no_sync():
        entered.append(True)
        yield

    w = OptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1),
        accumulative_counts=2,
        clip_grad=dict(max_norm=1.0),
    )
    w.initialize_count_status(model, 0, 4)
    w.set_grad_sync(no_sync)
    with w.optim_context(model):  # iteration 1 of a window of 2: no sync
        pass
    assert entered == [True]
    w.update_params(model(torch.ones(1, 3)).sum())
    with w.optim_context(model):  # iteration 2 completes the window: synced
        pass
    assert entered == [True]
    calls = []
    w.set_clip_func(lambda params, **kw: calls.append(kw) or torch.tensor(7.0))
    w.update_params(model(torch.ones(1, 3)).sum())
    assert calls == [{'max_norm': 1.0}] and float(w.last_grad_norm) == 7.0
    loaded = []
    w.load_state_dict(w.state_dict(), load_optimizer=loaded.append)
    assert len(loaded) == 1 and set(loaded[0]) == {'state', 'param_groups'}
    plain = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match='has no clip_grad'):
        plain.set_clip_func(torch.nn.utils.clip_grad_norm_)
    amp = AmpOptimWrapper(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16
    )
    with amp.optim_context(model):
        assert torch.is_autocast_enabled('cpu')
    amp.autocast = False  # the model wrapper supplies the precision (FSDP)
    with amp.optim_context(model):
        assert not torch.is_autocast_enabled('cpu')
