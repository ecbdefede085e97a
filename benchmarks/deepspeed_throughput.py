"""DeepSpeed throughput: DeepSpeedStrategy + DeepSpeedOptimWrapper versus a raw DeepSpeed loop.

2 processes, gloo, 1 thread each, the DDP benchmark's 4×Linear(1024, 1024) MLP, batch 64 per
rank, torch Adam, ZeRO stage 2 and 3 (``--stages``). In the same processes and process group:

- raw DeepSpeed: ``deepspeed.initialize`` with the same config DeepSpeedStrategy derives
  (clipping 0, no accumulation), then ``engine(x)``, ``engine.backward(loss)``,
  ``engine.step()`` — DeepSpeed's own documented loop;
- stratagem: the model and optim wrapper from ``DeepSpeedStrategy.prepare``, driven by
  ``optim_context`` + ``update_params``;
- control: DeepSpeed's loop driving stratagem's engine (separates the wrapper's cost from
  where each model happens to be allocated, which moves CPU step times by a few %);
- raw torch DDP + Adam, for context.

Blocks run interleaved (raw, ours, DDP; reversed every other round), so machine noise hits
all alike. Prints medians of ms/step and the time ratios stratagem / raw DeepSpeed (goal
<= 1.02) and raw DeepSpeed / raw DDP.

    python benchmarks/deepspeed_throughput.py [--rounds 15] [--steps 10] [--stages 2 3]
"""

from __future__ import annotations

import argparse
import logging
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


def _worker(rank: int, world: int, port: int, rounds: int, steps: int, stages: list[int]) -> None:
    as_torchrun_rank(rank, world, port)
    import deepspeed
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stratagem import env
    from stratagem.strategies import DeepSpeedStrategy

    logging.getLogger('DeepSpeed').setLevel(logging.WARNING)
    batches = [torch.randn(64, 1024) for _ in range(4)]
    results = {}
    for stage in stages:
        strategy = DeepSpeedStrategy(
            work_dir=tempfile.mkdtemp(prefix='ds-bench-'),
            zero_optimization=dict(stage=stage),
            env_kwargs=dict(randomness=dict(seed=0)),
            log_kwargs=dict(log_level='WARNING'),
        )
        torch.manual_seed(0)
        model, optim_wrapper = strategy.prepare(
            _mlp(),
            optim_wrapper=dict(optimizer=dict(type='Adam', lr=1e-4)),
            dispatch_kwargs=dict(train_micro_batch_size_per_gpu=64),
        )
        raw_module = _mlp()
        raw_config = dict(
            train_micro_batch_size_per_gpu=64,
            gradient_accumulation_steps=1,
            gradient_clipping=0.0,
            steps_per_print=10**13,
            zero_optimization=dict(stage=stage),
        )
        raw, *_ = deepspeed.initialize(
            model=raw_module,
            optimizer=torch.optim.Adam(raw_module.parameters(), lr=1e-4),
            config=raw_config,
        )
        ddp = DDP(_mlp())
        ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)

        def raw_step(x: torch.Tensor) -> None:
            loss = raw(x).square().mean()
            raw.backward(loss)
            raw.step()

        def ours_step(x: torch.Tensor) -> None:
            with optim_wrapper.optim_context(model):
                loss = model(x).square().mean()
            optim_wrapper.update_params(loss)

        def control_step(x: torch.Tensor) -> None:  # DeepSpeed's loop on our engine
            loss = model(x).square().mean()
            model.backward(loss)
            model.step()

        def ddp_step(x: torch.Tensor) -> None:
            ddp_opt.zero_grad()
            ddp(x).square().mean().backward()
            ddp_opt.step()

        def block(step) -> float:
            env.barrier()
            t = time.perf_counter()
            for i in range(steps):
                step(batches[i % len(batches)])
            env.barrier()
            return (time.perf_counter() - t) / steps

        fns = [raw_step, ours_step, control_step, ddp_step]
        for fn in fns:  # warm-up: allocator, buckets, partitions
            block(fn)
        times = {fn: [] for fn in fns}
        ratios, control = [], []
        for r in range(rounds):
            got = {fn: block(fn) for fn in (fns if r % 2 == 0 else fns[::-1])}
            for fn in fns:
                times[fn].append(got[fn])
            ratios.append(got[ours_step] / got[raw_step])
            control.append(got[ours_step] / got[control_step])
        results[stage] = (
            {fn.__name__: statistics.median(t) for fn, t in times.items()},
            statistics.median(ratios),
            statistics.median(control),
        )
        del raw, model, optim_wrapper, strategy, ddp
    if rank == 0:
        print(
            f'DeepSpeed {deepspeed.__version__}, 2 ranks x gloo x 1 thread (CPU), '
            f'4xLinear(1024,1024), batch 64/rank, torch Adam; {rounds} interleaved rounds x '
            f'{steps} steps'
        )
        for stage, (med, ratio, control_ratio) in results.items():
            print(
                f'ZeRO-{stage}: raw DeepSpeed loop          median '
                f'{med["raw_step"] * 1e3:8.2f} ms/step'
            )
            print(
                f'ZeRO-{stage}: DeepSpeedStrategy+wrapper   median '
                f'{med["ours_step"] * 1e3:8.2f} ms/step'
            )
            print(
                f'ZeRO-{stage}: raw torch DDP (context)     median '
                f'{med["ddp_step"] * 1e3:8.2f} ms/step'
            )
            ratio_of_medians = med['ours_step'] / med['raw_step']
            print(
                f'ZeRO-{stage}: stratagem/raw DeepSpeed {ratio_of_medians:.3f}x '
                f'(ratio of medians), {ratio:.3f}x (median of per-round ratios); raw '
                f'DeepSpeed/DDP {med["raw_step"] / med["ddp_step"]:.2f}x'
            )
            print(
                f"ZeRO-{stage}: wrapper alone (our engine driven by DeepSpeed's own loop): "
                f'{control_ratio:.3f}x'
            )
    env.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=15)
    parser.add_argument('--steps', type=int, default=10)
    parser.add_argument('--stages', type=int, nargs='+', default=[2, 3], choices=[0, 1, 2, 3])
    args = parser.parse_args()
    port = free_port()
    mp.spawn(_worker, args=(2, port, args.rounds, args.steps, args.stages), nprocs=2)


if __name__ == '__main__':
    main()
