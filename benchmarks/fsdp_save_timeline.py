"""Where a sharded save's time goes, rank by rank: FSDPStrategy.save_checkpoint against raw
``get_state_dict`` + ``dcp.save`` of the same model and optimizer state.

2 processes, gloo, one thread each, the 4×Linear(1024) MLP of ``fsdp_throughput.py``, AdamW.
Each save (raw and ours alternating, after a warm-up) records the time of each step's start
(``name>``) and end (``name<``) from the save's start on both ranks: the state dicts, DCP's
planning, write and finish exchanges, our writer's steps and rank 0's commit. Prints the
median of each mark over the saves, rank 0 and rank 1, ms; marks a rank does not pass show
``-``.

    python benchmarks/fsdp_save_timeline.py [--saves 15]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _spawn import as_torchrun_rank, spawn_ranks  # benchmarks/, on the path as a script
from fsdp_throughput import prepared

_MARKS: list[tuple[str, float]] = []
_START = [0.0]


def _mark(name: str) -> None:
    _MARKS.append((name, (time.perf_counter() - _START[0]) * 1000))


def _timed(owner: Any, attribute: str, name: str) -> None:
    """Mark the start and the end of every call of ``owner.attribute``."""
    fn: Callable = getattr(owner, attribute)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        _mark(f'{name}>')
        try:
            return fn(*args, **kwargs)
        finally:
            _mark(f'{name}<')

    setattr(owner, attribute, timed)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    as_torchrun_rank(rank, world, port)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import utils as dcp_utils
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from stratagem.checkpoint import checkpointer, dcp_writer, directory

    strategy, model, wrapper = prepared(tmp)
    with wrapper.optim_context(model):
        loss = model(torch.randn(8, 1024)).sum()
    wrapper.update_params(loss)  # the optimizer's state exists
    exchanges = dcp_utils._DistWrapper  # noqa: SLF001 - DCP's exchanges: no public handle
    for owner, attribute, name in (
        (checkpointer, '_rank0_path', 'path'),
        (checkpointer.Checkpointer, '_capture', 'state_dicts'),
        (DefaultSavePlanner, 'create_local_plan', 'local_plan'),
        (exchanges, 'gather_object', 'gather'),
        (exchanges, 'scatter_object', 'scatter'),
        (exchanges, 'broadcast_object', 'broadcast'),
        (dcp_writer.DirectoryWriter, '_write', 'write'),
        (FileSystemWriter, 'finish', 'metadata'),
        (directory.CollectiveCommit, 'commit', 'commit'),
    ):
        _timed(owner, attribute, name)
    marks: dict[str, list[list[tuple[str, float]]]] = {'raw': [], 'ours': []}
    for i in range(args.saves + 1):  # the first is a warm-up
        for kind in ('raw', 'ours'):
            dist.barrier()
            _MARKS.clear()
            _START[0] = time.perf_counter()
            if kind == 'raw':
                model_sd, optim_sd = get_state_dict(model, [wrapper.optimizer])
                _mark('state_dicts<')
                state = {'state_dict': model_sd, 'optimizer': optim_sd}
                dcp.save(state, checkpoint_id=os.path.join(tmp, f'raw_{i}'))
            else:
                strategy.save_checkpoint(f'ours_{i}')
            _mark('end')
            dist.barrier()
            if i:
                marks[kind].append(list(_MARKS))
    medians = {kind: _medians(saves) for kind, saves in marks.items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, medians)
    if rank == 0:
        for kind in ('raw', 'ours'):
            print(f'== {kind} (ms from the save start; rank 0, rank 1)')
            names = list(gathered[0][kind]) + [
                n for n in gathered[1][kind] if n not in gathered[0][kind]
            ]
            for name in sorted(names, key=lambda n: gathered[0][kind].get(n, float('inf'))):
                cells = [r[kind].get(name) for r in gathered]
                print(
                    f'{name:14s}' + ''.join('       -' if c is None else f'{c:8.2f}' for c in cells)
                )


def _medians(saves: list[list[tuple[str, float]]]) -> dict[str, float]:
    """The median of each mark over the saves (a step passed twice: ``name#2``)."""
    seen: dict[str, list[float]] = {}
    for marks in saves:
        count: dict[str, int] = {}
        for name, at in marks:
            count[name] = count.get(name, 0) + 1
            key = name if count[name] == 1 else f'{name}#{count[name]}'
            seen.setdefault(key, []).append(at)
    return {key: statistics.median(values) for key, values in seen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--saves', type=int, default=15)
    spawn_ranks(_worker, parser.parse_args())


if __name__ == '__main__':
    main()
