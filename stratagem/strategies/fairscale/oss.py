"""``OSS``: fairscale's sharded optimizer (ZeRO-1: optimizer state split across ranks).

Buildable from a config, under DDPStrategy or ShardedDDPStrategy, as mmengine registers
``ZeroRedundancyOptimizer``::

    optim_wrapper=dict(optimizer=dict(type='OSS', optim='AdamW', lr=1e-3, weight_decay=0.05))

``optim`` is the local optimizer: a name registered in ``OPTIMIZERS`` or a class. Param
groups (``paramwise_cfg``) are supported. fairscale is imported when ``'OSS'`` is first
built; without it the error names ``pip install "stratagem[fairscale]"``. fairscale is in
maintenance: for new work prefer FSDPStrategy (torch FSDP), the recommended sharded backend.

Differences from ``fairscale.optim.OSS``, all fixes:

1. ``state_dict()`` is a collective (every rank calls it, as ZeroRedundancyOptimizer's):
   rank 0 returns the whole, plain torch state (loads with ``weights_only=True`` into any
   optimizer of the same type), the other ranks ``{}``. The shards are sent to rank 0
   tensor by tensor, straight into their CPU tensors, so rank 0 holds at most one extra
   full copy of the state; fairscale pickles each shard, unpickles it on *every* rank and
   keeps the consolidated copy alive on the optimizer after saving.
2. ``load_state_dict(full)`` re-shards a whole state (saved with any world size, by any
   strategy) without blanking entries of the caller's dict, and without a second copy
   of this rank's shard in the wrapper's own ``state``.
3. ``zero_grad()``: under a ShardedDataParallel, gradients of bucketed parameters are views
   into its reduce buckets. torch's ``set_to_none=True`` default (inherited by fairscale's
   OSS) detaches them and makes every later step wrong; once
   :meth:`OSS.attach_sharded_ddp` was called, zeroing goes through the wrapper, which keeps
   the bucket views and drops only the others.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

try:
    from fairscale.optim import OSS as _FairscaleOSS
except ImportError as e:  # pragma: no cover - exercised only without fairscale
    raise ImportError(
        'OSS and ShardedDDPStrategy need fairscale: pip install '
        f'"stratagem[fairscale]" (import failed: {e})'
    ) from e

__all__ = ['OSS', 'optimizer_state_bytes']


class _Slot:
    """Stands for one tensor of a shard's state while its skeleton travels as an object."""

    __slots__ = ('shape', 'dtype')

    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        self.shape, self.dtype = tuple(shape), dtype


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a :class:`_Slot`; the tensors appended in order."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(obj.shape, obj.dtype)
    if isinstance(obj, Mapping):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, fetch: Any) -> Any:
    """The inverse of :func:`_split`: each :class:`_Slot` becomes ``fetch(slot)``, in order."""
    if isinstance(obj, _Slot):
        return fetch(obj)
    if isinstance(obj, Mapping):
        return {k: _fill(v, fetch) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, fetch) for v in obj)
    return obj


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state tensors this process holds for ``optimizer`` (for OSS: its shard).

    Tensors shared between entries are counted once (by storage).
    """
    inner = optimizer.optim if isinstance(optimizer, _FairscaleOSS) else optimizer
    seen, total = set(), 0
    states = list(inner.state.values())
    if inner is not optimizer:
        states += list(optimizer.state.values())
    for state in states:
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                key = (storage.data_ptr(), value.device)
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
    return total


class OSS(_FairscaleOSS):
    """Shard an optimizer's state across ranks (``fairscale.optim.OSS``).

    Args:
        params: Parameters or param groups.
        optim: The local optimizer: a registered name (``'AdamW'``) or a
            ``torch.optim.Optimizer`` subclass. Required.
        **kwargs: fairscale OSS arguments (``group``, ``broadcast_fp16``) and the local
            optimizer's (``lr``, ``betas``, ``weight_decay``, ...).

    Needs an initialised process group.
    """

    def __init__(self, params: Any, optim: str | type | None = None, **kwargs: Any) -> None:
        if optim is None:
            raise ValueError(
                "OSS needs the optimizer to shard: optimizer=dict(type='OSS', "
                "optim='AdamW', lr=...) (a registered name or a class)"
            )
        if isinstance(optim, str):
            from stratagem.registry import OPTIMIZERS

            cls = OPTIMIZERS.get(optim)
            if cls is None:
                err = OPTIMIZERS.unknown_name_error(optim)
                raise type(err)(f'{err} (in OSS optim=)')
            optim = cls
        if not (isinstance(optim, type) and issubclass(optim, torch.optim.Optimizer)) or issubclass(
            optim, _FairscaleOSS
        ):
            raise TypeError(
                f'OSS optim= must name a torch.optim.Optimizer subclass (not OSS '
                f'itself), got {optim!r}'
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                'OSS shards optimizer state across ranks and needs an initialised '
                'process group; launch with torchrun and DDPStrategy or '
                'ShardedDDPStrategy, or use a plain optimizer'
            )
        super().__init__(params, optim=optim, **kwargs)
        self._sdp_ref: weakref.ref | None = None

    # ---- gradients -------------------------------------------------------------------
    def attach_sharded_ddp(self, sharded_ddp: torch.nn.Module) -> None:
        """Route :meth:`zero_grad` through ``sharded_ddp`` (a ShardedDataParallel over this
        optimizer), which keeps its gradient-bucket views alive (see the module docstring)."""
        self._sdp_ref = weakref.ref(sharded_ddp)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; ``set_to_none`` as torch's, except that gradients held in a
        ShardedDataParallel's reduce buckets are zeroed in place."""
        sdp = self._sdp_ref() if self._sdp_ref is not None else None
        if sdp is None:
            super().zero_grad(set_to_none=set_to_none)
        else:
            sdp.zero_grad(set_to_none=set_to_none)

    # ---- state -----------------------------------------------------------------------
    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather every rank's shard on ``recipient_rank`` (CPU tensors). A collective.

        ``recipient_rank=-1`` (every rank) uses fairscale's broadcast of pickled shards.
        """
        if recipient_rank == -1:
            super().consolidate_state_dict(recipient_rank)
            return
        if not 0 <= recipient_rank < self.world_size:
            raise ValueError(
                f'recipient_rank={recipient_rank} is not a rank of this group '
                f'(world size {self.world_size}); use 0..{self.world_size - 1}'
            )
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        cpu = torch.device('cpu')
        comm = (
            torch.device('cuda', torch.cuda.current_device())
            if self.backend == dist.Backend.NCCL
            else cpu
        )
        dst = self._local_to_global_rank[recipient_rank]
        self._all_states = []
        for rank in range(self.world_size):
            if rank == recipient_rank == self.rank:
                own: list[torch.Tensor] = []
                skeleton = _split(self.optim.state_dict(), own)
                it = iter(own)  # on CPU ``to`` is a no-op: no copy of this rank's own shard
                self._all_states.append(_fill(skeleton, lambda _s, it=it: next(it).to(cpu)))
            elif rank == self.rank:  # send this shard: its skeleton, then tensor by tensor
                tensors: list[torch.Tensor] = []
                skeleton = _split(self.optim.state_dict(), tensors)
                dist.send_object_list([skeleton], dst=dst, group=self.group, device=comm)
                for t in tensors:
                    dist.send(t.detach().to(comm).contiguous(), dst=dst, group=self.group)
            elif self.rank == recipient_rank:
                src = self._local_to_global_rank[rank]
                box = [None]
                dist.recv_object_list(box, src=src, group=self.group, device=comm)
                self._all_states.append(_fill(box[0], lambda s, src=src: self._recv(s, src, comm)))

    def _recv(self, slot: _Slot, src: int, comm: torch.device) -> torch.Tensor:
        buf = torch.empty(slot.shape, dtype=slot.dtype, device=comm)
        dist.recv(buf, src=src, group=self.group)
        return buf if comm.type == 'cpu' else buf.cpu()

    def state_dict(self, all_ranks: bool = False) -> dict:
        """The whole state on rank 0 (``{}`` elsewhere), or on every rank with ``all_ranks``.

        A collective: every rank must call it. The gathered copy is not kept.
        """
        if not all_ranks:
            self.consolidate_state_dict(recipient_rank=0)
            if self.rank != 0:
                return {}
        try:
            return super().state_dict(all_ranks=all_ranks)
        finally:
            self._all_states = []

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a whole (consolidated or plain torch) state and keep this rank's shard."""
        for key in ('state', 'param_groups'):
            if key not in state_dict:
                raise KeyError(
                    f'optimizer state_dict has no {key!r} (keys: {sorted(state_dict)})'
                    '; OSS loads a whole optimizer state, e.g. the rank-0 '
                    'state_dict() of OSS or of a plain optimizer'
                )
        groups = state_dict['param_groups']
        n_saved = sum(len(g['params']) for g in groups)
        n_here = sum(len(g['params']) for g in self.param_groups)
        if len(groups) != len(self.param_groups) or n_saved != n_here:
            raise ValueError(
                f'optimizer state_dict has {len(groups)} param group(s) with '
                f'{n_saved} parameters but this OSS has {len(self.param_groups)} '
                f'with {n_here}; it was saved for another model or paramwise_cfg'
            )
        # fairscale blanks the entries other ranks own in the dict it is given: give it copies
        state_dict = {**state_dict, 'state': dict(state_dict['state'])}
        super().load_state_dict(state_dict)
        # torch's loader also filled the wrapper's own ``state`` with this rank's shard, which
        # nothing reads (the local optimizer holds the live one): a second copy on a device
        self.state.clear()
