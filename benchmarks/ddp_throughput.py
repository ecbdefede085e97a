"""DDP throughput: DDPStrategy and ShardedDDPStrategy versus a raw torch DDP loop.

2 processes, gloo, 1 thread each, a 4×Linear(1024, 1024) MLP, batch 64 per rank,
Adam. All loops run in the same processes and process group, interleaved
(raw block, stratagem block, sharded block, ...), so machine noise hits them alike.
Prints the median ms/step of each, the time ratios to raw, and each rank's
optimizer-state bytes (ShardedDDP keeps only its shard: fairscale OSS +
ShardedDataParallel; its rows are left out when fairscale is not installed).

    python benchmarks/ddp_throughput.py [--rounds 15] [--steps 10] [--order raw-first]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp
from _spawn import as_torchrun_rank, free_port  # benchmarks/, on the path when run as a script
from torch import nn


def _mlp() -> nn.Module:
    layers = []
    for _ in range(4):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _worker(rank: int, world: int, port: int, rounds: int, steps: int, order: str) -> None:
    as_torchrun_rank(rank, world, port)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stratagem import env
    from stratagem.strategies import DDPStrategy, build_strategy

    strategy = DDPStrategy(
        work_dir=tempfile.mkdtemp(prefix='ddp-bench-'),
        env_kwargs=dict(randomness=dict(seed=0)),
        log_kwargs=dict(log_level='WARNING'),
    )
    torch.manual_seed(0)
    # which model is allocated first shifts step time by a few % on CPU (memory placement);
    # --order picks it, and the control below separates placement from wrapper overhead
    if order == 'raw-first':
        raw = DDP(_mlp())
    model, optim_wrapper = strategy.prepare(
        _mlp(), optim_wrapper=dict(optimizer=dict(type='Adam', lr=1e-4))
    )
    if order == 'ours-first':
        raw = DDP(_mlp())
    raw_opt = torch.optim.Adam(raw.parameters(), lr=1e-4)
    inner = optim_wrapper.optimizer
    try:
        import fairscale  # noqa: F401
    except ImportError:
        sharded = None
    else:
        sharded = build_strategy(
            dict(
                type='ShardedDDPStrategy',
                work_dir=tempfile.mkdtemp(prefix='sdp-bench-'),
                log_kwargs=dict(log_level='WARNING'),
            )
        )
        s_model, s_wrapper = sharded.prepare(
            _mlp(), optim_wrapper=dict(optimizer=dict(type='Adam', lr=1e-4))
        )
    batches = [torch.randn(64, 1024) for _ in range(4)]

    def raw_step(x: torch.Tensor) -> None:
        raw_opt.zero_grad()
        loss = raw(x).square().mean()
        loss.backward()
        raw_opt.step()

    def ours_step(x: torch.Tensor) -> None:
        with optim_wrapper.optim_context(model):
            loss = model(x).square().mean()
        optim_wrapper.update_params(loss)

    def sharded_step(x: torch.Tensor) -> None:
        with s_wrapper.optim_context(s_model):
            loss = s_model(x).square().mean()
        s_wrapper.update_params(loss)

    def raw_on_ours_step(x: torch.Tensor) -> None:  # control: a raw loop, our model+optimizer
        inner.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        inner.step()

    def block(step) -> float:
        env.barrier()
        t = time.perf_counter()
        for i in range(steps):
            step(batches[i % len(batches)])
        env.barrier()
        return (time.perf_counter() - t) / steps

    fns = [raw_step, ours_step, raw_on_ours_step] + ([sharded_step] if sharded else [])
    for fn in fns:  # warm-up: allocator, DDP buckets, optimizer state
        block(fn)
    raw_t, ours_t, sdp_t, ratios, control_ratios, sdp_ratios = [], [], [], [], [], []
    for r in range(rounds):
        times = {fn: block(fn) for fn in (fns if r % 2 == 0 else fns[::-1])}
        raw_t.append(times[raw_step])
        ours_t.append(times[ours_step])
        ratios.append(times[ours_step] / times[raw_step])
        control_ratios.append(times[ours_step] / times[raw_on_ours_step])
        if sharded:
            sdp_t.append(times[sharded_step])
            sdp_ratios.append(times[sharded_step] / times[raw_step])
    states = []
    if sharded:  # the byte counter lives with OSS (it imports fairscale)
        from stratagem.strategies.fairscale.oss import optimizer_state_bytes

        states = env.all_gather_object(
            [optimizer_state_bytes(raw_opt), optimizer_state_bytes(s_wrapper.optimizer)]
        )
    if rank == 0:
        raw_m, ours_m = statistics.median(raw_t), statistics.median(ours_t)
        print(
            f'DDP, 2 ranks x gloo x 1 thread, 4xLinear(1024,1024), batch 64/rank, Adam; '
            f'{rounds} interleaved rounds x {steps} steps; models built {order}'
        )
        print(
            f'raw torch DDP loop        median {raw_m * 1e3:8.2f} ms/step  '
            f'({1 / raw_m:6.2f} steps/s)'
        )
        print(
            f'DDPStrategy+OptimWrapper  median {ours_m * 1e3:8.2f} ms/step  '
            f'({1 / ours_m:6.2f} steps/s)'
        )
        print(
            f'time ratio stratagem/raw: {ours_m / raw_m:.3f}x (ratio of medians), '
            f'{statistics.median(ratios):.3f}x (median of per-round ratios)'
        )
        print(
            f'wrapper alone (same model+optimizer driven by a raw loop): '
            f'{statistics.median(control_ratios):.3f}x'
        )
        if sharded:
            sdp_m = statistics.median(sdp_t)
            print(
                f'ShardedDDPStrategy (OSS)  median {sdp_m * 1e3:8.2f} ms/step  '
                f'({1 / sdp_m:6.2f} steps/s)'
            )
            print(
                f'time ratio sharded/raw DDP: {sdp_m / raw_m:.3f}x (ratio of medians), '
                f'{statistics.median(sdp_ratios):.3f}x (median of per-round ratios); '
                f'sharded/DDPStrategy: {sdp_m / ours_m:.3f}x'
            )
        for r, (full, shard) in enumerate(states):
            print(
                f'rank {r} optimizer state: DDP (Adam) {full / 2**20:7.2f} MiB, ShardedDDP '
                f'(OSS shard) {shard / 2**20:7.2f} MiB ({shard / full:.2f}x)'
            )
    env.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=15)
    parser.add_argument('--steps', type=int, default=10)
    parser.add_argument(
        '--order',
        choices=['raw-first', 'ours-first'],
        default='raw-first',
        help='which model is allocated first',
    )
    args = parser.parse_args()
    port = free_port()
    mp.spawn(_worker, args=(2, port, args.rounds, args.steps, args.order), nprocs=2)


if __name__ == '__main__':
    main()
