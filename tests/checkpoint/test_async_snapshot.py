"""The async snapshot contract: a committed checkpoint equals the state at the
``save_checkpoint`` call, bit for bit, whatever the program does after the call returns.

Every test holds the writer thread at a gate (``held_writer``) so the mutation right after the
call is certain to land before anything is written, not timing-dependent; then releases it,
waits, and compares the committed file with a clone taken at the call. Single-process kinds
here; DDP, FSDP (sharded DTensors), ShardedDDP and DeepSpeed in
``test_async_snapshot_dist.py``; the SIGKILL soak in ``test_ckpt_crash.py`` (mode
``strategy``)."""

import contextlib
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from stratagem.checkpoint import load_checkpoint_file
from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
from stratagem.strategies import SingleDeviceStrategy


@contextlib.contextmanager
def held_writer():
    """The writer thread of every ``AsyncCheckpointWriter`` is held at a gate before it runs
    anything of a submitted save (all layouts submit their whole write through ``submit``):
    a job that waits for the gate goes first on the single writer thread. Yields the
    gate's ``set``."""
    gate, real = threading.Event(), AsyncCheckpointWriter.submit

    def submit(self, job, *args, **kwargs):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix='stratagem-ckpt-writer')
        self._pool.submit(gate.wait, 60)
        return real(self, job, *args, **kwargs)

    AsyncCheckpointWriter.submit = submit
    try:
        yield gate.set
    finally:
        gate.set()
        AsyncCheckpointWriter.submit = real


def clone_tree(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, clone_tree(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return copy.deepcopy(obj)


def differences(saved, expected, path='checkpoint'):
    """Where ``saved`` differs from ``expected`` (tensors bit for bit, dtypes included)."""
    if isinstance(expected, torch.Tensor):
        ok = (
            isinstance(saved, torch.Tensor)
            and saved.dtype == expected.dtype
            and saved.shape == expected.shape
            and torch.equal(saved, expected)
        )
        return [] if ok else [path]
    if isinstance(expected, dict):
        if set(saved) != set(expected):
            return [f'{path}: keys {sorted(map(str, saved))} != {sorted(map(str, expected))}']
        return [d for k in expected for d in differences(saved[k], expected[k], f'{path}[{k!r}]')]
    if isinstance(expected, (list, tuple)):
        if len(saved) != len(expected):
            return [f'{path}: length {len(saved)} != {len(expected)}']
        return [
            d
            for i, (a, b) in enumerate(zip(saved, expected))
            for d in differences(a, b, f'{path}[{i}]')
        ]
    return [] if saved == expected else [f'{path}: {saved!r} != {expected!r}']


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 8))
        self.discriminator = nn.Linear(8, 1)

    def forward(self, x):
        return self.discriminator(self.generator(x))


def _prepare(tmp_path):
    torch.manual_seed(0)
    s = SingleDeviceStrategy(
        work_dir=str(tmp_path), async_checkpoint=True, env_kwargs=dict(randomness=dict(seed=1))
    )
    model, wrapper, _ = s.prepare(
        Net(),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)),
        param_scheduler=dict(type='StepLR', step_size=2, by_epoch=False),
    )
    return s, model, wrapper


def _train(model, wrapper, steps=2):
    wrappers = list(wrapper.values()) if hasattr(wrapper, 'values') else [wrapper]
    for _ in range(steps):
        for w in wrappers:
            w.update_params(model(torch.randn(4, 8)).square().mean())


def _expected(s, extra=None):
    """What the committed checkpoint must hold: the state at the call, cloned."""
    state = {
        'state_dict': clone_tree(s.model.state_dict()),
        'optimizer': clone_tree(s.optim_state_dict()),
    }
    if extra:
        state.update(clone_tree(extra))
    return state


def _mutate_in_place(s, model, wrapper, extras):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-1.0)


def _mutate_through_data(s, model, wrapper, extras):
    for p in model.parameters():  # .data leaves the version counter alone
        p.data.fill_(-2.0)


def _mutate_ema(s, model, wrapper, extras):
    ema = extras['ema']
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p + 5.0, 0.5)


def _mutate_load_state_dict(s, model, wrapper, extras):
    other = Net()
    for p in other.parameters():
        nn.init.constant_(p, 3.0)
    model.load_state_dict(other.state_dict())


def _mutate_raw_optimizer(s, model, wrapper, extras):
    raw = torch.optim.SGD(model.parameters(), lr=10.0)  # not the wrapper's
    model(torch.randn(4, 8)).sum().backward()
    raw.step()


def _mutate_buffer(s, model, wrapper, extras):
    model.generator[1].running_mean.add_(100.0)
    model.generator[1].num_batches_tracked.add_(7)


def _mutate_lr(s, model, wrapper, extras):
    wrapper.optimizer.param_groups[0]['lr'] = 123.0


def _mutate_momentum(s, model, wrapper, extras):
    for state in wrapper.optimizer.state.values():
        state['momentum_buffer'].mul_(0.5)


def _mutate_next_step(s, model, wrapper, extras):
    _train(model, wrapper, 1)


def _mutate_extra_tensor(s, model, wrapper, extras):
    extras['ema_state_dict']['0.weight'].zero_()


MUTATIONS = {
    f.__name__.removeprefix('_mutate_'): f
    for f in (
        _mutate_in_place,
        _mutate_through_data,
        _mutate_ema,
        _mutate_load_state_dict,
        _mutate_raw_optimizer,
        _mutate_buffer,
        _mutate_lr,
        _mutate_momentum,
        _mutate_next_step,
        _mutate_extra_tensor,
    )
}


@pytest.mark.parametrize('kind', list(MUTATIONS))
def test_async_checkpoint_is_the_state_at_the_call(tmp_path, kind):
    s, model, wrapper = _prepare(tmp_path)
    _train(model, wrapper)
    ema = copy.deepcopy(model.generator)
    extra = {'ema_state_dict': ema.state_dict(), 'meta': {'iter': 2}}
    expected = _expected(s, {'ema_state_dict': extra['ema_state_dict']})
    extras = {'ema': ema, 'ema_state_dict': extra['ema_state_dict']}
    with held_writer() as release:
        path = s.save_checkpoint('iter_2.pth', extra_ckpt=extra)
        assert s.checkpointer.writer.pending  # held: nothing written yet
        MUTATIONS[kind](s, model, wrapper, extras)
        changed = differences(_expected(s, {'ema_state_dict': ema.state_dict()}), expected)
        assert changed, f'the {kind} mutation changed nothing: the test would prove nothing'
        release()
        s.wait_for_checkpoints()
    saved = load_checkpoint_file(path)
    assert saved['meta']['iter'] == 2
    assert differences({k: saved[k] for k in expected}, expected) == []


def test_second_optimizer_of_an_optim_wrapper_dict(tmp_path):
    torch.manual_seed(0)
    s = SingleDeviceStrategy(work_dir=str(tmp_path), async_checkpoint=True)
    model, wrappers = s.prepare(
        Net(),
        optim_wrapper=dict(
            generator=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)),
            discriminator=dict(optimizer=dict(type='Adam', lr=0.01)),
        ),
    )
    _train(model, wrappers)
    expected = _expected(s)
    with held_writer() as release:
        path = s.save_checkpoint('iter_2.pth')
        wrappers['discriminator'].update_params(model(torch.randn(4, 8)).square().mean())
        adam = wrappers['discriminator'].optimizer
        assert differences(clone_tree(s.optim_state_dict()), expected['optimizer'])
        assert all(int(st['step']) == 3 for st in adam.state.values())
        release()
        s.wait_for_checkpoints()
    saved = load_checkpoint_file(path)
    assert differences({k: saved[k] for k in expected}, expected) == []


def test_the_snapshot_is_complete_when_save_returns(tmp_path):
    """Nothing is left for the writer to copy: with the writer held, every staged tensor
    already holds the state at the call, and the live tensors share no memory with it."""
    s, model, wrapper = _prepare(tmp_path)
    _train(model, wrapper)
    with held_writer() as release:
        s.save_checkpoint('iter_2.pth')
        staged = s.checkpointer.writer._staging
        live = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
        live |= {
            t.untyped_storage().data_ptr()
            for st in wrapper.optimizer.state.values()
            for t in st.values()
        }
        assert staged and not live & {t.untyped_storage().data_ptr() for t in staged.values()}
        weight = model.generator[0].weight
        assert any(b.shape == weight.shape and torch.equal(b, weight) for b in staged.values())
        release()
        s.wait_for_checkpoints()


def test_large_snapshot_is_split_over_threads_and_exact(monkeypatch):
    """Above the split threshold the copy runs in shares on the copier threads (flat slices
    of contiguous tensors, strided ones whole); every byte lands where it belongs."""
    from stratagem.checkpoint import async_writer

    monkeypatch.setattr(async_writer, '_SPLIT_BYTES', 1)
    monkeypatch.setattr(async_writer, 'copy_threads', lambda: 3)
    threads_before = torch.get_num_threads()
    w = AsyncCheckpointWriter()
    torch.manual_seed(0)
    state = {
        'a': torch.randn(1000, 7),
        'b': torch.randn(5, 3).t(),
        'c': torch.arange(10),
        'd': [torch.randn(333, dtype=torch.float64), torch.zeros(0)],
    }
    want = clone_tree(state)
    snap = w.snapshot(state)
    for t in (state['a'], state['c'], state['d'][0]):
        t.zero_() if t.dtype != torch.int64 else t.fill_(-1)
    assert differences(snap, want) == []
    assert w._copiers is not None and w._copiers._max_workers == 3
    assert torch.get_num_threads() == threads_before  # the caller's thread count is kept


def _flexible_runner_check(work_dir):
    """mmengine's FlexibleRunner: its CheckpointHook saves through the strategy at iteration
    2; a hook that runs before it records the state, one that runs after it (the writer still
    held) overwrites the weights, momentum and lr."""
    from mmengine.hooks import Hook
    from mmengine.model import BaseModel
    from mmengine.runner import FlexibleRunner

    import stratagem.integrations.mmengine  # noqa: F401  (allow-list, scoped names)

    class Toy(BaseModel):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, inputs, labels, mode='tensor'):
            out = self.linear(inputs)
            return {'loss': ((out - labels) ** 2).mean()} if mode == 'loss' else out

    seen = {}

    class Record(Hook):
        priority = 'NORMAL'  # before CheckpointHook (VERY_LOW)

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            if runner.iter + 1 == 2:
                seen['state_dict'] = clone_tree(runner.model.state_dict())
                seen['optimizer'] = clone_tree(runner.optim_wrapper.optimizer.state_dict())

    class Vandal(Hook):
        priority = 'LOWEST'  # after CheckpointHook

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            if runner.iter + 1 == 2:
                seen['pending'] = runner.strategy.checkpointer.writer.pending
                optimizer = runner.optim_wrapper.optimizer
                with torch.no_grad():
                    for p in runner.model.parameters():
                        p.fill_(-1.0)
                    for st in optimizer.state.values():
                        st['momentum_buffer'].fill_(-1.0)
                optimizer.param_groups[0]['lr'] = 123.0
                release()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
    with held_writer() as release:
        runner = FlexibleRunner(
            model=Toy(),
            work_dir=work_dir,
            launcher='none',
            randomness=dict(seed=3),
            strategy=dict(type='stratagem.SingleDeviceStrategy', async_checkpoint=True),
            train_dataloader=dict(
                dataset=[dict(inputs=x[i], labels=y[i]) for i in range(16)],
                batch_size=4,
                collate_fn=dict(type='default_collate'),
                sampler=dict(type='DefaultSampler', shuffle=False),
            ),
            optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9)),
            train_cfg=dict(by_epoch=False, max_iters=3),
            default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=2, by_epoch=False)),
            custom_hooks=[Record(), Vandal()],
            log_level='WARNING',
        )
        runner.train()
        runner.strategy.wait_for_checkpoints()
    saved = load_checkpoint_file(f'{work_dir}/iter_2.pth')
    return dict(
        pending=seen['pending'],
        iter=saved['meta']['iter'],
        model=differences(saved['state_dict'], seen['state_dict']),
        optimizer=differences(
            {k: saved['optimizer'][k] for k in seen['optimizer']}, seen['optimizer']
        ),
    )


def test_flexible_runner_checkpoint_hook(tmp_path):
    pytest.importorskip('mmengine', reason='mmengine is in the test extra')
    from dist_harness import run_distributed

    # a fresh process: mmengine's registries and hooks stay out of this one
    r = run_distributed(_flexible_runner_check, nproc=1, args=(str(tmp_path),), timeout=120)[0]
    assert r == dict(pending=True, iter=2, model=[], optimizer=[])
