"""Rank queries and collectives that are correct no-ops in a single process.

Each function behaves as if the world had one process when ``torch.distributed`` is not
initialised: ranks are 0, sizes are 1, collectives return their input unchanged. So code
written once runs the same under ``python train.py`` and under ``torchrun``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

F = TypeVar('F', bound=Callable[..., Any])

_REDUCE_OPS = ('sum', 'mean', 'max', 'min', 'product')


def is_distributed() -> bool:
    """True when a default process group is initialised (whatever its size)."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """Rank of this process in ``group`` (default: the world); 0 when not distributed."""
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Any = None) -> int:
    """Number of processes in ``group`` (default: the world); 1 when not distributed."""
    return dist.get_world_size(group) if is_distributed() else 1


def get_dist_info(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` when not distributed."""
    return get_rank(group), get_world_size(group)


def get_local_rank() -> int:
    """Rank of this process on its node (``LOCAL_RANK``, set by the launcher or init_dist).

    0 when not distributed, so a single process always uses device 0.
    """
    return int(os.environ.get('LOCAL_RANK', 0)) if is_distributed() else 0


def default_device() -> torch.device:
    """This process's device, for every strategy that is not given one: ``cuda:LOCAL_RANK``
    when CUDA is available and the launcher set ``LOCAL_RANK`` (:func:`get_local_rank`), the
    current CUDA device when it did not (a host trainer that started the processes itself, a
    single process), else ``cpu``."""
    if not torch.cuda.is_available():
        return torch.device('cpu')
    if 'LOCAL_RANK' in os.environ:
        return torch.device('cuda', get_local_rank())
    return torch.device('cuda', torch.cuda.current_device())


def is_main_process(group: Any = None) -> bool:
    """True on rank 0 of ``group`` (always true in a single process)."""
    return get_rank(group) == 0


def master_only(fn: F) -> F:
    """Decorate ``fn`` to run only on the main process; other ranks get ``None``.

    Do not call collectives inside ``fn``: only rank 0 would enter them and it would hang.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if is_main_process() else None

    return wrapper  # type: ignore[return-value]


def barrier(group: Any = None) -> None:
    """Block until every process of ``group`` reaches this call; no-op in a single process."""
    if is_distributed():
        dist.barrier(group)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with global rank ``src``'s copy and return it.

    With NCCL the tensor must live on this process's CUDA device.
    """
    if is_distributed() and get_world_size(group) > 1:
        dist.broadcast(tensor, src, group)
    return tensor


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Return global rank ``src``'s ``obj`` on every rank (picklable objects only).

    Other ranks' ``obj`` is ignored; pass ``None`` there.
    """
    if not is_distributed() or get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group)
    return box[0]


def all_reduce(tensor: torch.Tensor, op: str = 'sum', group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` in place across ``group`` and return it.

    Args:
        op: one of 'sum', 'mean', 'max', 'min', 'product'. 'mean' needs a floating
            point (or complex) tensor because it divides in place.
    """
    if not isinstance(op, str) or op.lower() not in _REDUCE_OPS:
        raise ValueError(
            f'unknown reduce op {op!r}; valid ops: {", ".join(map(repr, _REDUCE_OPS))}'
        )
    op = op.lower()
    if op == 'mean' and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"all_reduce(op='mean') needs a floating point tensor, got "
            f"{tensor.dtype}; convert it first or use op='sum'"
        )
    world_size = get_world_size(group)
    if not is_distributed() or world_size == 1:
        return tensor
    # AVG exists only for NCCL; sum-then-divide works for every backend.
    reduce_op = {
        'sum': dist.ReduceOp.SUM,
        'mean': dist.ReduceOp.SUM,
        'max': dist.ReduceOp.MAX,
        'min': dist.ReduceOp.MIN,
        'product': dist.ReduceOp.PRODUCT,
    }[op]
    dist.all_reduce(tensor, reduce_op, group)
    if op == 'mean':
        tensor.div_(world_size)
    return tensor


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank; ``[obj]`` in a single process."""
    if not is_distributed() or get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(out, obj, group)
    return out


_MISSING = -(1 << 63)  # how key_of(None) travels


def key_of(value: Any) -> int:
    """A signed 64-bit key for ``value`` in :func:`all_gather_keys`: an int (in range) is
    itself, None is a sentinel, anything else a 60-bit hash of its ``repr``. Equal reprs
    give equal keys, so it is meant for ints, strings and small containers of them built the
    same way on every rank (``1`` and ``1.0`` differ, as do dicts in another key order; a
    value whose repr elides, like a large tensor's, is not one to key). Different reprs
    collide with a chance of 1 in 2**60."""
    if value is None:
        return _MISSING
    if type(value) is int and -(1 << 62) <= value < (1 << 62):
        return value
    import hashlib

    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return (1 << 62) + (int.from_bytes(digest, 'little') >> 4)  # apart from the ints


def all_gather_keys(keys: list[int], group: Any = None) -> list[tuple[int, ...]]:
    """Every rank's ``keys`` (signed 64-bit ints, as many on every rank), in rank order.

    One collective of a small tensor, no pickling: a third of ``all_gather_object``'s cost,
    for the checks that run on every save and resume ("does every rank hold the same value?
    did any rank fail?"), which then exchange the details only when the answer is no."""
    if not is_distributed() or get_world_size(group) == 1:
        return [tuple(keys)]
    device = torch.device('cpu')
    if dist.get_backend(group) == 'nccl':  # NCCL gathers CUDA tensors only
        device = torch.device('cuda', torch.cuda.current_device())
    mine = torch.tensor(keys, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(get_world_size(group))]
    dist.all_gather(out, mine, group)
    return [tuple(t.tolist()) for t in out]
