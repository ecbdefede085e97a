"""The checkpoint side of BaseStrategy: the state it hands its ``Checkpointer``, and the
public checkpoint API (mmengine's names) that delegates to it.

``CheckpointState`` is ``BaseStrategy``'s second half, in its own file for size. It holds
the ``Checkpointed`` interface (``layout.py``) a backend overrides where its state differs:
``model_state_dict`` / ``load_model_state_dict``, ``optim_state_dict`` /
``load_optim_state_dict``, ``scheduler_state_dict`` / ``load_scheduler_state_dict``,
``checkpoint_meta``, ``_partial_grad_states`` / ``_load_partial_grads``,
``_load_checkpoint_files`` (reading a format whole) and ``_restore_randomness``. The
sequences (save, async save, resume, load, load_or_resume) are the ``Checkpointer``'s
(``checkpointer.py``), written once for every backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from stratagem import checkpoint as ckpt
from stratagem import env

from .checkpointer import Checkpointer

if TYPE_CHECKING:
    import logging

    from torch import nn

__all__ = ['CheckpointState']


class CheckpointState:
    """The state :class:`~stratagem.strategies.BaseStrategy` hands its checkpointer, and the
    checkpoint API that delegates to it (see module doc)."""

    checkpointer: Checkpointer

    if TYPE_CHECKING:  # for the type checker: what BaseStrategy provides
        model: nn.Module
        optim_wrapper: Any
        param_schedulers: Any
        logger: logging.Logger
        dispatch_kwargs: dict[str, Any]
        _work_dir: str
        _experiment_name: str
        _randomness: dict[str, Any]
        _seed: int
        _auto_scale_lr: dict[str, Any] | None
        _lr_scaled: bool
        _prepared: bool
        resumed_from: str | None

        @property
        def rank(self) -> int: ...
        @property
        def world_size(self) -> int: ...
        @property
        def data_parallel_size(self) -> int: ...
        @property
        def work_dir(self) -> str: ...
        @property
        def device(self) -> torch.device: ...
        def _unwrap_model(self) -> nn.Module: ...
        def _wrappers(self) -> list[Any]: ...
        def _initialize_accumulation(self, done_iters: int | None = 0) -> None: ...
        def _set_randomness(
            self, seed: int | None = None, deterministic: bool = False, diff_rank_seed: bool = False
        ) -> None: ...

    # ----------------------------------------------------------------------- save
    @property
    def async_checkpoint(self) -> bool:
        """Whether saves are written on a background thread (the constructor's option; may
        be switched between saves)."""
        return self.checkpointer.async_checkpoint

    @async_checkpoint.setter
    def async_checkpoint(self, value: bool) -> None:
        if type(value) is not bool:
            raise TypeError(f'async_checkpoint must be True or False, got {value!r}')
        self.checkpointer.async_checkpoint = value

    @property
    def checkpoint_timeout(self) -> float:
        """Seconds a rank may show no sign of life during a distributed save."""
        return self.checkpointer.timeout

    def save_checkpoint(
        self,
        filename: str,
        *,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        extra_ckpt: Mapping | None = None,
        callback: Callable[[dict], None] | None = None,
    ) -> str:
        """Save model (+ optimizer, schedulers, RNG states) atomically; every rank calls it.

        ``filename`` is a path; relative paths are under ``work_dir``.
        ``extra_ckpt['meta']`` (e.g. ``iter``/``epoch``) merges into ``meta``;
        other ``extra_ckpt`` keys are stored as they are (tensors and plain values
        only). ``callback(checkpoint)`` may edit the dict before it is written.
        Returns the final path (with ``async_checkpoint``, where the checkpoint will
        be once committed; ``wait_for_checkpoints`` waits for that). The sequence:
        :class:`~stratagem.strategies.checkpointer.Checkpointer`.
        """
        return self.checkpointer.save(
            filename,
            save_optimizer=save_optimizer,
            save_param_scheduler=save_param_scheduler,
            extra_ckpt=extra_ckpt,
            callback=callback,
        )

    def wait_for_checkpoints(self) -> None:
        """Block until every pending (asynchronous) save is committed; raise its error if it
        failed, on every rank. A no-op when nothing is pending. ``save_checkpoint``,
        ``resume``, ``load_checkpoint`` and ``load_or_resume`` call it first."""
        self.checkpointer.wait()

    def checkpoint_meta(self, extra_meta: Mapping | None = None) -> dict:
        """A checkpoint's ``meta``: seed, time, experiment, world size, strategy, versions,
        what a resume at another world size needs, then ``extra_meta`` (e.g. ``iter``)."""
        from stratagem.version import __version__

        meta = {
            'seed': self._randomness['seed'],
            'time': time.strftime('%Y%m%d_%H%M%S'),
            'experiment_name': self._experiment_name,
            'world_size': self.world_size,
            'data_parallel_size': self.data_parallel_size,
            'strategy': type(self).__name__,
            'stratagem_version': __version__,
            'torch_version': str(torch.__version__),
            'auto_scale_lr_applied': self._lr_scaled,
        }
        for key in ('train_micro_batch_size_per_gpu', 'epoch_length'):
            if self.dispatch_kwargs.get(key) is not None:
                meta[key] = int(self.dispatch_kwargs[key])
        meta.update(extra_meta or {})
        return meta

    def _partial_grad_states(self) -> list | None:
        """Under DDP, mid accumulation window: every rank's partial gradients, per wrapper.

        Under ``no_sync`` each rank accumulates its own gradients and the optimizer state
        holds only the saving rank's, so they are gathered (on CPU). Collective; the
        window is open on all ranks alike, so all ranks take the same branch.
        """
        if self.world_size == 1:
            return None  # the optimizer state's pending gradients are the whole story
        states = [
            w.grad_state_dict() if hasattr(w, 'grad_state_dict') and not w.should_update() else None
            for w in self._wrappers()
        ]
        if all(st is None for st in states):
            return None
        on_cpu = [
            None if st is None else {**st, 'grads': {i: g.cpu() for i, g in st['grads'].items()}}
            for st in states
        ]
        return env.all_gather_object(on_cpu)

    # ----------------------------------------------------------------- state dicts
    def model_state_dict(self) -> dict:
        """The unwrapped model's state dict (tensors kept on their device)."""
        return self._unwrap_model().state_dict()

    def optim_state_dict(self) -> dict:
        """The optim wrapper's state dict (optimizer, counters, scaler)."""
        return self.optim_wrapper.state_dict()

    def scheduler_state_dict(self) -> list | dict:
        """Each scheduler's state dict, in the shape ``param_schedulers`` has."""
        scheds = self.param_schedulers
        if isinstance(scheds, Mapping):
            return {k: [s.state_dict() for s in v] for k, v in scheds.items()}
        return [s.state_dict() for s in scheds]

    def load_model_state_dict(
        self,
        state_dict: Mapping,
        *,
        strict: bool = False,
        revise_keys: Sequence[tuple[str, str]] = ((r'^module\.', ''),),
    ) -> Any:
        """Load weights into the unwrapped model; mismatches reported in one message."""
        state_dict = ckpt.revise_keys(state_dict, list(revise_keys))
        return ckpt.load_state_dict(
            self._unwrap_model(), state_dict, strict=strict, logger=self.logger
        )

    def load_optim_state_dict(self, state_dict: Mapping) -> None:
        self.optim_wrapper.load_state_dict(state_dict)

    def load_scheduler_state_dict(self, state_dict: list | dict) -> None:
        scheds = self.param_schedulers
        if isinstance(scheds, Mapping):
            for name, states in state_dict.items():  # type: ignore[union-attr]
                self._load_scheduler_list(scheds[name], states)
        else:
            self._load_scheduler_list(scheds, state_dict)  # type: ignore[arg-type]

    @classmethod
    def _load_scheduler_list(cls, scheds: Sequence, states: Sequence) -> None:
        cls._check_scheduler_count(scheds, states)
        for sched, state in zip(scheds, states):
            sched.load_state_dict(state)

    @staticmethod
    def _check_scheduler_count(scheds: Sequence, states: Sequence) -> None:
        if len(scheds) != len(states):
            raise ValueError(
                f'checkpoint holds {len(states)} param scheduler state(s) but '
                f'{len(scheds)} scheduler(s) were built; the param_scheduler config '
                'changed since the checkpoint was saved'
            )

    # ----------------------------------------------------------------- checkpoints
    def _resolve_map_location(self, map_location: Any) -> Any:
        """mmengine's ``'default'``: this strategy's device (CUDA's current one, else cpu)."""
        if map_location != 'default':
            return map_location
        return str(self.device)

    def _load_checkpoint_files(self, filename: str, map_location: Any) -> dict:
        """Backend hook: read a checkpoint whole. A file: verified, ``weights_only``; a
        directory in a known format (``checkpoint.formats``: FSDP's sharded one, DeepSpeed's)
        is verified and read unsharded; anything else gets ``load_checkpoint_file``'s error."""
        from stratagem.checkpoint.formats import detect_format, read_whole

        name = detect_format(filename)
        if name is None or name == 'file':
            return ckpt.load_checkpoint_file(filename, map_location=map_location)
        return _move(read_whole(filename, name), map_location)

    def load_checkpoint(
        self,
        filename: str,
        *,
        map_location: Any = 'cpu',
        strict: bool = False,
        revise_keys: Sequence[tuple[str, str]] = ((r'^module\.', ''),),
        callback: Callable[[dict], None] | None = None,
    ) -> dict:
        """Load model weights from ``filename``; returns the whole checkpoint dict.

        ``callback(checkpoint)`` runs after reading and before loading, and may
        edit the dict in place. Foreign layouts are recognised: the weights are taken
        from ``state_dict``, ``model_state_dict``, ``model`` or ``module``, else the
        file is read as a bare state dict (``module.`` prefixes are stripped by the
        default ``revise_keys``). A file whose weights match none of the model's keys
        is an error even when not ``strict`` (mmengine loads nothing and goes on); a
        failed load leaves the model unchanged.
        """
        return self.checkpointer.load(
            filename,
            map_location=map_location,
            strict=strict,
            revise_keys=revise_keys,
            callback=callback,
        )

    def resume(
        self,
        filename: str,
        *,
        resume_optimizer: bool = True,
        resume_param_scheduler: bool = True,
        map_location: Any = 'default',
        callback: Callable[[dict], None] | None = None,
    ) -> dict:
        """Continue exactly where ``filename`` stopped; returns the checkpoint (``meta`` has iter).

        Restores model, optimizer (with counters, scaler, partial gradients),
        schedulers, then every rank's RNG state last. Call after ``prepare``. The
        sequence: :meth:`~stratagem.strategies.checkpointer.Checkpointer.resume`.
        """
        return self.checkpointer.resume(
            filename,
            resume_optimizer=resume_optimizer,
            resume_param_scheduler=resume_param_scheduler,
            map_location=map_location,
            callback=callback,
        )

    def _load_partial_grads(self, checkpoint: Mapping, meta: Mapping) -> None:
        """Each rank's own partial gradients (saved mid accumulation window under DDP)."""
        grads = checkpoint.get('partial_grads')
        if not grads:
            return
        world = meta.get('world_size', len(grads))
        if world == self.world_size:
            mine = grads[self.rank]
        else:  # DDP would have averaged the ranks' accumulated gradients at the window's end
            mine = [
                None
                if per_rank[0] is None
                else {
                    **per_rank[0],
                    'grads': {
                        i: sum(st['grads'][i] for st in per_rank) / world
                        for i in per_rank[0]['grads']
                    },
                }
                for per_rank in zip(*grads)
            ]
        for wrapper, state in zip(self._wrappers(), mine):
            if state is not None:
                wrapper.load_grad_state_dict(state)
        if world == self.world_size:
            return
        env.warn_rank_zero(
            f'the checkpoint was taken mid accumulation window with world '
            f'size {world}; this run has {self.world_size}, so every rank '
            f"continues the window from the mean of the {world} ranks' "
            'partial gradients',
            stacklevel=3,
        )

    def _restore_randomness(self, checkpoint: Mapping, meta: Mapping, filename: str) -> None:
        """Every rank's RNG state (same world size), else a re-seed from the saved seed."""
        states = checkpoint.get('rng_states')
        world = meta.get('world_size', 1)
        base = meta.get('seed', self._seed)  # rank 0's seed: the configured one
        if states and world == self.world_size:
            self._seed = base + self.rank if self._randomness.get('diff_rank_seed') else base
            self._randomness.update(seed=base)
            env.set_rng_state(states[self.rank])
            return
        if states:
            env.warn_rank_zero(
                f'{filename} was saved with world size {world}, this run has '
                f'{self.world_size}: per-rank RNG streams cannot be restored, so '
                f'every rank is re-seeded from seed {base}',
                stacklevel=3,
            )
        self._set_randomness(**{**self._randomness, 'seed': base})

    def load_or_resume(
        self, load_from: str | None = None, resume: bool | str = False
    ) -> dict | None:
        """mmengine's runner logic: resume (latest in work_dir, or a path) or just load weights.

        ``resume=True`` with no ``load_from`` resumes from the newest committed
        checkpoint in ``work_dir`` (none, in a work dir that never held one: starts fresh,
        with a log line; none, in a work dir whose pointer or checkpoint files show an
        earlier run: ``FileNotFoundError``, before anything is written; one this world
        size cannot continue from exactly: the newest that it can, with a warning);
        ``resume='path'`` or ``resume=True`` with ``load_from`` resumes from that
        file; ``load_from`` alone loads weights only. Returns the checkpoint or None.
        """
        return self.checkpointer.load_or_resume(load_from, resume)


def _move(obj: Any, map_location: Any) -> Any:
    """Tensors of a checkpoint read on CPU, moved where ``map_location`` (a device) says."""
    if map_location in (None, 'cpu') or not isinstance(map_location, (str, torch.device)):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(map_location)
    if isinstance(obj, dict):
        return {k: _move(v, map_location) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_move(v, map_location) for v in obj]
    return obj
