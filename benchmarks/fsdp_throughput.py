"""FSDP throughput and sharded checkpoint I/O: FSDPStrategy versus raw ``fully_shard`` / DCP.

2 processes, gloo, 1 thread each, a 4×Linear(1024, 1024) MLP (``--width``) sharded per layer,
batch 64 per rank, AdamW. Step time: FSDPStrategy + OptimWrapper versus a raw ``fully_shard``
loop in the same processes, interleaved blocks (raw, ours, raw, ...). Checkpoints:
``save_checkpoint`` / ``resume`` of a sharded directory (atomic commit, manifest, xxh3
digests, verification, the store vote) versus raw ``get_state_dict`` + ``dcp.save`` /
``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` of the same model + optimizer state,
interleaved. Loads are timed twice: in the saving process (which remembers the hashes of the
files it wrote) and cold (that memory cleared, so every file is hashed before it is read, as
in a new process). Prints medians (ms) and ratios ours / raw, and the raw loop's load through
our ``ShardReader`` (each rank on its own, no checks), which splits ours into the faster read
and the fixed cost of the checks.

    python benchmarks/fsdp_throughput.py [--rounds 9] [--steps 10] [--ckpt-rounds 5] [--width 1024]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings
from typing import Any

import torch
from _spawn import (  # benchmarks/, on the path when run as a script
    as_torchrun_rank,
    spawn_ranks,
    timed_block,
)
from torch import nn


def _mlp(width: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def prepared(tmp: str, width: int = 1024) -> tuple[Any, nn.Module, Any]:
    """The FSDPStrategy (work_dir ``tmp``) and its prepared MLP and AdamW wrapper."""
    from stratagem.strategies import build_strategy

    strategy = build_strategy(
        dict(
            type='FSDPStrategy',
            work_dir=tmp,
            model_wrapper=dict(auto_wrap_policy=['Linear']),
            log_kwargs=dict(log_level='WARNING'),
        )
    )
    model, wrapper = strategy.prepare(
        _mlp(width), optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-4))
    )
    return strategy, model, wrapper


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    as_torchrun_rank(rank, world, port)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    strategy, model, ow = prepared(tmp, args.width)
    raw = _mlp(args.width)
    mesh = init_device_mesh('cpu', (world,))
    for layer in raw:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(raw, mesh=mesh)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-4)
    x, y = torch.randn(64, args.width), torch.randn(64, args.width)

    def ours() -> None:
        with ow.optim_context(model):
            loss = nn.functional.mse_loss(model(x), y)
        ow.update_params(loss)

    def baseline() -> None:
        loss = nn.functional.mse_loss(raw(x), y)
        loss.backward()
        raw_opt.step()
        raw_opt.zero_grad()

    for fn in (ours, baseline):
        timed_block(fn, 3)  # warm-up
    step = {'raw': [], 'ours': []}
    for _ in range(args.rounds):
        step['raw'].append(timed_block(baseline, args.steps))
        step['ours'].append(timed_block(ours, args.steps))

    from stratagem.checkpoint.dcp_reader import ShardReader
    from stratagem.checkpoint.manifest import forget_verified

    def raw_load(raw_dir: str, fast: bool = False) -> None:
        model_sd, optim_sd = get_state_dict(raw, [raw_opt])
        state = {'state_dict': model_sd, 'optimizer': optim_sd}
        if fast:  # the read ours does: ShardReader, each rank on its own, no checks
            with warnings.catch_warnings():
                warnings.simplefilter('ignore', UserWarning)  # no_dist under a group
                dcp.load(state, storage_reader=ShardReader(raw_dir), no_dist=True)
        else:
            dcp.load(state, checkpoint_id=raw_dir)
        set_state_dict(
            raw,
            [raw_opt],
            model_state_dict=state['state_dict'],
            optim_state_dict=state['optimizer'],
        )

    io = {
        k: []
        for k in (
            'raw_save',
            'ours_save',
            'raw_load',
            'ours_load',
            'raw_load2',
            'ours_load_cold',
            'raw_load_fast',
        )
    }

    def clock(times: dict, key: str, fn, *fn_args):
        """``fn(*fn_args)`` on every rank, timed until the last rank is done."""
        t = time.perf_counter()
        out = fn(*fn_args)
        dist.barrier()
        times[key] = time.perf_counter() - t
        return out

    def raw_save(raw_dir: str) -> None:
        # a raw save gathers the state dicts too (ours does, inside save_checkpoint)
        model_sd, optim_sd = get_state_dict(raw, [raw_opt])
        dcp.save({'state_dict': model_sd, 'optimizer': optim_sd}, checkpoint_id=raw_dir)

    for i in range(args.ckpt_rounds + 1):  # round 0 warms up (imports, first-use setup)
        raw_dir = os.path.join(tmp, f'raw_{i}')
        times = {}
        dist.barrier()
        clock(times, 'raw_save', raw_save, raw_dir)
        path = clock(times, 'ours_save', strategy.save_checkpoint, f'ours_{i}')
        clock(times, 'raw_load', raw_load, raw_dir)
        # warm: the saving process knows the hashes of the files it wrote (a resume in the
        # same process reads each file once)
        clock(times, 'ours_load', strategy.resume, path)
        clock(times, 'raw_load2', raw_load, raw_dir)
        # cold: as a new process, every byte is hashed before DCP reads it
        forget_verified()
        dist.barrier()
        clock(times, 'ours_load_cold', strategy.resume, path)
        clock(times, 'raw_load_fast', raw_load, raw_dir, True)
        if i:
            for key, value in times.items():
                io[key].append(value * 1000)
        if rank == 0:
            shutil.rmtree(raw_dir)
            shutil.rmtree(path)
        dist.barrier()
    if rank == 0:
        med = {k: statistics.median(v) for k, v in {**step, **io}.items()}
        print(
            f'step ms: raw fully_shard {med["raw"]:.2f}, FSDPStrategy {med["ours"]:.2f}, '
            f'ratio {med["ours"] / med["raw"]:.3f} (medians of {args.rounds} blocks of '
            f'{args.steps} steps)'
        )
        for what, ours, base in (
            ('save', 'ours_save', 'raw_save'),
            ('load (same process)', 'ours_load', 'raw_load'),
            ('load (cold: every file hashed)', 'ours_load_cold', 'raw_load2'),
        ):
            print(
                f'{what} ms: raw dcp {med[base]:.1f}, ours {med[ours]:.1f}, ratio '
                f'{med[ours] / med[base]:.3f} (medians of {args.ckpt_rounds})'
            )
        print(
            f'where the load time goes: the raw loop reading through ShardReader, per rank '
            f'(no_dist), without checks: {med["raw_load_fast"]:.1f} ms, '
            f'{med["raw_load_fast"] / med["raw_load"]:.3f} of raw dcp; ours adds the checks, '
            "verification and the ranks' agreement "
            f'({med["ours_load"] - med["raw_load_fast"]:.1f} ms)'
        )
    dist.barrier()  # both ranks done before gloo tears down (a peer gone mid-teardown aborts)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--steps', type=int, default=10)
    parser.add_argument('--ckpt-rounds', type=int, default=5)
    parser.add_argument(
        '--width',
        type=int,
        default=1024,
        help='Linear width (2048: 4x the state, fixed costs amortised)',
    )
    args = parser.parse_args()
    spawn_ranks(_worker, args, prefix='fsdp_bench_', base=os.environ.get('BENCH_DIR'))


if __name__ == '__main__':
    main()
