"""The async snapshot contract on 2 gloo ranks, for every strategy that saves asynchronously:
DDP, FSDP (sharded directory: DTensor shards edited in place), FSDP with one full file,
ShardedDDP (fairscale OSS) and DeepSpeed ZeRO-1/ZeRO-3 (the fp32 partitions the next step
writes). Right after ``save_checkpoint`` returns, with every writer thread held at a gate, the
program overwrites the model's parameters and buffers, the optimizer's own parameters (the fp32
partitions under DeepSpeed) and state in place, changes the lr and takes one more step; the
committed checkpoint, resumed into a fresh strategy, equals the state at the call bit for bit.

Processes start once for the module; each backend's check is a scenario that runs inside them
(tests/scenarios.py), only for the backends of the selected tests.
"""

import functools
import importlib.util
import os

import pytest
import torch
from torch import nn

from scenarios import Scenarios

BACKENDS = [
    'DDPStrategy',
    'FSDPStrategy',
    'FSDPStrategy-full',
    'ShardedDDPStrategy',
    'DeepSpeedStrategy-1',
    'DeepSpeedStrategy-3',
]
_NEEDS = {
    'ShardedDDPStrategy': 'fairscale',
    'DeepSpeedStrategy-1': 'deepspeed',
    'DeepSpeedStrategy-3': 'deepspeed',
}
SCENARIOS = Scenarios(ranks=dict(nproc=2, timeout=400))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def _strategy(backend, work_dir):
    from stratagem.strategies import build_strategy

    kind, _, option = backend.partition('-')
    cfg = dict(
        type=kind,
        work_dir=work_dir,
        async_checkpoint=True,
        env_kwargs=dict(randomness=dict(seed=3)),
    )
    optimizer = dict(type='Adam', lr=0.01)
    wrapper = dict(optimizer=optimizer)
    if kind == 'FSDPStrategy' and option == 'full':
        cfg['state_dict_cfg'] = 'full'
    if kind == 'DeepSpeedStrategy':
        cfg['zero_optimization'] = dict(stage=int(option))
        wrapper = dict(type='DeepSpeedOptimWrapper', optimizer=optimizer)
    if kind == 'ShardedDDPStrategy':
        wrapper = dict(optimizer=dict(type='AdamW', lr=0.01))
    s = build_strategy(cfg)
    model, ow = s.prepare(
        _net(),
        optim_wrapper=wrapper,
        dispatch_kwargs=dict(max_iters=10, train_micro_batch_size_per_gpu=4),
    )
    return s, model, ow


def _inner(optimizer):
    """The torch optimizer that holds the tensors (under DeepSpeed its params are the fp32
    partitions; under OSS the rank's share)."""
    for _ in range(4):
        nxt = getattr(optimizer, 'optimizer', None) or getattr(optimizer, 'optim', None)
        if not isinstance(nxt, torch.optim.Optimizer):
            break
        optimizer = nxt
    return optimizer


def _local(t):
    return (t.to_local() if hasattr(t, 'to_local') else t).detach().clone()


def _fingerprint(s, ow):
    """This rank's view of everything a checkpoint must restore, cloned."""
    inner = _inner(ow.optimizer)
    return {
        'model': {
            k: _local(v) for k, v in s.model_state_dict().items() if isinstance(v, torch.Tensor)
        },
        'params': [_local(p) for g in inner.param_groups for p in g['params']],
        'state': [
            {k: _local(v) for k, v in st.items() if isinstance(v, torch.Tensor)}
            for st in inner.state.values()
        ],
        'lr': [g['lr'] for g in inner.param_groups],
    }


def _differences(a, b, path=''):
    if isinstance(a, torch.Tensor):
        return [] if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) else [path]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f'{path}: keys differ']
        return [d for k in a for d in _differences(a[k], b[k], f'{path}/{k}')]
    if isinstance(a, list):
        if len(a) != len(b):
            return [f'{path}: length {len(a)} != {len(b)}']
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f'{path}/{i}')]
    return [] if a == b else [f'{path}: {a!r} != {b!r}']


def _step(model, ow, rank, it):
    # the same batch on every rank: BatchNorm statistics then agree across ranks, so the
    # rank whose copy a checkpoint keeps (DCP dedups replicated tensors) does not matter
    g = torch.Generator().manual_seed(100 + it)
    x = torch.randn(4, 6, generator=g)
    with ow.optim_context(model):
        loss = model(x).square().mean()
    ow.update_params(loss)


def _mutate(model, ow, rank):
    """Everything a program may do after the call: in place, through another view, a step."""
    inner = _inner(ow.optimizer)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point() and t.numel():
                t.fill_(-1.0)
        for g in inner.param_groups:
            g['lr'] = 123.0
            for p in g['params']:
                p.data.fill_(-2.0)
        for st in inner.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.fill_(3.0)  # positive: Adam takes the root of exp_avg_sq


def _check(tmp, backend):
    """``backend``'s save, held at the writer while the program changes everything; the
    resumed checkpoint against the state at the call. None without the backend's extra."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
    from stratagem.env import get_rank

    if backend in _NEEDS and importlib.util.find_spec(_NEEDS[backend]) is None:
        return None
    work = os.path.join(tmp, backend)
    s, model, ow = _strategy(backend, work)
    rank = get_rank()
    for it in range(2):
        _step(model, ow, rank, it)
    expected = _fingerprint(s, ow)
    gate, real = threading.Event(), AsyncCheckpointWriter.submit

    def submit(self, job, *args, _gate=gate, _real=real, **kwargs):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix='stratagem-ckpt-writer')
        self._pool.submit(_gate.wait, 120)  # the writer thread is held behind this
        return _real(self, job, *args, **kwargs)

    AsyncCheckpointWriter.submit = submit
    try:
        path = s.save_checkpoint('iter_2', extra_ckpt={'meta': {'iter': 2}})
        pending = s.checkpointer.writer.pending
        _mutate(model, ow, rank)
        _step(model, ow, rank, 2)  # collectives on the default group while it is held
        changed = _differences(_fingerprint(s, ow), expected) != []
        gate.set()
        s.wait_for_checkpoints()
    finally:
        gate.set()
        AsyncCheckpointWriter.submit = real
    reader, rmodel, row = _strategy(backend, os.path.join(tmp, backend + '_reader'))
    meta = reader.resume(path)['meta']
    return dict(
        pending=pending,
        changed=changed,
        iter=meta['iter'],
        differences=_differences(_fingerprint(reader, row), expected),
    )


for _backend in BACKENDS:
    SCENARIOS.add('ranks', name=_backend)(functools.partial(_check, backend=_backend))


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('snapshot'))


# the first tier: DDP (one file) and FSDP with one full file (its own writer path); the
# sharded backends' async save is also each a first-tier cell of the conformance table
# (tests/strategies/conformance.py, async.<row>), so their in-place edits here are slow-tier
_FIRST_TIER = ('DDPStrategy', 'FSDPStrategy-full')


@pytest.mark.parametrize(
    'backend',
    [b if b in _FIRST_TIER else pytest.param(b, marks=pytest.mark.slow) for b in BACKENDS],
)
@pytest.mark.scenario('{backend}')
def test_async_checkpoint_is_the_state_at_the_call(scenario, backend):
    if scenario[0] is None:
        pytest.skip(f'{_NEEDS[backend]} is an optional extra, not installed')
    for rank, r in enumerate(scenario):
        assert r['pending'], 'the writer was held: the save must still be pending'
        assert r['changed'], 'the mutation changed nothing: the test would prove nothing'
        assert r['iter'] == 2
        assert r['differences'] == [], (rank, r['differences'][:10])
