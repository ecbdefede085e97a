"""FSDPStrategy's checkpoint storage: a sharded DCP directory every rank writes (or one file
under ``state_dict_type='full'``), read in place after every check of a resume."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from typing_extensions import override

from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
from stratagem.checkpoint.content import validate_checkpoint_content
from stratagem.checkpoint.formats import PIECEWISE, detect, read_like
from stratagem.checkpoint.location import is_url
from stratagem.checkpoint.sharded import (
    load_sharded_checkpoint,
    load_sharded_in_place,
    read_sharded_header,
    save_sharded_checkpoint,
)
from stratagem.checkpoint.storage import CheckpointStorage, SaveCommit

__all__ = ['FSDPStorage']


class FSDPStorage(CheckpointStorage):
    """A sharded DCP directory (every rank writes its shards and its partial gradients,
    ``checkpoint/sharded.py``), or under ``full`` the default single file (rank 0 holds the
    gathered state).

    Args:
        full: whether it is ``state_dict_type='full'`` now (the strategy's setting may be
            switched between saves).
        live_state: ``live_state(optimizer)`` returns the model's and (when ``optimizer``)
            the optimizer's live state dicts, DCP's targets: a resume reads the shards
            straight into them, a weights-only read reads them unsharded in their layout.
        extra_manifest: the manifest's extra fields (strategy, world size, mesh).
    """

    def __init__(
        self,
        *,
        full: Callable[[], bool],
        live_state: Callable[[bool], tuple[dict, dict | None]],
        extra_manifest: Callable[[], dict],
    ) -> None:
        super().__init__(extra_manifest)
        self.full = full
        self.live_state = live_state
        self._writer_group: Any = None  # DCP's planning group for asynchronous saves

    @override
    def all_ranks_write(self) -> bool:
        return not self.full()

    @override
    def own_keys(self) -> frozenset[str]:
        """Sharded: each rank's RNG state goes to its own file (``rng_states/rank_{r}.pth``)."""
        return frozenset() if self.full() else frozenset({'rng_states'})

    @override
    def validate(self, checkpoint: dict) -> list[str]:
        from torch.distributed.tensor import DTensor

        return validate_checkpoint_content(checkpoint, tensor_types=(DTensor,))

    @override
    def stage(
        self, checkpoint: dict, path: str, commit: SaveCommit, writer: AsyncCheckpointWriter | None
    ) -> Callable[[], None]:
        """An asynchronous sharded save runs DCP's planning collectives on the writer
        thread, so they get a gloo group of their own, created here (every rank saves in
        the same order): on the default group they would interleave with the training
        loop's collectives and deadlock. Created once every rank arrived (the default
        stage's last step), which a rank that failed before joins instead."""
        job = super().stage(checkpoint, path, commit, writer)
        if writer is not None and not self.full() and self._writer_group is None:
            import torch.distributed as dist

            self._writer_group = dist.new_group(backend='gloo')
        return job

    @override
    def write(self, checkpoint: dict | None, path: str, commit: SaveCommit) -> None:
        if self.full():  # one consolidated file (rank 0 holds it; others get None)
            super().write(checkpoint, path, commit)
            return
        assert checkpoint is not None  # every rank writes its shards
        # this rank's own values, each to its own file: the pending gradients (the part
        # hands over this rank's alone when sharded) and the keys of own_keys()
        per_rank = {
            key: checkpoint.pop(key)
            for key in ('partial_grads', *sorted(commit.own_keys))
            if key in checkpoint
        }
        save_sharded_checkpoint(
            path,
            checkpoint,
            step=commit.step,
            per_rank=per_rank,
            vote=commit.vote,
            process_group=self._writer_group,
            extra_manifest=self.extra_manifest(),
            backend_args=commit.backend_args,
            also_point=commit.also_point,
        )

    # ------------------------------------------------------------------- read side
    @override
    def open(
        self, path: str, map_location: Any, *, optimizer: bool = False, editable: bool = True
    ) -> tuple[dict, Any]:
        """A sharded directory that the caller will not edit is read in place, like a raw
        ``dcp.load``: everything but the tensors here, every check next, and only then (in
        ``restore``) DCP reads the shards straight into the model's and optimizer's own
        tensors (no second copy). A refused resume changes nothing; a read error after the
        checks (the files changed since they were verified) leaves the model partly read,
        and the resume raises. With a ``callback`` (``editable``: it may read or edit the
        tensors) they are read into new tensors first. At a URL the manifest is read once
        (``formats.detect``, passed on)."""
        detected = detect(path, self.backend_args)
        if not editable and detected[0] == 'sharded':
            header = read_sharded_header(
                path, optimizer=optimizer, backend_args=self.backend_args, found=detected[1]
            )
            if header is not None:
                return header  # (the checkpoint without tensors, DCP's metadata)
        return self._read(path, map_location, detected), None

    @override
    def read(self, path: str, map_location: Any) -> dict:
        """A sharded directory read whole into new tensors laid out like the live ones; a
        Hugging Face one (``formats.PIECEWISE``): each rank reads only its pieces; any other
        format: the default read."""
        return self._read(path, map_location, detect(path, self.backend_args))

    def _read(self, path: str, map_location: Any, detected: tuple[str | None, Any]) -> dict:
        name, found = detected
        if name in PIECEWISE and not is_url(path):
            return read_like(path, name, self.live_state(False)[0])
        if name != 'sharded':
            return super().read(path, map_location)
        model_sd, optim_sd = self.live_state(True)
        return load_sharded_checkpoint(
            path, model_sd, optim_sd, backend_args=self.backend_args, found=found
        )

    @override
    def restore(self, path: str, checkpoint: dict, opened: Any, *, optimizer: bool) -> None:
        """Every check passed: DCP reads the shards into the live state dicts, which the
        checkpoint the resume returns then holds (its ``optimizer`` too, when resumed)."""
        metadata = opened
        if metadata is None:  # read whole already
            return
        model_sd, optim_sd = self.live_state(optimizer)
        state: dict[str, Any] = {'state_dict': model_sd}
        if optimizer:
            state['optimizer'] = optim_sd
        load_sharded_in_place(path, state, metadata=metadata)
        checkpoint['state_dict'] = state['state_dict']
        if optimizer:
            counters = {
                k: v
                for k, v in checkpoint['optimizer'].items()
                if k not in ('state', 'param_groups')
            }
            checkpoint['optimizer'] = {**state['optimizer'], **counters}
