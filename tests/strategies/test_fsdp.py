"""FSDPStrategy on 2 gloo processes (CPU): equivalence, accumulation, clipping, bf16, activation
checkpointing, sharded checkpoints resumed exactly on 2 ranks, 2→1, 1→2, and across strategies.

Processes are started at most four times for the module, each time for the scenarios the
selected tests name (tests/scenarios.py): the training checks (also compile, ignored_modules,
skip_init_weights, FSDP1's config forms from test_fsdp_config.py) and the first half of a run
(2 ranks), a 1-rank FSDP resume, `stratagem train examples/configs/transformer_fsdp.py
--nproc 2` (torchrun), and the resumes in new processes (2 ranks, also the example config's,
through the reference loop); peer copies of the shards in the first spawn. The exact
resume mid window, the async save's state at the call and the weights crossing to every
backend are its row of the conformance table (test_conformance.py).
"""

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from scenarios import Scenarios

MAX_ITERS = 8
EXAMPLE = Path(__file__).resolve().parents[2] / 'examples' / 'configs' / 'transformer_fsdp.py'
COMPONENTS = dict(
    optim_wrapper=dict(
        optimizer=dict(type='AdamW', lr=0.01),
        accumulative_counts=3,
        clip_grad=dict(type='norm', max_norm=1.0),
    ),
    param_scheduler=[
        dict(type='LinearLR', start_factor=0.2, by_epoch=False, end=4),
        dict(type='CosineAnnealingLR', by_epoch=False, begin=4, T_max=4),
    ],
    dispatch_kwargs=dict(max_iters=MAX_ITERS),
)
SCENARIOS = Scenarios(
    ranks=dict(nproc=2, timeout=300),  # the checks and the first half of the run
    one_rank=dict(nproc=1, timeout=200),  # its checkpoint at 1 rank
    here=dict(nproc=0),  # in the test process: SingleDeviceStrategy, `stratagem train`
    resumes=dict(nproc=2, timeout=300),  # the resumes in new processes
)


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x


def _net():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), Block(), Block(), nn.Linear(8, 2))


def _strategy(work_dir, **kwargs):
    from stratagem.strategies import build_strategy

    kwargs.setdefault('model_wrapper', dict(auto_wrap_policy=['Block', 'Linear']))
    return build_strategy(
        dict(
            type='FSDPStrategy',
            work_dir=str(work_dir),
            env_kwargs=dict(randomness=dict(seed=7)),
            **kwargs,
        )
    )


def _batch(it, rank, world):
    g = torch.Generator().manual_seed(100 + it)
    x, y = torch.randn(8, 6, generator=g), torch.randint(2, (8,), generator=g)
    per = 8 // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _full_state(s):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    model = {k: v.clone() for k, v in get_model_state_dict(s.model, options=opts).items()}
    optim = get_optimizer_state_dict(s.model, s.optim_wrapper.optimizer, options=opts)
    return model, {
        k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
        for k, v in optim['state'].items()
    }


def _draws():
    """The next numbers of python's, numpy's and torch's global RNGs (an RNG state's mark)."""
    import random

    import numpy as np

    return [random.random(), float(np.random.rand()), *torch.rand(2).tolist()]


def _train(s, model, ow, scheds, start, stop, world):
    from torch.nn import functional as F

    for it in range(start, stop):
        x, y = _batch(it, s.rank, world)
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x), y)
        ow.update_params(loss)
        for sch in scheds:
            sch.step()


def _reference(steps, accumulate=1, clip=None, momentum=0.9):
    """One process, concatenated batch: the numerical oracle."""
    from torch.nn import functional as F

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum)
    norms = []
    for it in range(steps):
        x, y = _batch(it, 0, 1)
        (F.cross_entropy(net(x), y) / accumulate).backward()
        if (it + 1) % accumulate == 0:
            if clip:
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
            opt.step()
            opt.zero_grad()
    return net.state_dict(), norms


def _close(a, b, tol):
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b) <= tol


@SCENARIOS.add('ranks')
def equal_one_process(work_dir):
    """SGD + momentum, accumulation 3, clipping: equal to one process on the whole batch."""
    import torch.distributed as dist
    from torch.nn import functional as F

    out = {}
    calls = []
    original = dist.reduce_scatter_single

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counting
    try:
        for acc, clip in ((1, None), (3, 0.05)):
            s = _strategy(work_dir)
            model, ow = s.prepare(
                _net(),
                optim_wrapper=dict(
                    optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
                    accumulative_counts=acc,
                    clip_grad=None if clip is None else dict(type='norm', max_norm=clip),
                ),
                dispatch_kwargs=dict(max_iters=6),
            )
            calls.clear()
            norms = []
            for it in range(6):
                x, y = _batch(it, s.rank, 2)
                with ow.optim_context(model):
                    loss = F.cross_entropy(model(x), y)
                ow.update_params(loss)
                if clip and ow.should_update():
                    norms.append(
                        float(
                            ow.last_grad_norm.full_tensor()
                            if hasattr(ow.last_grad_norm, 'full_tensor')
                            else ow.last_grad_norm
                        )
                    )
            ref, ref_norms = _reference(6, acc, clip)
            out[f'equal_acc{acc}'] = _close(_full_state(s)[0], ref, 1e-6)
            out[f'reduce_scatters_acc{acc}'] = len(calls)
            if clip:
                out['norms'] = (norms, ref_norms)
    finally:
        dist.reduce_scatter_single = original
    return out


@SCENARIOS.add('ranks')
def precision(work_dir):
    """bf16 parameters (fp32 reduce), activation checkpointing and CPU offload, against fp32."""
    out = {}
    for key, kw in (
        (
            'bf16',
            dict(
                model_wrapper=dict(
                    auto_wrap_policy=['Block'],
                    mixed_precision=dict(param_dtype='bfloat16', reduce_dtype='float32'),
                )
            ),
        ),
        ('ac', dict(activation_checkpointing=['Block'])),
        ('offload', dict(model_wrapper=dict(auto_wrap_policy=['Block'], cpu_offload=True))),
    ):
        s = _strategy(work_dir, **kw)
        model, ow = s.prepare(
            _net(), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
        )
        _train(s, model, ow, [], 0, 3, 2)
        ref, _ = _reference(3)
        out[key] = max(float((_full_state(s)[0][k].float() - ref[k]).abs().max()) for k in ref)
    return out


@SCENARIOS.add('ranks')
def amp(work_dir):
    """AmpOptimWrapper: it autocasts when model_wrapper sets no mixed_precision (as under
    mmengine); with mixed_precision set, precision is FSDP's and it does not autocast again."""
    out = {}
    for key, mp in (('amp', None), ('amp_mp', dict(param_dtype='bfloat16'))):
        s = _strategy(
            work_dir,
            model_wrapper=dict(
                auto_wrap_policy=['Block'], **({'mixed_precision': mp} if mp else {})
            ),
        )
        model, ow = s.prepare(
            _net(),
            optim_wrapper=dict(
                type='AmpOptimWrapper',
                dtype='bfloat16',
                optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
            ),
        )
        seen = []
        hook = model[0].register_forward_hook(
            lambda m, i, o: seen.append((torch.is_autocast_enabled('cpu'), o.dtype))
        )
        _train(s, model, ow, [], 0, 3, 2)
        hook.remove()
        ref, _ = _reference(3)
        out[key] = (
            seen[0],
            ow.loss_scaler is None,
            max(float((_full_state(s)[0][k].float() - ref[k]).abs().max()) for k in ref),
        )
    return out


@SCENARIOS.add('ranks')
def build_errors(work_dir):
    """A misspelt wrap class; an optimizer built before prepare() sharded the model."""
    out = {}
    for name, build in (
        (
            'wrap_class',
            lambda: _strategy(work_dir, model_wrapper=dict(auto_wrap_policy=['Blok'])).prepare(
                _net()
            ),
        ),
        (
            'prebuilt',
            lambda: _strategy(work_dir).prepare(
                net := _net(),
                optim_wrapper=dict(optimizer=torch.optim.SGD(net.parameters(), lr=0.1)),
            ),
        ),
    ):
        try:
            build()
        except ValueError as err:
            out[f'err_{name}'] = str(err)
    return out


@SCENARIOS.add('ranks')
def compile_per_block(work_dir):
    return _compile_checks(work_dir)


@SCENARIOS.add('ranks')
def ignored_modules(work_dir):
    return _ignored_checks(work_dir)


@SCENARIOS.add('ranks')
def skip_init_weights(work_dir):
    return _skip_init_checks(work_dir)


@SCENARIOS.add('ranks')
def async_sharded_save(work_dir):
    return _async_checks(work_dir)


@SCENARIOS.add('ranks')
def refused_on_one_rank(work_dir):
    return _refused_checks(work_dir)


@SCENARIOS.add('ranks')
def first_half(work_dir):
    """The resumed run: checkpoints on a boundary (3, also one full file) and mid-window (4),
    a save that fails at its commit, then on to MAX_ITERS."""
    out = {}
    s = _strategy(work_dir)
    model, ow, scheds = s.prepare(_net(), **COMPONENTS)
    _train(s, model, ow, scheds, 0, 3, 2)
    from stratagem import env
    from stratagem.checkpoint import directory, manifest, single_file

    for _ in range(s.rank + 1):  # each rank's streams elsewhere: a rank's own must come back
        _draws()
    reads = []
    hashers = {m: m.hash_file for m in (single_file, directory, manifest)}
    for module, func in hashers.items():  # count re-reads of written files
        module.hash_file = lambda *a, _f=func, **k: reads.append(a[0]) or _f(*a, **k)
    try:
        s.save_checkpoint('iter_3', extra_ckpt={'meta': {'iter': 3}})
    finally:
        for module, func in hashers.items():
            module.hash_file = func
    out['reread_after_write'] = [str(p) for p in reads]
    rng = env.get_rng_state()  # iter_3_full.pth below saves these streams too
    out['draws_3'] = _draws()
    env.set_rng_state(rng)
    out['state_3'] = _full_state(s)
    s.state_dict_type = 'full'
    s.save_checkpoint('iter_3_full.pth', extra_ckpt={'meta': {'iter': 3}})
    # one file; only rank 0 gathers the full state (the others hold none of it)
    out['full_file'] = Path(work_dir, 'iter_3_full.pth').is_file()
    out['full_held'] = (len(s.model_state_dict()), len(s.optim_state_dict()['state']))
    s.state_dict_type = 'sharded'
    _train(s, model, ow, scheds, 3, 4, 2)
    s.save_checkpoint('iter_4', extra_ckpt={'meta': {'iter': 4}})
    # a save that fails after the shards are written leaves iter_4 as the latest
    out['failed_save'] = _failure(
        lambda: s.save_checkpoint('iter_4b', extra_ckpt={'meta': {'iter': 4}}),
        directory,
        'finalize_directory',
        'injected: disk full at commit',
    )
    from stratagem.checkpoint import find_latest_checkpoint

    out['latest_after_fail'] = str(find_latest_checkpoint(work_dir))
    out['listing'] = sorted(p.name for p in Path(work_dir).iterdir())
    _train(s, model, ow, scheds, 4, MAX_ITERS, 2)
    out['final'] = _full_state(s)
    out['lr'] = [g['lr'] for g in ow.param_groups]
    return out


@SCENARIOS.add('ranks', needs=['first_half'])
def resume_in_place(work_dir, first_half):
    return _in_place_checks(work_dir, first_half['state_3'])


@SCENARIOS.add('ranks', needs=['first_half'])
def peer_copies(work_dir, first_half):
    """Peer copies of the sharded state (checkpoint/peer.py): first_half's run again, a
    storage checkpoint at 3, a copy at 4 (mid window) taken in the background while
    ``state_dict_type='full'`` (a copy is each rank's shards anyway). A new strategy on the
    same mesh resumes from the copy and trains on to MAX_ITERS; one on another mesh of the
    same world size (HSDP) falls back to storage."""
    import logging

    import torch.distributed as dist

    from stratagem.checkpoint.peer import PeerCopies

    work, root = Path(work_dir) / 'peer', Path(work_dir) / 'peer-shm'
    group = dist.new_group(backend='gloo')  # the background writer's own

    def copies():
        return PeerCopies(root, dist.get_rank(), 2, group=group, same_node=True, background=True)

    def restart(**kwargs):
        again = _strategy(work, **kwargs)
        model, ow, scheds = again.prepare(_net(), **COMPONENTS)
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        again.logger.addHandler(handler)
        try:
            ckpt = again.load_or_resume(resume=True, peer=copies())
        finally:
            again.logger.removeHandler(handler)
        return again, (model, ow, scheds), ckpt, [x for x in lines if 'resume tier' in x]

    s = _strategy(work)
    model, ow, scheds = s.prepare(_net(), **COMPONENTS)
    _train(s, model, ow, scheds, 0, 3, 2)
    s.save_checkpoint('iter_3', extra_ckpt={'meta': {'iter': 3}})
    _train(s, model, ow, scheds, 3, 4, 2)
    s.state_dict_type = 'full'
    peer = copies()
    s.save_peer_copy(peer, extra_ckpt={'meta': {'iter': 4}})
    state_4 = _full_state(s)
    _train(s, model, ow, scheds, 4, 6, 2)  # on, while the copy is written
    peer.close()
    copy = torch.load(peer.own_dir / 'iter_4.pth', weights_only=True)
    manifest = json.loads((peer.own_dir / 'iter_4.pth.manifest.json').read_text())
    out = {
        'local_shape': list(copy['state_dict']['0.weight'].shape),
        'records': len(copy['peer_layout']),
        'meshes': manifest['meshes'],
        'held': sorted(os.listdir(peer.held_dir)),
    }
    again, (model, ow, scheds), ckpt, out['tier'] = restart()
    out['iter'] = ckpt['meta']['iter']
    out['loaded_equal'] = _state_equal(_full_state(again), state_4)
    _train(again, model, ow, scheds, 4, MAX_ITERS, 2)
    out['final'] = _full_state(again)
    out['lr'] = [g['lr'] for g in ow.param_groups]
    _, _, ckpt, out['hsdp_tier'] = restart(mesh=dict(replicate=2, shard=1))
    out['hsdp_iter'] = ckpt['meta']['iter']
    return out


@SCENARIOS.add('ranks')
def mmengine_forms(work_dir):
    """FSDP1's forms of model_wrapper through prepare (test_fsdp_config.py's model and
    policies; in this spawn, one start of processes less)."""
    from test_fsdp_config import prepare_mmengine_forms

    return prepare_mmengine_forms(Path(work_dir) / 'mmengine_forms')


def _in_place_checks(work_dir, state_3):
    """resume() reads a sharded directory in place, after its checks: a refused resume
    changes nothing; resume_optimizer=False keeps the optimizer; a callback sees the values
    (read into new tensors first)."""
    path = str(Path(work_dir) / 'iter_3')
    out = {}

    def trained(**overrides):
        s = _strategy(work_dir)
        model, ow, scheds = s.prepare(_net(), **{**COMPONENTS, **overrides})
        _train(s, model, ow, scheds, 0, 2, 2)  # its own state, unlike iter_3's
        return s

    def refused(s):
        before = _full_state(s)
        try:
            s.resume(path)
        except (ValueError, KeyError) as err:
            out.setdefault('refused', []).append(str(err))
        out.setdefault('refused_unchanged', []).append(_state_equal(before, _full_state(s)))

    refused(
        trained(param_scheduler=[dict(type='LinearLR', start_factor=0.2, by_epoch=False, end=4)])
    )
    refused(
        trained(
            optim_wrapper=dict(
                optimizer=dict(type='SGD', lr=0.1, momentum=0.9), accumulative_counts=3
            )
        )
    )
    s = trained()
    before = _full_state(s)
    s.resume(path, resume_optimizer=False)
    after = _full_state(s)
    out['weights_only_model'] = _state_equal((after[0], {}), (state_3[0], {}))
    out['weights_only_optim_kept'] = _state_equal(({}, after[1]), ({}, before[1]))
    seen = []
    s = trained()
    s.resume(
        path,
        callback=lambda c: seen.append(
            float(sum(v.full_tensor().double().sum() for v in c['state_dict'].values()))
        ),
    )
    out['callback_saw'] = (seen, float(sum(v.double().sum() for v in state_3[0].values())))
    # a read that fails on rank 1 only (after every check passed) raises on both ranks, with
    # rank 1's error; the ranks stay in step: the next resume reads everything
    import torch.distributed as dist

    from stratagem.checkpoint.dcp_reader import ShardReader

    out['read_failed'] = _failure(
        lambda: s.resume(path),
        ShardReader,
        'read_data',
        'injected: read failed',
        when=dist.get_rank() == 1,
    )
    s.resume(path)
    out['read_after_failure'] = _state_equal(_full_state(s), state_3)
    return out


def _failure(call, owner, name, message, when=True):
    """Run ``call()`` with ``owner.name`` raising ``OSError(message)`` (only ``when``);
    the error it raised as ``'Type: message'``, or None."""
    real = getattr(owner, name)

    def failing(*args, **kwargs):
        raise OSError(message)

    if when:
        setattr(owner, name, failing)
    try:
        call()
    except Exception as err:  # noqa: BLE001 - reported to the test
        return f'{type(err).__name__}: {err}'
    finally:
        setattr(owner, name, real)
    return None


def _state_equal(a, b):
    (ma, oa), (mb, ob) = a, b
    return (
        ma.keys() == mb.keys()
        and all(torch.equal(ma[k], mb[k]) for k in ma)
        and oa.keys() == ob.keys()
        and all(
            torch.equal(torch.as_tensor(oa[k][n]), torch.as_tensor(ob[k][n]))
            for k in oa
            for n in oa[k]
        )
    )


def _async_checks(work_dir):
    """async_checkpoint=True with sharded saves: the writer thread runs DCP (its planning
    collectives on a gloo group of its own) while training goes on with FSDP's collectives
    on the default group, undisturbed, and errors surface (that the checkpoint holds the
    state at the save: the conformance table's async cell)."""
    import time

    import torch.distributed.checkpoint as dcp

    from stratagem.checkpoint import directory

    sync, asyn = _strategy(work_dir), _strategy(work_dir, async_checkpoint=True)
    comps = {k: v for k, v in COMPONENTS.items() if k != 'optim_wrapper'}
    comps['optim_wrapper'] = dict(optimizer=dict(type='AdamW', lr=0.01))
    built = [(s, *s.prepare(_net(), **comps)) for s in (sync, asyn)]
    for s, model, ow, scheds in built:
        _train(s, model, ow, scheds, 0, 3, 2)
    real_save = dcp.save

    def slow_save(*args, **kwargs):  # the training below overlaps the whole write
        time.sleep(0.3)
        return real_save(*args, **kwargs)

    out = {}
    dcp.save = slow_save
    try:
        started = time.perf_counter()
        asyn.save_checkpoint('async_3', extra_ckpt={'meta': {'iter': 3}})
        out['async_returned_s'] = time.perf_counter() - started
        for s, model, ow, scheds in built:  # collectives on the default group meanwhile
            _train(s, model, ow, scheds, 3, 5, 2)
        out['pending_after_training'] = asyn.checkpointer.writer.pending
        asyn.wait_for_checkpoints()
    finally:
        dcp.save = real_save
    out['trained_5'] = (_full_state(sync), _full_state(asyn))
    # an error on the writer thread reaches every rank at the next wait; nothing committed
    out['async_failed'] = _failure(
        lambda: (
            asyn.save_checkpoint('async_fail', extra_ckpt={'meta': {'iter': 5}}),
            asyn.wait_for_checkpoints(),
        ),
        directory,
        'finalize_directory',
        'injected: async commit failed',
    )
    out['async_fail_exists'] = (Path(work_dir) / 'async_fail').exists()
    return out


def _refused_checks(work_dir):
    """A save that fails on rank 1 before its write (its callback raises there alone) while
    rank 0 is already in DCP's planning: it fails at once on both ranks, rank 1 named,
    nothing written, no store key left, and the next save and the training collectives go
    on in step. A synchronous save, then the first asynchronous ones (its writer's group
    made by the save after them)."""
    import time

    import torch.distributed as dist

    from stratagem.checkpoint.vote import _own_store, wait_tidied

    out = {}

    def refuse(checkpoint):
        if dist.get_rank() == 1:
            raise ValueError('refused on rank 1')

    comps = {k: v for k, v in COMPONENTS.items() if k != 'optim_wrapper'}
    comps['optim_wrapper'] = dict(optimizer=dict(type='AdamW', lr=0.01))
    for name, kwargs in (('sync', {}), ('async', {'async_checkpoint': True})):
        s = _strategy(work_dir, **kwargs)
        model, ow, scheds = s.prepare(_net(), **comps)
        store = _own_store()[0]
        _train(s, model, ow, scheds, 0, 2, 2)
        dist.barrier()
        keys_before = store.num_keys()
        dist.barrier()
        started = time.monotonic()
        where = 'save'  # the call that raised: the same on both ranks, async too
        try:
            s.save_checkpoint(f'refused_{name}', extra_ckpt={'meta': {'iter': 2}}, callback=refuse)
            where = 'wait'
            s.wait_for_checkpoints()
            out[name] = None
        except Exception as err:  # noqa: BLE001 - reported to the test
            out[name] = f'{type(err).__name__}: {err}'
        out[f'{name}_where'] = where
        out[f'{name}_s'] = time.monotonic() - started
        out[f'{name}_written'] = (Path(work_dir) / f'refused_{name}').exists()
        if name == 'async':  # rank 1's staging copy fails, in its stage
            writer = s.checkpointer.writer
            if dist.get_rank() == 1:
                writer.snapshot = lambda *a: (_ for _ in ()).throw(MemoryError('no staging'))
            where = 'save'
            try:
                s.save_checkpoint('refused_snapshot', extra_ckpt={'meta': {'iter': 2}})
                where = 'wait'
                s.wait_for_checkpoints()
                out['snapshot'] = None
            except Exception as err:  # noqa: BLE001 - reported to the test
                out['snapshot'] = f'{type(err).__name__}: {err}'
            finally:
                writer.__dict__.pop('snapshot', None)
            out['snapshot_where'] = where
            out['snapshot_written'] = (Path(work_dir) / 'refused_snapshot').exists()
        _train(s, model, ow, scheds, 2, 3, 2)  # FSDP's collectives, in step on both ranks
        s.save_checkpoint(f'after_{name}', extra_ckpt={'meta': {'iter': 3}})
        s.wait_for_checkpoints()
        out[f'{name}_after'] = sorted(p.name for p in (Path(work_dir) / f'after_{name}').iterdir())
        out[f'{name}_tidied'] = wait_tidied()
        dist.barrier()
        # the async save's writer group is made by the save after the refused ones: its keys
        # are not ours (the count is asserted for the synchronous save)
        out[f'{name}_keys_left'] = store.num_keys() - keys_before
        dist.barrier()
    return out


def _compile_checks(work_dir):
    """compile=True compiles each sharded block (before sharding), not the root."""
    graphs = []

    def backend(gm, inputs):  # counts what dynamo hands over, runs it as traced
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    s = _strategy(work_dir, model_wrapper=dict(auto_wrap_policy=['Block']))
    model, ow = s.prepare(
        _net(),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)),
        compile=dict(backend=backend),
    )
    compiled = [
        name
        for name, m in model.named_modules()
        if getattr(m, '_compiled_call_impl', None) is not None
    ]
    _train(s, model, ow, [], 0, 3, 2)
    ref, _ = _reference(3)
    out = {
        'compiled': compiled,
        'graphs': len(graphs),
        'compile_err': max(float((_full_state(s)[0][k] - ref[k]).abs().max()) for k in ref),
    }
    try:
        _strategy(work_dir).prepare(_net(), compile=dict(target='train_step'))
    except ValueError as err:
        out['err_compile_target'] = str(err)
    return out


def _ignored_checks(work_dir):
    """ignored_modules stay plain, full-size and unreduced; clipping over the mix of sharded
    and plain gradients gives the unsharded norm, the same factor on every rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.nn import functional as F

    out = {}
    for case in ('same_data', 'own_data'):
        s = _strategy(
            work_dir,
            model_wrapper=dict(
                auto_wrap_policy=['Block'],
                ignored_modules=lambda m: isinstance(m, nn.Linear) and m.out_features == 2,
            ),
        )
        model, ow = s.prepare(
            _net(),
            optim_wrapper=dict(
                optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
                clip_grad=dict(type='norm', max_norm=0.05),
            ),
        )
        norms = []
        for it in range(3):
            x, y = _batch(it, 0, 1) if case == 'same_data' else _batch(it, s.rank, 2)
            with ow.optim_context(model):
                loss = F.cross_entropy(model(x), y)
            ow.update_params(loss)
            norms.append(float(ow.last_grad_norm))
        kinds = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
        head = model[3].weight.detach().clone()
        out[case] = dict(
            kinds=kinds, norms=norms, head_shape=tuple(head.shape), heads=_gather(head)
        )
        if case == 'same_data':
            ref, ref_norms = _reference(3, clip=0.05)
            state = _full_state(s)[0]
            out[case]['err'] = max(float((state[k] - ref[k]).abs().max()) for k in ref)
            out[case]['ref_norms'] = ref_norms
        dist.barrier()
    return out


def _gather(tensor):
    from stratagem import env

    return env.all_gather_object(tensor)


def _skip_init_checks(work_dir):
    """skip_init_weights: a cfg model is built on the meta device, init_weights is not run,
    only this rank's shards are allocated; a loaded checkpoint then trains as the original."""
    from stratagem.models import TransformerLM

    calls = []
    original = TransformerLM.init_weights
    TransformerLM.init_weights = lambda self: calls.append(1) or original(self)
    cfg = dict(type='TransformerLM', vocab_size=16, dim=16, depth=2, heads=2, max_len=8)
    optim = dict(optimizer=dict(type='AdamW', lr=0.01))
    wrap = dict(auto_wrap_policy=['TransformerBlock'])
    try:
        a = _strategy(work_dir, model_wrapper=wrap)
        model_a, ow_a = a.prepare(dict(cfg), optim_wrapper=optim)
        a.save_checkpoint('lm_init')
        calls_normal = len(calls)
        b = _strategy(work_dir, model_wrapper=wrap, skip_init_weights=True)
        model_b, ow_b = b.prepare(dict(cfg), optim_wrapper=optim)
        out = {
            'init_calls': (calls_normal, len(calls) - calls_normal),
            'meta': any(p.is_meta or p.to_local().is_meta for p in model_b.parameters()),
            'local_numel': sum(p.to_local().numel() for p in model_b.parameters()),
            'full_numel': sum(p.numel() for p in model_b.parameters()),
        }
    finally:
        TransformerLM.init_weights = original
    b.load_checkpoint(str(Path(work_dir) / 'lm_init'))
    # reading a checkpoint (or saving one) before the first step leaves no optimizer state
    # behind: torch creates it with a zero-lr step that would set Adam's step count to 1
    out['fresh_state'] = (len(ow_a.optimizer.state), len(ow_b.optimizer.state))
    sa, sb = _full_state(a), _full_state(b)  # collectives: once each, on every rank
    out['loaded_equal'] = sa[0].keys() == sb[0].keys() and all(
        torch.equal(sa[0][k], sb[0][k]) for k in sa[0]
    )
    g = torch.Generator().manual_seed(5 + a.rank)
    for _ in range(2):
        x = torch.randint(16, (2, 8), generator=g)
        for model, ow in ((model_a, ow_a), (model_b, ow_b)):
            ow.update_params(model(x, x)['loss'])
    sa, sb = _full_state(a), _full_state(b)
    out['trained_equal'] = all(torch.equal(sa[0][k], sb[0][k]) for k in sa[0])
    return out


def _resume(work_dir, name, world, stop=MAX_ITERS, save=None):
    import warnings

    s = _strategy(work_dir)
    model, ow, scheds = s.prepare(_net(), **COMPONENTS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        ckpt = s.resume(str(Path(work_dir) / name))
    out = {
        'draws': _draws(),
        'loaded': _full_state(s),
        'iter': ckpt['meta']['iter'],
        'resumed_lr': [g['lr'] for g in ow.param_groups],
        'resumed_count': ow.inner_count,
        'resumed_scheds': [(sch.last_step, sch._global_step) for sch in scheds],
        'rng_warning': [str(w.message) for w in caught if 're-seeded' in str(w.message)],
    }
    _train(s, model, ow, scheds, ckpt['meta']['iter'], stop, world)
    out['final'] = _full_state(s)
    out['lr'] = [g['lr'] for g in ow.param_groups]
    if save:
        s.save_checkpoint(save, extra_ckpt={'meta': {'iter': stop}})
    return out


@SCENARIOS.add('one_rank', needs=['first_half'])
def two_to_one(work_dir, first_half):
    """The 2-rank checkpoint at iter 3 resumed on 1 rank, to iteration 5 (saved: one_rank)."""
    return _resume(work_dir, 'iter_3', 1, 5, 'one_rank')


@SCENARIOS.add('here', needs=['first_half'])
def single_device(work_dir, first_half):
    """SingleDeviceStrategy resumes the 2-rank FSDP directory and saves a file for FSDP."""
    from stratagem.strategies import SingleDeviceStrategy

    work = Path(work_dir)
    single = SingleDeviceStrategy(work_dir=str(work / 'single_run'))
    single.prepare(_net(), **COMPONENTS)
    single.load_checkpoint(str(work / 'iter_3'))
    single.resume(str(work / 'iter_3'))
    single.save_checkpoint(str(work / 'single.pth'), extra_ckpt={'meta': {'iter': 3}})
    return {
        'state_dict': single.model.state_dict(),
        'names': [n for n, _ in single.model.named_parameters()],
        'optimizer_state': single.optim_wrapper.optimizer.state_dict()['state'],
    }


@SCENARIOS.add('here')
def train_transformer_cli(work_dir):
    """The example config end to end under torchrun; lm_resume resumes it."""
    from stratagem.cli import main

    return main(
        [
            'train',
            str(EXAMPLE),
            '--nproc',
            '2',
            '--work-dir',
            str(Path(work_dir) / 'lm'),
            '--cfg-options',
            'train_cfg.max_iters=8',
            'train_cfg.checkpoint_interval=4',
        ]
    )


@SCENARIOS.add('resumes', needs=['first_half'])
def resume_two_ranks(work_dir, first_half):
    # iter_4 (mid window, sharded): the conformance table's fsdp row
    return {name: _resume(work_dir, name, 2) for name in ('iter_3', 'iter_3_full.pth')}


@SCENARIOS.add('resumes', needs=['two_to_one', 'resume_two_ranks'])
def one_to_two(work_dir, two_to_one, resume_two_ranks):
    """two_to_one's 1-rank checkpoint resumed on 2 ranks."""
    return {'one_rank': _resume(work_dir, 'one_rank', 2)}


@SCENARIOS.add('resumes', needs=['single_device', 'first_half'])
def fsdp_loads_single_device(work_dir, single_device, first_half):
    """FSDP on 2 ranks resumes the SingleDeviceStrategy file."""
    return {'single.pth': _resume(work_dir, 'single.pth', 2)}


@SCENARIOS.add('resumes', needs=['train_transformer_cli'])
def lm_resume(work_dir, train_transformer_cli):
    """The example transformer config, resumed by the reference loop from the checkpoint that
    `stratagem train --nproc 2` wrote at iter 4, into another work dir."""
    from stratagem.config import Config
    from stratagem.loop import train

    cfg = Config.fromfile(str(EXAMPLE))
    cfg.merge_from_dict(
        dict(
            train_cfg=dict(max_iters=8, checkpoint_interval=4),
            work_dir=str(Path(work_dir) / 'lm_resumed'),
        )
    )
    result = train(cfg, resume=str(Path(work_dir) / 'lm' / 'iter_4.pth'), progress=False)
    return {'lm_iter': result['iter']}


def _assert_equal_states(a, b):
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert oa.keys() == ob.keys()
    for k in oa:
        assert all(torch.equal(torch.as_tensor(oa[k][n]), torch.as_tensor(ob[k][n])) for n in oa[k])


@pytest.fixture(scope='module')
def scenarios(request, tmp_path_factory):
    return SCENARIOS.run(request, tmp_path_factory.mktemp('fsdp'))


@pytest.mark.scenario('equal_one_process')
def test_training_equals_one_process(scenario):
    for out in scenario:
        assert out['equal_acc1'] and out['equal_acc3']
        # one reduce-scatter per sharded group per update: 6 updates vs 2 updates
        assert out['reduce_scatters_acc3'] * 3 == out['reduce_scatters_acc1'] > 0
        norms, ref = out['norms']
        assert len(norms) == 2 and norms == pytest.approx(ref, rel=1e-5)


@pytest.mark.scenario('precision')
def test_bf16_activation_checkpointing_and_offload_against_fp32(scenario):
    for out in scenario:
        assert out['bf16'] < 3e-2  # bf16 parameters: ~3 significant digits
        assert out['ac'] < 1e-6 and out['offload'] < 1e-6


@pytest.mark.scenario('amp')
def test_amp_optim_wrapper_autocasts_unless_fsdp_mixed_precision(scenario):
    for out in scenario:
        # AMP alone autocasts (bf16 activations); with mixed_precision it leaves it to FSDP
        assert out['amp'][:2] == ((True, torch.bfloat16), True) and out['amp'][2] < 3e-2
        assert out['amp_mp'][:2] == ((False, torch.bfloat16), True) and out['amp_mp'][2] < 3e-2


@pytest.mark.scenario('compile_per_block')
def test_compile_per_block(scenario):
    for out in scenario:
        assert out['compiled'] == ['1', '2']  # the two Blocks, not the root or the Linears
        assert out['graphs'] >= 1 and out['compile_err'] < 1e-6
        assert 'names another target' in out['err_compile_target']


@pytest.mark.scenario('ignored_modules')
def test_ignored_modules(scenario):
    outs = scenario
    for out in outs:
        same, own = out['same_data'], out['own_data']
        assert same['kinds'] == {
            '0.weight': True,
            '0.bias': True,
            '1.fc.weight': True,
            '1.fc.bias': True,
            '2.fc.weight': True,
            '2.fc.bias': True,
            '3.weight': False,
            '3.bias': False,
        }
        assert same['head_shape'] == (2, 8)  # not sharded
        # same batch on both ranks: equal to one process, clipped norms included
        assert same['err'] < 1e-6 and same['norms'] == pytest.approx(same['ref_norms'], rel=1e-5)
        assert torch.equal(same['heads'][0], same['heads'][1])
        # own batches: the ignored head is not reduced (the ranks differ), yet both ranks
        # clip by the same norm
        assert not torch.equal(own['heads'][0], own['heads'][1])
    assert outs[0]['own_data']['norms'] == outs[1]['own_data']['norms']


@pytest.mark.scenario('skip_init_weights')
def test_skip_init_weights(scenario):
    for out in scenario:
        assert out['init_calls'] == (1, 0)
        assert not out['meta']
        assert out['local_numel'] * 2 == pytest.approx(out['full_numel'], rel=0.01)
        assert out['loaded_equal'] and out['trained_equal']
        assert out['fresh_state'] == (0, 0)


@pytest.mark.scenario('first_half')
def test_sharded_save_reads_nothing_back(scenario):
    for out in scenario:
        assert out['reread_after_write'] == []


@pytest.mark.scenario('first_half')
def test_full_state_dict_is_one_file_gathered_on_rank_zero(scenario):
    first = scenario
    assert first[0]['full_file'] and first[1]['full_file']
    assert first[0]['full_held'] == (8, 8)  # 4 Linear weights + biases, their Adam states
    assert first[1]['full_held'] == (0, 0)


@pytest.mark.scenario('resume_in_place')
def test_resume_reads_in_place_after_its_checks(scenario):
    for out in scenario:
        assert out['refused_unchanged'] == [True, True], out['refused']
        assert 'param scheduler' in out['refused'][0] and 'nothing was changed' in out['refused'][0]
        # the param groups are checked from extra.pth's copy, before any shard is read
        assert (
            'its optimizer param groups lack' in out['refused'][1]
            and "'momentum'" in out['refused'][1]
        ), out['refused'][1]
        assert out['weights_only_model'] and out['weights_only_optim_kept']
        seen, expected = out['callback_saw']
        assert seen == [expected]
        assert out['read_after_failure']
    first = scenario
    assert first[1]['read_failed'] == 'OSError: injected: read failed'
    assert first[0]['read_failed'].startswith('RuntimeError: reading ')
    assert first[0]['read_failed'].endswith(
        'into the model failed on rank 1: OSError: injected: read failed'
    )


@pytest.mark.scenario('async_sharded_save')
def test_async_sharded_save(scenario):
    for out in scenario:
        assert out['pending_after_training']  # the write overlapped two training steps
        assert out['async_returned_s'] < 0.3  # returned before the (slowed) write
        _assert_equal_states(*out['trained_5'])  # training went on undisturbed
        assert not out['async_fail_exists']
    assert scenario[0]['async_failed'] == 'OSError: injected: async commit failed'
    assert scenario[1]['async_failed'].startswith('CheckpointVoteError: saving ')
    assert 'failed on rank 0: OSError: injected: async commit failed' in scenario[1]['async_failed']


@pytest.mark.scenario('refused_on_one_rank')
def test_a_save_refused_on_one_rank_fails_at_once_on_every_rank(scenario):
    for out in scenario:
        assert out['snapshot_where'] == 'save'
        for name in ('sync', 'async'):
            assert out[f'{name}_where'] == 'save'
            assert out[f'{name}_s'] < 10  # not a wait for the vote's or the group's timeout
            assert not out[f'{name}_written']
            assert out[f'{name}_after'] == [
                '.metadata',
                '__0_0.distcp',
                '__1_0.distcp',
                'extra.pth',
                'manifest.json',
                'rng_states',
            ]
            assert out[f'{name}_tidied']
        assert out['sync_keys_left'] == 0, out  # nothing posted to the store, or all removed
    assert scenario[1]['snapshot'] == 'MemoryError: no staging'
    assert scenario[0]['snapshot'].endswith(
        'refused_snapshot failed on rank 1: MemoryError: no staging; nothing was committed'
    )
    assert not scenario[0]['snapshot_written']
    for name in ('sync', 'async'):
        assert scenario[1][name] == 'ValueError: refused on rank 1'
        assert scenario[0][name].startswith('CheckpointVoteError: saving ')
        assert scenario[0][name].endswith(
            f'refused_{name} failed on rank 1: ValueError: refused on rank 1; nothing was committed'
        ), scenario[0][name]


@pytest.mark.scenario('build_errors')
def test_build_errors(scenario):
    out = scenario[0]
    assert "['Blok']" in out['err_wrap_class'] and "'Block'" in out['err_wrap_class']
    assert 'before prepare() sharded' in out['err_prebuilt']


@pytest.mark.scenario('first_half')
def test_a_save_failed_at_its_commit_leaves_the_last_checkpoint(scenario):
    first = scenario
    assert 'injected: disk full' in first[0]['failed_save']
    assert first[0]['failed_save'].startswith('OSError')  # rank 0 raises its own error
    # the other rank learns it from the vote, with the rank and the cause
    assert first[1]['failed_save'].startswith('CheckpointVoteError: saving ')
    assert 'failed on rank 0: OSError: injected: disk full' in first[1]['failed_save']
    for out in first:
        assert out['latest_after_fail'] == str(scenario.tmp / 'iter_4')
        assert [n for n in out['listing'] if 'iter_4' in n] == ['iter_4']  # no staging left


@pytest.mark.scenario('peer_copies')
def test_peer_copies_of_shards_resume_bit_exact_on_the_same_mesh_only(scenario):
    for rank, out in enumerate(scenario):
        ref = scenario.needs['first_half'][rank]
        # each rank's copy: its shards of the model and optimizer, and where they go
        assert out['local_shape'] == [4, 6] and out['records'] > 0
        assert out['meshes'] == [[[2], []]]  # FSDP's 1-D mesh has no dimension names
        assert out['held'] == ['iter_4.pth', 'iter_4.pth.manifest.json']
        assert out['iter'] == 4 and out['loaded_equal']
        _assert_equal_states(out['final'], ref['final'])  # what a storage resume ends with
        assert out['lr'] == ref['lr']
        assert out['hsdp_iter'] == 3
    (tier,) = scenario[0]['tier']
    assert tier.startswith(
        'resume tier: peer (peer copies of iteration 4: at least as new as the newest '
        'storage checkpoint iter_3 (iteration 3))'
    ), tier
    (tier,) = scenario[0]['hsdp_tier']
    assert tier == (
        'resume tier: storage (no usable peer copy; not used: a copy of the shards on the '
        'mesh (2); this run lays them out on the mesh (replicate=2, shard=1) (a copy '
        'restores only its own layout) (own/rank0/iter_4.pth, held/rank1/iter_4.pth, '
        'own/rank1/iter_4.pth, held/rank0/iter_4.pth))'
    ), tier


@pytest.mark.scenario('resume_two_ranks')
def test_resume_two_ranks_bit_exact(scenario):
    for rank, out in enumerate(scenario):
        ref = scenario.needs['first_half'][rank]
        for name in ('iter_3', 'iter_3_full.pth'):
            _assert_equal_states(out[name]['final'], ref['final'])
            assert out[name]['lr'] == ref['lr']
        _assert_equal_states(out['iter_3']['loaded'], ref['state_3'])
        assert out['iter_3']['rng_warning'] == []  # same world size: streams restored
        # each rank's own streams, from its own file (sharded) or the gathered list (full)
        assert out['iter_3']['draws'] == out['iter_3_full.pth']['draws'] == ref['draws_3']
    assert scenario[0]['iter_3']['draws'] != scenario[1]['iter_3']['draws']


@pytest.mark.scenario('two_to_one')
def test_two_to_one(scenario):
    ref = scenario.needs['first_half'][0]['state_3']
    one = scenario[0]
    _assert_equal_states(one['loaded'], ref)
    assert 'saved with world size 2, this run has 1' in one['rng_warning'][0]
    assert one['resumed_lr'] != one['lr']  # the schedule moved between iter 3 and 5


@pytest.mark.scenario('one_to_two')
def test_one_to_two(scenario):
    one = scenario.needs['two_to_one'][0]
    one_final = one['final']
    for rank, out in enumerate(scenario):
        two = scenario.needs['resume_two_ranks'][rank]
        _assert_equal_states(out['one_rank']['loaded'], one_final)
        # 2 -> 1 resumes the schedule and counters as 2 -> 2 does; 1 -> 2 where 1 rank stopped
        for key in ('resumed_lr', 'resumed_count', 'resumed_scheds'):
            assert one[key] == two['iter_3'][key], key
        assert out['one_rank']['resumed_lr'] == one['lr']
        assert out['one_rank']['resumed_count'] == 5 == one['iter'] + 2
        # a world-size change re-seeds, said once (rank 0)
        assert len(out['one_rank']['rng_warning']) == (rank == 0)


@pytest.mark.scenario('single_device')
def test_single_device_resumes_the_fsdp_directory(scenario):
    ref_model, ref_optim = scenario.needs['first_half'][0]['state_3']
    single = scenario[0]
    sd = single['state_dict']
    assert all(torch.equal(sd[k], ref_model[k]) for k in ref_model)
    names = single['names']
    state = single['optimizer_state']
    for i, name in enumerate(names):
        for key, value in ref_optim[name].items():
            assert torch.equal(torch.as_tensor(state[i][key]), torch.as_tensor(value))


@pytest.mark.scenario('fsdp_loads_single_device')
def test_fsdp_resumes_the_single_device_file(scenario):
    ref = scenario.needs['first_half'][0]['state_3']
    for out in scenario:  # FSDP loaded the SingleDeviceStrategy file
        _assert_equal_states(out['single.pth']['loaded'], ref)


def test_mmengine_config_builds():
    from stratagem.strategies.fsdp.config import parse_model_wrapper
    from stratagem.strategies.fsdp.options import parse_state_dict_cfg

    cfg = parse_model_wrapper(
        dict(
            type='MMFullyShardedDataParallel',
            sharding_strategy='SHARD_GRAD_OP',
            use_orig_params=True,
            cpu_offload=dict(offload_params=True),
            mixed_precision=dict(param_dtype='bfloat16'),
            auto_wrap_policy=dict(
                type='torch.distributed.fsdp.wrap.size_based_auto_wrap_policy', min_num_params=60
            ),
        )
    )
    assert cfg.reshard_after_forward is False and cfg.cpu_offload is True
    assert cfg.mp_policy.param_dtype == torch.bfloat16
    net = _net()  # Linear(6,8)=56, Block.fc=72 (x2), Linear(8,2)=18: bottom-up, like FSDP1
    targets = {id(m) for m in cfg.targets(net)}
    assert [n for n, m in net.named_modules() if id(m) in targets] == ['1.fc', '2.fc']
    assert parse_state_dict_cfg(None, 'local') == 'sharded'
    assert parse_state_dict_cfg(None, dict(state_dict_type='FULL_STATE_DICT')) == 'full'
    for bad, match in (
        (dict(sharding_strategy='NO_SHARD'), 'DDPStrategy'),
        (dict(backward_prefetch='BACKWARD_PRE'), 'backward_prefetch'),
        (dict(mixed_precision=dict(buffer_dtype='float16')), 'buffer_dtype'),
        (dict(auto_wrap=1), 'unknown model_wrapper key'),
    ):
        with pytest.raises(ValueError, match=match):
            parse_model_wrapper(bad)


def test_needs_distributed_launch():
    from stratagem.strategies import build_strategy

    with pytest.raises(RuntimeError, match='torchrun'):
        build_strategy(dict(type='FSDPStrategy'))


@pytest.mark.scenario('train_transformer_cli')
def test_train_transformer_config_end_to_end(scenario):
    """`stratagem train examples/configs/transformer_fsdp.py --nproc 2`: committed sharded
    directories and its run metrics."""
    from stratagem import checkpoint as ckpt
    from stratagem.checkpoint.directory import verify_directory
    from stratagem.checkpoint.sharded import is_sharded_checkpoint

    work = scenario.tmp
    assert scenario[0] == 0
    assert sorted(p.name for p in (work / 'lm').glob('iter_*')) == ['iter_4.pth', 'iter_8.pth']
    assert ckpt.find_latest_checkpoint(work / 'lm') == work / 'lm' / 'iter_8.pth'
    for it in (4, 8):
        path = work / 'lm' / f'iter_{it}.pth'
        assert is_sharded_checkpoint(path)
        manifest = verify_directory(path, collective=False)
        assert (manifest['step'], manifest['world_size'], manifest['strategy']) == (
            it,
            2,
            'FSDPStrategy',
        )
        assert {'.metadata', '__0_0.distcp', '__1_0.distcp', 'extra.pth'} <= {
            f['path'] for f in manifest['files']
        }
    # run metrics: rank 0 alone wrote one row per log interval (tokens: language data)
    import csv

    (table,) = (work / 'lm').glob('*/metrics.csv')
    with open(table) as f:
        rows = list(csv.DictReader(f))
    assert [r['iter'] for r in rows] == ['8']
    assert float(rows[0]['tokens_per_s']) == pytest.approx(float(rows[0]['samples_per_s']) * 32)
    # rank 0's first step counted under FSDP: its MFU against the CPU's measured peak
    assert int(rows[0]['flops_per_iter']) > 0 and float(rows[0]['mfu']) > 0
    assert float(rows[0]['grad_norm']) > 0  # the example clips
    assert float(rows[0]['checkpoint_stall_s']) > 0  # the save at iteration 4
    assert list((table.parent / 'tensorboard').glob('events.out.tfevents.*'))


@pytest.mark.scenario('lm_resume')
def test_transformer_config_resumed_from_iter_4_ends_bit_exact(scenario):
    """The reference loop resumes the run of `stratagem train` from iter 4 and ends
    bit-exact where the uninterrupted run did."""
    from stratagem import checkpoint as ckpt

    work = scenario.tmp
    assert [out['lm_iter'] for out in scenario] == [8, 8]
    first = ckpt.read_sharded_checkpoint(work / 'lm' / 'iter_8.pth')
    resumed = ckpt.read_sharded_checkpoint(work / 'lm_resumed' / 'iter_8.pth')
    start = ckpt.read_sharded_checkpoint(work / 'lm' / 'iter_4.pth')
    model = first['state_dict']
    assert sorted(model) == sorted(resumed['state_dict']) and 'blocks.3.q.weight' in model
    assert all(torch.equal(model[k], resumed['state_dict'][k]) for k in model)
    assert any(not torch.equal(model[k], start['state_dict'][k]) for k in model)  # it trained
    for index, state in first['optimizer']['state'].items():
        for key, value in state.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(resumed['optimizer']['state'][index][key])
            )
    assert first['meta']['iter'] == resumed['meta']['iter'] == 8


@pytest.mark.scenario('mmengine_forms')
def test_prepare_with_mmengine_forms(scenario):
    for out in scenario:
        assert out['sharded'] == ['', 'blocks.0', 'blocks.1']
        assert out['plain'] == ['head.0.bias', 'head.0.weight', 'head.1.bias', 'head.1.weight']
        assert out['state_dict_type'] == 'sharded'
        assert out['buffers'] == ['torch.float32', 'torch.int64']
        assert out['reduce'] == 'torch.float32'
        assert out['checkpointed'] == [
            'blocks.0.fc',
            'blocks.0.out',
            'blocks.1.fc',
            'blocks.1.out',
            'embed',
            'head.0',
            'head.1',
        ]
        assert out['changed'] == [True, True]
