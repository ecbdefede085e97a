"""What a backend supplies to the checkpoint sequence: its state (the ``Checkpointed``
interface, which ``BaseStrategy`` implements) and its layout on disk (``CheckpointLayout``:
one file written by rank 0 by default; FSDP's sharded directory and DeepSpeed's directory
subclass it). The sequence itself is the ``Checkpointer``'s (``checkpointer.py``).

A layout's save side (``Checkpointer.save`` calls them in this order):
    1. ``check_savable(path)``: refuse a moment this layout cannot hold.
    2. ``validate(checkpoint)``: tensors and plain values only; the allow-listed classes.
    3. ``stage(checkpoint, path, commit, writer)`` on the training thread: copy the state
       for an asynchronous write (or write in the foreground, as DeepSpeed's engine must);
       returns the write job.
    4. ``write(checkpoint, path, commit)`` (the default job): write, ``commit.gate()``, commit.
Its read side (``Checkpointer.resume``):
    1. ``open(filename, map_location, optimizer=, editable=)``: agree on the file and read
       what the checks need.
    2. ``resume_keys`` / ``missing_message``, then ``check``: refused before anything loads.
    3. ``restore(checkpoint, path, meta, optimizer)``: model, then optimizer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
from stratagem.checkpoint.vote import CheckpointVoteError, SaveVote

__all__ = ['CheckpointLayout', 'SaveCommit', 'Checkpointed']


class Checkpointed(Protocol):
    """What the checkpointer reads of its strategy: the narrow interface through which a
    backend supplies its state (``BaseStrategy`` implements it; a backend overrides the
    methods whose state differs). ``optim_wrapper`` / ``param_schedulers`` are read when the
    strategy has them (after ``prepare``)."""

    checkpointer: Any  # its Checkpointer (checkpointer.py imports this module)

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

    def run(self, job: Callable[[], None]) -> None:
        """The save's write job, then its outcome through the vote (at once, or on the
        writer thread): a failure or a dead rank raises on every rank, naming it."""
        vote, rank = self.vote, self._rank
        error = None
        try:
            job()
            if not self.reached and not (vote is not None and vote.ready_posted):
                self.gate()  # a rank with nothing to commit
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
        if vote is None or vote.concluded:  # a directory layout ran the whole vote itself
            if vote is not None:
                vote.close()
            if error is not None:
                raise error
            return
        message = None
        if error is not None:
            message = (
                str(error)
                if isinstance(error, CheckpointVoteError)
                else f'{type(error).__name__}: {error}'
            )
        try:
            if not self.reached and not vote.ready_posted:
                vote.ready(message)
            if rank == 0:
                vote.post_outcome(message)
            if error is not None:
                raise error
            if rank != 0:
                vote.wait_outcome()
        finally:
            vote.close()

    def abandon(self, message: str) -> None:
        """Staging failed on this rank: tell the others (who would otherwise wait for the
        vote) and leave it."""
        vote = self.vote
        if vote is None:
            return
        if not vote.concluded:
            if not vote.ready_posted:
                vote.ready(f'staging failed on rank {self._rank}: {message}')
            if self._rank == 0:
                vote.post_outcome(f'staging failed on rank 0: {message}')
        vote.close()


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
        checkpointer = self.strategy.checkpointer
        path = checkpointer.agree(filename)
        return path, checkpointer.read(path, map_location)

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
        strategy.checkpointer.load_weights(checkpoint, path, strict=False)
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
