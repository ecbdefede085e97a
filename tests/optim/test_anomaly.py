"""``StepGuard`` on the optim wrapper: a refused update leaves parameters, optimizer state and
the loss scale as they were; under float16 the scaler's own skips stay its own."""

import math

import pytest
import torch
from torch import nn

from stratagem.optim import AmpOptimWrapper, OptimWrapper
from stratagem.optim.anomaly import StepGuard


def _model():
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def _loss(model, poison=False):
    x = torch.ones(3, 4)
    if poison:
        x = x * float('nan')
    return model(x).float().pow(2).mean()


def _state(model, wrapper):
    return [p.detach().clone() for p in model.parameters()], repr(wrapper.optimizer.state_dict())


def test_plain_path_refuses_too():
    model = _model()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    guard = StepGuard()
    wrapper.set_step_guard(guard)
    assert wrapper._plain_step and wrapper.step_guard is guard  # the inlined update
    before = [p.detach().clone() for p in model.parameters()]
    wrapper.update_params(_loss(model, poison=True))
    assert guard.last is not None and wrapper.inner_count == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    wrapper.update_params(_loss(model))
    assert guard.last is None and not torch.equal(before[0], model.weight)


def test_refused_update_changes_nothing_and_counts_the_window():
    model = _model()
    wrapper = OptimWrapper(torch.optim.AdamW(model.parameters(), lr=0.1), accumulative_counts=2)
    guard = StepGuard()
    wrapper.set_step_guard(guard)
    wrapper.update_params(_loss(model))
    wrapper.update_params(_loss(model))  # a good window: steps
    assert guard.last is None
    before = _state(model, wrapper)
    wrapper.update_params(_loss(model, poison=True))  # the window's first micro-batch
    assert guard.last is None  # decided at the update, not before
    wrapper.update_params(_loss(model))
    assert guard.last is not None and guard.last.kind == 'nonfinite'
    assert math.isnan(guard.last.losses[0]) and math.isnan(guard.last.grad_norms[0])
    assert 'non-finite loss on rank 0 (nan)' in guard.last.describe()
    after = _state(model, wrapper)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
    assert before[1] == after[1]
    assert all(p.grad is None for p in model.parameters()) and wrapper.inner_count == 4


def test_float16_scaler_keeps_its_own_skips_and_a_nan_loss_is_ours():
    model = _model()
    wrapper = AmpOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              dtype='float16', loss_scale=dict(init_scale=2.0**16))  # fmt: skip
    guard = StepGuard()
    wrapper.set_step_guard(guard)
    scale = wrapper.loss_scaler.get_scale()
    # a finite loss whose gradients overflow: the scaler's skip (and back-off), not ours
    hook = model.weight.register_hook(lambda g: g * float('inf'))
    with wrapper.optim_context(model):
        loss = _loss(model)
    wrapper.update_params(loss)
    hook.remove()
    assert guard.last is None and wrapper.skipped_steps == 1
    assert wrapper.loss_scaler.get_scale() == scale / 2
    # a NaN loss: ours; the scaler neither steps nor backs off, nor counts it
    before = _state(model, wrapper)
    with wrapper.optim_context(model):
        loss = _loss(model, poison=True)
    wrapper.update_params(loss)
    assert guard.last is not None and guard.last.grad_norms == [None]
    assert wrapper.skipped_steps == 1 and wrapper.loss_scaler.get_scale() == scale / 2
    assert all(torch.equal(a, p) for a, p in zip(before[0], model.parameters(), strict=True))


def test_spike_window_and_its_state():
    guard = StepGuard(nonfinite=False, window=3, zscore=3.0)
    model = _model()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.0))
    wrapper.set_step_guard(guard)
    for value in (1.0, 1.1, 0.9, 1.0):
        wrapper.update_params(model(torch.ones(1, 4)).sum() * 0 + value)
        assert guard.last is None
    wrapper.update_params(model(torch.ones(1, 4)).sum() * 0 + 5.0)
    assert guard.last.kind == 'spike' and guard.last.zscore > 3
    state = guard.state_dict()
    assert state['filled'] == 4
    assert sorted(state['recent']) == pytest.approx([0.9, 1.0, 1.1])  # the last 3
    again = StepGuard(nonfinite=False, window=3)
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_sparse_gradients_are_checked_by_their_norm():
    # the one-kernel check takes no sparse gradient: the norm of its values decides
    torch.manual_seed(0)
    emb, head = nn.Embedding(6, 4, sparse=True), nn.Linear(4, 1)
    params = [*emb.parameters(), *head.parameters()]
    wrapper = OptimWrapper(torch.optim.SGD(params, lr=0.1))
    guard = StepGuard()
    wrapper.set_step_guard(guard)
    wrapper.update_params(head(emb(torch.tensor([1, 2]))).sum())
    assert guard.last is None
    with torch.no_grad():
        emb.weight[1, 0] = float('inf')
    before = emb.weight.detach().clone()
    wrapper.update_params(head(emb(torch.tensor([1, 2]))).sum())
    assert guard.last is not None and not math.isfinite(guard.last.grad_norms[0])
    assert torch.equal(before, emb.weight)


def test_spike_window_matches_its_values_and_survives_another_size():
    import statistics

    from stratagem.optim.anomaly import _Window

    window = _Window(5)
    values = [1e4 + (i * 7919 % 13) / 10 for i in range(23)]  # a large mean: no cancellation
    for v in values:
        window.add(v, finite_only=True)
    last = values[-5:]
    expected = (1e4 + 3 - statistics.fmean(last)) / statistics.pstdev(last)
    assert window.zscore(1e4 + 3) == pytest.approx(expected, rel=1e-9)
    smaller = _Window(3)
    smaller.load_state_dict(window.state_dict())  # the newest 3, in order
    again = _Window(3)
    for v in values[-3:]:
        again.add(v, finite_only=True)
    assert smaller.state_dict()['filled'] == 3
    assert smaller.zscore(1e4) == pytest.approx(again.zscore(1e4), rel=1e-12)
