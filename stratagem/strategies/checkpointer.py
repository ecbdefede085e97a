"""A strategy's checkpoint saves, written once: :class:`Checkpointer` and the layout it writes.

Every strategy owns one ``Checkpointer`` (``strategy.checkpointer``); ``save_checkpoint`` and
``wait_for_checkpoints`` are its ``save`` and ``wait``. What differs between backends is the
layout on disk, a :class:`CheckpointLayout` the strategy supplies (``_checkpoint_layout``):
one file written by rank 0 (this module's default), FSDP's sharded DCP directory, DeepSpeed's
directory. A layout never re-implements the sequence; it says where the state goes.

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

import functools
import os.path as osp
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
from stratagem.checkpoint.vote import CheckpointVoteError, SaveVote

__all__ = ['Checkpointer', 'CheckpointLayout', 'SaveCommit', 'Checkpointed']


class Checkpointed(Protocol):
    """What the checkpointer reads of its strategy: the narrow interface through which a
    backend supplies its state (``BaseStrategy`` implements it; a backend overrides the
    methods whose state differs). ``optim_wrapper`` / ``param_schedulers`` are read when the
    strategy has them (after ``prepare``)."""

    @property
    def work_dir(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def checkpoint_meta(self, extra_meta: Mapping | None = None) -> dict: ...
    def model_state_dict(self) -> dict: ...
    def optim_state_dict(self) -> dict: ...
    def scheduler_state_dict(self) -> list | dict: ...
    def _partial_grad_states(self) -> list | None: ...
    def _checkpoint_layout(self) -> CheckpointLayout: ...


class SaveCommit:
    """One save's agreement between the ranks, handed to a layout's write step.

    Attributes:
        vote: the save's ``SaveVote`` (None without a process group); a directory layout
            passes it to the directory protocol, which runs the whole vote.
        step: the iteration recorded in the manifest (``meta['iter']`` when an int).
        held: allow-listed classes the content holds (named in the manifest).
    """

    def __init__(self, vote: SaveVote | None, rank: int, step: int | None, held: list[str]) -> None:
        self.vote, self.step, self.held = vote, step, held
        self._rank = rank
        self.reached = False

    def gate(self) -> None:
        """Between "this rank's files are written" and rank 0's commit: every rank reports
        it is done; rank 0 waits for all of them and raises if one failed, died or stalled."""
        self.reached = True
        if self.vote is not None:
            self.vote.ready()
            if self._rank == 0:
                self.vote.wait_ready()


class CheckpointLayout:
    """How a backend's checkpoint is written: one file, written by rank 0 (the default).

    A backend's layout overrides what differs; the sequence stays the checkpointer's.
    """

    #: the layout's own files hold the model's state (DeepSpeed): no ``state_dict`` key
    holds_model = False

    def __init__(self, strategy: Checkpointed) -> None:
        self.strategy = strategy

    def all_ranks_write(self) -> bool:
        """Whether every rank writes files of its own (sharded), not only rank 0."""
        return False

    def check_savable(self, path: str) -> None:
        """Raise (on every rank alike) when this moment cannot be saved in this layout."""

    def validate(self, checkpoint: dict) -> list[str]:
        """Check the content loads with ``weights_only`` (tensors and plain values); returns
        the allow-listed classes it holds."""
        return ckpt.validate_checkpoint_content(checkpoint)

    def stage(
        self, checkpoint: dict, path: str, commit: SaveCommit, writer: AsyncCheckpointWriter | None
    ) -> Callable[[], None]:
        """On the training thread: make the write job. With a ``writer`` (async), the ranks
        that write copy ``checkpoint`` into its staging buffers first (the job only ever
        reads that copy); the others only take part in the vote."""
        writes = self.all_ranks_write() or env.is_main_process()
        state: dict | None = checkpoint if writes else None
        if writer is not None and state is not None:
            state = writer.snapshot(state)
        return functools.partial(self.write, state, path, commit)

    # ------------------------------------------------------------------- read side
    def open(
        self, filename: str, map_location: Any, *, optimizer: bool = False, editable: bool = True
    ) -> tuple[str, dict]:
        """Agree on ``filename`` (every rank sees rank 0's bytes) and read what the checks
        need; returns (the agreed path, the checkpoint dict). ``optimizer``: the optimizer
        state will be restored; ``editable``: a ``callback`` will see the dict (so its
        tensors must be real, not read later in place). Default: one verified file, or a
        sharded directory read unsharded (the strategy's ``_load_checkpoint_files``)."""
        strategy: Any = self.strategy
        path = strategy._agree_on_checkpoint(filename)
        return path, strategy._read_checkpoint(path, map_location, None)

    def resume_keys(self, optimizer: bool, schedulers: bool) -> list[str]:
        """The keys a resume needs (checked before anything is loaded)."""
        wanted = (('state_dict', True), ('optimizer', optimizer), ('param_schedulers', schedulers))
        return [key for key, want in wanted if want]

    def missing_message(self, path: str, missing: list[str], checkpoint: dict) -> str:
        return (
            f'{path} cannot be resumed: it has no {missing} (keys: {sorted(checkpoint)}); load '
            'weights only with load_checkpoint(), or pass resume_optimizer=False / '
            'resume_param_scheduler=False'
        )

    def check(self, checkpoint: dict, path: str, optimizer: bool, schedulers: bool) -> None:
        """The checks of the content against this run (shapes, param groups, schedulers)."""
        from .resume_checks import check_resumable

        check_resumable(self.strategy, checkpoint, path, optimizer=optimizer, schedulers=schedulers)

    def restore(self, checkpoint: dict, path: str, meta: dict, optimizer: bool) -> None:
        """Model (non-strict, as mmengine; mismatches in one warning), then the optimizer
        (counters, scaler, partial gradients)."""
        strategy: Any = self.strategy
        strategy._load_weights(checkpoint, path, strict=False)
        if optimizer:
            strategy.load_optim_state_dict(checkpoint['optimizer'])
            strategy._load_partial_grads(checkpoint, meta)

    def write(self, checkpoint: dict | None, path: str, commit: SaveCommit) -> None:
        """Write and commit (rank 0: one atomic file; ``commit.gate()`` before the rename)."""
        if checkpoint is not None:
            ckpt.save_checkpoint(
                checkpoint,
                path,
                step=commit.step,
                extra_manifest={
                    'world_size': self.strategy.world_size,
                    'strategy': type(self.strategy).__name__,
                },
                before_commit=commit.gate,
            )


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
        self.strategy = strategy
        self.async_checkpoint = async_checkpoint
        self.timeout = timeout
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
            self._abandon(commit, f'{type(err).__name__}: {err}')
            raise
        del checkpoint  # the live tensors may change from here on: an async job has a copy
        if writer is None:
            self._run(job, commit)
        else:
            writer.submit(self._run, job, commit)
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
        change, sched_states = strategy._plan_resume(checkpoint, meta, want_sched, path)
        layout.restore(checkpoint, path, meta, want_optim)
        strategy._finish_resume(checkpoint, meta, change, sched_states, want_sched, path)
        return checkpoint

    def _abandon(self, commit: SaveCommit, message: str) -> None:
        """Staging failed on this rank: tell the others (who would otherwise wait for the
        vote) and leave it."""
        vote = commit.vote
        if vote is None:
            return
        if not vote.concluded:
            if not vote.ready_posted:
                vote.ready(f'staging failed on rank {self.strategy.rank}: {message}')
            if self.strategy.rank == 0:
                vote.post_outcome(f'staging failed on rank 0: {message}')
        vote.close()

    def _run(self, job: Callable[[], None], commit: SaveCommit) -> None:
        """Steps 6-7: the layout's write job, then the outcome through the vote."""
        vote, rank = commit.vote, self.strategy.rank
        error = None
        try:
            job()
            if not commit.reached and not (vote is not None and vote.ready_posted):
                commit.gate()  # a rank with nothing to commit
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
        if vote is None or vote.concluded:  # a directory layout ran the whole vote itself
            if vote is not None:
                vote.close()
            if error is not None:
                raise error
            return
        message = (
            None
            if error is None
            else (
                str(error)
                if isinstance(error, CheckpointVoteError)
                else f'{type(error).__name__}: {error}'
            )
        )
        try:
            if not commit.reached and not vote.ready_posted:
                vote.ready(message)
            if rank == 0:
                vote.post_outcome(message)
            if error is not None:
                raise error
            if rank != 0:
                vote.wait_outcome()
        finally:
            vote.close()
