"""Fault-tolerant replica groups over torchft: ``strategy.fault_tolerance``.

A job is several replica groups, each an ordinary data-parallel run of K processes (its own
torchrun, its own process group), started apart (``stratagem train CFG --nproc K
--replica-id I``) and joined by torchft's lighthouse (``stratagem lighthouse``). Inside a
group, DDP averages the gradients over its K ranks as usual; across the groups, torchft's
``Manager`` forms a quorum of the live groups every step and averages the gradients over the
participants of that step. A group that dies is dropped at the next quorum and the others
keep stepping; a group that starts (or restarts) behind the others copies the live state from
a peer before its first step: it *heals*, from memory, not from storage.

:class:`ReplicaGroup` owns the ``Manager``; the strategy composes it (``DDPStrategy``'s
and ``FSDPStrategy``'s ``fault_tolerance=``) and ``BaseStrategy.prepare`` gives it the model
and the optim wrapper once built. Per step:

1. ``begin_step``: the quorum (synchronous: a group that heals has the peer's model, optimizer
   and registered extras loaded before its forward). Called by the reference loop's batch
   sampler (:class:`ReplicaStream`) before a batch is drawn, else by a forward pre-hook on the
   model (any loop); once per update (an accumulation window).
2. forward and backward; DDP averages over the group's ranks.
3. the optim wrapper's step guard (``OptimWrapper.set_step_guard``) after the backward that
   completes the window: the gradients averaged over the step's participants (one flat
   all-reduce through the Manager), then ``should_commit``: False (a peer failed during the
   step, too few replicas) drops the update on every rank of the group, as a refused
   anomaly does; clipping and AMP's unscale then work on the averaged gradients.

The data (:class:`ReplicaStream`): one global order of the samples per epoch, read by a
cursor every group holds alike: the samples of the committed steps (torchft's
``batches_committed`` times a group's batch, restored by a heal). A step with P participants
reads the next ``P x group batch`` samples, the participant of rank r the r-th slice (its
processes and accumulation micro-batches split it further), so within a step no sample is
read twice or skipped, whatever the participant set; a step that is not committed is read
again by the next one (with the participants of that step). Across a change of participants
the guarantee is per committed step: every sample of the stream is in exactly one committed
step, in order, until the epoch ends.

Failures named here (:class:`ReplicaGroupError`): an unreachable lighthouse, a quorum that
does not form within ``quorum_timeout``, a peer whose model has other parameter names or
shapes, a replica id two live groups use.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from stratagem import env
from stratagem.checkpoint.sharded import local_tensors

__all__ = [
    'LIGHTHOUSE_ENV',
    'REPLICA_ID_ENV',
    'FaultTolerance',
    'Heal',
    'ReplicaGroup',
    'ReplicaGroupError',
    'ReplicaStream',
    'require_torchft',
    'state_digest',
]

#: torchft's own variable for the lighthouse address (``stratagem train --lighthouse``)
LIGHTHOUSE_ENV = 'TORCHFT_LIGHTHOUSE'
#: the group's replica id when the config gives none (``stratagem train --replica-id``)
REPLICA_ID_ENV = 'STRATAGEM_REPLICA_ID'

_KEYS = {'min_replicas', 'replica_id', 'lighthouse', 'timeout', 'quorum_timeout', 'connect_timeout'}
_INSTALL = 'pip install "stratagem[torchft]"'


class ReplicaGroupError(RuntimeError):
    """A failure of the replica-group machinery, naming the group and what to do."""


def require_torchft() -> None:
    """Import torchft or fail naming the extra."""
    try:
        import torchft  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f'strategy.fault_tolerance trains replica groups over torchft, which is not '
            f'installed: {_INSTALL}'
        ) from err


@dataclass(frozen=True)
class FaultTolerance:
    """``strategy.fault_tolerance``, checked.

    Attributes:
        min_replicas: the fewest replica groups a step commits with (default 1: one
            survivor keeps training).
        replica_id: this group's id, an integer >= 0 unique among the job's groups; default
            ``$STRATAGEM_REPLICA_ID`` (``stratagem train --replica-id``).
        lighthouse: the lighthouse's address (``http://host:port``); default
            ``$TORCHFT_LIGHTHOUSE`` (``stratagem train --lighthouse``).
        timeout: seconds a collective, a commit vote or a heal's transfer may take (60).
        quorum_timeout: seconds to wait for a quorum (60); a group alone below
            ``min_replicas`` fails after it, naming the lighthouse.
        connect_timeout: seconds to reach the lighthouse and the peers (10).
    """

    min_replicas: int = 1
    replica_id: int | None = None
    lighthouse: str | None = None
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    connect_timeout: float = 10.0

    @classmethod
    def parse(cls, cfg: Mapping | bool, where: str = 'strategy.fault_tolerance') -> FaultTolerance:
        """From the config's dict (``True``: the defaults); refuses an unknown key or a bad
        value, naming it."""
        if cfg is True:
            cfg = {}
        if not isinstance(cfg, Mapping):
            raise TypeError(
                f'{where} should be a dict (e.g. dict(min_replicas=1)) or True, got '
                f'{type(cfg).__name__}: {cfg!r}'
            )
        unknown = sorted(set(cfg) - _KEYS)
        if unknown:
            raise ValueError(
                f'{where}: unknown key(s) {", ".join(unknown)}; valid: {", ".join(sorted(_KEYS))}'
            )
        values = dict(cfg)
        min_replicas = values.get('min_replicas', 1)
        if type(min_replicas) is not int or min_replicas < 1:
            raise ValueError(f'{where}.min_replicas={min_replicas!r}: give an integer >= 1')
        if values.get('replica_id') is not None:
            values['replica_id'] = _replica_id(values['replica_id'], f'{where}.replica_id')
        for key in ('timeout', 'quorum_timeout', 'connect_timeout'):
            value = values.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
            ):
                raise ValueError(f'{where}.{key}={value!r}: give a number of seconds > 0')
            if value is not None:
                values[key] = float(value)
        lighthouse = values.get('lighthouse')
        if lighthouse is not None and not isinstance(lighthouse, str):
            raise TypeError(
                f'{where}.lighthouse={lighthouse!r}: give the address, http://host:port'
            )
        return cls(**values)

    @classmethod
    def option(cls, cfg: Mapping | bool | None) -> FaultTolerance | None:
        """A strategy's ``fault_tolerance=``: None (or False) for none, else checked, with
        its id and lighthouse resolved (before the process group is set up)."""
        return None if cfg in (None, False) else cls.parse(cfg).resolved()

    def resolved(self) -> FaultTolerance:
        """With ``replica_id`` and ``lighthouse`` taken from the environment where the config
        has none; refuses what is still missing, saying how to give it."""
        replica_id = self.replica_id
        if replica_id is None:
            raw = os.environ.get(REPLICA_ID_ENV)
            if raw is None:
                raise ValueError(
                    'strategy.fault_tolerance: this replica group has no id; start it with '
                    f'stratagem train CFG --replica-id I (or set {REPLICA_ID_ENV}, or '
                    'fault_tolerance.replica_id), a different I >= 0 for each group'
                )
            replica_id = _replica_id(raw, REPLICA_ID_ENV)
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ValueError(
                f'strategy.fault_tolerance: replica group {replica_id} has no lighthouse '
                f'address; start one with `stratagem lighthouse` and pass the address it '
                f'prints as --lighthouse ADDR (or set {LIGHTHOUSE_ENV}, or '
                'fault_tolerance.lighthouse)'
            )
        if '://' not in lighthouse:
            lighthouse = f'http://{lighthouse}'
        return FaultTolerance(
            min_replicas=self.min_replicas,
            replica_id=replica_id,
            lighthouse=lighthouse,
            timeout=self.timeout,
            quorum_timeout=self.quorum_timeout,
            connect_timeout=self.connect_timeout,
        )


def _replica_id(value: Any, where: str) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit():
        raise ValueError(
            f'{where}={value!r}: a replica id is an integer >= 0, a different one per group '
            '(torchft orders the groups by it)'
        )
    return int(text)


@dataclass
class Heal:
    """One heal: the peer group it copied from, at which step, how long the transfer and
    load took (seconds, from the quorum's start)."""

    peer: int
    step: int
    seconds: float


@dataclass
class _Shared:
    state: Callable[[], Any]
    load: Callable[[Any], None]


@dataclass
class _Step:
    """What the quorum of the current step said."""

    participants: int = 0
    rank: int | None = None
    begun: bool = False


class ReplicaGroup:
    """This process's part in a replica group: the torchft ``Manager`` and its per-step
    protocol (see the module docstring). ``start(model, module, optim_wrapper)`` once
    they are built; :meth:`share` registers more state a heal copies (the loop's position and
    schedulers)."""

    def __init__(self, spec: FaultTolerance, logger: logging.Logger | None = None) -> None:
        # torchft's Rust side logs two lines a step at INFO (read once, at its import); its
        # Python side warns at each quorum that NCCL's flight recorder cannot be reset,
        # also on gloo. Our own lines say what a person needs: a heal, a dropped step.
        os.environ.setdefault('RUST_LOG', 'warn')
        logging.getLogger('torchft.manager').setLevel(logging.ERROR)
        require_torchft()
        self.spec = spec.resolved()
        assert self.spec.replica_id is not None
        self.replica_id: int = self.spec.replica_id
        self.logger = logger or logging.getLogger('stratagem')
        self.manager: Any = None
        self._extras: dict[str, _Shared] = {}
        self._step = _Step()
        self._module: nn.Module | None = None
        self._wrapper: Any = None
        # the all-reduce's buffer and its views shaped like the shards
        self._flat: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._pg: Any = None
        self._store: Any = None
        self.heals: list[Heal] = []
        self.on_heal: list[Callable[[Heal], None]] = []

    # ------------------------------------------------------------------ set-up
    def start(self, model: nn.Module, module: nn.Module, optim_wrapper: Any) -> None:
        """Join the job: the Manager (its server on group rank 0, registered with the
        lighthouse), the forward pre-hook on ``model`` (the wrapped model), the step guard
        on ``optim_wrapper``. ``module``: the plain module whose state a heal copies."""
        from stratagem.optim import OptimWrapperDict

        if optim_wrapper is None:
            raise ValueError(
                f'strategy.fault_tolerance: replica group {self.replica_id} commits each '
                'update with the other groups, so prepare() needs optim_wrapper='
            )
        if isinstance(optim_wrapper, OptimWrapperDict) or not hasattr(
            optim_wrapper, 'set_step_guard'
        ):
            raise ValueError(
                'strategy.fault_tolerance drives one OptimWrapper (its step guard commits each '
                f'update with the other groups); got {type(optim_wrapper).__name__}'
            )
        if optim_wrapper.step_guard is not None:
            raise ValueError(
                'strategy.fault_tolerance: the optim wrapper already has a step guard '
                f'({type(optim_wrapper.step_guard).__name__}, train_cfg.anomaly?); a replica '
                'group commits each update through its own: remove train_cfg.anomaly'
            )
        self._module, self._wrapper = module, optim_wrapper
        self.manager = self._manager()
        model.register_forward_pre_hook(self._before_forward)
        optim_wrapper.set_step_guard(self)

    def _manager(self) -> Any:
        from torchft.manager import Manager

        spec = self.spec
        rank, world = env.get_rank(), env.get_world_size()
        host, port = self._group_store()
        self._pg = _process_group(self, timedelta(seconds=spec.timeout))
        try:
            return Manager(
                pg=self._pg,
                load_state_dict=self._load_peer_state,
                state_dict=self._state,
                min_replica_size=spec.min_replicas,
                use_async_quorum=False,
                timeout=timedelta(seconds=spec.timeout),
                quorum_timeout=timedelta(seconds=spec.quorum_timeout),
                connect_timeout=timedelta(seconds=spec.connect_timeout),
                rank=rank,
                world_size=world,
                store_addr=host,
                store_port=port,
                lighthouse_addr=spec.lighthouse,
                replica_id=str(self.replica_id),
            )
        except RuntimeError as err:
            if 'connect' in str(err).lower():  # torchft: 'failed to connect to ... within'
                raise ReplicaGroupError(
                    f'replica group {self.replica_id}: the lighthouse at {spec.lighthouse} '
                    f'did not answer within {spec.connect_timeout:g} s '
                    f'(fault_tolerance.connect_timeout). Start it with `stratagem lighthouse` '
                    f'and give the address it prints (--lighthouse or {LIGHTHOUSE_ENV}); '
                    f'check the host and port are reachable from here ({err})'
                ) from err
            raise

    def _group_store(self) -> tuple[str, int]:
        """A fresh TCP store for this attempt of the group (rank 0 holds it, the port
        broadcast): torchrun's store outlives a restart and would hand a restarted group the
        dead attempt's Manager address."""
        from torch.distributed import TCPStore

        host = socket.gethostname()
        port = 0
        if env.get_rank() == 0:
            self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = int(self._store.port)
        if env.get_world_size() > 1:
            host, port = env.broadcast_object((host, port))
        return host, port

    def share(self, key: str, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """Register more state a heal copies from the peer (``state()`` there, ``load(value)``
        here, after the model and the optimizer)."""
        if key in self._extras or key in ('model', 'optimizer', 'group', 'signature'):
            raise ValueError(f'ReplicaGroup.share: {key!r} is taken')
        self._extras[key] = _Shared(state, load)

    # ------------------------------------------------------------------ the step
    def begin_step(self) -> None:
        """The quorum of the coming update, once per update (a heal loads the peer's state
        here, before the forward)."""
        if self._step.begun:
            return
        assert self.manager is not None, 'ReplicaGroup.start first'
        started = time.perf_counter()
        heals_before = len(self.heals)
        try:
            self.manager.start_quorum()
        except TimeoutError as err:
            raise ReplicaGroupError(
                f'replica group {self.replica_id}: no quorum within '
                f'{self.spec.quorum_timeout:g} s (fault_tolerance.quorum_timeout) at the '
                f'lighthouse {self.spec.lighthouse}: fewer than min_replicas='
                f'{self.spec.min_replicas} group(s) joined. Start the other groups (stratagem '
                'train CFG --replica-id I, each its own I), lower fault_tolerance.min_replicas, '
                "or raise quorum_timeout; the lighthouse's own --min-replicas must not exceed "
                'the groups you start'
            ) from err
        self._pg.raise_duplicate()
        self._step.begun = True
        self._step.participants = int(self.manager.num_participants())
        rank = self.manager.participating_rank()
        self._step.rank = None if rank is None else int(rank)
        if len(self.heals) > heals_before:
            heal = self.heals[-1]
            heal.seconds = time.perf_counter() - started
            if heal.step == 0:  # torchft's init_sync: every group starts from one state
                self.logger.info(
                    f'replica group {self.replica_id} took its initial state from replica '
                    f'group {heal.peer}'
                )
                return
            self.logger.info(
                f'replica group {self.replica_id} healed from replica group {heal.peer} at '
                f'step {heal.step} in {heal.seconds:.3f} s (live state copied from the peer, '
                'no checkpoint read)'
            )
            for listener in self.on_heal:
                listener(heal)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.begin_step()

    # the step guard's protocol (OptimWrapper.set_step_guard)
    def observe(self, loss: torch.Tensor) -> None:
        """Nothing to watch in a micro-batch's loss."""

    def allow(self, wrapper: Any) -> bool:
        """After the window's backward: the gradients averaged over the step's
        participants, then the commit vote; whether the update goes ahead."""
        self.begin_step()  # a loop whose forward ran outside train mode
        params = [p for g in wrapper.optimizer.param_groups for p in g['params']]
        with torch.no_grad():  # a DTensor's to_local() outside autograd: ~20x cheaper
            self._average(params)
        committed = bool(self.manager.should_commit())
        self._step.begun = False
        if not committed:
            self.logger.warning(
                f'replica group {self.replica_id}: step {self.manager.current_step()} not '
                'committed (a peer failed during it, or fewer than min_replicas groups); the '
                'update is dropped and its samples are read again by the next step'
            )
        return committed

    def _average(self, params: list[torch.Tensor]) -> None:
        """``params``' gradients averaged over the step's participants: one flat all-reduce
        through the Manager. A sharded parameter (FSDP): this rank's shard, the same one in
        every group (the groups shard alike), so the all-reduce is the mesh's replicate
        dimension."""
        shards = [_local(p) for p in params]
        grads = [None if p.grad is None else _local(p.grad) for p in params]
        flat, views = self._flat_views(shards)
        torch.cat(
            [
                shard.new_zeros(shard.numel()) if grad is None else grad.reshape(-1)
                for shard, grad in zip(shards, grads, strict=True)
            ],
            out=flat,
        )
        self.manager.allreduce(flat).wait()
        for p, shard, view, grad in zip(params, shards, views, grads, strict=True):
            if grad is None:  # another group's gradient, in the parameter's dtype
                p.grad = _like(p, view.to(shard.dtype, copy=True))
            else:
                grad.copy_(view)

    def _flat_views(self, shards: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One buffer for the step's all-reduce and a view of it shaped like each shard, kept
        from step to step while the shapes stay (one buffer and its views a run)."""
        shapes = [shard.shape for shard in shards]
        if self._flat is None or shapes != [view.shape for view in self._flat[1]]:
            # the widest dtype of the parameters: no gradient loses precision
            dtype = functools.reduce(torch.promote_types, (shard.dtype for shard in shards))
            flat = torch.empty(
                sum(shard.numel() for shard in shards), dtype=dtype, device=shards[0].device
            )
            views = flat.split([shard.numel() for shard in shards])
            self._flat = (flat, [v.view(shape) for v, shape in zip(views, shapes)])
        return self._flat

    # ------------------------------------------------------------------ what the step said
    @property
    def participants(self) -> int:
        """Replica groups in the current (or last) step's quorum."""
        return self._step.participants

    @property
    def participant_rank(self) -> int | None:
        """This group's rank among them (0 .. participants - 1)."""
        return self._step.rank

    @property
    def step(self) -> int:
        """Committed updates of the job (the same in every live group)."""
        return int(self.manager.current_step()) if self.manager is not None else 0

    @property
    def batches_committed(self) -> int:
        """Group batches of the committed updates (sum of each step's participants)."""
        return int(self.manager.batches_committed()) if self.manager is not None else 0

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the job's checkpoints: the lowest-ranked participant of
        the last quorum (the lowest live replica id)."""
        return self._step.rank == 0

    def position(self) -> dict[str, int]:
        """What a checkpoint keeps of the job's progress (``meta['replica_group']``)."""
        return {'step': self.step, 'batches_committed': self.batches_committed}

    def restore(self, position: Mapping[str, int]) -> None:
        """A resume from storage: the job's progress back."""
        self.manager.load_state_dict(
            {'step': int(position['step']), 'batches_committed': int(position['batches_committed'])}
        )

    def digest(self) -> str:
        """:func:`state_digest` of this group's model and optimizer; a sharded model's
        (FSDP) over every rank's shards (collective: every rank of the group calls it)."""
        assert self._module is not None
        own = state_digest(self._module, self._wrapper)
        if env.get_world_size() == 1 or not any(_is_dtensor(p) for p in self._module.parameters()):
            return own
        return hashlib.sha256(' '.join(env.all_gather_object(own)).encode()).hexdigest()

    def shutdown(self) -> None:
        """Leave the job (the Manager's servers stopped)."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    # ------------------------------------------------------------------ heal's state
    @staticmethod
    def _signature(model_state: dict[str, Any]) -> dict[str, list]:
        # a shard's own shape too: a peer group of another size holds other shards
        return {
            name: [list(t.shape), str(t.dtype)]
            + ([list(_local(t).shape)] if _is_dtensor(t) else [])
            for name, t in model_state.items()
        }

    def _state(self) -> dict[str, Any]:
        assert self._module is not None
        model_state = self._module.state_dict()
        # shards as plain tensors: a DTensor would carry its mesh to the peer
        return {
            'group': self.replica_id,
            'signature': self._signature(model_state),
            'model': local_tensors(model_state),
            'optimizer': local_tensors(self._wrapper.state_dict()),
            **{key: shared.state() for key, shared in self._extras.items()},
        }

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        assert self._module is not None
        peer = int(state['group'])
        own = self._module.state_dict()
        problem = _signature_difference(self._signature(own), state['signature'])
        if problem:
            raise ReplicaGroupError(
                f'replica group {self.replica_id} cannot heal from replica group {peer}: its '
                f'model differs ({problem}); every group of a job must run the same model '
                'config. Start this group with the config the others run (or give it another '
                'lighthouse if it is another job)'
            )
        if any(_is_dtensor(t) for t in own.values()):
            with torch.no_grad():  # into this rank's shards, which the peer's rank sent
                for name, tensor in own.items():
                    _local(tensor).copy_(state['model'][name])
            self._wrapper.load_state_dict(
                _sharded_optimizer_state(self._wrapper, state['optimizer'])
            )
        else:
            self._module.load_state_dict(state['model'], strict=True)
            self._wrapper.load_state_dict(state['optimizer'])
        for key, shared in self._extras.items():
            if key in state:
                shared.load(state[key])
        self.heals.append(Heal(peer=peer, step=self.step, seconds=0.0))


def state_digest(module: nn.Module, optim_wrapper: Any) -> str:
    """A SHA-256 of a model's and an optimizer's state (every tensor's dtype, shape and
    bytes, every plain value, in order): equal in two groups exactly when their states are."""
    h = hashlib.sha256()
    for value in _leaves({'model': module.state_dict(), 'optim': optim_wrapper.state_dict()}):
        if isinstance(value, torch.Tensor):
            t = _local(value).detach().cpu().contiguous()
            h.update(f'{t.dtype}{tuple(t.shape)}'.encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def _leaves(value: Any) -> Iterator[Any]:
    """The tensors and plain values of a nested state, keys included, in a fixed order."""
    if isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            yield key
            yield from _leaves(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _signature_difference(mine: Mapping[str, list], theirs: Mapping[str, list]) -> str:
    """What differs between two models' ``{name: [shape, dtype]}``, or ''."""
    only_here = sorted(set(mine) - set(theirs))
    only_there = sorted(set(theirs) - set(mine))
    parts = []
    if only_here:
        parts.append(f'only here: {", ".join(only_here[:5])}')
    if only_there:
        parts.append(f'only in the peer: {", ".join(only_there[:5])}')
    for name in sorted(set(mine) & set(theirs)):
        if list(mine[name]) != list(theirs[name]):
            parts.append(
                f'{name}: {mine[name][0]} {mine[name][1]} here, {theirs[name][0]} '
                f'{theirs[name][1]} in the peer'
            )
            if len(parts) >= 5:
                break
    return '; '.join(parts)


def _process_group(group: ReplicaGroup, timeout: timedelta) -> Any:
    """torchft's reconfigurable process group (gloo; NCCL on CUDA), which also checks each
    quorum for a replica id that two live groups use."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    base = ProcessGroupNCCL if torch.cuda.is_available() else ProcessGroupGloo

    class _Checked(base):  # type: ignore[misc, valid-type]
        duplicate: str | None = None
        configured = 0

        def configure(
            self,
            store_addr: str,
            replica_id: str,
            rank: int,
            world_size: int,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            # torchft passes (quorum_id, group_rank, group_world_size, global_ranks) after these
            global_ranks = kwargs.get('global_ranks', args[3] if len(args) > 3 else None)
            self.configured += 1
            if global_ranks is not None and len(set(global_ranks)) < len(global_ranks):
                message = (
                    f'replica id {group.replica_id} is used by two live replica groups (the '
                    'quorum holds it twice); each group needs its own --replica-id. Stop this '
                    f'one and start it with an id no other group uses'
                )
                if self.configured == 1:  # the newcomer stops; a running group goes on
                    self.duplicate = message
                else:
                    group.logger.warning(f'replica group {group.replica_id}: {message}')
            super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)

        def raise_duplicate(self) -> None:
            if self.duplicate is not None:
                raise ReplicaGroupError(f'replica group {group.replica_id}: {self.duplicate}')

    return _Checked(timeout=timeout)


class ReplicaStream:
    """The reference loop's batch sampler under replica groups (see the module docstring):
    per batch, the quorum first (``group.begin_step``), then this process's share of the
    step's global batch at the job's cursor. ``batch_size``: per process and micro-batch;
    ``optim_wrapper``: its accumulation window says which micro-batch of the update this is
    (read when the batch is drawn, so a loader without workers). Shuffling draws one
    permutation per epoch from ``seed + epoch``, the same in every group."""

    def __init__(
        self,
        group: ReplicaGroup,
        samples: int,
        batch_size: int,
        optim_wrapper: Any,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.group, self.samples, self.batch_size = group, samples, batch_size
        self.optim_wrapper, self.shuffle, self.seed = optim_wrapper, shuffle, seed
        self._order: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return max(1, self.samples // (self.batch_size * env.get_world_size()))

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def next_batch(self) -> list[int]:
        """This process's indices for its next micro-batch."""
        group = self.group
        group.begin_step()  # once per update: a no-op for the window's later micro-batches
        ranks, rank = env.get_world_size(), env.get_rank()
        micro = self.batch_size
        window = int(getattr(self.optim_wrapper, 'accumulative_counts', 1))
        index = int(getattr(self.optim_wrapper, 'inner_count', 0)) % window
        group_batch = micro * ranks * window
        participant = group.participant_rank
        # a group outside the quorum (never, with the synchronous quorum) reads rank 0's
        slot = 0 if participant is None else participant
        start = (
            group.batches_committed * group_batch
            + slot * group_batch
            + index * micro * ranks
            + rank * micro
        )
        return [self._index(i) for i in range(start, start + micro)]

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, self.samples)
        if not self.shuffle:
            return offset
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            self._order = (epoch, torch.randperm(self.samples, generator=g))
        return int(self._order[1][offset])


@functools.cache
def _dtensor() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, _dtensor())


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's piece) as a tensor like ``param``: a DTensor on its mesh when
    it is one. ``DTensor.from_local``, not ``_torch.dtensor_like``: a peer's optimizer state
    may differ from the parameter in dtype (the spec here is ``local``'s) and arrive on the
    host (moved to the mesh's device)."""
    if not _is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        shape=param.shape,
        stride=param.stride(),
        run_check=False,
    )


def _sharded_optimizer_state(wrapper: Any, state: dict) -> dict:
    """A peer's optimizer state of plain shards back on this rank's parameters' meshes:
    each per-parameter tensor with a sharded parameter's local shape becomes a DTensor
    like the parameter (the optimizer steps DTensor parameters with DTensor state)."""
    params = [p for g in wrapper.optimizer.param_groups for p in g['params']]
    out = dict(state)
    out['state'] = {
        index: {
            key: _like(params[int(index)], value)
            if isinstance(value, torch.Tensor)
            and _is_dtensor(params[int(index)])
            and value.shape == _local(params[int(index)]).shape
            else value
            for key, value in per_param.items()
        }
        for index, per_param in state.get('state', {}).items()
    }
    return out
