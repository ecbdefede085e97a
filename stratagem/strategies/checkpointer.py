"""A strategy's checkpoint sequences, written once: :class:`Checkpointer`.

Every strategy owns one ``Checkpointer`` (``strategy.checkpointer``): the strategy's
``save_checkpoint``, ``wait_for_checkpoints``, ``resume``, ``load_checkpoint`` and
``load_or_resume`` are its ``save``, ``wait``, ``resume``, ``load`` and ``load_or_resume``.
What differs between backends is the layout on disk, a ``CheckpointLayout`` the strategy
supplies (``layout.py``; ``_checkpoint_layout``): one file written by rank 0 (the default),
FSDP's sharded DCP directory, DeepSpeed's directory; and its state, read through the
``Checkpointed`` interface. A layout never re-implements a sequence.

``Checkpointer.save`` (every rank calls it, as mmengine's CheckpointHook does)
    0. The previous (asynchronous) save is waited for; its error is raised here.
    1. One collective: rank 0's path for every rank, and every rank's RNG state.
    2. ``layout.check_savable(path)``: a layout that cannot hold this moment refuses it
       before anything is written (DeepSpeed inside an accumulation window).
    3. The state, from the strategy's public state-dict methods: ``meta``
       (``strategy.checkpoint_meta``), the model's (unless the layout's own files hold it),
       the optimizer's (with every rank's partial gradients mid accumulation window), the
       schedulers', every rank's RNG state, then ``extra_ckpt``; ``callback(checkpoint)``.
    4. Every rank validates the content (``layout.validate``: tensors and plain values), so a
       bad value fails on all ranks alike instead of leaving the others waiting.
    5. The save's vote opens (``checkpoint/vote.py``: the process group's store, no
       collective) and ``layout.stage`` runs on the training thread: with
       ``async_checkpoint`` the writing ranks copy the whole state into the writer's CPU
       staging buffers here (complete before the call returns: the checkpoint is the state
       at the call, whatever the program does next); DeepSpeed's engine saves here. It
       returns the write job.
    6. The job runs at once, or on the writer thread (async): it writes, calls
       ``commit.gate()`` once this rank's files are written (the vote: every rank alive and
       done; it raises if not, and nothing may be committed), then rank 0 commits
       (manifest, rename, pointer). A directory layout runs the vote itself
       (``checkpoint/directory.py``).
    7. The ranks learn the outcome through the vote: a failure or a dead rank raises on
       every rank, naming it, instead of hanging.
"""

from __future__ import annotations

import os.path as osp
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
from stratagem.checkpoint.vote import SaveVote

from .layout import Checkpointed, CheckpointLayout, SaveCommit
from .resume_checks import previous_run_traces, resume_newest
from .world_change import plan_world_size_change

__all__ = ['Checkpointer', 'CheckpointLayout', 'SaveCommit', 'Checkpointed']


class Checkpointer:
    """The save sequence of one strategy (see module doc) and its background writer.

    Args:
        strategy: the strategy whose state is saved (its state-dict methods and layout).
        async_checkpoint: write on a background thread after copying the state.
        timeout: seconds a rank may show no sign of life during a distributed save
            before the others give up on it, naming it, without committing.
    """

    def __init__(
        self, strategy: Checkpointed, *, async_checkpoint: bool = False, timeout: float = 600.0
    ) -> None:
        if type(async_checkpoint) is not bool:
            raise TypeError(f'async_checkpoint must be True or False, got {async_checkpoint!r}')
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(
                f'checkpoint_timeout must be a positive number of seconds, got {timeout!r}'
            )
        self.strategy = strategy
        self.async_checkpoint = async_checkpoint
        self.timeout = float(timeout)
        self.writer: AsyncCheckpointWriter | None = None

    def wait(self) -> None:
        """Block until the pending (asynchronous) save is committed; raise its error if it
        failed, on every rank. A no-op when nothing is pending."""
        if self.writer is not None:
            self.writer.wait()

    def save(
        self,
        filename: str,
        *,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        extra_ckpt: Mapping | None = None,
        callback: Callable[[dict], None] | None = None,
    ) -> str:
        """Steps 0-7 of the module doc; returns the final path (with ``async_checkpoint``,
        where the checkpoint will be once committed)."""
        strategy = self.strategy
        self.wait()
        extra = dict(extra_ckpt or {})
        path = filename if osp.isabs(filename) else osp.join(strategy.work_dir, filename)
        gathered = env.all_gather_object((osp.abspath(path), env.get_rng_state()))
        path = gathered[0][0]
        layout = strategy._checkpoint_layout()
        layout.check_savable(path)
        checkpoint: dict[str, Any] = {'meta': strategy.checkpoint_meta(extra.pop('meta', None))}
        if not layout.holds_model:
            checkpoint['state_dict'] = strategy.model_state_dict()
        if save_optimizer and hasattr(strategy, 'optim_wrapper'):
            checkpoint['optimizer'] = strategy.optim_state_dict()
            partial = None if layout.holds_model else strategy._partial_grad_states()
            if partial is not None:
                checkpoint['partial_grads'] = partial
        if save_param_scheduler and hasattr(strategy, 'param_schedulers'):
            checkpoint['param_schedulers'] = strategy.scheduler_state_dict()
        checkpoint['rng_states'] = [rng for _, rng in gathered]
        checkpoint.update(extra)
        if callback is not None:
            callback(checkpoint)
        held = layout.validate(checkpoint)
        step = checkpoint['meta'].get('iter')
        vote = SaveVote.open(self.timeout, f'saving {path}')
        commit = SaveCommit(vote, strategy.rank, step if type(step) is int else None, held)
        writer = None
        if self.async_checkpoint:
            if self.writer is None:
                self.writer = AsyncCheckpointWriter()
            writer = self.writer
        try:
            job = layout.stage(checkpoint, path, commit, writer)
        except BaseException as err:
            commit.abandon(f'{type(err).__name__}: {err}')
            raise
        del checkpoint  # the live tensors may change from here on: an async job has a copy
        if writer is None:
            commit.run(job)
        else:
            writer.submit(commit.run, job)
        return path

    def resume(
        self,
        filename: str,
        *,
        resume_optimizer: bool = True,
        resume_param_scheduler: bool = True,
        map_location: Any = 'default',
        callback: Callable[[dict], None] | None = None,
    ) -> dict:
        """The resume sequence, for every backend (its layout reads and restores):

        1. A pending asynchronous save is committed first (it may be that very file).
        2. ``layout.open``: the ranks agree on the checkpoint and read what the checks need;
           then ``callback(checkpoint)``.
        3. Every check runs before anything is loaded, so a refused resume changes nothing:
           the keys asked for, ``layout.check`` (shapes, param groups, schedulers), and a
           world-size change (converted, or refused naming both sizes).
        4. ``layout.restore``: model, then optimizer (counters, scaler, partial gradients).
        5. Accumulation counters, schedulers, every rank's RNG state last; every rank then
           checks it stands at the same iteration.
        """
        strategy: Any = self.strategy
        if not strategy._prepared:
            raise RuntimeError(
                'resume() needs the prepared components: call strategy.prepare('
                'model, optim_wrapper=..., param_scheduler=...) first'
            )
        self.wait()
        layout = strategy._checkpoint_layout()
        want_optim = resume_optimizer and hasattr(strategy, 'optim_wrapper')
        want_sched = resume_param_scheduler and hasattr(strategy, 'param_schedulers')
        path, checkpoint = layout.open(
            filename, map_location, optimizer=want_optim, editable=callback is not None
        )
        if callback is not None:
            callback(checkpoint)
        missing = [k for k in layout.resume_keys(want_optim, want_sched) if k not in checkpoint]
        if missing:
            raise KeyError(layout.missing_message(path, missing, checkpoint))
        layout.check(checkpoint, path, want_optim, want_sched)
        meta = checkpoint.get('meta') or {}
        change, sched_states = self._plan(checkpoint, meta, want_sched, path)
        layout.restore(checkpoint, path, meta, want_optim)
        self._finish(checkpoint, meta, change, sched_states, want_sched, path)
        return checkpoint

    def load(
        self,
        filename: str,
        *,
        map_location: Any = 'cpu',
        strict: bool = False,
        revise_keys: Sequence[tuple[str, str]] = ((r'^module\.', ''),),
        callback: Callable[[dict], None] | None = None,
    ) -> dict:
        """Weights only (``strategy.load_checkpoint``): agree, read, ``callback``, load."""
        path = self.agree(filename)
        checkpoint = self.read(path, map_location, callback)
        self.load_weights(checkpoint, path, strict=strict, revise_keys=revise_keys)
        return checkpoint

    def load_or_resume(
        self, load_from: str | None = None, resume: bool | str = False
    ) -> dict | None:
        """mmengine's runner logic (``strategy.load_or_resume``, documented there)."""
        strategy: Any = self.strategy
        self.wait()
        if isinstance(resume, str):
            return strategy.resume(resume)
        if resume and load_from is None:
            # rank 0 decides (other ranks may not see this work_dir, or see another one);
            # resume() then checks every rank reads that same checkpoint
            work_dir = strategy.work_dir
            latest = ckpt.find_latest_checkpoint(work_dir) if strategy.rank == 0 else None
            latest = env.broadcast_object(None if latest is None else str(latest))
            if latest is None:
                # a previous run left traces but nothing resumable: starting fresh would
                # overwrite its files, so stop before anything is written
                traces = env.broadcast_object(
                    previous_run_traces(work_dir) if strategy.rank == 0 else None
                )
                if traces:
                    raise FileNotFoundError(
                        f'cannot resume from work_dir {work_dir}: {traces}, but no '
                        'committed checkpoint there verifies; nothing was changed. Resume '
                        'from a file with --resume PATH (API: resume=PATH), or start from '
                        f'scratch in a new --work-dir (or after removing {ckpt.POINTER_NAME})'
                    )
                strategy.logger.info(
                    f'no checkpoint in {work_dir} to resume from; training starts from scratch'
                )
                return None
            return resume_newest(strategy, str(latest))
        if resume and load_from is not None:  # resume=True with a file: that file
            return strategy.resume(load_from)
        if load_from is not None:
            return strategy.load_checkpoint(load_from)
        return None

    # ------------------------------------------------------- steps the layouts share
    def agree(self, filename: str) -> str:
        """Rank 0's ``filename``, verified to be the same bytes on every rank (collective).
        A pending asynchronous save is committed first (it may be that very file)."""
        self.wait()
        return str(ckpt.agree_on_checkpoint(filename))

    def read(
        self, path: str, map_location: Any, callback: Callable[[dict], None] | None = None
    ) -> dict:
        """The whole checkpoint at ``path`` (the strategy's ``_load_checkpoint_files``),
        then ``callback(checkpoint)``."""
        strategy: Any = self.strategy
        self.wait()
        checkpoint = strategy._load_checkpoint_files(
            str(path), strategy._resolve_map_location(map_location)
        )
        if not isinstance(checkpoint, dict):
            raise ValueError(
                f'{path} holds a {type(checkpoint).__name__}, not a checkpoint '
                "dict (expected keys like 'state_dict', 'meta', 'optimizer')"
            )
        if callback is not None:
            callback(checkpoint)
        return checkpoint

    # below this share of the model's tensors found in the file, a load warns loudly
    MIN_LOADED_SHARE = 0.5

    def load_weights(
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
        strategy: Any = self.strategy
        where = None
        try:
            state_dict, where = ckpt.find_model_weights(checkpoint)
            report = strategy.load_model_state_dict(
                state_dict, strict=strict, revise_keys=revise_keys
            )
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
                    f'tensors of {type(strategy._unwrap_model()).__name__} were found and '
                    f'loaded; not loaded: {", ".join(left_out[:10])}'
                    f'{", ..." if len(left_out) > 10 else ""}. The file holds '
                    f'{ckpt.describe_keys(checkpoint)}. Fine for a partial (e.g. backbone) '
                    'load; otherwise check the checkpoint and revise_keys',
                    ckpt.PartialLoadWarning,
                    stacklevel=4,
                )
        strategy.logger.info(f'loaded weights from {filename} ({where}{counts})')

    def _plan(
        self, checkpoint: dict, meta: Mapping, want_sched: bool, filename: str
    ) -> tuple[Any, Any]:
        """The world-size change (None if none) and the scheduler states to load, converted
        to this run's units; raises before anything is loaded when it cannot be exact."""
        strategy: Any = self.strategy
        change = plan_world_size_change(
            meta,
            strategy.dispatch_kwargs,
            strategy.world_size,
            self._max_accumulation(),
            filename,
            strategy.data_parallel_size,
        )
        sched_states = checkpoint.get('param_schedulers') if want_sched else None
        if want_sched and change is not None and change.new_iter is not None:
            sched_states = change.rescale_schedulers(
                strategy.param_schedulers,
                sched_states,
                strategy.dispatch_kwargs.get('epoch_length'),
                filename,
            )
        return change, sched_states

    def _finish(
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
        strategy: Any = self.strategy
        converting = change is not None and change.new_iter is not None
        done = meta.get('iter')
        if converting:
            done = change.new_iter
            if change.max_iters is not None:
                strategy.dispatch_kwargs['max_iters'] = change.max_iters[1]
        if hasattr(strategy, 'optim_wrapper'):
            strategy._initialize_accumulation(done)
        if want_sched:
            strategy.load_scheduler_state_dict(sched_states)
            if converting:
                change.replay_schedulers(
                    strategy.param_schedulers, strategy.dispatch_kwargs.get('epoch_length')
                )
        strategy._restore_randomness(checkpoint, meta, filename)
        if change is not None:
            checkpoint['meta'] = meta = {
                **meta,
                'iter': done,
                'world_size_change': change.as_meta(),
            }
            if strategy.rank == 0:  # the same on every rank: said once
                enabled = bool((strategy._auto_scale_lr or {}).get('enable'))
                strategy.logger.warning(change.describe(filename, auto_scale_lr=enabled))
        self.check_same_step(meta.get('iter'), filename)
        strategy.resumed_from = osp.abspath(filename)
        strategy.logger.info(f'resumed from {filename} (iter {meta.get("iter")})')

    def _max_accumulation(self) -> int:
        strategy: Any = self.strategy
        if not hasattr(strategy, 'optim_wrapper'):
            return 1
        return max(getattr(w, '_accumulative_counts', 1) for w in strategy._wrappers())

    @staticmethod
    def check_same_step(step: Any, filename: str) -> None:
        """After a resume every rank must stand at the same iteration (collective)."""
        keys = env.all_gather_keys([env.key_of(step)])
        if any(key != keys[0] for key in keys):  # the steps themselves only to report them
            steps = env.all_gather_object(step)
            raise RuntimeError(
                f'after resuming {filename} the ranks disagree on the iteration: '
                f'{steps} (rank order); every rank must resume the same '
                'checkpoint'
            )
