"""Write the frozen checkpoints of ``tests/checkpoint/test_legacy_checkpoints.py``.

Generated from the clean tree of commit 139334c with torch 2.13.0+cpu and deepspeed 0.19.8
(CPU, gloo), with the stratagem package of that commit ahead on the path::

    git clone -q --shared /work/main /tmp/src && git -C /tmp/src checkout -q 139334c
    cd /tmp/src && PYTHONPATH=/tmp/src:/work/main/tests /work/main/.venv/bin/python \
        /work/main/tests/data/legacy/make_legacy_checkpoints.py

(from that directory: the ranks' ``python -c`` puts the working directory first on the path;
``tests/`` on ``PYTHONPATH`` is for ``dist_harness``, as pytest's ``pythonpath`` gives it to
the tests)

The script writes beside itself and records the commit of the stratagem package it imported;
it refuses a package whose tracked files differ from their commit (a frozen checkpoint must
come from a commit, not from work in progress).

One checkpoint per layout, each after 3 training steps of the same tiny model
(``Sequential(Linear(4, 8), Tanh(), Linear(8, 2))``) on fixed data, saved with
``extra_ckpt={'meta': {'iter': 3}}``:

    single/iter_3.pth (+ .manifest.json)  SingleDeviceStrategy, SGD momentum: one file
    fsdp/iter_3/                          FSDPStrategy, 2 gloo ranks, AdamW: a DCP directory
    deepspeed/iter_3/                     DeepSpeedStrategy ZeRO-2, 2 gloo ranks, torch Adam

DDPStrategy's file and FSDPStrategy's ``state_dict_type='full'`` file are the single-file
layout again (rank 0 writes through the same ``checkpoint.save_checkpoint``) and are left
out to keep this directory small: most of a checkpoint's bytes here are fixed costs (each
rank's RNG states, ~15 KB; ~1.5 KB per tensor in a DCP shard; DeepSpeed's 38 KB
``zero_to_fp32.py``), not the model's.

``expected.json`` beside them holds, per layout, the components' configs and the values at
the ``save_checkpoint`` call, taken from the live objects (not read back from the files):
weights, optimizer state, the lr and each scheduler's last value, the optim wrapper's
``inner_count``, the meta iteration and each rank's ``torch.rand(3)`` drawn right after the
save (its RNG state). Tensors are ``{"dtype", "shape", "data"}``; a float32 written as a
Python float and read back is the same float32, so the test compares exactly.

Numbers are deterministic (fixed seeds, fixed data); the files' bytes are not (meta holds a
timestamp, manifests their creation time). The ``last_checkpoint`` pointers are not kept:
they hold the absolute path of the work directory this script used.

Regenerating replaces what the test guards: do it only on purpose, and say so in the commit.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from dist_harness import run_distributed  # tests/ on PYTHONPATH (see the docstring)

HERE = Path(__file__).resolve().parent

ITER = 3  # steps trained before the save
SEED = 7  # env_kwargs.randomness.seed of every strategy
SCHEDULER = [dict(type='LinearLR', start_factor=0.25, by_epoch=False, end=6)]  # mid-warmup at 3
SGD = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
LAYOUTS = {
    'single': dict(strategy=dict(type='SingleDeviceStrategy', device='cpu'),
                   components=dict(optim_wrapper=SGD, param_scheduler=SCHEDULER,
                                   dispatch_kwargs=dict(max_iters=6)),
                   world_size=1, checkpoint='iter_3.pth'),
    'fsdp': dict(strategy=dict(type='FSDPStrategy',
                               model_wrapper=dict(auto_wrap_policy=['Linear'])),
                 components=dict(optim_wrapper=dict(optimizer=dict(type='AdamW', lr=0.01)),
                                 param_scheduler=SCHEDULER, dispatch_kwargs=dict(max_iters=6)),
                 world_size=2, checkpoint='iter_3'),
    'deepspeed': dict(strategy=dict(type='DeepSpeedStrategy', zero_optimization=dict(stage=2)),
                      components=dict(
                          optim_wrapper=dict(type='DeepSpeedOptimWrapper',
                                             optimizer=dict(type='Adam', lr=0.05)),
                          param_scheduler=SCHEDULER,
                          dispatch_kwargs=dict(max_iters=6, train_micro_batch_size_per_gpu=4)),
                      world_size=2, checkpoint='iter_3'),
}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(it: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of iteration ``it``'s global batch of 8 samples."""
    g = torch.Generator().manual_seed(100 + it)
    x, y = torch.randn(8, 4, generator=g), torch.randint(2, (8,), generator=g)
    per = 8 // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def encode(t: torch.Tensor) -> dict:
    t = t.detach().cpu()
    return {'dtype': str(t.dtype).removeprefix('torch.'), 'shape': list(t.shape),
            'data': t.flatten().tolist()}


def dumps(obj: dict) -> str:
    """JSON, indented, each encoded tensor on one line."""
    tensors: list[dict] = []

    def mark(o):
        if isinstance(o, dict) and set(o) == {'dtype', 'shape', 'data'}:
            tensors.append(o)
            return f'@tensor{len(tensors) - 1}@'
        if isinstance(o, dict):
            return {k: mark(v) for k, v in o.items()}
        if isinstance(o, list):
            return [mark(v) for v in o]
        return o
    text = json.dumps(mark(obj), indent=1)
    for i, t in enumerate(tensors):
        text = text.replace(f'"@tensor{i}@"', json.dumps(t), 1)
    return text


def _build(layout: str, work_dir: str):
    from stratagem.strategies import build_strategy
    spec = LAYOUTS[layout]
    s = build_strategy(dict(spec['strategy'], work_dir=work_dir,
                            env_kwargs=dict(randomness=dict(seed=SEED))))
    model, ow, scheds = s.prepare(net(), **spec['components'])
    return s, model, ow, scheds


def _train_and_save(layout: str, work_dir: str) -> dict:
    """Train ITER steps, save, and return the values at the save (every rank)."""
    from torch.nn import functional as F
    s, model, ow, scheds = _build(layout, work_dir)
    for it in range(ITER):
        x, y = batch(it, s.rank, s.world_size)
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x), y)
        ow.update_params(loss)
        for sch in scheds:
            sch.step()
    weights, optim = _state(layout, s)  # before the call: the state at the call
    values = dict(lr=[g['lr'] for g in ow.param_groups],
                  scheduler_last_values=[sch.get_last_value() for sch in scheds],
                  inner_count=ow.inner_count)
    path = s.save_checkpoint(LAYOUTS[layout]['checkpoint'],
                             extra_ckpt={'meta': {'iter': ITER}})
    rng = torch.rand(3)
    return dict(path=path, weights=weights, optimizer=optim, iter=ITER, rng_after_save=rng,
                **values)


def _state(layout: str, s) -> tuple[dict, dict]:
    """Full weights and optimizer state by parameter name, cloned (see the test's twin)."""
    if layout == 'single':
        module = s.model
        names = {p: n for n, p in module.named_parameters()}
        weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        optim = {names[p]: {k: v.clone() for k, v in st.items()}
                 for p, st in s.optim_wrapper.optimizer.state.items()}
        return weights, optim
    if layout == 'fsdp':
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        opts = StateDictOptions(full_state_dict=True)
        weights = {k: v.detach().clone()
                   for k, v in get_model_state_dict(s.model, options=opts).items()}
        optim = get_optimizer_state_dict(s.model, s.optim_wrapper.optimizer, options=opts)
        return weights, {k: {n: v.clone() for n, v in st.items()}
                         for k, st in optim['state'].items()}
    # deepspeed: fp32 master weights and Adam's moments, gathered without padding
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    module = s.model.module
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    optim = {n: {'fp32': safe_get_full_fp32_param(p).clone(),
                 **{k: safe_get_full_optimizer_state(p, k).clone()
                    for k in ('exp_avg', 'exp_avg_sq')}}
             for n, p in module.named_parameters()}
    steps = {float(st['step']) for st in s.model.optimizer.optimizer.state.values()}
    assert len(steps) == 1, steps  # one flat partition per rank, one step count
    step = steps.pop()
    for entry in optim.values():
        entry['step'] = torch.tensor(step)
    return weights, optim


def _two_ranks(work_dir: str) -> dict:
    out = {'package': _package()}
    for layout in ('fsdp', 'deepspeed'):
        out[layout] = _train_and_save(layout, str(Path(work_dir) / layout))
    return out


def _record(layout: str, per_rank: list[dict]) -> dict:
    first = per_rank[0]
    for other in per_rank[1:]:  # every rank saw the same full state
        for key in ('weights', 'optimizer'):
            flat = [(k, n, v) for k, v in other[key].items()
                    for n, v in (v.items() if isinstance(v, dict) else [('', v)])]
            for k, n, v in flat:
                ref = first[key][k][n] if n else first[key][k]
                assert torch.equal(ref, v), (layout, key, k, n)
    spec = LAYOUTS[layout]
    return dict(
        checkpoint=f'{layout}/{spec["checkpoint"]}', world_size=spec['world_size'],
        strategy=spec['strategy'], components=spec['components'], iter=first['iter'],
        lr=first['lr'], scheduler_last_values=first['scheduler_last_values'],
        inner_count=first['inner_count'],
        weights={k: encode(v) for k, v in first['weights'].items()},
        optimizer={k: {n: encode(v) for n, v in st.items()}
                   for k, st in first['optimizer'].items()},
        rng_after_save=[encode(r['rng_after_save']) for r in per_rank])


def _copy(src: Path, layout: str) -> None:
    """The checkpoint (file + sidecar manifest, or directory) into HERE/layout/."""
    dst = HERE / layout
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    if src.is_dir():
        shutil.copytree(src, dst / src.name)
        return
    for f in (src, src.with_name(src.name + '.manifest.json')):
        shutil.copy2(f, dst / f.name)


def _git(package: Path, *args: str) -> str:
    return subprocess.run(['git', '-C', str(package), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def _stratagem_source() -> tuple[str, str]:
    """(the stratagem package's directory, its commit); refuses uncommitted changes."""
    import stratagem
    package = Path(stratagem.__file__).resolve().parent
    changed = _git(package, 'status', '--porcelain', '--untracked-files=no', '--', '.')
    if changed:
        raise SystemExit(f'{package} has uncommitted changes:\n{changed}\nfrozen checkpoints '
                         'must come from a commit: run this script with a clean checkout of '
                         'it first on PYTHONPATH (see the docstring)')
    return str(package), _git(package, 'rev-parse', '--short', 'HEAD')


def _package() -> str:
    import stratagem
    return str(Path(stratagem.__file__).resolve().parent)


def main() -> None:
    import deepspeed
    package, commit = _stratagem_source()
    print(f'stratagem from {package} at {commit}')
    expected = dict(generated_at=dict(commit=commit, torch=str(torch.__version__),
                                      deepspeed=deepspeed.__version__,
                                      script='tests/data/legacy/make_legacy_checkpoints.py'))
    with tempfile.TemporaryDirectory(prefix='stratagem-legacy-') as tmp:
        single = _train_and_save('single', str(Path(tmp) / 'single'))
        expected['single'] = _record('single', [single])
        _copy(Path(single['path']), 'single')
        ranks = run_distributed(_two_ranks, nproc=2, args=(tmp,), timeout=600)
        assert {r['package'] for r in ranks} == {package}, (package, ranks[0]['package'])
        for layout in ('fsdp', 'deepspeed'):
            expected[layout] = _record(layout, [r[layout] for r in ranks])
            _copy(Path(ranks[0][layout]['path']), layout)
    (HERE / 'expected.json').write_text(dumps(expected) + '\n')
    total = sum(p.stat().st_size for p in HERE.rglob('*') if p.is_file())
    print(f'wrote {HERE} ({total / 1024:.0f} KiB)')


if __name__ == '__main__':
    main()
