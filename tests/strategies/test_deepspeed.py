"""DeepSpeedStrategy on 2 gloo processes (CPU): ZeRO-0 against one process, accumulation,
clipping and schedulers against the OptimWrapper oracle, checkpoints (exact resume, 2 -> 1,
tampering, conversion, async errors). ZeRO 1-3 equal to one process (accumulation, clipping,
schedulers), the refused mid-window save and the exact resume, the async save and the
cross-backend loads are their rows of the conformance table (test_conformance.py).

Processes start at most twice for the module (2 ranks, then 1 rank to resume at another world
size), and every check runs inside them as a scenario (tests/scenarios.py), several engines
per process: DeepSpeed JIT-builds its shm communication op once per machine (~30-60 s cold,
cached in ~/.cache/torch_extensions). A session runs only the scenarios its tests name.
Optimizers are torch's (a DeepSpeed-config optimizer would JIT-build fused_adam).
"""

import errno
import functools
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip('deepspeed', reason='DeepSpeed is an optional extra (stratagem[deepspeed])')

from scenarios import Scenarios

MAX_ITERS = 10
SAVE_AT = 6  # a window boundary (windows of 3: [0,3) [3,6) [6,9) [9,10))
_COMPONENTS = dict(
    optim_wrapper=dict(
        type='DeepSpeedOptimWrapper',
        optimizer=dict(type='Adam', lr=0.05),
        accumulative_counts=3,
        clip_grad=dict(type='norm', max_norm=0.5),
    ),
    param_scheduler=[
        dict(type='LinearLR', start_factor=0.25, by_epoch=False, end=4),
        dict(type='CosineAnnealingLR', by_epoch=False, begin=4, T_max=6),
    ],
    dispatch_kwargs=dict(max_iters=MAX_ITERS, train_micro_batch_size_per_gpu=4),
)
# 'ranks': every check; 'one_rank': the 2-rank ZeRO-2 checkpoint resumed on 1 rank
SCENARIOS = Scenarios(ranks=dict(nproc=2, timeout=420), one_rank=dict(nproc=1, timeout=240))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(it: int, world: int = 2):
    """The global batch of iteration ``it``: 4 samples per rank of a 2-rank run."""
    g = torch.Generator().manual_seed(1000 + it)
    return torch.randn(4 * world, 6, generator=g), torch.randint(3, (4 * world,), generator=g)


def _strategy(work_dir, **kwargs):
    from stratagem.strategies import build_strategy

    kwargs.setdefault('env_kwargs', dict(randomness=dict(seed=7)))
    return build_strategy(dict(type='DeepSpeedStrategy', work_dir=str(work_dir), **kwargs))


def _full_weights(s):
    return {k: v.detach().float().clone() for k, v in s.model_state_dict().items()}


def _max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _oracle(iters, accumulative_counts=1, clip=None, lr=0.05, schedulers=True, start=None):
    """One process, the whole batch, stratagem's OptimWrapper: the numerical reference.
    Returns (weights, lrs used at each update, pre-clip norms at each update)."""
    from torch.nn import functional as F

    from stratagem.optim import OptimWrapper
    from stratagem.scheduler import build_param_schedulers

    model = _net()
    if start is not None:
        model.load_state_dict(start)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ow = OptimWrapper(
        opt,
        accumulative_counts=accumulative_counts,
        clip_grad=None if clip is None else dict(max_norm=clip),
    )
    ow.initialize_count_status(model, 0, iters)
    scheds = (
        build_param_schedulers(_COMPONENTS['param_scheduler'], ow, max_iters=iters)
        if schedulers
        else []
    )
    lrs, norms = [], []
    opt.register_step_pre_hook(lambda o, *a: lrs.append(o.param_groups[0]['lr']))
    for it in range(iters):
        x, y = _batch(it)
        ow.update_params(F.cross_entropy(model(x), y))
        if ow.should_update() and ow.last_grad_norm is not None:
            norms.append(float(ow.last_grad_norm))
        for s in scheds:
            s.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, lrs, norms


def _train(s, model, ow, scheds, start, stop, rank, updates=None):
    from torch.nn import functional as F

    for it in range(start, stop):
        x, y = _batch(it)
        half = slice(rank * 4, rank * 4 + 4)
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x[half]), y[half])
        ow.update_params(loss)
        if updates is not None and ow.should_update():
            updates.append(float(ow.last_grad_norm))
        for sch in scheds:
            sch.step()


@SCENARIOS.add('ranks')
def zero_stages(tmp):
    """ZeRO-0 (1-3: the conformance table), fp32, torch Adam: 3 steps equal one process on
    the whole batch."""
    out = {}
    ref, _, _ = _oracle(3, schedulers=False)
    for stage in (0,):
        s = _strategy(os.path.join(tmp, f'z{stage}'), zero_optimization=dict(stage=stage))
        model, ow = s.prepare(
            _net(),
            optim_wrapper=dict(optimizer=dict(type='Adam', lr=0.05)),
            dispatch_kwargs=dict(train_micro_batch_size_per_gpu=4),
        )
        _train(s, model, ow, [], 0, 3, s.rank)
        out[f'zero{stage}_diff'] = _max_diff(_full_weights(s), ref)
        out[f'zero{stage}_gas_clip'] = (
            s.model.gradient_accumulation_steps(),
            s.model.gradient_clipping(),
        )
        out['rank'], out['world'] = s.rank, s.world_size
    return out


@SCENARIOS.add('ranks')
def bf16(tmp):
    """bf16 (ZeRO-2) runs the same 3 steps, close to fp32 on the whole batch."""
    ref, _, _ = _oracle(3, schedulers=False)
    s = _strategy(
        os.path.join(tmp, 'bf16'),
        zero_optimization=dict(stage=2),
        bf16=dict(enabled=True),
        inputs_to_half=[0],
    )
    model, ow = s.prepare(
        _net(),
        optim_wrapper=dict(optimizer=dict(type='Adam', lr=0.05)),
        dispatch_kwargs=dict(train_micro_batch_size_per_gpu=4),
    )
    _train(s, model, ow, [], 0, 3, s.rank)
    return {
        'bf16_dtype': str(next(s.model.module.parameters()).dtype),
        'bf16_diff': _max_diff(_full_weights(s), ref),
    }


def _accumulation_clipping_schedulers(tmp, stage):
    """Accumulation 3 with a tail window, clipping, schedulers under ZeRO ``stage``, and the
    OptimWrapper oracle's."""
    want, want_lrs, want_norms = _oracle(MAX_ITERS, 3, clip=0.5)
    s = _strategy(os.path.join(tmp, f'acc{stage}'), zero_optimization=dict(stage=stage))
    model, ow, scheds = s.prepare(_net(), **_COMPONENTS)
    lrs = []
    ow.optimizer.register_step_pre_hook(lambda o, *a: lrs.append(o.param_groups[0]['lr']))
    norms = []
    _train(s, model, ow, scheds, 0, MAX_ITERS, s.rank, norms)
    return {
        f'acc{stage}': dict(
            diff=_max_diff(_full_weights(s), want),
            updates=s.model.global_steps,
            lrs=lrs,
            norms=norms,
            inner=ow.inner_count,
        ),
        'oracle': dict(lrs=want_lrs, norms=want_norms),
    }


for _stage in (0,):  # 2 and 3: the conformance table
    SCENARIOS.add('ranks', name=f'accumulation_{_stage}')(
        functools.partial(_accumulation_clipping_schedulers, stage=_stage)
    )


@SCENARIOS.add('ranks')
def zero_grad_in_window(tmp):
    """zero_grad inside a window drops its partial gradients, as OptimWrapper's does."""
    from torch.nn import functional as F

    from stratagem.optim import OptimWrapper

    out = {}
    ref_model = _net()
    ref_ow = OptimWrapper(torch.optim.Adam(ref_model.parameters(), lr=0.05), accumulative_counts=3)
    ref_ow.initialize_count_status(ref_model, 0, 3)
    for stage in (0, 2, 3):
        s = _strategy(os.path.join(tmp, f'zg{stage}'), zero_optimization=dict(stage=stage))
        model, ow = s.prepare(
            _net(),
            optim_wrapper=dict(optimizer=dict(type='Adam', lr=0.05), accumulative_counts=3),
            dispatch_kwargs=dict(max_iters=3, train_micro_batch_size_per_gpu=4),
        )
        pairs = [(model, ow, slice(s.rank * 4, s.rank * 4 + 4))]
        if stage == 0:
            pairs.append((ref_model, ref_ow, slice(None)))
        for it in range(3):
            x, y = _batch(it)
            for m, o, part in pairs:
                o.update_params(F.cross_entropy(m(x[part]), y[part]))
                if it == 0:
                    try:
                        o.zero_grad()
                    except RuntimeError as e:  # refused under ZeRO: DeepSpeed's buffers
                        out[f'zero_grad{stage}'] = str(e)
        out.setdefault(f'zero_grad{stage}', _max_diff(_full_weights(s), ref_model.state_dict()))
    return out


@SCENARIOS.add('ranks')
def auto_scale_lr(tmp):
    """auto_scale_lr (mmengine's DeepSpeedStrategy never applies it): real batch 2 ranks x 4 x 3."""
    s = _strategy(
        os.path.join(tmp, 'scale'),
        zero_optimization=dict(stage=1),
        auto_scale_lr=dict(enable=True, base_batch_size=8),
    )
    model, ow = s.prepare(
        _net(),
        optim_wrapper=dict(optimizer=dict(type='Adam', lr=0.05), accumulative_counts=3),
        dispatch_kwargs=dict(max_iters=3, train_micro_batch_size_per_gpu=4),
    )
    used = []
    ow.optimizer.register_step_pre_hook(lambda o, *a: used.append(o.param_groups[0]['lr']))
    _train(s, model, ow, [], 0, 3, s.rank)
    return {'scaled_lr': (ow.get_lr()['lr'][0], used)}


@SCENARIOS.add('ranks')
def disagreeing_settings(tmp):
    """Disagreeing DeepSpeed settings raise, naming both values."""
    errors = {}
    for key, kwargs, wrapper in (
        ('gas', dict(gradient_accumulation_steps=2), dict(accumulative_counts=3)),
        ('clip', dict(config=dict(gradient_clipping=1.0)), {}),
        ('clip2', dict(gradient_clipping=0.3), dict(clip_grad=dict(max_norm=0.5))),
        ('micro', dict(train_micro_batch_size_per_gpu=8), {}),
        ('type', {}, dict(type='AmpOptimWrapper')),
    ):
        s = _strategy(os.path.join(tmp, 'bad'), zero_optimization=dict(stage=2), **kwargs)
        try:
            s.prepare(
                _net(),
                optim_wrapper=dict(optimizer=dict(type='Adam', lr=0.1), **wrapper),
                dispatch_kwargs=dict(max_iters=4, train_micro_batch_size_per_gpu=4),
            )
        except (ValueError, TypeError) as e:
            errors[key] = str(e)
    return {'errors': errors}


@SCENARIOS.add('ranks')
def mmengine_config(tmp):
    """An mmengine DeepSpeedStrategy config builds (fp16 -> bf16 on this CPU) and trains."""
    s = _strategy(
        os.path.join(tmp, 'mm'),
        bf16=dict(enabled=True),
        inputs_to_half=[0],
        zero_optimization=dict(
            stage=3,
            allgather_partitions=True,
            reduce_scatter=True,
            allgather_bucket_size=50000000,
            reduce_bucket_size=50000000,
            overlap_comm=True,
            contiguous_gradients=True,
            cpu_offload=False,
        ),
        gradient_accumulation_steps=2,
        steps_per_print=100,
        exclude_frozen_parameters=False,
    )
    model, ow = s.prepare(
        _net(),
        optim_wrapper=dict(
            type='DeepSpeedOptimWrapper',
            optimizer=dict(type='AdamW', lr=1e-3),
            accumulative_counts=2,
        ),
        dispatch_kwargs=dict(max_iters=4),
    )
    _train(s, model, ow, [], 0, 4, s.rank)
    return {'mm_updates': s.model.global_steps}


def _save_resume_exact(tmp, stage):
    """Run B resumes run A's checkpoint at SAVE_AT and ends where A ended, bit for bit."""
    out = {}
    work = os.path.join(tmp, f'ck{stage}')
    path, saved, rng_after_save, final_a = _run_a_saves(work, out, stage)
    torch.manual_seed(1234)  # a resumed run must get its RNG back from the checkpoint
    b = _strategy(work, zero_optimization=dict(stage=stage))
    model, ow, scheds = b.prepare(_net(), **_COMPONENTS)
    state = b.resume(path)
    rng_resumed = torch.rand(2)
    sched = b.scheduler_state_dict()
    _train(b, model, ow, scheds, SAVE_AT, MAX_ITERS, b.rank)
    out[f'resume{stage}'] = dict(
        path=path,
        iter=state['meta']['iter'],
        listing=sorted(os.listdir(path)),
        exact=all(torch.equal(final_a[k], v) for k, v in _full_weights(b).items()),
        rng=torch.equal(rng_after_save, rng_resumed),
        lr=ow.get_lr()['lr'][0],
        updates=b.model.global_steps,
        saved=saved,
        final=final_a,
        work_listing=sorted(os.listdir(work)),
        sched=sched,
    )
    return out


for _stage in (2,):  # 3: the conformance table
    SCENARIOS.add('ranks', name=f'save_resume_{_stage}')(
        functools.partial(_save_resume_exact, stage=_stage)
    )


def _run_a_saves(work, out, stage):
    """Run A: refused mid window, saved at SAVE_AT; returns (path, weights, next draw, final)."""
    a = _strategy(work, zero_optimization=dict(stage=stage))
    model, ow, scheds = a.prepare(_net(), **_COMPONENTS)
    _train(a, model, ow, scheds, 0, 4, a.rank)
    try:  # mid window: refused before anything is written
        a.save_checkpoint('iter_4.pth', extra_ckpt={'meta': {'iter': 4}})
    except ValueError as e:
        out[f'midwindow{stage}'] = (str(e), sorted(os.listdir(work)))
    _train(a, model, ow, scheds, 4, SAVE_AT, a.rank)
    path = a.save_checkpoint(f'iter_{SAVE_AT}.pth', extra_ckpt={'meta': {'iter': SAVE_AT}})
    saved = _full_weights(a)
    rng_after_save = torch.rand(2)
    _train(a, model, ow, scheds, SAVE_AT, MAX_ITERS, a.rank)
    return path, saved, rng_after_save, _full_weights(a)


@SCENARIOS.add('ranks', needs=['save_resume_2'])
def load_checkpoint(tmp, save_resume_2):
    """Weights only, from the directory, into a fresh ZeRO-2 engine: the fp32 masters follow."""
    out = save_resume_2
    c = _strategy(os.path.join(tmp, 'load'), zero_optimization=dict(stage=2))
    model, ow = c.prepare(
        _net(),
        optim_wrapper=dict(optimizer=dict(type='Adam', lr=0.0)),
        dispatch_kwargs=dict(train_micro_batch_size_per_gpu=4),
    )
    c.load_checkpoint(out['resume2']['path'])
    loaded = _full_weights(c)
    _train(c, model, ow, [], 0, 1, c.rank)  # an update with lr 0 keeps them
    return {
        'load_only': (
            _max_diff(loaded, out['resume2']['saved']),
            _max_diff(_full_weights(c), out['resume2']['saved']),
        )
    }


@SCENARIOS.add('ranks', needs=['save_resume_2'])
def tampered(tmp, save_resume_2):
    """Tampering: refused on every rank before DeepSpeed unpickles anything."""
    from stratagem.checkpoint import CheckpointCorruptError

    out = {}
    cases = {
        'flipped': os.path.join(tmp, 'flipped'),
        'payload': os.path.join(tmp, 'payload'),
        'foreign': os.path.join(tmp, 'foreign'),
    }
    if torch.distributed.get_rank() == 0:
        _tamper(save_resume_2['resume2']['path'], cases, os.path.join(tmp, 'pwned'))
    torch.distributed.barrier()
    d = _strategy(os.path.join(tmp, 'tamper'), zero_optimization=dict(stage=2))
    d.prepare(_net(), **_COMPONENTS)
    out['tampered'] = {}
    for case, where in cases.items():
        for call in ('resume', 'load_checkpoint'):
            try:
                getattr(d, call)(where)
                out['tampered'][case, call] = None
            except CheckpointCorruptError as e:
                out['tampered'][case, call] = str(e)
    out['pwned'] = os.path.exists(os.path.join(tmp, 'pwned'))
    return out


def _tamper(src, cases, pwned):
    """Copies ``src`` to each case's place and damages the copy as the case names."""
    for where in cases.values():
        shutil.copytree(src, where)
    shard = sorted(Path(cases['flipped'], 'deepspeed').glob('*optim_states.pt'))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    shard.write_bytes(bytes(data))
    # a shard replaced by a pickle whose loading runs code (creates the file ``pwned``)
    shard = sorted(Path(cases['payload'], 'deepspeed').glob('*optim_states.pt'))[0]
    shard.write_bytes(pickle.dumps(_Boom(pwned)))
    os.remove(os.path.join(cases['foreign'], 'manifest.json'))  # DeepSpeed's files only


def _optim_values(s):
    """DeepSpeed's optimizer state per parameter, gathered and without the partitions'
    padding (uninitialised memory; collective under ZeRO-3): fp32 master weights and Adam's
    moments, then the step count of each partition."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    link = getattr(s.model.optimizer, '_lazy_init_hp_params_optimizer_state', None)
    if link is not None:  # ZeRO-1/2 make these views at the first step; a resumed engine
        link()  # has not stepped yet (so a reader resumes only once)
    found = []
    for param in s.model.module.parameters():
        found.append(safe_get_full_fp32_param(param).clone())
        found += [
            safe_get_full_optimizer_state(param, key).clone() for key in ('exp_avg', 'exp_avg_sq')
        ]
    return found + [float(state['step']) for state in s.model.optimizer.optimizer.state.values()]


def _snap(s):
    """What a resume must restore: weights, optimizer state, schedulers, counters (every
    rank; ZeRO-3 gathers the weights)."""
    return dict(
        weights=_full_weights(s),
        optim=_optim_values(s),
        sched=s.scheduler_state_dict(),
        wrapper=s.optim_wrapper.state_dict(),
        steps=(s.model.global_steps, s.model.global_samples),
        lr=[g['lr'] for g in s.optim_wrapper.param_groups],
    )


def _diff(a, b):
    """The parts of two ``_snap``s that differ (bit-exact); [] when equal."""
    bad = [k for k in a['weights'] if not torch.equal(a['weights'][k], b['weights'][k])]
    if len(a['optim']) != len(b['optim']):
        bad.append(f'optim: {len(a["optim"])} != {len(b["optim"])} values')
    for i, (x, y) in enumerate(zip(a['optim'], b['optim'])):
        if type(x) is not type(y) or not (
            torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        ):
            bad.append(f'optim[{i}]: {x!r} != {y!r}'[:300])
    return bad + [k for k in ('sched', 'wrapper', 'steps', 'lr') if a[k] != b[k]]


# async_checkpoint=True: DeepSpeed's engine hands its files over in the foreground, the writer
# thread writes and commits them while training (DeepSpeed's collectives on the default group)
# goes on; the checkpoint holds the state at the save, exactly as a sync save's; errors on the
# writer thread or before it reach every rank.
def _async_save_is_the_state_at_the_call(tmp, stage):
    """A sync and an async run side by side; returns the async save's record."""
    runs = []
    for kind in ('sync', 'async'):
        s = _strategy(
            os.path.join(tmp, f'async{stage}_{kind}'),
            zero_optimization=dict(stage=stage),
            async_checkpoint=kind == 'async',
        )
        runs.append((s, *s.prepare(_net(), **_COMPONENTS)))
        _train(*runs[-1], 0, SAVE_AT, s.rank)
    sync, asyn = runs[0][0], runs[1][0]
    at_save = _snap(asyn)
    meta = {'meta': {'iter': SAVE_AT}}
    sync_path = sync.save_checkpoint('sync_6', extra_ckpt=meta)
    r, path = _async_save_overlaps_training(runs, meta, at_save)
    _async_resumes_as_saved(tmp, stage, r, (path, sync_path), at_save)
    r.update(sync_path=sync_path, saved=at_save['weights'], sched=at_save['sched'])
    return r


for _stage in (3,):  # 1: the conformance table
    SCENARIOS.add('ranks', name=f'async_{_stage}')(
        functools.partial(_async_save_is_the_state_at_the_call, stage=_stage)
    )


def _async_save_overlaps_training(runs, meta, at_save):
    """The writer waits while both runs train on; returns the record and the save's path."""
    import threading

    from stratagem.checkpoint import find_latest_checkpoint
    from stratagem.strategies.deepspeed import capture

    sync, asyn = runs[0][0], runs[1][0]
    gate, written, real = threading.Event(), [], capture.write_torch_file

    def held(state, path, _real=real):  # the writer waits until training went on
        gate.wait(120)
        written.append(path)
        return _real(state, path)

    capture.write_torch_file = held
    try:
        path = asyn.save_checkpoint('async_6', extra_ckpt=meta)
        for s, model, ow, scheds in runs:  # an update (iteration 8) while it is written
            _train(s, model, ow, scheds, SAVE_AT, SAVE_AT + 3, s.rank)
        r = dict(
            pending=asyn.checkpointer.writer.pending,
            written_meanwhile=len(written),
            exists_meanwhile=os.path.exists(path),
            trained=_diff(_snap(asyn), at_save) != [],
            same_training=_diff(_snap(sync), _snap(asyn)),
        )
        gate.set()
        asyn.wait_for_checkpoints()
    finally:
        gate.set()
        capture.write_torch_file = real
    r.update(
        written=len(written),
        latest=str(find_latest_checkpoint(Path(path).parent)),
        listing=sorted(os.listdir(path)),
        staged_bytes=asyn.checkpointer.writer.staged_bytes,
    )
    return r, path


def _async_resumes_as_saved(tmp, stage, r, paths, at_save):
    """Fresh engines resume the async and the sync save: both bit-exact, the state at the save."""
    resumed = []
    for name, where in zip(('async', 'sync'), paths):
        reader = _strategy(
            os.path.join(tmp, f'async{stage}_r{name}'), zero_optimization=dict(stage=stage)
        )
        reader.prepare(_net(), **_COMPONENTS)
        r[f'iter_{name}'] = reader.resume(where)['meta']['iter']
        resumed.append(_snap(reader))
    r['vs_save'] = _diff(resumed[0], at_save)
    r['vs_sync'] = _diff(resumed[0], resumed[1])


def _resume_without_optimizer(work, stage, path, micro=4):
    """A fresh ZeRO-``stage`` engine (``micro`` samples per rank) resumes ``path`` with
    ``resume_optimizer=False``: the
    weights and fp32 masters, a fresh optimizer, the schedulers and counters; the checkpoint's
    listing and the temporary directory before and after (nothing written into either)."""
    import tempfile

    from deepspeed.utils import safe_get_full_fp32_param

    def temps():
        return sorted(p.name for p in Path(tempfile.gettempdir()).glob('stratagem-latest-*'))

    listing, before = sorted(os.listdir(path)), temps()
    s = _strategy(work, zero_optimization=dict(stage=stage))
    dispatch = dict(max_iters=MAX_ITERS, train_micro_batch_size_per_gpu=micro)
    model, ow, scheds = s.prepare(_net(), **dict(_COMPONENTS, dispatch_kwargs=dispatch))
    state = s.resume(path, resume_optimizer=False)
    masters = {
        name: safe_get_full_fp32_param(p).clone() for name, p in s.model.module.named_parameters()
    }
    return dict(
        iter=state['meta']['iter'],
        weights=_full_weights(s),
        masters=masters,
        adam_state=len(s.model.optimizer.optimizer.state),  # torch Adam's: none until a step
        sched=s.scheduler_state_dict(),
        inner=ow.inner_count,
        listing=(listing, sorted(os.listdir(path))),
        temps=(before, temps()),
    )


@SCENARIOS.add('ranks', needs=['save_resume_2', 'async_3'])
def without_optimizer(tmp, save_resume_2, async_3):
    """resume_optimizer=False of the 2-rank ZeRO-2 and ZeRO-3 checkpoints at 2 ranks (ZeRO-3:
    DeepSpeed consolidates the weights through a `latest` file the checkpoint has not)."""
    return {
        2: _resume_without_optimizer(
            os.path.join(tmp, 'noopt2'), 2, save_resume_2['resume2']['path']
        ),
        3: _resume_without_optimizer(os.path.join(tmp, 'noopt3'), 3, async_3['sync_path']),
    }


@SCENARIOS.add('ranks')
def async_errors(tmp):
    """Failed commit, write and snapshot (at iteration 9, a window boundary) fail every rank:
    a ZeRO-3 async run that saved async_6 and trained on to iteration 9."""
    from stratagem.checkpoint import directory
    from stratagem.strategies.deepspeed import capture

    asyn = _strategy(
        os.path.join(tmp, 'async_errors'), zero_optimization=dict(stage=3), async_checkpoint=True
    )
    model, ow, scheds = asyn.prepare(_net(), **_COMPONENTS)
    _train(asyn, model, ow, scheds, 0, SAVE_AT, asyn.rank)
    asyn.save_checkpoint('async_6', extra_ckpt={'meta': {'iter': SAVE_AT}})
    _train(asyn, model, ow, scheds, SAVE_AT, SAVE_AT + 3, asyn.rank)
    asyn.wait_for_checkpoints()
    real_finalize, real_write = directory.finalize_directory, capture.write_torch_file
    errors = {}
    errors['commit_rank0'] = _attempt(  # rank 0 alone calls finalize_directory
        asyn,
        'fail_commit',
        lambda: setattr(directory, 'finalize_directory', _failing_finalize),
        lambda: setattr(directory, 'finalize_directory', real_finalize),
    )
    errors['write_rank1'] = _attempt(
        asyn,
        'fail_write',
        lambda: setattr(
            capture, 'write_torch_file', _failing_write if asyn.rank == 1 else real_write
        ),
        lambda: setattr(capture, 'write_torch_file', real_write),
    )
    writer = asyn.checkpointer.writer
    for bad in (1, 0):  # before anything reaches this rank's writer thread
        errors[f'snapshot_rank{bad}'] = _attempt(
            asyn,
            f'fail_snapshot{bad}',
            lambda: asyn.rank == bad and setattr(writer, 'snapshot', _failing_snapshot),
            lambda: writer.__dict__.pop('snapshot', None),
        )
    errors['callback_rank1'] = _attempt(  # before its write: the others are in DeepSpeed's
        asyn, 'fail_callback', lambda: None, lambda: None, callback=_refused_on_rank1
    )
    errors['after'] = _attempt(asyn, 'after_errors', lambda: None, lambda: None)
    return errors


def _refused_on_rank1(checkpoint):
    if torch.distributed.get_rank() == 1:
        raise ValueError('refused on rank 1')


def _attempt(asyn, name, patch, undo, callback=None):
    """One async save under ``patch`` (``callback``: the save's): where it raised, what,
    and what it left behind."""
    from stratagem.checkpoint import find_latest_checkpoint

    work = Path(asyn.work_dir)
    patch()
    where, error = 'save', None  # the call that raised
    try:
        asyn.save_checkpoint(name, extra_ckpt={'meta': {'iter': SAVE_AT + 3}}, callback=callback)
        where = 'wait'
        asyn.wait_for_checkpoints()
        where = None
    except Exception as err:  # noqa: BLE001
        error = f'{type(err).__name__}: {err}'
    finally:
        undo()
    # a rank that failed on its own returns before rank 0 has removed the staging dir
    torch.distributed.barrier()
    return dict(
        where=where,
        error=error,
        exists=(work / name).exists(),
        latest=str(find_latest_checkpoint(work)),
        temps=[n for n in os.listdir(work) if '.tmp-' in n],
    )


def _failing_finalize(*args, **kwargs):
    """An injected commit failure."""
    raise OSError('injected: commit failed')


def _failing_write(state, path):
    """An injected full disk."""
    raise OSError(errno.ENOSPC, 'injected: no space left', str(path))


def _failing_snapshot(*args, **kwargs):
    """An injected out-of-memory while staging."""
    raise MemoryError('injected: no memory for staging')


class _Boom:
    """Unpickling this creates a file: proof that a loader ran the payload."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, 'w'))


@SCENARIOS.add('one_rank', needs=['save_resume_2'])
def resume_one_rank(tmp, save_resume_2):
    """Runs in 1 rank: resume the 2-rank ZeRO-2 checkpoint, finish the run on the whole batch."""
    from torch.nn import functional as F

    path, work = save_resume_2['resume2']['path'], os.path.join(tmp, 'one')
    b = _strategy(work, zero_optimization=dict(stage=2))
    comps = dict(
        _COMPONENTS, dispatch_kwargs=dict(max_iters=MAX_ITERS, train_micro_batch_size_per_gpu=8)
    )
    model, ow, scheds = b.prepare(_net(), **comps)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        state = b.resume(path)
    for it in range(SAVE_AT, MAX_ITERS):
        x, y = _batch(it)
        ow.update_params(F.cross_entropy(model(x), y))
        for sch in scheds:
            sch.step()
    return dict(
        iter=state['meta']['iter'],
        final=_full_weights(b),
        updates=b.model.global_steps,
        warnings=[str(w.message) for w in caught],
    )


@SCENARIOS.add('one_rank', needs=['save_resume_2', 'async_3'])
def without_optimizer_one_rank(tmp, save_resume_2, async_3):
    """resume_optimizer=False of the 2-rank checkpoints on 1 rank, on the same global batch
    (no universal conversion: the weights alone do not depend on the world size)."""
    return {
        2: _resume_without_optimizer(
            os.path.join(tmp, 'noopt2_one'), 2, save_resume_2['resume2']['path'], micro=8
        ),
        3: _resume_without_optimizer(
            os.path.join(tmp, 'noopt3_one'), 3, async_3['sync_path'], micro=8
        ),
    }


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('deepspeed'))


@pytest.mark.scenario('zero_stages')
def test_zero_stages_equal_one_process(scenario):
    for out in scenario:
        assert (out['rank'], out['world']) in ((0, 2), (1, 2))
        assert out['zero0_diff'] < 1e-6, out['zero0_diff']
        # written explicitly: DeepSpeed's default gradient_clipping=1.0 would clip
        assert out['zero0_gas_clip'] == (1, 0.0)


@pytest.mark.scenario('bf16')
def test_bf16_runs_within_tolerance(scenario):
    for out in scenario:
        assert out['bf16_dtype'] == 'torch.bfloat16'
        # bf16 weights (8 bits of mantissa) after 3 Adam steps of lr 0.05: ~1e-2 of fp32
        assert 0 < out['bf16_diff'] < 2e-2, out['bf16_diff']


@pytest.mark.parametrize('stage', [0])
@pytest.mark.scenario('accumulation_{stage}')
def test_accumulation_clipping_schedulers_equal_optim_wrapper(scenario, stage):
    outs = scenario
    oracle = outs[0]['oracle']
    assert len(oracle['lrs']) == 4  # ceil(10 / 3) updates, the last over 1 micro-batch
    for out in outs:
        acc = out[f'acc{stage}']
        assert acc['diff'] < 1e-6, acc['diff']
        assert acc['updates'] == 4 and acc['inner'] == MAX_ITERS
        # the client optimizer stepped once per update, with the oracle's scheduled lrs
        assert acc['lrs'] == pytest.approx(oracle['lrs'], rel=1e-12)
        # pre-clip global norms, as clip_grad_norm_ returns them on the whole batch
        assert acc['norms'] == pytest.approx(oracle['norms'], rel=1e-5)
        assert max(acc['norms']) > 0.5  # clipping was active


@pytest.mark.scenario('auto_scale_lr')
def test_auto_scale_lr_applies(scenario):
    for out in scenario:
        lr, used = out['scaled_lr']
        assert lr == pytest.approx(0.15) and used == [pytest.approx(0.15)]


@pytest.mark.scenario('zero_grad_in_window')
def test_zero_grad_inside_a_window_drops_or_refuses(scenario):
    for out in scenario:
        # without ZeRO the window's gradients are p.grad: dropped, as OptimWrapper drops them
        assert out['zero_grad0'] < 1e-6, out['zero_grad0']
        # under ZeRO they sit in DeepSpeed's reduced buffers: refused, never silently kept
        for stage in (2, 3):
            assert 'inside an accumulation window (iteration 1)' in out[f'zero_grad{stage}']


@pytest.mark.scenario('disagreeing_settings')
def test_disagreeing_settings_raise_naming_both(scenario):
    errors = scenario[0]['errors']
    assert 'gradient_accumulation_steps=2' in errors['gas']
    assert 'accumulative_counts=3' in errors['gas']
    assert 'gradient_clipping=1.0' in errors['clip'] and '0.0' in errors['clip']
    assert 'gradient_clipping=0.3' in errors['clip2'] and '0.5' in errors['clip2']
    assert 'train_micro_batch_size_per_gpu=8' in errors['micro'] and ' 4 ' in errors['micro']
    assert 'AmpOptimWrapper' in errors['type']


@pytest.mark.scenario('mmengine_config')
def test_mmengine_config_builds_and_trains(scenario):
    for out in scenario:
        assert out['mm_updates'] == 2


@pytest.mark.parametrize('stage', [2])
@pytest.mark.scenario('save_resume_{stage}')
def test_save_resume_exact_at_two_ranks(scenario, stage):
    outs = scenario
    for out in outs:
        r = out[f'resume{stage}']
        assert r['iter'] == SAVE_AT and r['exact'] and r['rng']
        assert r['updates'] == 4
        assert {'manifest.json', 'stratagem_state.pth', 'deepspeed'} <= set(r['listing'])
        # nothing written outside the checkpoint: no 'latest', no recovery scripts
        logs = {n for n in r['work_listing'] if n[:8].isdigit()}  # the runs' log folders
        assert set(r['work_listing']) - logs == {f'iter_{SAVE_AT}.pth', 'last_checkpoint'}
        msg, listing = out[f'midwindow{stage}']
        assert 'iteration 4' in msg and 'accumulative_counts=3' in msg
        assert not any(n.startswith('iter_') or n.startswith('.iter') for n in listing)
    assert outs[0][f'resume{stage}']['exact'] == outs[1][f'resume{stage}']['exact']


@pytest.mark.scenario('load_checkpoint')
def test_load_checkpoint_refreshes_master_weights(scenario):
    for out in scenario:
        loaded, after_zero_lr_step = out['load_only']
        assert loaded < 1e-6 and after_zero_lr_step < 1e-6


@pytest.mark.scenario('tampered')
def test_tampered_shard_refused_before_unpickling(scenario):
    for out in scenario:
        for call in ('resume', 'load_checkpoint'):
            msg = out['tampered']['flipped', call]
            assert 'optim_states.pt is damaged: xxh3_128' in msg, msg
            msg = out['tampered']['payload', call]
            assert 'optim_states.pt is damaged: size' in msg, msg
            msg = out['tampered']['foreign', call]
            assert 'no manifest.json' in msg, msg
        assert out['pwned'] is False  # the payload never ran


@pytest.mark.parametrize('stage', [3])
@pytest.mark.scenario('async_{stage}')
def test_async_save_overlaps_training_and_resumes_exactly(scenario, stage):
    for rank, r in enumerate(scenario):
        # save_checkpoint returned and 3 iterations (one update) ran before the writer
        # wrote a single file: the state changed under a pending save
        assert r['pending'] and r['written_meanwhile'] == 0 and not r['exists_meanwhile']
        assert r['trained'] and r['same_training'] == []
        # this rank's files: its optimizer partition; rank 0's model states (ZeRO-3: every
        # rank's) and rank 0's stratagem_state.pth
        assert r['written'] == {1: (3, 1), 3: (3, 2)}[stage][rank]
        assert r['staged_bytes'] > 0
        assert r['latest'].endswith('async_6')
        assert r['iter_async'] == r['iter_sync'] == SAVE_AT
        assert {'manifest.json', 'stratagem_state.pth', 'deepspeed'} <= set(r['listing'])
        # bit-exact: weights, optimizer partitions, schedulers, counters as at the save, and
        # as a synchronous save of the same state resumes them
        assert r['vs_save'] == [] and r['vs_sync'] == []


def _assert_resumed_without_optimizer(out, saved, sched, iters):
    assert out['iter'] == iters
    # the saved weights bit for bit, in the module and in DeepSpeed's fp32 masters
    assert saved.keys() == out['weights'].keys() == out['masters'].keys()
    assert all(torch.equal(out['weights'][k], saved[k]) for k in saved)
    assert all(torch.equal(out['masters'][k], saved[k]) for k in saved)
    assert out['adam_state'] == 0  # a fresh optimizer, as asked
    # the schedulers resumed; accumulation aligned to the resumed iteration
    assert out['sched'] == sched and out['inner'] == iters
    listed_before, listed_after = out['listing']
    assert listed_before == listed_after and 'latest' not in listed_after
    assert out['temps'][0] == out['temps'][1]  # the `latest` view removed


@pytest.mark.scenario('without_optimizer')
def test_resume_without_optimizer_loads_the_weights(scenario):
    """ZeRO-2 and ZeRO-3 (whose DeepSpeed load without the optimizer reads a `latest` file
    that no stratagem checkpoint has) at the saving world size."""
    zero2, zero3 = scenario.needs['save_resume_2'], scenario.needs['async_3']
    for rank, out in enumerate(scenario):
        two, three = zero2[rank]['resume2'], zero3[rank]
        _assert_resumed_without_optimizer(out[2], two['saved'], two['sched'], SAVE_AT)
        _assert_resumed_without_optimizer(out[3], three['saved'], three['sched'], SAVE_AT)


@pytest.mark.scenario('without_optimizer_one_rank')
def test_resume_without_optimizer_at_another_world_size(scenario):
    """2 ranks -> 1, on the same global batch."""
    (out,) = scenario
    zero2, zero3 = scenario.needs['save_resume_2'], scenario.needs['async_3']
    two, three = zero2[0]['resume2'], zero3[0]
    _assert_resumed_without_optimizer(out[2], two['saved'], two['sched'], SAVE_AT)
    _assert_resumed_without_optimizer(out[3], three['saved'], three['sched'], SAVE_AT)


@pytest.mark.scenario('async_errors')
def test_async_errors_reach_every_rank(scenario):
    outs = scenario
    for out in outs:
        errors = out
        for name in (
            'commit_rank0',
            'write_rank1',
            'snapshot_rank1',
            'snapshot_rank0',
            'callback_rank1',
        ):
            e = errors[name]
            assert e['error'] is not None and not e['exists'], (name, e)
            assert e['latest'].endswith('async_6') and e['temps'] == [], (name, e)
        after = errors['after']  # the writer goes on after a failed save
        assert after['error'] is None and after['exists']
        assert after['latest'].endswith('after_errors')
    zero, one = outs
    # rank 1 failed before its write (its callback): rank 0 is told before DeepSpeed's
    # collectives, in the call, naming it
    assert zero['callback_rank1']['where'] == one['callback_rank1']['where'] == 'save'
    assert one['callback_rank1']['error'] == 'ValueError: refused on rank 1'
    assert zero['callback_rank1']['error'].startswith('CheckpointVoteError: saving ')
    assert zero['callback_rank1']['error'].endswith(
        'fail_callback failed on rank 1: ValueError: refused on rank 1; nothing was committed'
    )
    # a failure on the writer thread surfaces at the next wait, on every rank
    assert zero['commit_rank0']['where'] == one['commit_rank0']['where'] == 'wait'
    assert zero['commit_rank0']['error'] == 'OSError: injected: commit failed'
    assert one['commit_rank0']['error'].startswith('CheckpointVoteError: ')
    assert 'failed on rank 0: OSError: injected: commit failed' in one['commit_rank0']['error']
    # a full disk on rank 1's writer: named with the file on rank 1, and by rank 0
    assert zero['write_rank1']['where'] == one['write_rank1']['where'] == 'wait'
    assert one['write_rank1']['error'].startswith(
        'CheckpointWriteError: no space left on device writing '
    )
    assert '/deepspeed/zero_pp_rank_1_mp_rank_00_' in one['write_rank1']['error']
    assert one['write_rank1']['error'].endswith('the previous checkpoint is unchanged')
    assert (
        'failed on rank 1: CheckpointWriteError: no space left on device writing '
        in zero['write_rank1']['error']
    )
    # a failed snapshot raises at once on its rank; the others learn it at the next wait
    assert one['snapshot_rank1']['where'] == 'save'
    assert one['snapshot_rank1']['error'] == 'MemoryError: injected: no memory for staging'
    assert zero['snapshot_rank1']['where'] == 'wait'
    assert 'failed on rank 1: MemoryError: injected' in zero['snapshot_rank1']['error']
    assert zero['snapshot_rank0']['where'] == 'save'
    assert zero['snapshot_rank0']['error'] == 'MemoryError: injected: no memory for staging'
    assert one['snapshot_rank0']['where'] == 'wait'
    assert 'failed on rank 0: MemoryError: injected' in one['snapshot_rank0']['error']


@pytest.mark.scenario('resume_one_rank')
def test_resume_at_another_world_size(scenario):
    one, outs = scenario[0], scenario.needs['save_resume_2']
    assert one['iter'] == SAVE_AT and one['updates'] == 4
    assert _max_diff(one['final'], outs[0]['resume2']['final']) < 1e-6


@pytest.mark.scenario('save_resume_2')
def test_convert_to_single_file_loads_in_single_device(scenario, tmp_path):
    """The command and the function (a ZeRO-3 directory read whole: the conformance table's
    loads from deepspeed_zero3)."""
    from stratagem.cli import main
    from stratagem.strategies import SingleDeviceStrategy
    from stratagem.strategies.deepspeed.files import convert_zero_checkpoint

    src, want = scenario[0]['resume2']['path'], scenario[0]['resume2']['saved']
    by_command, by_function = tmp_path / 'command.pth', tmp_path / 'function.pth'
    assert main(['convert', src, str(by_command)]) == 0
    convert_zero_checkpoint(src, by_function)
    for dst in (by_command, by_function):
        s = SingleDeviceStrategy(work_dir=str(tmp_path / dst.stem))
        s.prepare(_net())
        s.load_checkpoint(str(dst), strict=True)
        got = s.model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert torch.load(dst, weights_only=True)['meta']['iter'] == SAVE_AT


# ---------------------------------------------------------------- one process, no DeepSpeed engine
def test_wrapper_refuses_what_deepspeed_cannot_do():
    from stratagem.optim import DeepSpeedOptimWrapper

    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match='clips by value'):
        DeepSpeedOptimWrapper(opt, clip_grad=dict(type='value', clip_value=1.0))
    with pytest.raises(ValueError, match='norm_type 1'):
        DeepSpeedOptimWrapper(opt, clip_grad=dict(max_norm=1.0, norm_type=1))
    w = DeepSpeedOptimWrapper(opt, accumulative_counts=2, clip_grad=dict(max_norm=2.5))
    assert (w.max_norm, w.accumulative_counts) == (2.5, 2)
    assert DeepSpeedOptimWrapper(opt).max_norm == 0.0
    with pytest.raises(RuntimeError, match='no DeepSpeed engine'):
        w.backward(torch.zeros((), requires_grad=True))
    w._inner_count = 3  # mid window
    with pytest.raises(RuntimeError, match='inside an accumulation window of 2'):
        w.state_dict()
    w._inner_count = 4
    w.load_state_dict(
        {'optim_wrapper': {'inner_count': 6, 'max_counts': 9, 'accumulative_counts': 2}}
    )
    assert (w.inner_count, w.max_counts) == (6, 9)
    assert w.state_dict() == {
        'optim_wrapper': {'inner_count': 6, 'max_counts': 9, 'accumulative_counts': 2}
    }


@pytest.mark.parametrize(
    'kwargs, match',
    [
        (dict(config=dict(optimizer=dict(type='Adam'))), "a 'optimizer' section"),
        (dict(config=dict(scheduler=dict(type='WarmupLR'))), "a 'scheduler' section"),
        (dict(fp16=dict(enabled=True)), 'needs CUDA'),
        (
            dict(config=dict(gradient_clipping=1.0), gradient_clipping=2.0),
            'gradient_clipping=2.0 disagrees with the DeepSpeed config',
        ),
        (dict(zero_optimization=dict(stage=4)), 'stage=4'),
        (dict(config=dict(managed_gradient_accumulation=True)), 'managed_gradient_accumulation'),
        (
            dict(config=dict(checkpoint=dict(checkpoint_serialization=False))),
            'checkpoint.checkpoint_serialization=false',
        ),
        (dict(config='/no/such/ds_config.json'), 'does not exist'),
    ],
)
def test_bad_config_raises_before_any_set_up(kwargs, match):
    if 'fp16' in kwargs and torch.cuda.is_available():
        pytest.skip('fp16 is refused only without CUDA')
    from stratagem.strategies import DeepSpeedStrategy

    before = dict(os.environ)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        DeepSpeedStrategy(**kwargs)
    assert dict(os.environ) == before and not torch.distributed.is_initialized()


def test_json_config_file(tmp_path):
    from stratagem.strategies.deepspeed.config import parse_config as _parse_config

    path = tmp_path / 'ds.json'
    path.write_text('{"zero_optimization": {"stage": 3}, "bf16": {"enabled": true}}')
    assert _parse_config(str(path)) == {
        'zero_optimization': {'stage': 3},
        'bf16': {'enabled': True},
    }
    path.write_text('{"zero_optimization": ')
    with pytest.raises(ValueError, match='not valid JSON'):
        _parse_config(str(path))


# DeepSpeed's laziness (registered, not imported) and the missing extra's error:
# tests/test_imports.py, in the one interpreter that checks every optional package


# ---------------------------------------------------------------- stratagem train --nproc 2
def test_train_config_with_two_processes(tmp_path):
    """The example config under `stratagem train --nproc 2` (torchrun): it trains, and its
    directory checkpoints commit with a manifest and consolidate to the trained weights.
    (Exact resume is checked in-process above; one launch keeps this test short.)"""
    from stratagem import checkpoint as ckpt
    from stratagem.checkpoint.directory import verify_directory
    from stratagem.cli import main
    from stratagem.strategies.deepspeed.files import zero_to_state_dict

    config = str(
        Path(__file__).resolve().parents[2] / 'examples' / 'configs' / 'classifier_deepspeed.py'
    )
    work = tmp_path / 'w'
    assert (
        main(
            [
                'train',
                config,
                '--nproc',
                '2',
                '--work-dir',
                str(work),
                '--cfg-options',
                'train_cfg.max_epochs=1',
                'train_cfg.max_keep_ckpts=None',
            ]
        )
        == 0
    )
    assert sorted(n for n in os.listdir(work) if n.startswith('iter_')) == [
        'iter_16.pth',
        'iter_32.pth',
    ]
    assert ckpt.find_latest_checkpoint(work).name == 'iter_32.pth'
    manifest = verify_directory(work / 'iter_32.pth', collective=False)
    assert (manifest['world_size'], manifest['zero_stage'], manifest['step']) == (2, 2, 32)
    first, last = (zero_to_state_dict(work / f'iter_{i}.pth') for i in (16, 32))
    assert set(first) == set(last) and any(not torch.equal(first[k], last[k]) for k in first)
