"""Where a checkpoint's content goes on disk: the storage protocol the ``Checkpointer`` writes
and reads through, and its default, one file written by rank 0.

A backend whose checkpoint is not one file supplies its own storage: FSDP's sharded DCP
directory (``strategies/fsdp/storage.py``), DeepSpeed's directory
(``strategies/deepspeed/checkpoint.py``). A storage is handed what it needs when it is made
(functions, never a strategy); the sequences stay the checkpointer's.

Save side (``Checkpointer.save`` calls them in this order):
    1. ``check_savable(path)``: refuse a moment this storage cannot hold; ``own_keys()``:
       the parts whose own value each rank hands over (``own_state_dict``), not every rank's.
    2. ``validate(checkpoint)``: tensors and plain values only; the allow-listed classes.
    3. ``stage(checkpoint, path, commit, writer)`` on the training thread: copy the content
       for an asynchronous write (or write in the foreground, as DeepSpeed's engine must);
       returns the write job.
    4. ``write(checkpoint, path, commit)`` (the default job): write, ``commit.gate()``,
       commit. A URL target (``location.py``): the same into a local staging directory, then
       the upload (no rename on a store: the order of the objects is the commit).
Read side (``Checkpointer.load``):
    1. ``open(path, map_location, optimizer=, editable=)`` on the agreed path: what the
       checks need (``read`` reads a checkpoint whole), and what ``restore`` will need.
    2. ``holds``: the keys the storage's own files hold (not in the dict ``open`` returns).
    3. ``restore(path, checkpoint, opened, optimizer=)`` after every part's check: what is
       read in place (FSDP's shards into the live tensors, DeepSpeed's engine files).
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .async_writer import AsyncCheckpointWriter
from .content import validate_checkpoint_content
from .errors import CheckpointVoteError
from .latest import update_pointer
from .load import load_checkpoint_file
from .location import is_url, load_file, upload_file
from .rank_errors import NOTHING_COMMITTED, all_ok, describe_error, raise_first
from .single_file import save_checkpoint
from .vote import SaveVote

__all__ = ['CheckpointStorage', 'SaveCommit', 'move_to']


class SaveCommit:
    """One save's agreement between the ranks, handed to a storage's write step.

    Attributes:
        vote: the save's ``SaveVote`` (None without a process group); a directory storage
            passes it to the directory protocol, which runs the whole vote.
        backend_args, also_point: see ``__init__``.
        step: the iteration recorded in the manifest (``meta['iter']`` when an int).
        held: allow-listed classes the content holds (named in the manifest).
        own_keys: keys of the content that hold this rank's own value (its part's
            ``own_state_dict``), which the storage writes per rank (``own_keys()``).
    """

    def __init__(
        self,
        vote: SaveVote | None,
        rank: int,
        step: int | None,
        held: list[str],
        *,
        backend_args: Mapping | None = None,
        also_point: str | None = None,
    ) -> None:
        self.vote, self.step, self.held = vote, step, held
        self.rank = rank
        self.own_keys: frozenset[str] = frozenset()  # set by the save once it knows them
        self.reached = False
        self.arrived = False  # this rank took part in ``arrive``
        #: a URL target's storage options; a local directory whose ``last_checkpoint`` also
        #: names the committed checkpoint (a run's work_dir when checkpoints go elsewhere)
        self.backend_args, self.also_point = backend_args, also_point

    def arrive(self, error: BaseException | None = None) -> None:
        """The last step before a write whose every rank takes part in collectives (DCP's,
        DeepSpeed's engine; ``storage.stage`` calls it): every rank is here (one small
        collective on the default group), or a rank that failed before takes part with its
        ``error`` (``abandon``; it then raises its own) and every other rank raises
        ``CheckpointVoteError`` naming it, in the same call on every rank (an asynchronous
        save's too), so that none waits in those collectives for a rank that is not coming,
        and no rank's next collective meets theirs (a mismatch, which gloo ends by aborting
        the process)."""
        self.arrived = True
        if self.vote is None:
            return
        from stratagem import env  # see checkpoint/__init__.py: env only when saving

        if all_ok(error is not None):
            return
        outcomes = env.all_gather_object(None if error is None else describe_error(error))
        if error is None:
            raise_first(outcomes, None, self.vote.what, CheckpointVoteError, NOTHING_COMMITTED)

    def gate(self) -> None:
        """Between "this rank's files are written" and rank 0's commit: every rank reports
        it is done; rank 0 waits for all of them and raises if one failed, died or stalled."""
        self.reached = True
        if self.vote is not None:
            self.vote.ready()
            if self.rank == 0:
                self.vote.wait_ready()

    def run(self, job: Callable[[], None]) -> None:
        """The save's write job, then its outcome through the vote (at once, or on the
        writer thread): a failure or a dead rank raises on every rank, naming it."""
        vote, rank = self.vote, self.rank
        error = None
        try:
            job()
            if not self.reached and not (
                vote is not None and (vote.ready_posted or vote.concluded)
            ):
                self.gate()  # a rank with nothing to commit
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
        if vote is None or vote.concluded:  # a directory storage ran the whole vote itself
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

    def abandon(self, error: BaseException, *, arrive: bool = False) -> None:
        """This rank failed before its write (``error``; the caller raises it): tell the
        others, who would otherwise wait for the vote, and leave it. ``arrive``: the others
        meet at ``arrive`` before their write (a storage whose every rank writes), where
        this rank takes part with its error first (not for an interrupt: the others may be
        anywhere, and it must not wait for them; rank 0 then posts the outcome without
        waiting for them to read it)."""
        vote = self.vote
        if vote is None:
            return
        message = describe_error(error)
        caught = isinstance(error, Exception)
        if arrive and not self.arrived and caught:
            # a collective that fails here (a peer died) leaves the telling to the vote below
            with contextlib.suppress(Exception):
                self.arrive(error)
        if not vote.concluded:
            if not vote.ready_posted:
                vote.ready(f'staging failed on rank {self.rank}: {message}')
            if self.rank == 0:
                vote.post_outcome(f'staging failed on rank 0: {message}', wait=caught)
        vote.close()


class CheckpointStorage:
    """One file, written by rank 0 (the default storage); read whole, in any known format.

    Args:
        extra_manifest: returns the manifest's extra fields at each save (e.g. the strategy's
            name and world size).
    """

    #: keys of the content this storage's own files hold, absent from what ``open`` returns
    #: (DeepSpeed's files hold the model: ``{'state_dict'}``)
    holds: frozenset[str] = frozenset()
    #: whether this storage saves to and reads from a URL (``location.py``,
    #: ``remote_directory.py``); the checkpointer refuses a URL for one that does not
    urls: bool = True
    #: a URL's storage options, set by the checkpointer before each load
    backend_args: Mapping | None = None

    def __init__(self, extra_manifest: Callable[[], dict] | None = None) -> None:
        self.extra_manifest = extra_manifest or dict

    def all_ranks_write(self) -> bool:
        """Whether every rank writes files of its own (sharded), not only rank 0, in a write
        whose collectives every rank takes part in (DCP's, DeepSpeed's engine): ``stage``
        ends with ``commit.arrive()``, before them."""
        return False

    def check_savable(self, path: str) -> None:
        """Raise (on every rank alike) when this moment cannot be saved in this storage."""

    def own_keys(self) -> frozenset[str]:
        """Keys whose every rank's value this storage writes to that rank's own file and
        reads back as the list over the ranks: their parts hand over this rank's own value
        (``own_state_dict``), so the save gathers nothing for them. None by default (rank 0
        writes the one file: every rank's value is gathered)."""
        return frozenset()

    def validate(self, checkpoint: dict) -> list[str]:
        """Check the content loads with ``weights_only`` (tensors and plain values); returns
        the allow-listed classes it holds."""
        return validate_checkpoint_content(checkpoint)

    def stage(
        self, checkpoint: dict, path: str, commit: SaveCommit, writer: AsyncCheckpointWriter | None
    ) -> Callable[[], None]:
        """On the training thread: make the write job. With a ``writer`` (async), the ranks
        that write copy ``checkpoint`` into its staging buffers first (the job only ever
        reads that copy); the others only take part in the vote."""
        writes = self.all_ranks_write() or commit.rank == 0
        state: dict | None = checkpoint if writes else None
        if writer is not None and state is not None:
            state = writer.snapshot(state)
        if self.all_ranks_write():  # every rank here before the write's collectives
            commit.arrive()
        return functools.partial(self.write, state, path, commit)

    def write(self, checkpoint: dict | None, path: str, commit: SaveCommit) -> None:
        """Write and commit (rank 0: one atomic file; ``commit.gate()`` before the rename).
        A URL: the same commit into a local staging directory, then the upload
        (``location.upload_file``: the file, its manifest, the pointer, in that order)."""
        if checkpoint is None:
            return
        if not is_url(path):
            final = save_checkpoint(
                checkpoint,
                path,
                step=commit.step,
                extra_manifest=self.extra_manifest(),
                before_commit=commit.gate,
            )
            if commit.also_point is not None and Path(commit.also_point) != final.parent:
                update_pointer(commit.also_point, final)
            return
        staging = Path(tempfile.mkdtemp(prefix='stratagem-upload-'))
        try:
            local = save_checkpoint(
                checkpoint,
                staging / path.rsplit('/', 1)[-1],
                step=commit.step,
                extra_manifest=self.extra_manifest(),
                update_pointer=False,
                before_commit=commit.gate,
            )
            upload_file(local, path, backend_args=commit.backend_args, also_point=commit.also_point)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    # ------------------------------------------------------------------- read side
    def open(
        self, path: str, map_location: Any, *, optimizer: bool = False, editable: bool = True
    ) -> tuple[dict, Any]:
        """What a resume's checks need of the agreed ``path`` (by default the whole
        checkpoint), and what ``restore`` will need (None here).
        ``optimizer``: the optimizer state will be restored; ``editable``: a ``callback``
        will see the dict (so its tensors must be real, not read later in place)."""
        return self.read(path, map_location), None

    def read(self, path: str, map_location: Any) -> dict:
        """The whole checkpoint at ``path``: a file verified and read ``weights_only``; a
        directory in a known format (``checkpoint.formats``: FSDP's sharded one,
        DeepSpeed's) verified and read unsharded, on a disk or at a URL; anything else gets
        ``load_checkpoint_file``'s error."""
        from .formats import detect, read_whole

        name, found = detect(path, self.backend_args)
        if is_url(path):
            if name in (None, 'file'):
                return load_file(path, map_location=map_location, backend_args=self.backend_args)
            whole = read_whole(path, name, backend_args=self.backend_args, found=found)
            return move_to(whole, map_location)
        if name is None or name == 'file':
            return load_checkpoint_file(path, map_location=map_location)
        return move_to(read_whole(path, name), map_location)

    def restore(self, path: str, checkpoint: dict, opened: Any, *, optimizer: bool) -> None:
        """After every check passed, before the parts load: what this storage reads in
        place into the live state, given what ``open`` returned (nothing for a file: its
        content is already in ``checkpoint``)."""


def move_to(obj: Any, map_location: Any) -> Any:
    """Tensors of a checkpoint read on CPU, moved where ``map_location`` (a device) says."""
    if map_location in (None, 'cpu') or not isinstance(map_location, (str, torch.device)):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(map_location)
    if isinstance(obj, dict):
        return {k: move_to(v, map_location) for k, v in obj.items()}
    if isinstance(obj, list):
        return [move_to(v, map_location) for v in obj]
    return obj
