"""FSDPStrategy's checkpoint parts (``strategies/parts.py``'s, where FSDP's state differs):
the model's says how the mesh changed, the optimizer's checks a pipeline stage's share of the
saved groups, and the pending gradients are each rank's unsharded ones (each rank's own file
in a sharded directory), refused across tensor-parallel sizes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from stratagem import env
from stratagem.checkpoint.checkpointer import LoadContext

from ..parts import ModelPart, OptimizerPart, PendingGradsPart, wrappers_of
from .grad_sync import pending_grads, set_pending_grads
from .mesh import MeshSpec

__all__ = ['FSDPModelPart', 'FSDPOptimizerPart', 'FSDPPendingGradsPart']


class FSDPModelPart(ModelPart):
    """The model's part; rank 0 first says once how the mesh differs from the saving run's
    (the shards are resharded as they are read).

    Args:
        save, load, module: ``ModelPart``'s.
        mesh: this run's mesh.
        logger: where the change is said.
    """

    def __init__(
        self,
        save: Callable[[], Any],
        load: Callable[[Mapping, str], None],
        module: Callable[[], nn.Module],
        *,
        mesh: MeshSpec,
        logger: Any,
    ) -> None:
        super().__init__(save, load, module)
        self.mesh, self.logger = mesh, logger

    @override
    def restore(self, value: Any, context: LoadContext) -> None:
        self._say_mesh_change(context.path, context.meta)
        super().restore(value, context)

    def _say_mesh_change(self, path: str, meta: Mapping) -> None:
        saved = meta.get('mesh')
        if saved is None:  # before meshes, or another backend: sharded over the world
            saved = {'shard': int(meta.get('world_size', 1))}
        try:
            before = MeshSpec(**saved)
        except TypeError:
            return
        if before != self.mesh and env.get_rank() == 0:
            self.logger.warning(
                f'{path} was saved on the mesh {before.describe()} '
                f'({before.world_size} rank(s)); this run has {self.mesh.describe()} '
                f'({env.get_world_size()}): parameters and optimizer state are resharded as '
                'they are read'
            )


class FSDPOptimizerPart(OptimizerPart):
    """The optimizer's part; under a pipeline its check compares this stage's share of the
    saved groups (a checkpoint holds the whole model's).

    Args:
        optim_wrapper, save, load: ``OptimizerPart``'s.
        stage_names: under a pipeline, the names of this stage's parameters; None without.
    """

    def __init__(
        self,
        optim_wrapper: Any,
        save: Callable[[], Any],
        load: Callable[[Mapping], None],
        *,
        stage_names: Callable[[], set[str]] | None = None,
    ) -> None:
        super().__init__(optim_wrapper, save, load)
        self.stage_names = stage_names

    @override
    def check(self, value: Any, context: LoadContext) -> None:
        if self.stage_names is not None and isinstance(value, Mapping):
            mine = self.stage_names()
            groups = [
                {**g, 'params': [p for p in g.get('params', ()) if p in mine]}
                for g in value.get('param_groups') or []
                if isinstance(g, Mapping)
            ]
            value = {**value, 'param_groups': [g for g in groups if g['params']]}
        super().check(value, context)


class FSDPPendingGradsPart(PendingGradsPart):
    """Mid accumulation window: each rank's unsynchronised, unsharded gradients, by name.

    Args:
        optim_wrapper: the prepared optim wrapper.
        model: the FSDP-sharded model (it holds the gradients).
        full: whether the strategy saves one consolidated file now (``state_dict_type=
            'full'``: every rank's gradients gathered into it), else a sharded directory
            (each rank's own, written to its own file).
        tensor: this run's tensor-parallel size (slices of another size do not convert).
        pipelined: under a pipeline the schedule has reduced the window's gradients
            already: a save waits for the window's end.
    """

    def __init__(
        self,
        optim_wrapper: Any,
        model: nn.Module,
        *,
        full: Callable[[], bool],
        tensor: int,
        pipelined: bool,
    ) -> None:
        super().__init__(optim_wrapper, lambda: model)
        self.model = model
        self.full, self.tensor, self.pipelined = full, tensor, pipelined

    @override
    def pending(self) -> dict[str, torch.Tensor] | None:
        wrappers = wrappers_of(self.optim_wrapper)
        if all(w.should_update() for w in wrappers):
            return None
        if self.pipelined:
            wrapper = wrappers[0]
            raise ValueError(
                f'a pipelined run saves at an update boundary: this is micro-step '
                f'{wrapper.inner_count} inside a window of accumulative_counts='
                f'{wrapper.accumulative_counts}, whose gradients the schedule has already '
                'reduced; save after the window ends'
            )
        return pending_grads(self.model)

    @override
    def put(self, grads: Mapping[str, torch.Tensor]) -> None:
        set_pending_grads(self.model, grads)

    @override
    def state_dict(self) -> list | dict | None:
        """Sharded: this rank's own (the storage writes each rank's to its own file);
        ``'full'``: every rank's, gathered on CPU into the one file."""
        mine = self.pending()
        if mine is None:
            return None
        if self.full():
            return env.all_gather_object({k: v.cpu() for k, v in mine.items()})
        return mine

    @override
    def restore(self, value: Any, context: LoadContext) -> None:
        if value or context.checkpoint.get('partial_grads_fqn'):
            saved_tensor = int((context.meta.get('mesh') or {}).get('tensor', 1))
            if saved_tensor != self.tensor:
                raise ValueError(
                    f'the checkpoint was taken inside an accumulation window on a mesh with '
                    f'tensor={saved_tensor}; this run has tensor={self.tensor}, '
                    "and tensor-parallel ranks' pending gradients are slices that do not "
                    f'convert. Resume it with tensor={saved_tensor}, or from a checkpoint '
                    'saved at an update boundary'
                )
        if isinstance(value, Mapping):  # this rank's own, as its peer copy holds them
            self.put(value)
            return
        super().restore(value, context)
