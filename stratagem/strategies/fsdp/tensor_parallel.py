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

- ``'colwise_rep'``: ``'colwise'`` whose output is gathered, whole on every rank (a model's
  head: the logits);
- ``'rowwise_rep'``: ``'rowwise'`` whose input is whole on every rank (each rank takes its
  slice; an ``Embedding``'s token ids).

A ``torch.distributed.tensor.parallel.ParallelStyle`` object is accepted as a style, and a
callable ``parallelize_fn(model, mesh)`` (``mesh``: the tensor dimension's ``DeviceMesh``)
replaces the dict for anything else. A pattern that matches no module, a module matched twice,
a style on a module it cannot split, or a dimension that the tensor size does not divide is an
error naming the key, the value and what would fit.

``'auto'`` takes the plan a Hugging Face ``transformers`` model declares, read from its
attributes (this module never imports transformers): the model's ``_tp_plan`` (already
prefixed; transformers 5 merges into it the base model's plan and its children's), and
``config.base_model_tp_plan`` (relative to the base model, so prefixed with
``base_model_prefix`` when the model holds its base model there). Its patterns use ``*`` for
one layer index (a ``.``-separated component of digits), as transformers matches them. Its
style names map onto ours (:data:`HF_STYLES`); any other (``packed_*``, ``moe_*``,
``all_reduce``, ...) is refused, naming the module and the style, when the plan is checked,
before the mesh is built. A rule that matches no module is skipped, as transformers skips it.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = [
    'HF_STYLES',
    'TensorParallelPlan',
    'check_plan_fits_mesh',
    'declared_plan',
    'parse_tensor_parallel_plan',
    'tied_parameters',
    'torch_style',
]

KEY = 'tensor_parallel_plan'
STYLES = ('colwise', 'rowwise', 'sequence', 'colwise_rep', 'rowwise_rep')
AUTO = 'auto'
# transformers 5.x's style names (its own classes, registered in its ALL_PARALLEL_STYLES) → ours.
# Its 'colwise' / 'rowwise' are Megatron's split with local outputs, as torch's styles are by
# default; '*_rep' / '_gather_output' / '_split_input' / 'embedding_rowwise' keep the other
# side whole. The rest (fused 'packed_*' weights, experts 'moe_*', 'all_reduce',
# 'replicated_with_grad_allreduce', 'local_params', 'mla_kv_a_proj', ...) have no torch
# ParallelStyle: refused.
HF_STYLES = {
    'colwise': 'colwise',
    'rowwise': 'rowwise',
    'colwise_rep': 'colwise_rep',
    'colwise_gather_output': 'colwise_rep',
    'embedding_colwise': 'colwise_rep',
    'rowwise_rep': 'rowwise_rep',
    'rowwise_split_input': 'rowwise_rep',
    'embedding_rowwise': 'rowwise_rep',
    'sequence_parallel': 'sequence',
}
# transformers' config keys for attention heads: a colwise q/k/v gives each rank heads / T
_HEADS = ('num_attention_heads', 'num_key_value_heads')
_PROJECTIONS = (
    'q_proj',
    'k_proj',
    'v_proj',
    'qkv_proj',
    'query_key_value',
    'query',
    'key',
    'value',
)


@dataclass
class TensorParallelPlan:
    """A validated plan: ``entries`` (pattern → style name or ParallelStyle), ``fn``, or
    ``auto`` (the plan the model declares, read in :meth:`resolve`)."""

    entries: dict[str, Any] = field(default_factory=dict)
    fn: Callable[[nn.Module, Any], Any] | None = None
    auto: bool = False

    def resolve(self, model: nn.Module, tensor: int) -> dict[str, Any]:
        """Module name → style name (or ParallelStyle), every pattern expanded over
        ``model`` and checked; raises ``ValueError`` naming the pattern and the module."""
        if self.fn is not None:
            return {}
        names = [n for n, _ in model.named_modules() if n]
        modules = dict(model.named_modules())
        match: Callable[[str, str], bool] = fnmatch.fnmatchcase
        entries: Mapping[str, Any] = self.entries
        if self.auto:
            entries, match = _auto_entries(model, names), _matches_layer_pattern
        chosen: dict[str, Any] = {}
        for pattern, style in entries.items():
            matched = [n for n in names if match(n, pattern)]
            if not matched and self.auto:  # the model's rule for a module it lacks
                continue
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
        if self.auto and not chosen:
            raise ValueError(
                f"{KEY}='auto': the plan {type(model).__name__} declares "
                f'({dict(entries)}) matches none of its modules; give the plan as a dict'
            )
        return chosen

    def check(self, model: nn.Module, tensor: int, blocks: list[nn.Module]) -> None:
        """Every check of :meth:`apply`, without building anything (``model`` may be on
        the meta device); a module with a ``check_tensor_parallel(tensor)`` method (e.g.
        attention heads that ``tensor`` must divide) is asked too, and under ``'auto'`` the
        heads of the model's config."""
        for module in model.modules():
            own = getattr(module, 'check_tensor_parallel', None)
            if callable(own):
                own(tensor)
        chosen = self.resolve(model, tensor)
        if self.auto:
            _check_heads(model, chosen, tensor)
        tied_parameters(model, chosen)
        self.blocks_needing_sequence_split(chosen, model, blocks)

    def blocks_needing_sequence_split(
        self, chosen: Mapping[str, Any], model: nn.Module, blocks: list[nn.Module]
    ) -> list[nn.Module]:
        """Under sequence parallelism (a ``'sequence'`` module in ``chosen``): the
        ``auto_wrap_policy`` blocks holding a ``'sequence'`` module (each takes its input
        split along the sequence)."""
        if not any(style == 'sequence' for style in chosen.values()):
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
            PrepareModuleInput,
            PrepareModuleOutput,
            parallelize_module,
        )

        chosen = self.resolve(model, mesh.size())
        split_blocks = self.blocks_needing_sequence_split(chosen, model, blocks)
        # inside a block that splits the sequence, 'colwise' gathers it and 'rowwise'
        # reduce-scatters along it; elsewhere both take and give whole sequences
        in_split = {id(m) for b in split_blocks for m in b.modules() if m is not b}
        modules = dict(model.named_modules())
        styles = {
            name: torch_style(style, modules[name], sequence_split=id(modules[name]) in in_split)
            for name, style in chosen.items()
        }
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
        ties = tied_parameters(model, chosen)
        parallelize_module(model, mesh, styles)
        for holders in ties:  # each module got its own copy: one parameter again
            first_module, first_attr = holders[0]
            param = getattr(modules[first_module], first_attr)
            for module_name, attr in holders[1:]:
                setattr(modules[module_name], attr, param)
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


def torch_style(style: Any, module: nn.Module, sequence_split: bool = False) -> Any:
    """A plan's style name → torch's ``ParallelStyle`` for ``module`` (a ParallelStyle
    object is returned as it is). Outputs are local tensors (``use_local_output``, torch's
    default and what transformers' styles give): a colwise projection's output is this rank's
    heads, which Llama-style attention views as ``(..., -1, head_dim)``. ``sequence_split``:
    the module runs inside a block whose input is split along the sequence (dimension 1)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    if not isinstance(style, str):
        return style
    if style == 'sequence':
        return SequenceParallel()
    if style == 'colwise':
        return ColwiseParallel(input_layouts=Shard(1)) if sequence_split else ColwiseParallel()
    if style == 'colwise_rep':
        return ColwiseParallel(
            input_layouts=Shard(1) if sequence_split else Replicate(), output_layouts=Replicate()
        )
    # rowwise: an Embedding's input is token ids, whole on every rank (torch's default input
    # layout, the last dimension split, would gather the ids of the ranks instead)
    whole_input = style == 'rowwise_rep' or isinstance(module, nn.Embedding)
    out = Shard(1) if sequence_split else Replicate()
    if whole_input:
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
    return RowwiseParallel(output_layouts=out)


def _placement(module: nn.Module, style: Any, attr: str) -> str:
    """Where ``style`` puts ``module``'s parameter ``attr`` on the tensor dimension."""
    if style == 'sequence':
        return 'whole'
    if not isinstance(style, str):
        return f'as {type(style).__name__} puts it'
    colwise = style.startswith('colwise')
    if isinstance(module, nn.Embedding):
        return 'split on dim 1' if colwise else 'split on dim 0'
    if attr == 'bias':
        return 'split on dim 0' if colwise else 'whole'
    return 'split on dim 0' if colwise else 'split on dim 1'


def tied_parameters(model: nn.Module, chosen: Mapping[str, Any]) -> list[list[tuple[str, str]]]:
    """The parameters that several modules share (tied weights: a head and its input
    embedding) and the plan splits, as lists of ``(module name, attribute)``; the plan's
    owner of each comes first. torch's styles give each module its own copy, so
    :meth:`TensorParallelPlan.apply` ties them again; a tie the plan splits in two ways, or
    splits in one module and not another, is refused naming the modules."""
    holders: dict[int, list[tuple[str, str]]] = {}
    modules = dict(model.named_modules())  # a module reachable twice: once, as resolve names it
    for name, module in modules.items():
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(param), []).append((name, attr))
    ties = []
    for group in holders.values():
        split = [(n, a) for n, a in group if n in chosen]
        if len(group) < 2 or not split:
            continue
        where = {
            f'{n}.{a}': _placement(modules[n], chosen[n], a) if n in chosen else 'not in the plan'
            for n, a in group
        }
        if len(set(where.values())) > 1:
            said = ', '.join(f'{k} ({v})' for k, v in where.items())
            raise ValueError(
                f'{KEY}: {said} are one parameter (tied weights), but the plan would leave '
                'its copies placed differently over the tensor dimension and untied; split '
                "every module that holds it the same way (e.g. a head 'colwise_rep' and its "
                "embedding 'rowwise_rep': both split the vocabulary), or untie the weights"
            )
        ties.append(split + [h for h in group if h not in split])
    return ties


def declared_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan a ``transformers`` model declares, prefixed from the model
    (transformers' names and ``*`` patterns, unmapped): ``config.base_model_tp_plan`` under
    ``base_model_prefix`` (when the model holds its base model there), then the model's
    ``_tp_plan`` (already prefixed; it wins where both name a pattern). Empty when the model
    declares none. Duck-typed: transformers is not imported."""
    config = getattr(model, 'config', None)
    base = getattr(config, 'base_model_tp_plan', None) or {}
    prefix = getattr(model, 'base_model_prefix', '') or ''
    holder = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    lead = f'{prefix}.' if isinstance(holder, nn.Module) and holder is not model else ''
    plan = {f'{lead}{k}': v for k, v in dict(base).items()}
    plan.update(dict(getattr(model, '_tp_plan', None) or {}))
    return plan


def _matches_layer_pattern(name: str, pattern: str) -> bool:
    """transformers' matching: a ``*`` stands for one component of digits (a layer index)."""
    return '.'.join('*' if part.isdigit() else part for part in name.split('.')) == pattern


def _auto_entries(model: nn.Module, names: list[str]) -> dict[str, str]:
    """The model's declared plan in our style names; an unmapped style is refused naming the
    module(s) it would split (or the pattern's parameter) and the style."""
    plan = declared_plan(model)
    if not plan:
        raise ValueError(
            f"{KEY}='auto' takes the plan a transformers model declares (its _tp_plan, or "
            'config.base_model_tp_plan under base_model_prefix); '
            f'{type(model).__name__} declares none; give the plan as a dict, e.g. '
            "{'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'}"
        )
    entries: dict[str, str] = {}
    for pattern, style in plan.items():
        ours = HF_STYLES.get(style) if isinstance(style, str) else None
        if ours is None:
            params = [n for n, _ in model.named_parameters()]
            where = [n for n in names + params if _matches_layer_pattern(n, pattern)]
            shown = where[:3] + ([f'... ({len(where) - 3} more)'] if len(where) > 3 else [])
            raise ValueError(
                f"{KEY}='auto': {type(model).__name__} declares {pattern!r}: {style!r} "
                f'(module {", ".join(map(repr, shown)) if shown else "none present"}); '
                f"transformers' style {style!r} has no torch ParallelStyle here (mapped: "
                f'{", ".join(map(repr, HF_STYLES))}); give the plan as a dict with '
                'ParallelStyle objects, or a parallelize_fn(model, mesh), for this model'
            )
        entries[pattern] = ours
    return entries


def _check_heads(model: nn.Module, chosen: Mapping[str, Any], tensor: int) -> None:
    """A colwise split of q/k/v hands each rank ``heads / tensor`` whole heads: the config's
    head counts must divide by the tensor size (the projections' widths may divide when
    the heads do not)."""
    if not any(
        style == 'colwise' and name.rsplit('.', 1)[-1] in _PROJECTIONS
        for name, style in chosen.items()
    ):
        return
    config = getattr(model, 'config', None)
    for attr in _HEADS:
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and not isinstance(heads, bool) and heads % tensor:
            fits = [d for d in range(2, heads + 1) if heads % d == 0]
            raise ValueError(
                f"{KEY}='auto': {type(model).__name__}'s config.{attr}={heads} is not "
                f'divisible by the tensor size {tensor}: a colwise attention projection gives '
                f'each rank whole heads; use a tensor size that divides it ({fits})'
            )


def parse_tensor_parallel_plan(plan: Any) -> TensorParallelPlan | None:
    """``tensor_parallel_plan`` → :class:`TensorParallelPlan` (None when not given)."""
    if plan is None:
        return None
    if plan == AUTO:
        return TensorParallelPlan(auto=True)
    if callable(plan) and not isinstance(plan, Mapping):
        return TensorParallelPlan(fn=plan)
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            f'{KEY}={plan!r}: give a dict of module-name patterns to styles, e.g. '
            "{'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}, a callable "
            "parallelize_fn(model, mesh), or 'auto' (the plan a transformers model declares)"
        )
    entries: dict[str, Any] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f'{KEY}: {pattern!r} is not a module-name pattern (a str)')
        if not isinstance(style, str):  # torch's DTensor stack is imported only for objects
            from torch.distributed.tensor.parallel import ParallelStyle

            if isinstance(style, ParallelStyle):
                entries[pattern] = style
                continue
        if style not in STYLES:
            close = difflib.get_close_matches(str(style), STYLES, n=1)
            if isinstance(style, str) and style in HF_STYLES:  # transformers' name
                close = [HF_STYLES[style]]
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
            f"split; give one, e.g. {{'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}} "
            "('auto' for a transformers model: the plan it declares), or drop tensor from the "
            'mesh'
        )


def _check_module(name: str, module: nn.Module, style: Any, pattern: str, tensor: int) -> None:
    where = f'{KEY}[{pattern!r}]={style!r}: module {name!r} ({type(module).__name__})'
    if style == 'sequence' or not isinstance(style, str):
        return
    colwise = style.startswith('colwise')  # 'colwise_rep' splits as 'colwise' does
    if isinstance(module, nn.Linear):
        dim, what = (
            (module.out_features, 'out_features')
            if colwise
            else (module.in_features, 'in_features')
        )
    elif isinstance(module, nn.Embedding):
        dim, what = (
            (module.embedding_dim, 'embedding_dim')
            if colwise
            else (module.num_embeddings, 'num_embeddings')
        )
    else:
        raise ValueError(
            f"{where}: 'colwise' and 'rowwise' (and their '_rep' forms) split nn.Linear or "
            'nn.Embedding modules; '
            "match those (e.g. a pattern ending in the Linear's name), or pass a "
            'ParallelStyle object or a parallelize_fn for other modules'
        )
    if dim % tensor:
        fits = [d for d in range(2, dim + 1) if dim % d == 0][:6]
        raise ValueError(
            f'{where}: {what}={dim} is not divisible by the tensor size {tensor}; use a '
            f'tensor size that divides it ({fits}) or leave this module out of the plan'
        )
