"""The save half of BaseStrategy's checkpoints: ``save_checkpoint``, asynchronous saves.

Mixed into :class:`~stratagem.strategies.checkpointing.CheckpointMixin` (hence into
:class:`BaseStrategy`); it uses what BaseStrategy provides (``model``, ``optim_wrapper``,
``param_schedulers``, ``logger``, ``world_size``, ``rank``, ``_wrappers``, ``_randomness``,
``_work_dir``, ``dispatch_kwargs``) and the state-dict methods of ``CheckpointMixin``.

``save_checkpoint`` (every rank calls it, as mmengine's CheckpointHook does)
    0. the previous save (asynchronous) is waited for; its error is raised here.
    1. rank 0's path and every rank's RNG state are gathered in one collective. 2. mid
    accumulation window under DDP, every rank's partial gradients are gathered. 3. every
    rank validates the content (tensors and plain values only). With ``async_checkpoint``
    the writing ranks snapshot the state to CPU staging buffers and ``save_checkpoint``
    returns; steps 4-5 run on a background writer thread. 4. rank 0 writes through
    ``checkpoint/`` (temp, fsync; then the commit vote: every rank alive and done;
    then manifest, rename, pointer); a sharded backend's ranks each write their files
    and the directory protocol (``checkpoint/directory.py``) runs the same vote.
    5. the ranks learn the outcome through the vote
    (``checkpoint/vote.py``: the process group's store, no collective), so a failure or
    a dead rank raises on every rank, naming it, instead of hanging.

Backend hooks: ``_save_checkpoint_files`` (the write; default: rank 0, one atomic file),
``_async_capable`` (whether the write may run on the writer thread),
``_checkpoint_all_ranks_write`` (every rank snapshots and writes, e.g. sharded),
``_partial_grad_states``, ``_validate_checkpoint``.
"""

from __future__ import annotations

import os.path as osp
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
from stratagem.checkpoint.vote import CheckpointVoteError, SaveVote
from stratagem.version import __version__

if TYPE_CHECKING:
    import logging

    from torch import nn

__all__ = ['SaveMixin']


class SaveMixin:
    """``save_checkpoint`` and the asynchronous writer of a strategy."""

    async_checkpoint: bool = False
    checkpoint_timeout: float = 600.0
    _async_writer: AsyncCheckpointWriter | None = None
    _commit_gate: Callable[[], None] | None = None
    # the save's vote, for a backend whose directory protocol runs all of it (steps 2-4)
    _commit_vote: SaveVote | None = None
    # a backend whose every rank writes files (sharded) sets this: every rank snapshots
    _checkpoint_all_ranks_write = False

    if TYPE_CHECKING:  # for the type checker: what BaseStrategy and CheckpointMixin provide
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
        def _unwrap_model(self) -> nn.Module: ...
        def _wrappers(self) -> list[Any]: ...
        def _initialize_accumulation(self, done_iters: int | None = 0) -> None: ...
        def _set_randomness(
            self, seed: int | None = None, deterministic: bool = False, diff_rank_seed: bool = False
        ) -> None: ...
        def model_state_dict(self) -> dict: ...
        def optim_state_dict(self) -> dict: ...
        def scheduler_state_dict(self) -> list | dict: ...
        def _validate_checkpoint(self, checkpoint: dict) -> None: ...

    def wait_for_checkpoints(self) -> None:
        """Block until every pending (asynchronous) save is committed; raise its error if it
        failed, on every rank. A no-op when nothing is pending. ``save_checkpoint``,
        ``resume``, ``load_checkpoint`` and ``load_or_resume`` call it first."""
        writer = getattr(self, '_async_writer', None)
        if writer is not None:
            writer.wait()

    def _meta(self, extra_meta: Mapping | None) -> dict:
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
        # what a resume at another world size needs to convert iteration counts
        for key in ('train_micro_batch_size_per_gpu', 'epoch_length'):
            if self.dispatch_kwargs.get(key) is not None:
                meta[key] = int(self.dispatch_kwargs[key])
        meta.update(extra_meta or {})
        return meta

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
        be once committed; ``wait_for_checkpoints`` waits for that).
        """
        self.wait_for_checkpoints()
        extra = dict(extra_ckpt or {})
        path = filename if osp.isabs(filename) else osp.join(self._work_dir, filename)
        # one collective: rank 0's path for every rank, and every rank's RNG state
        gathered = env.all_gather_object((osp.abspath(path), env.get_rng_state()))
        path = gathered[0][0]
        checkpoint: dict[str, Any] = {
            'meta': self._meta(extra.pop('meta', None)),
            'state_dict': self.model_state_dict(),
        }
        if save_optimizer and hasattr(self, 'optim_wrapper'):
            checkpoint['optimizer'] = self.optim_state_dict()
            partial = self._partial_grad_states()
            if partial is not None:
                checkpoint['partial_grads'] = partial
        if save_param_scheduler and hasattr(self, 'param_schedulers'):
            checkpoint['param_schedulers'] = self.scheduler_state_dict()
        checkpoint['rng_states'] = [rng for _, rng in gathered]
        checkpoint.update(extra)
        if callback is not None:
            callback(checkpoint)
        # every rank checks the content, so a bad value fails on all ranks alike instead of
        # leaving the others waiting for rank 0
        self._validate_checkpoint(checkpoint)
        vote = SaveVote.open(self.checkpoint_timeout, f'saving {path}')
        if not (self.async_checkpoint and self._async_capable()):
            self._write_and_agree(checkpoint, path, vote)
            return path
        if self._async_writer is None:
            self._async_writer = AsyncCheckpointWriter()
        # only ranks that write need the state; the others take part in the vote
        writes = self._checkpoint_all_ranks_write or env.is_main_process()
        try:
            staged = self._async_writer.snapshot(checkpoint, self._deferrable()) if writes else None
        except BaseException:
            if vote is not None:  # tell the others, who would otherwise wait for the vote
                vote.ready(f'snapshot failed on rank {self.rank}')
                if self.rank == 0:
                    vote.post_outcome(f'snapshot failed on rank {self.rank}')
                vote.close()
            raise
        del checkpoint  # the live tensors may change from here on
        self._async_writer.submit(self._write_and_agree, staged, path, vote)
        return path

    def _deferrable(self) -> Callable[[torch.Tensor], bool] | None:
        """Which tensors of an async snapshot the writer thread may copy after
        ``save_checkpoint`` returns: the model's parameters and the optimizer state, which
        only an optimizer step writes. A step pre-hook on every optimizer waits for that copy,
        so the copy overlaps the next forward and backward; buffers (BatchNorm statistics
        change in forward), RNG states and everything else are copied at once. Code that
        writes parameters in place outside ``optimizer.step`` between a save and the next
        step (rare: EMA of the same model, manual surgery) must call
        ``wait_for_checkpoints()`` first."""
        if not hasattr(self, 'optim_wrapper'):
            return None
        live: set[int] = {_storage_ptr(p) for p in self.model.parameters()}
        for wrapper in self._wrappers():
            optimizer = wrapper.optimizer
            if not getattr(optimizer, '_stratagem_snapshot_guard', False):
                optimizer.register_step_pre_hook(self._wait_staged_hook)
                optimizer._stratagem_snapshot_guard = True
            for state in optimizer.state.values():
                live.update(
                    _storage_ptr(t)
                    for t in state.values()
                    if isinstance(t, torch.Tensor) and t.numel() > 1
                )
        live.discard(0)
        return lambda tensor: _storage_ptr(tensor) in live

    def _wait_staged_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._async_writer is not None:
            self._async_writer.wait_staged()

    def _async_capable(self) -> bool:
        """Backend hook (every rank, on the training thread, before the snapshot): whether
        this save's write step can run on the writer thread. The writer agrees with the
        other ranks through the store vote, never on the default group; a layout whose
        writer still issues collectives (DCP's planning) creates a group of the writer's own
        here (FSDPStrategy), or returns False to stay synchronous rather than risk a
        deadlock."""
        return True

    def _write_and_agree(self, checkpoint: dict | None, path: str, vote: SaveVote | None) -> None:
        """Steps 4-5 of ``save_checkpoint``: write, vote, commit, learn the outcome."""
        reached = []

        def gate() -> None:  # between "every rank's files are written" and the commit
            reached.append(True)
            if vote is not None:
                vote.ready()
                if self.rank == 0:
                    vote.wait_ready()

        self._commit_gate, self._commit_vote = gate, vote
        error = None
        try:
            self._save_checkpoint_files(checkpoint, path)  # type: ignore[arg-type]
            if not reached and not (vote is not None and vote.ready_posted):
                gate()  # a rank with nothing to commit, or a backend without the gate
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
        finally:
            self._commit_gate = self._commit_vote = None
        if vote is None or vote.concluded:  # a directory save ran the whole vote itself
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
            if not reached and not vote.ready_posted:
                vote.ready(message)
            if self.rank == 0:
                vote.post_outcome(message)
            if error is not None:
                raise error
            if self.rank != 0:
                vote.wait_outcome()
        finally:
            vote.close()

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

    def _save_checkpoint_files(self, checkpoint: dict, filename: str) -> None:
        """Backend hook: write ``checkpoint`` (default: rank 0 writes one atomic file).

        Runs on the writer thread under ``async_checkpoint``, with a CPU snapshot (None on
        ranks that do not write, unless ``_checkpoint_all_ranks_write``). A backend calls
        ``self._commit_gate()`` once its files are written and before it commits (for a
        directory: after the ranks' files, before ``finalize_directory``): that is the vote
        that every rank is alive and done; it raises if not, and the save must not commit.
        """
        if env.is_main_process():
            ckpt.save_checkpoint(
                checkpoint,
                filename,
                step=checkpoint['meta'].get('iter'),
                extra_manifest={'world_size': self.world_size, 'strategy': type(self).__name__},
                before_commit=self._commit_gate,
            )


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Address of the memory ``tensor`` lives in (a DTensor's: its local shard's)."""
    local = getattr(tensor, '_local_tensor', None)  # a DTensor (FSDP's sharded parameters)
    return (tensor if local is None else local).untyped_storage().data_ptr()
