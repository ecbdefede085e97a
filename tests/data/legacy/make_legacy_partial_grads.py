"""Write the frozen mid-window checkpoints of ``tests/checkpoint/test_legacy_checkpoints.py``.

Generated from the clean tree of commit b7238de (the last main that wrote partial gradients
in format 1) with torch 2.13.0+cpu (gloo), with the stratagem package of that commit first on
the path::

    git -C /work/main worktree add --detach /work/old-main b7238de   # a clean checkout
    cd /work/old-main && PYTHONPATH=/work/old-main OMP_NUM_THREADS=1 \
        /work/main/.venv/bin/python <this checkout>/tests/data/legacy/make_legacy_partial_grads.py

(from that directory: the ranks' ``python -c`` puts the working directory first on the path).
The script writes beside itself, into ``partial_grads/``, records the commit of the stratagem
package it imported and refuses a package whose tracked files differ from their commit, and a
package that does not write format 1 (``meta['format_version']`` absent).

Format 1, what these files freeze: a checkpoint saved inside a gradient-accumulation window
keeps every rank's own (unsynchronised) gradients:

- DDPStrategy (every backend but FSDP): ``checkpoint['partial_grads']``, a list over ranks of
  a list over optim wrappers (``OptimWrapperDict`` order) of ``{'inner_count': int, 'grads':
  {flat optimizer index: tensor}, 'scale': float}`` or None;
- FSDPStrategy with ``state_dict_type='full'``: ``checkpoint['partial_grads_fqn']``, a list
  over ranks of ``{parameter name: tensor}``.

Three checkpoints, 2 gloo ranks each, ``accumulative_counts=2``, ``max_iters=6``, saved after
3 iterations (one micro-batch into the window [2, 4)) with ``extra_ckpt={'meta': {'iter':
3}}``; each rank reads its own half of every global batch, so the ranks' pending gradients
differ:

    partial_grads/ddp/iter_3.pth       DDPStrategy, one OptimWrapper (SGD momentum)
    partial_grads/ddp_dict/iter_3.pth  DDPStrategy, an OptimWrapperDict: ``head`` (SGD momentum)
                                       first, ``body`` (AdamW) second, so each wrapper's
                                       optimizer index 0 is another parameter (and neither is
                                       the model's first)
    partial_grads/fsdp_full/iter_3.pth FSDPStrategy, state_dict_type='full', AdamW

(each with its ``.manifest.json``; the ``last_checkpoint`` pointers are not kept: they hold
the absolute path of the work directory this script used).

``partial_grads/expected.json`` holds, per case, the components' configs and, taken from the
live objects (not read back from the files): each rank's pending gradients by parameter name
and the weights at the ``save_checkpoint`` call, each wrapper's ``inner_count``, the names
each wrapper's optimizer indices count (what format 1 leaves implicit), and the weights after
training on to ``max_iters``. Before writing, the script checks that the old code's own
resume of each checkpoint (into a model with other weights) puts back every rank's pending
gradients and ends, after 3 more iterations, bit for bit where an uninterrupted run of 6 ends;
and that the files hold exactly those gradients in format 1. Tensors are ``{"dtype",
"shape", "data"}``; a float32 written as a Python float and read back is the same float32.

Numbers are deterministic (fixed seeds, fixed data); the files' bytes are not (meta holds a
timestamp, manifests their creation time). Regenerating replaces what the test guards: do it
only on purpose, and say so in the commit.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
OUT = HERE / 'partial_grads'
ITER = 3  # iterations before the save: one micro-batch into the window [2, 4)
MAX_ITERS = 6
SEED = 7  # env_kwargs.randomness.seed of every strategy
CHECKPOINT = 'iter_3.pth'


def _accumulating(optimizer: dict) -> dict:
    return dict(optimizer=optimizer, accumulative_counts=2)


SGD = dict(type='SGD', lr=0.1, momentum=0.9)
ADAMW = dict(type='AdamW', lr=0.01)
DISPATCH = dict(max_iters=MAX_ITERS)
CASES = {
    'ddp': dict(
        strategy=dict(type='DDPStrategy'),
        model='net',
        components=dict(optim_wrapper=_accumulating(SGD), dispatch_kwargs=DISPATCH),
    ),
    'ddp_dict': dict(
        strategy=dict(type='DDPStrategy'),
        model='two_parts',
        components=dict(
            optim_wrapper=dict(head=_accumulating(SGD), body=_accumulating(ADAMW)),
            dispatch_kwargs=DISPATCH,
        ),
    ),
    'fsdp_full': dict(
        strategy=dict(
            type='FSDPStrategy',
            state_dict_type='full',
            model_wrapper=dict(auto_wrap_policy=['Linear']),
        ),
        model='net',
        components=dict(optim_wrapper=_accumulating(ADAMW), dispatch_kwargs=DISPATCH),
    ),
}


def _dist_harness():
    """tests/dist_harness.py, by its path (the tests' helpers are not a package)."""
    spec = importlib.util.spec_from_file_location(
        'dist_harness', HERE.parents[1] / 'dist_harness.py'
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TwoParts(nn.Module):
    """``body`` then ``head``, each trained by its own optimizer: the forward gives each part
    logits whose loss reaches only that part's parameters (the other part detached)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        for_body = F.linear(h, self.head.weight.detach(), self.head.bias.detach())
        return for_body, self.head(h.detach())


def net(kind: str, seed: int = 0) -> nn.Module:
    """The case's model; the test builds it with another ``seed`` (other weights)."""
    torch.manual_seed(seed)
    if kind == 'two_parts':
        return TwoParts()
    return nn.Sequential(OrderedDict(fc1=nn.Linear(4, 8), act=nn.Tanh(), fc2=nn.Linear(8, 2)))


def batch(it: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of iteration ``it``'s global batch of 8 samples."""
    g = torch.Generator().manual_seed(100 + it)
    x, y = torch.randn(8, 4, generator=g), torch.randint(2, (8,), generator=g)
    per = 8 // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(case: str, model: nn.Module, ow, it: int, rank: int, world: int) -> None:
    """Iteration ``it`` of ``case`` (the test runs the same steps)."""
    x, y = batch(it, rank, world)
    if case != 'ddp_dict':
        with ow.optim_context(model):
            loss = F.cross_entropy(model(x), y)
        ow.update_params(loss)
        return
    # one forward, both backwards (DDP reduces the whole model once, in the second), then
    # each wrapper's step at its window's end: update_params, split in its phases
    head, body = ow['head'], ow['body']
    with head.optim_context(model), body.optim_context(model):
        for_body, for_head = model(x)
    head.backward(head.scale_loss(F.cross_entropy(for_head, y)))
    body.backward(body.scale_loss(F.cross_entropy(for_body, y)))
    for wrapper in (head, body):
        if wrapper.should_update():
            wrapper.step()
            wrapper.zero_grad()


def wrappers(ow) -> list:
    return list(ow.values()) if hasattr(ow, 'values') else [ow]


def encode(t: torch.Tensor) -> dict:
    t = t.detach().cpu()
    return {
        'dtype': str(t.dtype).removeprefix('torch.'),
        'shape': list(t.shape),
        'data': t.flatten().tolist(),
    }


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


# ------------------------------------------------------------------------------ the ranks
def _build(case: str, work_dir: str, seed: int = 0):
    from stratagem.strategies import build_strategy

    spec = CASES[case]
    s = build_strategy(
        dict(spec['strategy'], work_dir=work_dir, env_kwargs=dict(randomness=dict(seed=SEED)))
    )
    model, ow = s.prepare(net(spec['model'], seed), **spec['components'])
    return s, model, ow


def _module(s) -> nn.Module:
    return s.model.module if hasattr(s.model, 'module') else s.model


def _weights(case: str, s) -> dict:
    """The full weights by name, cloned (collective under FSDP)."""
    if case == 'fsdp_full':
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        full = get_model_state_dict(s.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().clone() for k, v in full.items()}
    return {k: v.detach().clone() for k, v in _module(s).state_dict().items()}


def _pending(case: str, s) -> dict:
    """This rank's pending gradients by parameter name, cloned."""
    if case == 'fsdp_full':  # FSDP2 keeps them unsharded, beside the sharded parameters
        from stratagem.strategies.fsdp.grad_sync import pending_grads

        return {k: g.clone() for k, g in pending_grads(s.model).items()}
    return {n: p.grad.clone() for n, p in _module(s).named_parameters() if p.grad is not None}


def _run_case(case: str, root: Path) -> dict:
    """Uninterrupted, saved at ITER, resumed by this code: what the parent checks and records."""
    s, model, ow = _build(case, str(root / 'uninterrupted'))
    for it in range(MAX_ITERS):
        train(case, model, ow, it, s.rank, s.world_size)
    uninterrupted = _weights(case, s)

    s, model, ow = _build(case, str(root / 'saved'))
    for it in range(ITER):
        train(case, model, ow, it, s.rank, s.world_size)
    names = {id(p): n for n, p in _module(s).named_parameters()}
    out = dict(
        rank=s.rank,
        grads=_pending(case, s),  # before the call: the state at the call
        weights=_weights(case, s),
        inner_count=[w.inner_count for w in wrappers(ow)],
        index_names=[
            [names[id(p)] for g in w.optimizer.param_groups for p in g['params']]
            for w in wrappers(ow)
        ],
    )
    out['path'] = s.save_checkpoint(CHECKPOINT, extra_ckpt={'meta': {'iter': ITER}})

    s, model, ow = _build(case, str(root / 'resumed'), seed=1)
    start = s.resume(out['path'])['meta']['iter']
    out['resumed_grads'] = _pending(case, s)
    for it in range(start, MAX_ITERS):
        train(case, model, ow, it, s.rank, s.world_size)
    out['resumed'], out['uninterrupted'] = _weights(case, s), uninterrupted
    return out


def _ranks(root: str) -> dict:
    import stratagem

    out = {'package': str(Path(stratagem.__file__).resolve().parent)}
    for case in CASES:
        out[case] = _run_case(case, Path(root) / case)
    return out


# ------------------------------------------------------------------------------ the parent
def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def _check_file(case: str, per_rank: list[dict]) -> None:
    """The file holds format 1 and exactly the ranks' pending gradients."""
    checkpoint = torch.load(per_rank[0]['path'], weights_only=True)
    if 'format_version' in checkpoint['meta']:
        raise SystemExit(
            f'this stratagem writes format {checkpoint["meta"]["format_version"]}; the frozen '
            'files must be format 1: run the script with commit b7238de (see the docstring)'
        )
    if case == 'fsdp_full':
        assert 'partial_grads' not in checkpoint, list(checkpoint)
        saved = checkpoint['partial_grads_fqn']
    else:
        assert 'partial_grads_fqn' not in checkpoint, list(checkpoint)
        index_names = per_rank[0]['index_names']
        saved = []
        for entry in checkpoint['partial_grads']:  # per rank, per wrapper, by optimizer index
            assert len(entry) == len(index_names)
            assert all(isinstance(i, int) for st in entry for i in st['grads'])
            saved.append(
                {index_names[w][i]: g for w, st in enumerate(entry) for i, g in st['grads'].items()}
            )
    assert len(saved) == len(per_rank) == 2, (case, len(saved))
    for r, (got, out) in enumerate(zip(saved, per_rank)):
        assert _same(got, out['grads']), (case, r)


def _record(case: str, per_rank: list[dict]) -> dict:
    first = per_rank[0]
    for r, out in enumerate(per_rank):
        assert out['rank'] == r
        assert _same(out['weights'], first['weights']), (case, r)  # the ranks agree
        assert _same(out['uninterrupted'], first['uninterrupted']), (case, r)
        assert out['inner_count'] == [ITER] * len(out['inner_count']), out['inner_count']
        assert _same(out['resumed_grads'], out['grads']), (case, r, 'old resume: grads')
        assert _same(out['resumed'], out['uninterrupted']), (case, r, 'old resume: weights')
        assert set(out['grads']) == set(out['weights']), (case, sorted(out['grads']))
    assert not any(  # each rank its own data, its own gradients
        torch.equal(first['grads'][k], per_rank[1]['grads'][k]) for k in first['grads']
    ), case
    _check_file(case, per_rank)
    spec = CASES[case]
    return dict(
        checkpoint=f'partial_grads/{case}/{CHECKPOINT}',
        world_size=len(per_rank),
        strategy=spec['strategy'],
        model=spec['model'],
        components=spec['components'],
        iter=ITER,
        max_iters=MAX_ITERS,
        inner_count=first['inner_count'],
        index_names=first['index_names'],
        partial_grads=[{k: encode(v) for k, v in out['grads'].items()} for out in per_rank],
        weights_at_save={k: encode(v) for k, v in first['weights'].items()},
        final_weights={k: encode(v) for k, v in first['uninterrupted'].items()},
    )


def _copy(src: Path, case: str) -> None:
    """The checkpoint file and its sidecar manifest into OUT/case/."""
    dst = OUT / case
    dst.mkdir(parents=True)
    for f in (src, src.with_name(src.name + '.manifest.json')):
        shutil.copy2(f, dst / f.name)


def _git(package: Path, *args: str) -> str:
    return subprocess.run(
        ['git', '-C', str(package), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def _stratagem_source() -> tuple[str, str]:
    """(the stratagem package's directory, its commit); refuses uncommitted changes."""
    import stratagem

    package = Path(stratagem.__file__).resolve().parent
    changed = _git(package, 'status', '--porcelain', '--untracked-files=no', '--', '.')
    if changed:
        raise SystemExit(
            f'{package} has uncommitted changes:\n{changed}\nfrozen checkpoints must come '
            'from a commit: run this script with a clean checkout of it first on PYTHONPATH '
            '(see the docstring)'
        )
    return str(package), _git(package, 'rev-parse', '--short', 'HEAD')


def main() -> None:
    package, commit = _stratagem_source()
    print(f'stratagem from {package} at {commit}')
    expected: dict = dict(
        generated_at=dict(
            commit=commit,
            torch=str(torch.__version__),
            script='tests/data/legacy/make_legacy_partial_grads.py',
        )
    )
    with tempfile.TemporaryDirectory(prefix='stratagem-legacy-partial-') as tmp:
        ranks = _dist_harness().run_distributed(_ranks, nproc=2, args=(tmp,), timeout=600)
        assert {r['package'] for r in ranks} == {package}, (package, ranks[0]['package'])
        records = {case: _record(case, [r[case] for r in ranks]) for case in CASES}
        if OUT.exists():
            shutil.rmtree(OUT)
        for case in CASES:
            _copy(Path(ranks[0][case]['path']), case)
    expected.update(records)
    (OUT / 'expected.json').write_text(dumps(expected) + '\n')
    total = sum(p.stat().st_size for p in OUT.rglob('*') if p.is_file())
    print(f'wrote {OUT} ({total / 1024:.0f} KiB)')


if __name__ == '__main__':
    main()
