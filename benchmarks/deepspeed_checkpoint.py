"""DeepSpeed checkpoints: DeepSpeedStrategy's sync and async saves against raw DeepSpeed.

2 processes, gloo, 1 thread each, torch Adam, ZeRO ``--stage`` (default 2), two models: the
tests' tiny MLP (163 parameters: fixed costs) and ``--width``-wide 4-layer MLP (default
1024: 4.2M parameters, ~50 MB of files per save over both ranks). In the same processes, on
the same engine and state, interleaved (order rotated every round), each save into a fresh
directory under ``work_dirs/bench`` (removed after it is timed):

- raw: ``engine.save_checkpoint(dir, tag, save_latest=False)`` then rank 0 fsyncs every
  file: DeepSpeed's own save made durable, no verification data (the baseline);
- old sync: stratagem's save before async support (DeepSpeed's engine writes with
  ``torch.save``, rank 0 re-reads and hashes every file at the commit);
- sync: ``save_checkpoint`` (each file hashed as written and fsynced by the rank that
  writes it, through the capturing engine);
- async: ``save_checkpoint`` with ``async_checkpoint=True``: the time it blocks the caller,
  and the time until the checkpoint is committed (``wait_for_checkpoints``).

Every time is the slowest rank's (barriers around each save). Prints medians and the
ratios to raw.

    python benchmarks/deepspeed_checkpoint.py [--rounds 9] [--stage 2] [--width 1024]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _spawn import as_torchrun_rank, spawn_ranks  # benchmarks/, on the path when run as a script
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _mlp(width: int) -> nn.Module:
    layers = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _old_storage(strategy):
    """The synchronous save as it was before the capturing engine (for comparison): the
    engine writes with ``torch.save``, rank 0 re-reads and hashes every file at the commit."""
    from stratagem import env
    from stratagem.checkpoint.directory import save_directory
    from stratagem.strategies.deepspeed.checkpoint import ZeroStorage
    from stratagem.strategies.deepspeed.files import DEEPSPEED_TAG, STATE_FILE

    class OldZeroStorage(ZeroStorage):
        def stage(self, checkpoint, path, commit, writer):
            def write(staging: Path) -> None:
                strategy.model.save_checkpoint(
                    str(staging), tag=DEEPSPEED_TAG, client_state={}, save_latest=False
                )
                if env.is_main_process():
                    torch.save(checkpoint, staging / STATE_FILE)

            return lambda: save_directory(
                path,
                write,
                step=commit.step,
                extra_manifest={'strategy': 'bench'},
                vote=commit.vote,
            )

    new = strategy.checkpointer.storage
    return OldZeroStorage(
        engine=new.engine,
        optim_wrapper=new.optim_wrapper,
        exclude_frozen_parameters=False,
        extra_manifest=new.extra_manifest,
        logger=new.logger,
    )


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    as_torchrun_rank(rank, world, port)
    from stratagem import env
    from stratagem.strategies import DeepSpeedStrategy

    logging.getLogger('DeepSpeed').setLevel(logging.WARNING)
    report = []
    for name, build, dim in (
        ('tiny MLP (163 params)', _tiny, 6),
        (f'4xLinear({args.width},{args.width})', lambda: _mlp(args.width), args.width),
    ):
        work = tempfile.mkdtemp(prefix=f'ds-ckpt-{rank}-', dir=out_dir)
        s = DeepSpeedStrategy(
            work_dir=work,
            zero_optimization=dict(stage=args.stage),
            env_kwargs=dict(randomness=dict(seed=0)),
            log_kwargs=dict(log_level='WARNING'),
        )
        torch.manual_seed(0)
        model, ow = s.prepare(
            build(),
            optim_wrapper=dict(optimizer=dict(type='Adam', lr=1e-4)),
            dispatch_kwargs=dict(train_micro_batch_size_per_gpu=8),
        )
        with ow.optim_context(model):
            loss = model(torch.randn(8, dim)).square().mean()
        ow.update_params(loss)  # the optimizer state exists
        new_layout = s.checkpointer.storage
        old_layout = _old_storage(s)
        target = os.path.join(out_dir, 'ckpt')  # rank 0's path is used on every rank
        counter = [0]

        def fresh() -> str:
            counter[0] += 1
            return f'{target}_{counter[0]}'

        def clean(path: str) -> None:
            env.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            env.barrier()

        def raw() -> dict:
            path = fresh()
            env.barrier()
            t = time.perf_counter()
            s.model.save_checkpoint(path, tag='deepspeed', save_latest=False)
            if rank == 0:
                _fsync_tree(path)
            env.barrier()
            took = time.perf_counter() - t
            clean(path)
            return {'raw': took}

        def sync(layout) -> float:
            s.checkpointer.storage, s.async_checkpoint = layout, False
            path = fresh()
            env.barrier()
            t = time.perf_counter()
            s.save_checkpoint(path, extra_ckpt={'meta': {'iter': 1}})
            env.barrier()
            took = time.perf_counter() - t
            clean(path)
            return took

        def asyn() -> dict:
            s.checkpointer.storage, s.async_checkpoint = new_layout, True
            path = fresh()
            env.barrier()
            t = time.perf_counter()
            s.save_checkpoint(path, extra_ckpt={'meta': {'iter': 1}})
            blocked = time.perf_counter() - t
            s.wait_for_checkpoints()
            env.barrier()
            committed = time.perf_counter() - t
            clean(path)
            return {'async_blocked': blocked, 'async_commit': committed}

        blocks = [
            raw,
            lambda: {'old_sync': sync(old_layout)},
            lambda: {'sync': sync(new_layout)},
            asyn,
        ]
        for block in blocks:  # warm-up: staging buffers, page cache, lazy imports
            block()
        times: dict[str, list[float]] = {}
        for r in range(args.rounds):
            order = blocks[r % len(blocks) :] + blocks[: r % len(blocks)]
            for block in order:
                for key, value in block().items():
                    # the slowest rank's time
                    times.setdefault(key, []).append(max(env.all_gather_object(value)))
        med = {k: statistics.median(v) for k, v in times.items()}
        size = s.checkpointer.writer.staged_bytes if s.checkpointer.writer is not None else 0
        report.append((name, med, env.all_gather_object(size)))
        del model, ow, s
    if rank == 0:
        import deepspeed

        print(
            f'DeepSpeed {deepspeed.__version__}, ZeRO-{args.stage}, 2 ranks x gloo x 1 '
            f'thread (CPU), torch Adam; {args.rounds} interleaved rounds; medians, slowest '
            'rank; a shared machine'
        )
        for name, med, staged in report:
            raw_t = med['raw']
            print(f'{name}: staged bytes per rank {staged}')
            for key in ('raw', 'old_sync', 'sync', 'async_blocked', 'async_commit'):
                print(f'  {key:14s} {med[key] * 1e3:9.1f} ms  {med[key] / raw_t:6.3f}x raw')
    env.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--stage', type=int, default=2, choices=[1, 2, 3])
    parser.add_argument('--width', type=int, default=1024)
    args = parser.parse_args()
    base = ROOT / 'work_dirs' / 'bench'
    base.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_worker, args, prefix='ds-ckpt-', base=str(base))


if __name__ == '__main__':
    main()
