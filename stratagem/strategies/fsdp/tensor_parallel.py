"""FSDPStrategy's ``tensor_parallel_plan``: which modules split their matmuls over the mesh's
``tensor`` dimension, checked against the model before anything is built.

A plan is a dict from module-name patterns (``fnmatch`` over ``model.named_modules()``, e.g.
``'blocks.*.fc1'``) to a style:

- ``'colwise'``: a ``Linear``'s output features (an ``Embedding``'s embedding dimension) are
  split; the output is this rank's slice of the last dimension;
- ``'rowwise'``: a ``Linear``'s input features (an ``Embedding``'s rows) are split; the partial
  outputs are summed over the tensor group, so the output is whole again;
- ``'sequence'``: sequence parallelism for a norm (or any module whose parameters stay whole):
  it runs on this rank's slice of the sequence (dimension 1). Modules with ``'sequence'`` must
  sit inside a block of ``auto_wrap_policy``; such a block takes its input split along the
  sequence (a local slice, no communication) and returns it whole (an all-gather), and inside
  it ``'colwise'`` gathers the sequence before the matmul and ``'rowwise'`` reduce-scatters
  its output along the sequence (Megatron-style sequence parallelism).

A ``torch.distributed.tensor.parallel.ParallelStyle`` object is accepted as a style, and a
callable ``parallelize_fn(model, mesh)`` (``mesh``: the tensor dimension's ``DeviceMesh``)
replaces the dict for anything else. A pattern that matches no module, a module matched twice,
a style on a module it cannot split, or a dimension that the tensor size does not divide is an
error naming the key, the value and what would fit.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ['TensorParallelPlan', 'check_plan_fits_mesh', 'parse_tensor_parallel_plan']

KEY = 'tensor_parallel_plan'
STYLES = ('colwise', 'rowwise', 'sequence')


@dataclass
class TensorParallelPlan:
    """A validated plan: ``entries`` (pattern → style name or ParallelStyle) or ``fn``."""

    entries: dict[str, Any] = field(default_factory=dict)
    fn: Callable[[nn.Module, Any], Any] | None = None

    @property
    def sequence_parallel(self) -> bool:
        return any(style == 'sequence' for style in self.entries.values())

    def resolve(self, model: nn.Module, tensor: int) -> dict[str, Any]:
        """Module name → style name (or ParallelStyle), every pattern expanded over
        ``model`` and checked; raises ``ValueError`` naming the pattern and the module."""
        if self.fn is not None:
            return {}
        names = [n for n, _ in model.named_modules() if n]
        modules = dict(model.named_modules())
        chosen: dict[str, Any] = {}
        for pattern, style in self.entries.items():
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                close = difflib.get_close_matches(pattern, names, n=3)
                shown = names[:20] + ([f'... ({len(names) - 20} more)'] if len(names) > 20 else [])
                raise ValueError(
                    f'{KEY}: pattern {pattern!r} matches no module of '
                    f'{type(model).__name__}'
                    + (f' (did you mean {", ".join(map(repr, close))}?)' if close else '')
                    + f'; module names: {shown}'
                )
            for name in matched:
                if name in chosen and chosen[name] != style:
                    raise ValueError(
                        f'{KEY}: module {name!r} is matched with {chosen[name]!r} and by '
                        f'{pattern!r} with {style!r}; give each module one style'
                    )
                _check_module(name, modules[name], style, pattern, tensor)
                chosen[name] = style
        return chosen

    def check(self, model: nn.Module, tensor: int, blocks: list[nn.Module]) -> None:
        """Every check of :meth:`apply`, without building anything (``model`` may be on
        the meta device); a module with a ``check_tensor_parallel(tensor)`` method (e.g.
        attention heads that ``tensor`` must divide) is asked too."""
        for module in model.modules():
            own = getattr(module, 'check_tensor_parallel', None)
            if callable(own):
                own(tensor)
        self.blocks_needing_sequence_split(self.resolve(model, tensor), model, blocks)

    def blocks_needing_sequence_split(
        self, chosen: Mapping[str, Any], model: nn.Module, blocks: list[nn.Module]
    ) -> list[nn.Module]:
        """Under sequence parallelism: the ``auto_wrap_policy`` blocks holding a
        ``'sequence'`` module (each takes its input split along the sequence)."""
        if not self.sequence_parallel:
            return []
        modules = dict(model.named_modules())
        block_names = {id(b): n for n, b in model.named_modules() if any(b is x for x in blocks)}
        out: list[nn.Module] = []
        for name, style in chosen.items():
            if style != 'sequence':
                continue
            owners = [b for b in blocks if name.startswith(block_names[id(b)] + '.')]
            if not owners:
                raise ValueError(
                    f"{KEY}: {name!r} is 'sequence' but is not inside a block of "
                    'model_wrapper.auto_wrap_policy; sequence parallelism runs inside the '
                    'sharded blocks (they split their input along the sequence): add the '
                    f"block's class to auto_wrap_policy (module {type(modules[name]).__name__} "
                    'is not enough on its own)'
                )
            owner = owners[-1]  # the innermost block
            if all(owner is not b for b in out):
                out.append(owner)
        return out

    def apply(self, model: nn.Module, mesh: Any, blocks: list[nn.Module]) -> None:
        """Split the modules over ``mesh`` (the tensor dimension); before ``fully_shard``."""
        if self.fn is not None:
            self.fn(model, mesh)
            return
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        chosen = self.resolve(model, mesh.size())
        split_blocks = self.blocks_needing_sequence_split(chosen, model, blocks)
        sp = self.sequence_parallel
        styles: dict[str, Any] = {}
        for name, style in chosen.items():
            if style == 'colwise':
                styles[name] = ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel()
            elif style == 'rowwise':
                styles[name] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
            elif style == 'sequence':
                styles[name] = SequenceParallel()
            else:
                styles[name] = style
        for block in split_blocks:
            parallelize_module(
                block,
                mesh,
                PrepareModuleInput(
                    input_layouts=(Replicate(),),
                    desired_input_layouts=(Shard(1),),
                    use_local_output=True,
                ),
            )
        parallelize_module(model, mesh, styles)
        for block in split_blocks:  # last: its output hook runs after the inner ones
            parallelize_module(
                block,
                mesh,
                PrepareModuleOutput(
                    output_layouts=(Shard(1),),
                    desired_output_layouts=(Replicate(),),
                    use_local_output=True,
                ),
            )


def parse_tensor_parallel_plan(plan: Any) -> TensorParallelPlan | None:
    """``tensor_parallel_plan`` → :class:`TensorParallelPlan` (None when not given)."""
    if plan is None:
        return None
    if callable(plan) and not isinstance(plan, Mapping):
        return TensorParallelPlan(fn=plan)
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            f'{KEY}={plan!r}: give a dict of module-name patterns to styles, e.g. '
            "{'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}, or a callable "
            'parallelize_fn(model, mesh)'
        )
    from torch.distributed.tensor.parallel import ParallelStyle

    entries: dict[str, Any] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f'{KEY}: {pattern!r} is not a module-name pattern (a str)')
        if isinstance(style, ParallelStyle):
            entries[pattern] = style
            continue
        if style not in STYLES:
            close = difflib.get_close_matches(str(style), STYLES, n=1)
            raise ValueError(
                f'{KEY}[{pattern!r}]={style!r} is not a style'
                + (f'; did you mean {close[0]!r}?' if close else '')
                + f'; valid: {", ".join(map(repr, STYLES))} or a ParallelStyle object'
            )
        entries[pattern] = style
    return TensorParallelPlan(entries=entries)


def check_plan_fits_mesh(plan: TensorParallelPlan | None, spec: Any, mesh_cfg: Any) -> None:
    """A plan needs ``tensor > 1`` and ``tensor > 1`` needs a plan."""
    if plan is not None and spec.tensor == 1:
        raise ValueError(
            f'{KEY} is given but mesh={mesh_cfg!r} has no tensor dimension (tensor=1), so '
            'nothing would be split; add tensor=T to the mesh (e.g. dict(shard='
            f'{max(spec.world_size // 2, 1)}, tensor=2)) or remove {KEY}'
        )
    if plan is None and spec.tensor > 1:
        raise ValueError(
            f'mesh={mesh_cfg!r} has tensor={spec.tensor} but no {KEY} says which modules to '
            f"split; give one, e.g. {{'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}}, "
            'or drop tensor from the mesh'
        )


def _check_module(name: str, module: nn.Module, style: Any, pattern: str, tensor: int) -> None:
    where = f'{KEY}[{pattern!r}]={style!r}: module {name!r} ({type(module).__name__})'
    if style == 'sequence' or not isinstance(style, str):
        return
    if isinstance(module, nn.Linear):
        dim, what = (
            (module.out_features, 'out_features')
            if style == 'colwise'
            else (module.in_features, 'in_features')
        )
    elif isinstance(module, nn.Embedding):
        dim, what = (
            (module.embedding_dim, 'embedding_dim')
            if style == 'colwise'
            else (module.num_embeddings, 'num_embeddings')
        )
    else:
        raise ValueError(
            f"{where}: 'colwise' and 'rowwise' split nn.Linear or nn.Embedding modules; "
            "match those (e.g. a pattern ending in the Linear's name), or pass a "
            'ParallelStyle object or a parallelize_fn for other modules'
        )
    if dim % tensor:
        fits = [d for d in range(2, dim + 1) if dim % d == 0][:6]
        raise ValueError(
            f'{where}: {what}={dim} is not divisible by the tensor size {tensor}; use a '
            f'tensor size that divides it ({fits}) or leave this module out of the plan'
        )
