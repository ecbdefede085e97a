"""The checkpoint half of BaseStrategy: state dicts, save, load, resume.

Split from ``base.py`` to keep each file readable; :class:`BaseStrategy` is the
only class that mixes it in, and the methods use what it provides
(``model``, ``optim_wrapper``, ``param_schedulers``, ``logger``, ``world_size``,
``rank``, ``_unwrap_model``, ``_wrappers``, ``_initialize_accumulation``,
``_set_randomness``, ``_randomness``, ``_seed``, ``_work_dir``, ``_prepared``).

``save_checkpoint`` and asynchronous saves: the strategy's ``Checkpointer``
(``checkpointer.py``), over the layout the backend supplies (``_checkpoint_layout``).

``resume`` checks the checkpoint has what was asked for, then restores, in order:
model, optimizer (counters, scaler, partial gradients), accumulation counters,
schedulers, and every RNG state last.
"""

from __future__ import annotations

import os.path as osp
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from stratagem import checkpoint as ckpt
from stratagem import env

from .checkpointer import Checkpointer
from .resume_checks import previous_run_traces
from .world_change import plan_world_size_change

if TYPE_CHECKING:
    import logging

    from torch import nn

__all__ = ['CheckpointMixin']


class CheckpointMixin:
    """State dicts and the checkpoint sequence of :class:`~stratagem.strategies.BaseStrategy`."""

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
        def work_dir(self) -> str: ...
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
        device = getattr(self, 'device', None)
        if device is not None:
            return str(device)
        return f'cuda:{torch.cuda.current_device()}' if torch.cuda.is_available() else 'cpu'

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
        filename = self._agree_on_checkpoint(filename)
        checkpoint = self._read_checkpoint(filename, map_location, callback)
        self._load_weights(checkpoint, filename, strict=strict, revise_keys=revise_keys)
        return checkpoint

    def _agree_on_checkpoint(self, filename: str) -> str:
        """Rank 0's ``filename``, verified to be the same bytes on every rank (collective).
        A pending asynchronous save is committed first (it may be that very file)."""
        self.wait_for_checkpoints()
        return str(ckpt.agree_on_checkpoint(filename))

    def _read_checkpoint(
        self, filename: str, map_location: Any, callback: Callable[[dict], None] | None
    ) -> dict:
        self.wait_for_checkpoints()
        checkpoint = self._load_checkpoint_files(
            str(filename), self._resolve_map_location(map_location)
        )
        if not isinstance(checkpoint, dict):
            raise ValueError(
                f'{filename} holds a {type(checkpoint).__name__}, not a checkpoint '
                "dict (expected keys like 'state_dict', 'meta', 'optimizer')"
            )
        if callback is not None:
            callback(checkpoint)
        return checkpoint

    # below this share of the model's tensors found in the file, a load warns loudly
    MIN_LOADED_SHARE = 0.5

    def _load_weights(
        self,
        checkpoint: dict,
        filename: str,
        *,
        strict: bool,
        revise_keys: Sequence[tuple[str, str]] = ((r'^module\.', ''),),
    ) -> None:
        """Find the weights (``state_dict``, or a foreign layout: ``model_state_dict``,
        ``model``, ``module``, a bare state dict) and load them; nothing changes on an error.

        No layout found, no key matching, or a strict mismatch raises
        ``StateDictMismatchError`` naming the file and what it holds; fewer than
        ``MIN_LOADED_SHARE`` of the model's tensors loaded warns ``PartialLoadWarning``.
        """
        where = None
        try:
            state_dict, where = ckpt.find_model_weights(checkpoint)
            report = self.load_model_state_dict(state_dict, strict=strict, revise_keys=revise_keys)
        except ckpt.StateDictMismatchError as err:
            raise ckpt.StateDictMismatchError(
                f'{filename} {err}'
                if where is None
                else f'{filename} ({where}): {err}\nthe file holds {ckpt.describe_keys(checkpoint)}'
            ) from None
        counts = ''
        if isinstance(report, ckpt.LoadReport) and report.total:
            counts = f', {report.loaded} of {report.total} tensors'
            if report.loaded < self.MIN_LOADED_SHARE * report.total:
                left_out = report.missing_keys + [
                    k for k, *_ in report.shape_mismatches + report.type_mismatches
                ]
                env.warn_rank_zero(  # every rank loads the same file: said once
                    f'{filename} ({where}): only {report.loaded} of the {report.total} '
                    f'tensors of {type(self._unwrap_model()).__name__} were found and loaded; '
                    f'not loaded: {", ".join(left_out[:10])}'
                    f'{", ..." if len(left_out) > 10 else ""}. The file holds '
                    f'{ckpt.describe_keys(checkpoint)}. Fine for a partial (e.g. backbone) '
                    'load; otherwise check the checkpoint and revise_keys',
                    ckpt.PartialLoadWarning,
                    stacklevel=3,
                )
        self.logger.info(f'loaded weights from {filename} ({where}{counts})')

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

    def _plan_resume(
        self, checkpoint: dict, meta: Mapping, want_sched: bool, filename: str
    ) -> tuple[Any, Any]:
        """The world-size change (None if none) and the scheduler states to load, converted
        to this run's units; raises before anything is loaded when it cannot be exact."""
        change = plan_world_size_change(
            meta, self.dispatch_kwargs, self.world_size, self._max_accumulation(), filename
        )
        sched_states = checkpoint.get('param_schedulers') if want_sched else None
        if want_sched and change is not None and change.new_iter is not None:
            sched_states = change.rescale_schedulers(
                self.param_schedulers,
                sched_states,
                self.dispatch_kwargs.get('epoch_length'),
                filename,
            )
        return change, sched_states

    def _finish_resume(
        self,
        checkpoint: dict,
        meta: Mapping,
        change: Any,
        sched_states: Any,
        want_sched: bool,
        filename: str,
    ) -> None:
        """After model and optimizer: counters, schedulers, RNG states last; then every rank
        checks it stands at the same iteration (``checkpoint['meta']`` gets the converted
        iteration and ``world_size_change`` when the world size changed)."""
        converting = change is not None and change.new_iter is not None
        done = meta.get('iter')
        if converting:
            done = change.new_iter
            if change.max_iters is not None:
                self.dispatch_kwargs['max_iters'] = change.max_iters[1]
        if hasattr(self, 'optim_wrapper'):
            self._initialize_accumulation(done)
        if want_sched:
            self.load_scheduler_state_dict(sched_states)
            if converting:
                change.replay_schedulers(
                    self.param_schedulers, self.dispatch_kwargs.get('epoch_length')
                )
        self._restore_randomness(checkpoint, meta, filename)
        if change is not None:
            checkpoint['meta'] = meta = {
                **meta,
                'iter': done,
                'world_size_change': change.as_meta(),
            }
            self._report_world_size_change(change, filename)
        self._check_same_step(meta.get('iter'), filename)
        self.resumed_from = osp.abspath(filename)
        self.logger.info(f'resumed from {filename} (iter {meta.get("iter")})')

    def _max_accumulation(self) -> int:
        if not hasattr(self, 'optim_wrapper'):
            return 1
        return max(getattr(w, '_accumulative_counts', 1) for w in self._wrappers())

    def _report_world_size_change(self, change: Any, filename: str) -> None:
        if self.rank == 0:  # the same on every rank: said once
            enabled = bool((self._auto_scale_lr or {}).get('enable'))
            self.logger.warning(change.describe(filename, auto_scale_lr=enabled))

    def _check_same_step(self, step: Any, filename: str) -> None:
        """After a resume every rank must stand at the same iteration (collective)."""
        keys = env.all_gather_keys([env.key_of(step)])
        if any(key != keys[0] for key in keys):  # the steps themselves only to report them
            steps = env.all_gather_object(step)
            raise RuntimeError(
                f'after resuming {filename} the ranks disagree on the iteration: '
                f'{steps} (rank order); every rank must resume the same '
                'checkpoint'
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
        earlier run: ``FileNotFoundError``, before anything is written);
        ``resume='path'`` or ``resume=True`` with ``load_from`` resumes from that
        file; ``load_from`` alone loads weights only. Returns the checkpoint or None.
        """
        self.wait_for_checkpoints()
        if isinstance(resume, str):
            return self.resume(resume)
        if resume and load_from is None:
            # rank 0 decides (other ranks may not see this work_dir, or see another one);
            # resume() then checks every rank reads that same checkpoint
            latest = ckpt.find_latest_checkpoint(self._work_dir) if self.rank == 0 else None
            latest = env.broadcast_object(None if latest is None else str(latest))
            if latest is None:
                # a previous run left traces but nothing resumable: starting fresh would
                # overwrite its files, so stop before anything is written
                traces = env.broadcast_object(
                    previous_run_traces(self._work_dir) if self.rank == 0 else None
                )
                if traces:
                    raise FileNotFoundError(
                        f'cannot resume from work_dir {self._work_dir}: {traces}, but no '
                        'committed checkpoint there verifies; nothing was changed. Resume '
                        'from a file with --resume PATH (API: resume=PATH), or start from '
                        f'scratch in a new --work-dir (or after removing {ckpt.POINTER_NAME})'
                    )
                self.logger.info(
                    f'no checkpoint in {self._work_dir} to resume from; '
                    'training starts from scratch'
                )
                return None
            return self.resume(str(latest))
        if resume and load_from is not None:  # resume=True with a file: that file
            return self.resume(load_from)
        if load_from is not None:
            return self.load_checkpoint(load_from)
        return None


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
