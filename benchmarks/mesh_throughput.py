"""FSDPStrategy on a device mesh versus a raw loop that builds the same mesh itself.

4 processes, gloo, 1 thread each, a ``TransformerLM`` (``--dim``, ``--depth``; heads of 32),
batch ``--batch`` sequences of ``--seq`` tokens per data-parallel rank, AdamW. For each of the
meshes HSDP ``dict(replicate=2, shard=2)`` and 2-D ``dict(shard=2, tensor=2)``: step time of
FSDPStrategy + OptimWrapper against a raw loop that calls ``init_device_mesh``,
``parallelize_module`` (the same Megatron plan) and ``fully_shard`` itself, interleaved blocks
(raw, ours, ours, raw, ...) in the same processes; medians and the ratio ours / raw. Then bytes per
rank of parameters + optimizer state, for flat ``dict(shard=4)``, HSDP and 2-D.

    python benchmarks/mesh_throughput.py [--rounds 7] [--steps 5] [--dim 256] [--depth 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _spawn import (  # benchmarks/, on the path when run as a script
    as_torchrun_rank,
    spawn_ranks,
    state_bytes,
)

MESHES = {
    'flat': dict(shard=4),
    'hsdp': dict(replicate=2, shard=2),
    '2d': dict(shard=2, tensor=2),
}


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from stratagem.models import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(
        vocab_size=256, dim=args.dim, depth=args.depth, heads=args.dim // 32, max_len=args.seq
    )


def _raw(args: argparse.Namespace, mesh_cfg: dict) -> tuple:
    """The hand-written set-up: mesh, tensor parallel plan, fully_shard, AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _model(args)
    model.init_weights()
    if 'tensor' in mesh_cfg:
        mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('shard', 'tensor'))
        plan = {}
        for i in range(args.depth):
            for name in ('q', 'k', 'v', 'mlp.0'):
                plan[f'blocks.{i}.{name}'] = ColwiseParallel()
            for name in ('proj', 'mlp.2'):
                plan[f'blocks.{i}.{name}'] = RowwiseParallel()
        parallelize_module(model, mesh['tensor'], plan)
        data = mesh['shard']
    elif 'replicate' in mesh_cfg:
        data = init_device_mesh('cpu', (2, 2), mesh_dim_names=('replicate', 'shard'))
    else:
        data = init_device_mesh('cpu', (4,))
    for block in model.blocks:
        fully_shard(block, mesh=data)
    fully_shard(model, mesh=data)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _ours(args: argparse.Namespace, mesh_cfg: dict, tmp: str) -> tuple:
    from stratagem.models import TENSOR_PARALLEL_PLAN
    from stratagem.strategies import build_strategy

    extra = {'tensor_parallel_plan': TENSOR_PARALLEL_PLAN} if 'tensor' in mesh_cfg else {}
    strategy = build_strategy(
        dict(
            type='FSDPStrategy',
            work_dir=tmp,
            mesh=mesh_cfg,
            model_wrapper=dict(auto_wrap_policy=['TransformerBlock']),
            log_kwargs=dict(log_level='WARNING'),
            **extra,
        )
    )
    model, ow = strategy.prepare(
        _model(args), optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-4))
    )
    return strategy, model, ow


def _measure(
    args: argparse.Namespace, mesh_cfg: dict, tmp: str, world: int, timed: bool
) -> tuple[dict, list]:
    """Step times (ours and raw, interleaved, the order alternating) and bytes per rank."""
    import torch.distributed as dist

    strategy, model, ow = _ours(args, mesh_cfg, tmp)
    raw, raw_opt = _raw(args, mesh_cfg)
    g = torch.Generator().manual_seed(strategy.data_parallel_rank)
    tokens = torch.randint(256, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def ours() -> None:
        with ow.optim_context(model):
            loss = model(x, y)['loss']
        ow.update_params(loss)

    def baseline() -> None:
        raw(x, y)['loss'].backward()
        raw_opt.step()
        raw_opt.zero_grad()

    def block(fn, n: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        dist.barrier()
        return (time.perf_counter() - start) * 1000 / n

    for fn in (ours, baseline):
        block(fn, 2)  # warm-up
    times: dict[str, list[float]] = {'raw': [], 'ours': []}
    for i in range(args.rounds if timed or args.flat_steps else 0):
        pair = [('raw', baseline), ('ours', ours)]
        for key, fn in pair if i % 2 == 0 else pair[::-1]:
            times[key].append(block(fn, args.steps))
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, (state_bytes(model, ow.optimizer), state_bytes(raw, raw_opt)))
    return times, per_rank


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    as_torchrun_rank(rank, world, port)
    import torch.distributed as dist

    results = {
        name: _measure(args, mesh_cfg, os.path.join(tmp, name), world, timed=name != 'flat')
        for name, mesh_cfg in MESHES.items()
    }
    if rank == 0:
        for name, (times, per_rank) in results.items():
            if times['raw']:
                raw_ms, ours_ms = statistics.median(times['raw']), statistics.median(times['ours'])
                print(
                    f'{name:5s} {str(MESHES[name]):32s} step ms: raw {raw_ms:.1f}, '
                    f'FSDPStrategy {ours_ms:.1f}, ratio {ours_ms / raw_ms:.3f} '
                    f'(medians of {args.rounds} blocks of {args.steps} steps)'
                )
            mib = [b / 2**20 for b, _ in per_rank]
            print(
                f'{name:5s} params + AdamW state per rank: '
                + ', '.join(f'{m:.2f}' for m in mib)
                + f' MiB (raw loop: {per_rank[0][1] / 2**20:.2f} MiB on rank 0)'
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--dim', type=int, default=256)
    parser.add_argument('--depth', type=int, default=4)
    parser.add_argument('--seq', type=int, default=64)
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--flat-steps', action='store_true', help='time the flat mesh too')
    args = parser.parse_args()
    spawn_ranks(_worker, args, world=4, prefix='mesh_bench_', base=os.environ.get('BENCH_DIR'))


if __name__ == '__main__':
    main()
