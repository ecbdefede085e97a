"""FSDPStrategy's checkpoint layout: a sharded DCP directory every rank writes (or one
file under ``state_dict_type='full'``), resumed in place after every check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from typing_extensions import override

from stratagem import checkpoint as ckpt
from stratagem.checkpoint.async_writer import AsyncCheckpointWriter
from stratagem.checkpoint.formats import detect_format

from ..layout import CheckpointLayout, SaveCommit

__all__ = ['FSDPLayout']


class FSDPLayout(CheckpointLayout):
    """FSDPStrategy's checkpoints: a sharded DCP directory (every rank writes its shards,
    ``checkpoint/sharded.py``), or under ``state_dict_type='full'`` the default single file
    (rank 0 holds the gathered state)."""

    strategy: Any  # the FSDPStrategy (strategy.py imports this module)
    _pending: tuple | None = None  # (path, header, DCP metadata, optimizer): read in restore
    _writer_group: Any = None  # DCP's planning group for asynchronous saves (first one)

    @override
    def all_ranks_write(self) -> bool:
        return not self.strategy._full

    @override
    def validate(self, checkpoint: dict) -> list[str]:
        return ckpt.validate_checkpoint_content(ckpt.local_tensors(checkpoint))

    @override
    def stage(
        self, checkpoint: dict, path: str, commit: SaveCommit, writer: AsyncCheckpointWriter | None
    ) -> Callable[[], None]:
        """An asynchronous sharded save runs DCP's planning collectives on the writer
        thread, so they get a gloo group of their own, created here (every rank saves in
        the same order): on the default group they would interleave with the training
        loop's collectives and deadlock."""
        strategy = self.strategy
        if writer is not None and not strategy._full and self._writer_group is None:
            import torch.distributed as dist

            self._writer_group = dist.new_group(backend='gloo')
        return super().stage(checkpoint, path, commit, writer)

    # ------------------------------------------------------------------- read side
    @override
    def open(
        self, filename: str, map_location: Any, *, optimizer: bool = False, editable: bool = True
    ) -> tuple[str, dict]:
        """A sharded directory that the caller will not edit is read in place, like a raw
        ``dcp.load``: everything but the tensors here, every check next, and only then (in
        ``restore``) DCP reads the shards straight into the model's and optimizer's own
        tensors (no second copy). A refused resume changes nothing; a read error after the
        checks (the files changed since they were verified) leaves the model partly read,
        and the resume raises. With a ``callback`` (``editable``: it may read or edit the
        tensors) they are read into new tensors first."""
        self._pending = None
        strategy = self.strategy
        path = strategy.checkpointer.agree(filename)
        if not editable and detect_format(path) == 'sharded':
            header = ckpt.read_sharded_header(path, optimizer=optimizer)
            if header is not None:
                self._pending = (path, *header, optimizer)
                return path, header[0]
        return path, strategy.checkpointer.read(path, map_location)

    @override
    def restore(self, checkpoint: dict, path: str, meta: dict, optimizer: bool) -> None:
        self._say_mesh_change(path, meta)
        if self._pending is not None:  # every check passed: read the shards in place now
            pending, self._pending = self._pending, None
            self.strategy.read_shards_in_place(*pending)
        super().restore(checkpoint, path, meta, optimizer)

    def _say_mesh_change(self, path: str, meta: dict) -> None:
        """Rank 0 says once how the mesh differs from the saving run's (the shards are
        resharded as they are read)."""
        from .mesh import MeshSpec

        strategy = self.strategy
        saved = meta.get('mesh')
        if saved is None:  # before meshes, or another backend: sharded over the world
            saved = {'shard': int(meta.get('world_size', 1))}
        try:
            before = MeshSpec(**saved)
        except TypeError:
            return
        if before != strategy.mesh_spec and strategy.rank == 0:
            strategy.logger.warning(
                f'{path} was saved on the mesh {before.describe()} '
                f'({before.world_size} rank(s)); this run has {strategy.mesh_spec.describe()} '
                f'({strategy.world_size}): parameters and optimizer state are resharded as '
                'they are read'
            )

    @override
    def write(self, checkpoint: dict | None, path: str, commit: SaveCommit) -> None:
        if self.strategy._full:  # one consolidated file (rank 0 holds it; others get None)
            if checkpoint is not None and 'partial_grads' in checkpoint:  # every rank's, by FQN
                checkpoint['partial_grads_fqn'] = checkpoint.pop('partial_grads')
            super().write(checkpoint, path, commit)
            return
        assert checkpoint is not None  # every rank writes its shards
        partial = checkpoint.pop('partial_grads', None)
        ckpt.save_sharded_checkpoint(
            path,
            checkpoint,
            step=checkpoint['meta'].get('iter'),
            partial_grads=partial,
            vote=commit.vote,
            process_group=self._writer_group,
            extra_manifest={
                'strategy': type(self.strategy).__name__,
                'mesh': self.strategy.mesh_spec.as_dict(),
            },
        )
