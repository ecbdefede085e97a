"""Start a multi-rank benchmark: a free localhost port, a scratch directory removed
afterwards; and what the distributed benchmarks measure alike: a timed block of steps between
barriers, the bytes of a rank's parameters and optimizer state."""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A localhost TCP port nobody listens on (for MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def as_torchrun_rank(rank: int, world: int, port: int) -> None:
    """Make this process rank ``rank`` of ``world`` as torchrun would (its variables, the
    master on localhost at ``port``), with one intra-op thread."""
    import os

    import torch

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT=str(port),
        OMP_NUM_THREADS='1',
    )
    torch.set_num_threads(1)


def spawn_ranks(
    worker: Callable[..., Any],
    args: Any,
    *,
    world: int = 2,
    prefix: str = 'bench-',
    base: str | None = None,
) -> None:
    """Run ``worker(rank, world, port, args, scratch_dir)`` in ``world`` processes; the scratch
    directory (under ``base``, else the system temp dir) is removed afterwards."""
    scratch = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        mp.spawn(worker, args=(world, free_port(), args, scratch), nprocs=world)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def timed_block(fn: Callable[[], None], n: int) -> float:
    """ms per call of ``fn``, over ``n`` calls between two barriers (every rank calls it)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) * 1000 / n


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's parameters + optimizer state, in bytes (local shards of DTensors)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, 'to_local') else t

    total = sum(local(p).numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                total += local(v).numel() * v.element_size()
    return total
