"""The backend conformance table: every backend (and mesh shape) × the checks every backend
passes. ``test_conformance.py`` runs it; each cell is a test of its own
(``test_equals_one_process[fsdp]``, ``test_loads_weights_of[deepspeed_zero3->ddp]``, ...).

Rows (``BACKENDS``): a strategy, its options, how many processes. A row whose extra is not
installed is left out. A new backend is one more row, a mesh shape too (``fsdp_hsdp``:
``mesh=dict(replicate=2, shard=2)``; ``fsdp_2d``: ``mesh=dict(shard=2, tensor=2)`` with a
tensor-parallel plan for the MLP); what a row cannot do is a field of its row, asserted as
such (DeepSpeed refuses a save inside an accumulation window), never a cell left out. A row
of more than 2 processes (``Backend.slow``: the meshes, on 4) is the slow tier's: every cell
that involves it is marked ``slow``, so the first tier never starts the 4-process spawn.

Columns (the scenarios), on one recipe: a small MLP, Adam, accumulation 2 with a tail window
(7 iterations: windows [0,2) [2,4) [4,6) [6,7)), clipping, a warm-up scheduler, 8 samples
per iteration split over the data-parallel ranks (a mesh's ``replicate × shard``: the tensor
ranks of one data-parallel index compute on one batch):

- ``equal.<row>``: the losses, pre-clip norms, learning rates and weights of one process on
  the whole batch (a plain torch loop), to ``Backend.equal_tol`` (0: bit for bit).
- ``resume.<row>``: a run saves at iteration 3 (inside a window; a row that cannot save
  there must refuse it, write nothing, and save at the boundary 4), goes on to the end; a
  fresh strategy resumes the checkpoint and ends bit for bit where the run ended, the global
  RNG restored (dropout, per-rank seeds, batches drawn from the global RNG).
- ``async.<row>``: the same save with ``async_checkpoint=True``, its writer held back while
  the run trains on and overwrites its weights: the resumed checkpoint is the state at the
  call (it ends where ``resume.<row>``'s run ended, bit for bit).
- ``load.<row>``: the weights every other row saved (``resume.<other>``'s checkpoint) load
  with ``load_checkpoint`` into this row bit-equal.
- ``flexible.<row>``: mmengine's FlexibleRunner on the strategy trains 3 epochs, a new
  runner resumes to 4, and both land where an uninterrupted 4-epoch run lands.

Spawns (tests/scenarios.py), in order: the 1-process rows in one spawn of 1, the 2-process
rows in one spawn of 2 (every column of every row), the 4-process rows in one spawn of 4
(every column, their loads of every other row's checkpoint too), then the 4-process rows'
checkpoints loaded into the 2-process rows in a second spawn of 2 (``load_slow.<row>``), and
the loads into the 1-process rows in the test process. The first tier's cells need the first
two spawns and the test process; the 4-process rows' cells add the other two.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scenarios import Scenarios

__all__ = ['BACKENDS', 'FLEXIBLE', 'PAIRS', 'SCENARIOS', 'Backend', 'reference']


@dataclass(frozen=True)
class Backend:
    """A row: ``strategy`` (its registry name) with ``options`` on ``nproc`` processes.

    ``extra``: the module it needs (the row is left out without it). ``saves_mid_window``:
    False when a save inside an accumulation window is refused. ``equal_tol``: the largest
    weight difference from one process (0.0: bit-exact). ``flexible``: how mmengine's
    FlexibleRunner names it (``'name'``: ``'stratagem.<strategy>'``; ``'class'``: the class
    object, mmengine's pure-Python config style), or None for no FlexibleRunner cell.
    """

    strategy: str
    nproc: int
    options: dict = field(default_factory=dict)
    extra: str | None = None
    saves_mid_window: bool = True
    equal_tol: float = 1e-6
    flexible: str | None = None

    @property
    def slow(self) -> bool:
        """Its cells are the slow tier's: more than 2 processes."""
        return self.nproc > 2


def _zero(stage: int, **kw: Any) -> Backend:
    return Backend(
        'DeepSpeedStrategy',
        2,
        dict(zero_optimization=dict(stage=stage)),
        extra='deepspeed',
        saves_mid_window=False,
        **kw,
    )


_WRAP = dict(model_wrapper=dict(auto_wrap_policy=['Linear']))
_ALL = {
    'single': Backend('SingleDeviceStrategy', 1, equal_tol=0.0, flexible='name'),
    'ddp': Backend('DDPStrategy', 2, flexible='class'),
    'fsdp': Backend('FSDPStrategy', 2, _WRAP, flexible='name'),
    # the mesh shapes, on 4 processes
    'fsdp_hsdp': Backend(
        'FSDPStrategy', 4, dict(_WRAP, mesh=dict(replicate=2, shard=2)), flexible='name'
    ),
    'fsdp_2d': Backend(
        'FSDPStrategy',
        4,
        dict(
            _WRAP,
            mesh=dict(shard=2, tensor=2),
            # the recipe's MLP: its hidden layer split over the tensor ranks
            tensor_parallel_plan={'0': 'colwise', '3': 'rowwise'},
        ),
        # mmengine's DefaultSampler splits over every rank, tensor ranks included: the
        # runner's batches are not a tensor-parallel run's
        flexible=None,
    ),
    'deepspeed_zero1': _zero(1),
    'deepspeed_zero2': _zero(2, flexible='name'),
    'deepspeed_zero3': _zero(3),
    'sharded_ddp': Backend('ShardedDDPStrategy', 2, extra='fairscale', flexible='name'),
}
BACKENDS = {k: v for k, v in _ALL.items() if v.extra is None or importlib.util.find_spec(v.extra)}


def load_scenario(source: str, target: str) -> str:
    """The scenario that loads ``source``'s checkpoint into ``target``: a row of the first
    tier loads the slow rows' checkpoints in a scenario of their own, which alone waits for
    the 4-process spawn."""
    slow = BACKENDS[source].slow and not BACKENDS[target].slow
    return f'load_slow.{target}' if slow else f'load.{target}'


# (saved by, loaded into, its scenario)
PAIRS = [(a, b, load_scenario(a, b)) for b in BACKENDS for a in BACKENDS if a != b]
# DeepSpeed first: mmengine imports deepspeed when it can, and the non-DeepSpeed runners
# block that import only where no DeepSpeed runner comes later in the process
FLEXIBLE = (
    sorted(
        (k for k, v in BACKENDS.items() if v.flexible),
        key=lambda k: BACKENDS[k].strategy != 'DeepSpeedStrategy',
    )
    if importlib.util.find_spec('mmengine')
    else []
)
SCENARIOS = Scenarios(
    one=dict(nproc=1, timeout=300),  # the 1-process rows
    two=dict(nproc=2, timeout=1200),  # the 2-process rows: every column
    four=dict(nproc=4, timeout=1200),  # the 4-process rows (meshes): every column
    two_slow=dict(nproc=2, timeout=600),  # the 4-process rows' checkpoints into 2-process rows
    here=dict(nproc=0),  # the loads into the 1-process rows, in the test process
)

# ---------------------------------------------------------------------------- the recipe
ITERS, ACC, STOP, BOUNDARY = 7, 2, 3, 4  # STOP is inside the window [2, 4)
BATCH, LR, CLIP, DROPOUT = 8, 0.05, 0.5, 0.25
OPTIM = dict(
    optimizer=dict(type='Adam', lr=LR),  # torch's: DeepSpeed's own would JIT-build ops
    accumulative_counts=ACC,
    clip_grad=dict(type='norm', max_norm=CLIP),
)
SCHEDULER = [dict(type='LinearLR', start_factor=0.25, by_epoch=False, end=4)]


def _net(dropout: float = 0.0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # the same weights, the global RNG untouched
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3))


def _fixed_batch(it: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Iteration ``it``'s global batch (its own generator), this rank's share."""
    g = torch.Generator().manual_seed(1000 + it)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randint(3, (BATCH,), generator=g)
    per = BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _drawn_batch(it: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch drawn from the global RNG: a resume is exact only if it comes back."""
    return torch.randn(BATCH // world, 6), torch.randint(3, (BATCH // world,))


@functools.lru_cache(maxsize=1)
def reference() -> dict:
    """One process, the whole batch, a plain torch loop: losses, pre-clip norms and the lr of
    each update, final weights."""
    from torch.nn import functional as F

    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    # mmengine's LinearLR(end=4) reaches its end factor at step end - begin - 1
    with warnings.catch_warnings():  # stepped each iteration, before the first update
        warnings.filterwarnings('ignore', 'Detected call of')
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
    tail = ITERS - ITERS % ACC  # the last window is shorter: its losses count 1/its length
    out: dict[str, Any] = dict(losses=[], norms=[], lrs=[])
    for it in range(ITERS):
        x, y = _fixed_batch(it, 0, 1)
        loss = F.cross_entropy(net(x), y)
        (loss / (ACC if it < tail else ITERS - tail)).backward()
        out['losses'].append(loss.item())
        if (it + 1) % ACC == 0 or it + 1 == ITERS:
            out['norms'].append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
            out['lrs'].append(opt.param_groups[0]['lr'])
            opt.step()
            opt.zero_grad()
        with warnings.catch_warnings():
            warnings.filterwarnings('ignore', 'Detected call of')
            sched.step()
    out['weights'] = {k: v.detach().clone() for k, v in net.state_dict().items()}
    out['init'] = {k: v.detach().clone() for k, v in _net().state_dict().items()}
    return out


# ---------------------------------------------------------------------------- in every rank
def _build(name: str, work_dir: Path, **options: Any) -> Any:
    from stratagem.strategies import build_strategy

    row = BACKENDS[name]
    return build_strategy(
        dict(
            type=row.strategy,
            work_dir=str(work_dir),
            env_kwargs=dict(randomness=dict(seed=5, diff_rank_seed=True)),
            **row.options,
            **options,
        )
    )


def _prepare(s: Any, dropout: float = 0.0) -> tuple[Any, Any, list]:
    model, ow, scheds = s.prepare(
        _net(dropout),
        optim_wrapper=copy.deepcopy(OPTIM),
        param_scheduler=copy.deepcopy(SCHEDULER),
        dispatch_kwargs=dict(
            max_iters=ITERS, train_micro_batch_size_per_gpu=BATCH // s.data_parallel_size
        ),
    )
    return model, ow, scheds


def _whole(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, 'full_tensor') else t  # a DTensor: collective


def _weights(s: Any) -> dict:
    """The full weights (every rank calls it: gathering may be collective)."""
    return {k: _whole(v).detach().clone() for k, v in s.model_state_dict().items()}


def _train(s, model, ow, scheds, start, stop, batch, record=None) -> None:
    from torch.nn import functional as F

    for it in range(start, stop):
        x, y = _one_per_tensor_group(s, *batch(it, s.data_parallel_rank, s.data_parallel_size))
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x), y)
        ow.update_params(loss)
        if record is not None:
            record['losses'].append(loss.item())
            if ow.should_update():
                record['norms'].append(float(_whole(ow.last_grad_norm)))
                record['lrs'].append(ow.param_groups[0]['lr'])
        for sch in scheds:
            sch.step()


def _one_per_tensor_group(s: Any, *batch: torch.Tensor) -> tuple:
    """The tensor ranks of one data-parallel index compute on one batch: its first rank's
    (a batch drawn from the per-rank seeded RNG differs between them)."""
    mesh = getattr(s, 'device_mesh', None)
    if mesh is None or 'tensor' not in (mesh.mesh_dim_names or ()):
        return batch
    import torch.distributed as dist

    group = mesh['tensor'].get_group()
    for t in batch:
        dist.broadcast(t, group_src=0, group=group)
    return batch


def _equal(tmp: str, backend: str) -> dict:
    s = _build(backend, Path(tmp, backend, 'equal'))
    model, ow, scheds = _prepare(s)
    record: dict[str, list] = dict(losses=[], norms=[], lrs=[])
    _train(s, model, ow, scheds, 0, ITERS, _fixed_batch, record)
    return dict(record, weights=_weights(s), world=s.world_size)


def _resume(tmp: str, backend: str) -> dict:
    """Run A saves (mid window, or refused there and at the boundary) and trains on; a fresh
    strategy B resumes A's checkpoint and trains to the end."""
    work = Path(tmp, backend, 'resume')
    a = _build(backend, work)
    model, ow, scheds = _prepare(a, DROPOUT)
    _train(a, model, ow, scheds, 0, STOP, _drawn_batch)
    out: dict[str, Any] = {'refused': None}
    save_at = STOP
    if not BACKENDS[backend].saves_mid_window:
        try:
            a.save_checkpoint(f'iter_{STOP}', extra_ckpt={'meta': {'iter': STOP}})
        except ValueError as err:
            out['refused'] = str(err)
        out['after_refusal'] = sorted(n for n in os.listdir(work) if 'iter_' in n)
        _train(a, model, ow, scheds, STOP, BOUNDARY, _drawn_batch)
        save_at = BOUNDARY
    path = a.save_checkpoint(f'iter_{save_at}', extra_ckpt={'meta': {'iter': save_at}})
    out.update(path=path, save_at=save_at, at_save=_weights(a), probe=torch.rand(2))
    _train(a, model, ow, scheds, save_at, ITERS, _drawn_batch)
    out.update(final=_weights(a), lr=ow.param_groups[0]['lr'])
    b = _build(backend, work)
    model, ow, scheds = _prepare(b, DROPOUT)
    torch.manual_seed(1234)  # the checkpoint must bring the RNG back
    ckpt = b.resume(path)
    resumed = dict(iter=ckpt['meta']['iter'], probe=torch.rand(2))
    _train(b, model, ow, scheds, ckpt['meta']['iter'], ITERS, _drawn_batch)
    out['resumed'] = dict(resumed, final=_weights(b), lr=ow.param_groups[0]['lr'])
    return out


@contextlib.contextmanager
def _held_writer(gate: threading.Event):
    """Every asynchronous write job waits for ``gate`` before it starts."""
    from stratagem.checkpoint.async_writer import AsyncCheckpointWriter

    real = AsyncCheckpointWriter.submit

    def held(self, job, *args, **kwargs):
        def later():
            gate.wait(120)
            return job(*args, **kwargs)

        return real(self, later)

    AsyncCheckpointWriter.submit = held
    try:
        yield
    finally:
        gate.set()
        AsyncCheckpointWriter.submit = real


def _async(tmp: str, backend: str, **needs: Any) -> dict:
    """resume.<backend>'s run again, its save asynchronous: trained on and overwritten while
    the write waits; a fresh strategy resumes the checkpoint and trains to the end."""
    save_at = needs[f'resume.{backend}']['save_at']
    work = Path(tmp, backend, 'async')
    s = _build(backend, work, async_checkpoint=True)
    model, ow, scheds = _prepare(s, DROPOUT)
    _train(s, model, ow, scheds, 0, save_at, _drawn_batch)
    gate = threading.Event()
    with _held_writer(gate):
        path = s.save_checkpoint(f'iter_{save_at}', extra_ckpt={'meta': {'iter': save_at}})
        _train(s, model, ow, scheds, save_at, save_at + 2, _drawn_batch)  # one update
        with torch.no_grad():
            for p in model.parameters():
                p.data.fill_(7.0)
        out: dict[str, Any] = dict(
            pending=s.checkpointer.writer.pending, exists_meanwhile=os.path.exists(path)
        )
        gate.set()
        s.wait_for_checkpoints()
    reader = _build(backend, work)
    model, ow, scheds = _prepare(reader, DROPOUT)
    torch.manual_seed(1234)
    ckpt = reader.resume(path)
    out.update(iter=ckpt['meta']['iter'], probe=torch.rand(2))
    _train(reader, model, ow, scheds, ckpt['meta']['iter'], ITERS, _drawn_batch)
    out['final'] = _weights(reader)
    return out


def _load(tmp: str, backend: str, **needs: Any) -> dict:
    """Every other row's checkpoint loaded into this row: between two, this row's own
    untrained checkpoint, so that each load has to change every weight."""
    s = _build(backend, Path(tmp, backend, 'load'))
    _prepare(s)
    if s.world_size > 2:  # a 2-process need's values are its ranks 0 and 1's only
        import torch.distributed as dist

        box = [needs if s.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        needs = box[0]
    init_path = s.save_checkpoint('init', extra_ckpt={'meta': {'iter': 0}})
    init = _weights(s)
    out = {}
    for need, saved in needs.items():
        s.load_checkpoint(init_path)
        reset = _equal_weights(_weights(s), init)
        s.load_checkpoint(saved['path'])
        got = _weights(s)
        out[need.split('.', 1)[1]] = dict(
            reset=reset,
            equal=_equal_weights(got, saved['at_save']),
            moved=all(not torch.equal(got[k], init[k]) for k in init if k.endswith('weight')),
        )
    return out


def _equal_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------- FlexibleRunner
def _toy_model():
    from mmengine.model import BaseModel

    class ToyModel(BaseModel):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, inputs, labels, mode='tensor'):
            out = self.head(torch.relu(self.linear(inputs)))
            if mode == 'loss':
                return {'loss': ((out - labels) ** 2).mean()}
            return out

    torch.manual_seed(0)  # the same initial weights in every run and rank
    return ToyModel()


def _toy_dataset() -> list:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)
    return [dict(inputs=x[i], labels=y[i]) for i in range(32)]


def _runner(work_dir: Path, backend: str, max_epochs: int, resume: bool = False):
    from mmengine.runner import FlexibleRunner

    import stratagem.integrations.mmengine  # noqa: F401  (allow-list, scoped names)
    from stratagem import strategies

    row = BACKENDS[backend]
    kind = (
        getattr(strategies, row.strategy)
        if row.flexible == 'class'
        else f'stratagem.{row.strategy}'
    )
    return FlexibleRunner(
        model=_toy_model(),
        work_dir=str(work_dir),
        # a name of its own (mmengine's default, a timestamp to the second, is shared by the
        # runners of one process started within a second, and with it their MessageHub):
        # the resumed runner's history then comes from the checkpoint alone
        experiment_name=f'{backend}_{work_dir.name}_{max_epochs}_{int(resume)}',
        strategy=dict(type=kind, **row.options),
        launcher='pytorch' if row.nproc > 1 else 'none',
        # no env_cfg: FlexibleRunner's default (backend='nccl') must run on a CPU machine
        randomness=dict(seed=3),
        train_dataloader=dict(
            dataset=_toy_dataset(),
            batch_size=4,
            collate_fn=dict(type='default_collate'),
            sampler=dict(type='DefaultSampler', shuffle=True),
        ),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9)),
        param_scheduler=dict(type='MultiStepLR', milestones=[2, 3], end=4),
        train_cfg=dict(by_epoch=True, max_epochs=max_epochs),
        default_hooks=dict(
            checkpoint=dict(type='CheckpointHook', interval=1),
            logger=dict(type='LoggerHook', interval=2),
        ),
        resume=resume,
        log_level='WARNING',
    )


def _values(tensor: Any) -> list:
    return _whole(tensor).tolist()


def _runner_state(runner: Any) -> dict:
    strategy = runner.strategy
    optim = strategy.optim_state_dict()
    return {
        'weights': {k: _values(v) for k, v in strategy.model_state_dict().items()},
        # a sharded optimizer (OSS) gathers its whole state on rank 0 only
        'momentum': [_values(st['momentum_buffer']) for st in optim['state'].values()]
        if 'state' in optim
        else None,
        'lr': [g['lr'] for g in strategy.optim_wrapper.param_groups],
        'schedulers': strategy.scheduler_state_dict(),
        'iter': runner.iter,
        'epoch': runner.epoch,
        'lr_history': runner.message_hub.get_scalar('train/lr').data[0].tolist(),
        'resumed_from': strategy.resumed_from,
        # the loop's train_step ran on the wrapper (forward through it: gradient hooks),
        # and the step's zero_grad left no gradient behind
        'step_on_wrapper': getattr(runner.model.train_step, '__self__', None) is runner.model,
        'grads_left': [
            n
            for n, p in runner.model.named_parameters()
            if p.grad is not None and bool(p.grad.count_nonzero())
        ],
    }


def _flexible(tmp: str, backend: str) -> dict:
    """3 epochs, then a new runner resumes to 4; then 4 epochs in one go (in
    ``<tmp>/<backend>/flexible``)."""
    if BACKENDS[backend].strategy != 'DeepSpeedStrategy':
        # mmengine imports deepspeed when it is installed (~4 s per process on the CI machine)
        sys.modules.setdefault('deepspeed', None)
    root = Path(tmp, backend, 'flexible')
    _runner(root / 'split', backend, 3).train()
    resumed = _runner(root / 'split', backend, 4, resume=True)
    resumed.train()
    straight = _runner(root / 'straight', backend, 4)
    straight.train()
    # what was saved loads back with weights_only=True, message hub and all (through the
    # backend's reader: a sharded backend writes a directory)
    ckpt = resumed.strategy.checkpointer.storage.read(str(root / 'split' / 'epoch_3.pth'), 'cpu')
    hub = ckpt['message_hub']['log_scalars']['train/lr']
    return {
        'resumed': _runner_state(resumed),
        'straight': _runner_state(straight),
        'epoch_3_meta': {k: ckpt['meta'][k] for k in ('epoch', 'iter')},
        'epoch_3_lr_history': hub.data[0].tolist(),
        'rank': resumed.rank,
        'world': resumed.world_size,
    }


def manifest_of(path: Path) -> dict:
    """The manifest of a checkpoint (a file's beside it, a directory's inside it)."""
    where = (
        path / 'manifest.json' if path.is_dir() else path.with_name(f'{path.name}.manifest.json')
    )
    return json.loads(where.read_text())


# ---------------------------------------------------------------------------- the table
def _spawn(backend: str) -> str:
    return {1: 'one', 2: 'two', 4: 'four'}[BACKENDS[backend].nproc]


def _load_spawn(scenario: str, target: str) -> str:
    if BACKENDS[target].nproc == 1:
        return 'here'
    return 'two_slow' if scenario.startswith('load_slow.') else _spawn(target)


for _name in BACKENDS:
    SCENARIOS.add(_spawn(_name), name=f'equal.{_name}')(functools.partial(_equal, backend=_name))
    SCENARIOS.add(_spawn(_name), name=f'resume.{_name}')(functools.partial(_resume, backend=_name))
    SCENARIOS.add(_spawn(_name), name=f'async.{_name}', needs=[f'resume.{_name}'])(
        functools.partial(_async, backend=_name)
    )
_LOADS: dict[tuple[str, str], list[str]] = {}  # (scenario, target) -> its sources
for _source, _target, _scenario in PAIRS:
    _LOADS.setdefault((_scenario, _target), []).append(_source)
for (_scenario, _target), _sources in _LOADS.items():  # after every resume: their sources
    SCENARIOS.add(
        _load_spawn(_scenario, _target),
        name=_scenario,
        needs=[f'resume.{source}' for source in _sources],
    )(functools.partial(_load, backend=_target))
for _name in FLEXIBLE:  # last in their spawn: mmengine's runner sets up process-wide state
    SCENARIOS.add(_spawn(_name), name=f'flexible.{_name}')(
        functools.partial(_flexible, backend=_name)
    )
