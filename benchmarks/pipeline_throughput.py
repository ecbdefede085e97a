"""Pipeline parallelism: FSDPStrategy with ``pipeline=`` against a raw loop over
``torch.distributed.pipelining``, the bubble against the schedule's theory, bytes per rank.

gloo, 1 thread per process, a ``TransformerLM`` (``--dim``, ``--depth``; heads of 32) cut in
two stages before block ``depth / 2``, ``--batch`` sequences of ``--seq`` tokens per
data-parallel rank in ``--microbatches`` microbatches, AdamW, schedule ``--schedule``.

1. Step time, 2 processes ``mesh=dict(pipeline=2)`` and 4 processes
   ``mesh=dict(pipeline=2, shard=2)``: ``strategy.train_step(x, y, TransformerLM.loss)``
   against a raw loop written with torch only (the stage cut by hand, ``fully_shard`` on each
   block and on the stage over the ``shard`` dimension, ``PipelineStage`` over the
   ``pipeline`` dimension, the same schedule class, ``AdamW``), interleaved blocks
   (raw, ours, ours, raw, ...) in the same processes; medians, their ratio ours / raw, and the
   median of the rounds' paired ratios (each pair ran back to back); the CPU time each process
   used per step, per loop (another job's load moves it much less than the wall time);
   `--control` adds the raw loop that also broadcasts the loss to every stage.
2. The bubble, 2 processes (``--bubble-microbatches``): a rank's idle share of a step is
   1 − (the time it computes) / (its step time), the time it computes being its stage's
   forward and backward of each microbatch (``PipelineStage.forward_one_chunk`` /
   ``backward_one_chunk``, timed where they run), the loss and the optimizer step; the rest
   is waiting for the other stage, sending and the schedule's own work. The theory for GPipe
   and 1F1B with equal stages is (p − 1) / (m + p − 1). Timed on both loops.
3. Parameters + AdamW state per rank (local shards), and the whole model's on one process.

    python benchmarks/pipeline_throughput.py [--part steps|bubble|all] [--rounds 15] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from _spawn import (  # benchmarks/, on the path when run as a script
    as_torchrun_rank,
    spawn_ranks,
    state_bytes,
    timed_block,
)
from torch import nn
from torch.nn import functional as F

SCHEDULES = ('GPipe', '1F1B')


def _model(args: argparse.Namespace) -> nn.Module:
    from stratagem.models import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(
        vocab_size=256, dim=args.dim, depth=args.depth, heads=args.dim // 32, max_len=args.seq
    )
    model.init_weights()
    return model


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, a mean (the raw loop's own loss function)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _RawStage(nn.Module):
    """One stage of the TransformerLM cut by hand: the embeddings on the first stage, blocks
    ``blocks``, the final norm and the head on the last."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.tok, self.pos = (model.tok, model.pos) if first else (None, None)
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        self.norm, self.head = (model.norm, model.head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


class _Loop:
    """One pipelined training loop on this rank: its stage module, optimizer and ``step``."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], None]
    first: bool
    last: bool


def _raw(
    args: argparse.Namespace,
    shard: int,
    microbatches: int,
    x,
    y,
    loss_fn: Callable = _loss,
    broadcast: bool = False,
) -> _Loop:
    """The hand-written set-up: the mesh, this rank's stage, fully_shard, PipelineStage, the
    schedule, AdamW. ``broadcast``: each step ends by sending the last stage's mean loss to
    the other pipeline ranks (what ``train_step`` returns on every rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mesh = init_device_mesh(
        'cpu', (dist.get_world_size() // shard, shard), mesh_dim_names=('pipeline', 'shard')
    )
    stages, stage = mesh['pipeline'].size(), mesh['pipeline'].get_local_rank()
    per = args.depth // stages
    loop = _Loop()
    loop.first, loop.last = stage == 0, stage == stages - 1
    module = _RawStage(_model(args), range(stage * per, (stage + 1) * per), loop.first, loop.last)
    for block in module.blocks:
        fully_shard(block, mesh=mesh['shard'])
    fully_shard(module, mesh=mesh['shard'])
    cls = {'GPipe': ScheduleGPipe, '1F1B': Schedule1F1B}[args.schedule]
    schedule = cls(
        PipelineStage(
            module, stage, stages, torch.device('cpu'), group=mesh['pipeline'].get_group()
        ),
        n_microbatches=microbatches,
        loss_fn=loss_fn,
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)

    group = mesh['pipeline'].get_group()

    def step() -> None:
        losses: list[torch.Tensor] = []
        if loop.first:
            schedule.step(x)
        elif loop.last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        if broadcast:
            loss = torch.stack(losses).mean() if loop.last else torch.zeros(())
            dist.broadcast(loss, group=group, group_src=stages - 1)

    loop.module, loop.optimizer, loop.step = module, optimizer, step
    return loop


def _ours(
    args: argparse.Namespace,
    shard: int,
    microbatches: int,
    x,
    y,
    tmp: str,
    wrap_loss: Callable = lambda fn: fn,
) -> _Loop:
    """FSDPStrategy with ``mesh=dict(pipeline=2, shard=shard)`` and ``train_step``, its loss
    ``TransformerLM.loss`` (through ``wrap_loss``)."""
    from stratagem.models import TransformerLM
    from stratagem.strategies import build_strategy

    strategy = build_strategy(
        dict(
            type='FSDPStrategy',
            work_dir=tmp,
            mesh=dict(pipeline=2, shard=shard),
            pipeline=dict(
                schedule=args.schedule,
                microbatches=microbatches,
                split_points=[f'blocks.{args.depth // 2}'],
            ),
            model_wrapper=dict(auto_wrap_policy=['TransformerBlock']),
            log_kwargs=dict(log_level='WARNING'),
        )
    )
    model, ow = strategy.prepare(
        _model(args), optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-4))
    )
    loop = _Loop()
    loop.module, loop.optimizer = model, ow.optimizer
    rank = strategy.mesh_spec.pipeline_rank(strategy.rank)
    loop.first, loop.last = rank == 0, rank == 1

    loss_fn = wrap_loss(TransformerLM.loss)

    def step() -> None:
        strategy.train_step(x, y, loss_fn)

    loop.step = step
    return loop


def _batch(args: argparse.Namespace, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(dp_rank)
    tokens = torch.randint(256, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _steps(args: argparse.Namespace, shard: int, tmp: str) -> dict:
    """Step times of both loops (interleaved blocks, the order alternating) and bytes."""
    import torch.distributed as dist

    x, y = _batch(args, dist.get_rank() % shard)
    loops = {'raw': _raw(args, shard, args.microbatches, x, y)}
    if args.control:
        loops['raw+bcast'] = _raw(args, shard, args.microbatches, x, y, broadcast=True)
    loops['ours'] = _ours(args, shard, args.microbatches, x, y, tmp)
    for loop in loops.values():
        timed_block(loop.step, 2)  # warm-up: shape inference, optimizer state
    times: dict[str, list[float]] = {key: [] for key in loops}
    cpu: dict[str, float] = dict.fromkeys(loops, 0.0)
    for i in range(args.rounds):
        order = list(loops.items())
        for key, loop in order if i % 2 == 0 else order[::-1]:
            start = time.process_time()
            times[key].append(timed_block(loop.step, args.steps))
            cpu[key] += time.process_time() - start
    sizes = {key: state_bytes(loop.module, loop.optimizer) for key, loop in loops.items()}
    # CPU seconds this process used per step (all its threads): what the loop costs, which
    # another job's load on the machine changes much less than the wall time
    cpu_ms = {key: v * 1000 / (args.rounds * args.steps) for key, v in cpu.items()}
    return {'times': times, 'bytes': sizes, 'cpu_ms': cpu_ms}


class _Busy:
    """Wall time this process spends computing inside a pipeline step: the stage's forward
    and backward of each microbatch (``PipelineStage.forward_one_chunk`` /
    ``backward_one_chunk``, wrapped on the class so that both loops' stages count), the loss
    and the optimizer step. The rest of a step is waiting for a neighbour, sending, and the
    schedule's own work."""

    def __init__(self) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.seconds = 0.0
        for name in ('forward_one_chunk', 'backward_one_chunk'):
            setattr(PipelineStage, name, self.timed(getattr(PipelineStage, name)))

    def timed(self, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return run


def _bubble(args: argparse.Namespace, tmp: str) -> dict:
    """For each microbatch count and loop: the median step time (ms) and the median share of
    a step this rank does not compute (per block of ``--steps`` steps)."""
    import torch.distributed as dist

    busy = _Busy()
    x, y = _batch(args, 0)
    out: dict = {}
    for m in args.bubble_microbatches:
        loops = {'raw': _raw(args, 1, m, x, y, busy.timed(_loss))}
        loops['ours'] = _ours(args, 1, m, x, y, os.path.join(tmp, f'm{m}'), busy.timed)
        for loop in loops.values():
            loop.optimizer.step = busy.timed(loop.optimizer.step)  # type: ignore[method-assign]
            timed_block(loop.step, 2)
        step_ms: dict[str, list[float]] = {key: [] for key in loops}
        idle: dict[str, list[float]] = {key: [] for key in loops}
        for i in range(args.rounds):
            order = list(loops.items())
            for key, loop in order if i % 2 == 0 else order[::-1]:
                busy.seconds = 0.0
                ms = timed_block(loop.step, args.steps)
                step_ms[key].append(ms)
                idle[key].append(1 - busy.seconds * 1000 / args.steps / ms)
        for key in loops:
            out[(key, m)] = (statistics.median(step_ms[key]), statistics.median(idle[key]))
        dist.barrier()
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    as_torchrun_rank(rank, world, port)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group('gloo')
    shard = world // 2
    results: dict = {}
    if args.part in ('steps', 'all'):
        results['steps'] = _steps(args, shard, os.path.join(tmp, 'steps'))
    if world == 2 and args.part in ('bubble', 'all'):
        results['bubble'] = _bubble(args, os.path.join(tmp, 'bubble'))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        _report(args, world, gathered)
    dist.barrier()
    dist.destroy_process_group()


def _report(args: argparse.Namespace, world: int, per_rank: list[dict]) -> None:
    mesh = dict(pipeline=2) if world == 2 else dict(pipeline=2, shard=world // 2)
    if 'steps' in per_rank[0]:
        times = per_rank[0]['steps']['times']
        raw_ms = statistics.median(times['raw'])
        line = (
            f'{world} processes, mesh={mesh}, {args.schedule}, m={args.microbatches}: '
            f'step ms raw {raw_ms:.1f}'
        )
        for key in (k for k in times if k != 'raw'):
            ours_ms = statistics.median(times[key])
            # each round's pair of blocks ran back to back: the median of their ratios
            # resists a burst of another job's load better than the ratio of medians
            ratios = sorted(o / r for o, r in zip(times[key], times['raw']))
            q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
            name = 'FSDPStrategy' if key == 'ours' else key
            line += (
                f'; {name} {ours_ms:.1f}, ratio of medians {ours_ms / raw_ms:.3f}, '
                f'median of paired ratios {statistics.median(ratios):.3f} (IQR '
                f'{q1:.3f}-{q3:.3f})'
            )
        print(line + f' (medians of {args.rounds} blocks of {args.steps} steps)')
        for key in (k for k in times if k != 'raw'):
            cpu = [r['steps']['cpu_ms'][key] / r['steps']['cpu_ms']['raw'] for r in per_rank]
            print(
                f'  CPU time per step, {key} / raw, per rank: ' + ', '.join(f'{c:.3f}' for c in cpu)
            )
        for key in times:
            mib = [r['steps']['bytes'][key] / 2**20 for r in per_rank]
            print(
                f'  params + AdamW state per rank, {key}: '
                + ', '.join(f'{v:.2f}' for v in mib)
                + ' MiB'
            )
        whole = sum(p.numel() for p in _model(args).parameters()) * 4 * 3
        print(f'  the whole model + AdamW state on one process: {whole / 2**20:.2f} MiB')
    if 'bubble' in per_rank[0]:
        p = 2
        print(f'bubble, {args.schedule}, 2 stages, {args.batch} sequences a step:')
        print('  loop  m  theory  idle share per rank (1 - computing / step)   step ms')
        for key, m in per_rank[0]['bubble']:
            theory = (p - 1) / (m + p - 1)
            idle = [r['bubble'][(key, m)][1] for r in per_rank]
            step = per_rank[0]['bubble'][(key, m)][0]
            print(
                f'  {key:4s} {m:2d}  {theory:.3f}   '
                + ', '.join(f'rank {i} {v:.3f}' for i, v in enumerate(idle))
                + f'   {step:.1f}'
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--part', choices=('steps', 'bubble', 'all'), default='all')
    parser.add_argument('--schedule', choices=SCHEDULES, default='1F1B')
    parser.add_argument('--rounds', type=int, default=15)
    parser.add_argument('--steps', type=int, default=2)
    parser.add_argument('--dim', type=int, default=256)
    parser.add_argument('--depth', type=int, default=4)
    parser.add_argument('--seq', type=int, default=64)
    parser.add_argument('--batch', type=int, default=16)
    parser.add_argument('--microbatches', type=int, default=4)
    parser.add_argument(
        '--bubble-microbatches', type=int, nargs='+', default=[2, 4, 8, 16], metavar='M'
    )
    parser.add_argument(
        '--control',
        action='store_true',
        help='time a third loop: the raw one that also broadcasts the loss to every stage',
    )
    parser.add_argument('--world', type=int, nargs='+', default=[2, 4], choices=(2, 4))
    args = parser.parse_args()
    for world in args.world:
        spawn_ranks(
            _worker, args, world=world, prefix='pp_bench_', base=os.environ.get('BENCH_DIR')
        )


if __name__ == '__main__':
    main()
