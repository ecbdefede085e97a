"""FSDPStrategy's pipeline parallelism: ``pipeline=dict(schedule, microbatches, split_points)``
over the mesh's outermost ``pipeline`` dimension (``mesh.py``).

The model follows torchtitan's convention: its forward runs its top-level modules in order
and skips any that is None, so a *stage* is the whole model with the other stages' modules
deleted, and parameter names stay the model's own (checkpoints keep the model's keys). The
units a model splits into are its top-level modules, and the entries of a top-level
``ModuleList`` / ``ModuleDict`` / ``Sequential`` (``blocks.2``); ``split_points`` name the
units where a new stage begins, or a top-level container (its first entry: ``split_positions``
resolves the names, for the strategy and doctor alike). A deleted top-level module becomes
None; a deleted entry of a container is removed with the others keeping their names
(``blocks.2`` stays ``blocks.2``), so the forward must iterate over a container, not index
it. A model that is an ``nn.Sequential`` is such a container itself: its entries are removed.

Everything here is checked before the model passed in is touched (``stage_modules``,
``check_forward``); a forward the static check cannot read is checked at the first
``train_step`` on meta tensors (``dry_run``), on every rank, before any communication.
"""

from __future__ import annotations

import ast
import copy
import difflib
import inspect
import itertools
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .mesh import MeshSpec

__all__ = ['SCHEDULES', 'PipelineRun', 'PipelineSpec', 'parse_pipeline', 'shard_stages']

# schedule name -> (torch class in torch.distributed.pipelining, stage placement): 'one' stage
# per pipeline rank, or 'loop' (several, stage s on rank s % P). Each is measured to give the
# unpipelined model's gradients on CPU with gloo under torch 2.13 (tests/strategies/).
SCHEDULES: dict[str, tuple[str, str]] = {
    'GPipe': ('ScheduleGPipe', 'one'),
    '1F1B': ('Schedule1F1B', 'one'),
    'Interleaved1F1B': ('ScheduleInterleaved1F1B', 'loop'),
    'LoopedBFS': ('ScheduleLoopedBFS', 'loop'),
}
# torch ships these too; they run on CPU, but with FSDP2 under torch 2.13 their split
# backward (input, then weight gradients) leaves gradients that differ from the reference
# (measured: parameters off by 4e-2 after 5 SGD steps), so they are refused by name
_REFUSED = {
    'InterleavedZeroBubble': 'its weight-gradient pass',
    'ZBVZeroBubble': 'its weight-gradient pass',
    'DualPipeV': 'its weight-gradient pass',
}
_KEYS = ('schedule', 'microbatches', 'split_points')
_ALIASES = {'n_microbatches': 'microbatches', 'pipeline_parallel_microbatches': 'microbatches'}
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True)
class PipelineSpec:
    """A validated pipeline: the schedule, microbatches per step, the stage boundaries and the
    number of pipeline ranks (the mesh's ``pipeline`` size)."""

    schedule: str
    microbatches: int
    split_points: tuple[str, ...]
    ranks: int

    @property
    def stages(self) -> int:
        return len(self.split_points) + 1

    @property
    def placement(self) -> str:
        return SCHEDULES[self.schedule][1]

    def schedule_class(self) -> type:
        import torch.distributed.pipelining as pipelining

        return getattr(pipelining, SCHEDULES[self.schedule][0])

    def stage_indices(self, pipeline_rank: int) -> list[int]:
        """The stages pipeline rank ``pipeline_rank`` runs, in order."""
        return list(range(pipeline_rank, self.stages, self.ranks))

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``."""
        return next(r for r in range(self.ranks) if stage in self.stage_indices(r))

    def describe(self) -> str:
        return (
            f'{self.schedule}, {self.stages} stage(s) over {self.ranks} pipeline rank(s), '
            f'{self.microbatches} microbatches'
        )

    # ------------------------------------------------------------------ the model's stages
    def stage_modules(self, model: nn.Module) -> list[list[str]]:
        """Each stage's units (module names), in order; refuses, naming the key, a split
        point that names no unit (listing the candidates), split points out of order, and
        parameters of the root module itself (they would belong to no stage)."""
        name = type(model).__name__
        own = [n for n, _ in model.named_parameters(recurse=False)]
        if own:
            raise ValueError(
                f'pipeline: {name} has parameters of its own ({", ".join(own)}) that belong '
                'to no stage; hold them in a submodule'
            )
        units = model_units(model)
        position = split_positions(model)
        bounds = []
        for point in self.split_points:
            if point not in position:
                raise ValueError(
                    f"pipeline.split_points: '{point}' names no module {name} splits at; "
                    f'{_did_you_mean(point, position)}a split point is a top-level module, a '
                    'top-level ModuleList/ModuleDict/Sequential (its first entry begins the '
                    'stage) or an entry of one: candidates '
                    + ', '.join(n for n, i in position.items() if i > 0)
                )
            bounds.append(position[point])
        if bounds[0] == 0 or any(b <= a for a, b in itertools.pairwise(bounds)):
            named = [
                f'{p!r} begins at {units[b]!r}'
                for p, b in zip(self.split_points, bounds, strict=True)
                if p != units[b]
            ]
            raise ValueError(
                f'pipeline.split_points={list(self.split_points)}: each must come after the '
                f'previous one in {name} (and not be its first module, {units[0]!r}), so '
                f'that no stage is empty; '
                + (f'{", ".join(named)}; ' if named else '')
                + f'the model runs {", ".join(units)}'
            )
        edges = [0, *bounds, len(units)]
        return [units[a:b] for a, b in itertools.pairwise(edges)]

    def check_forward(self, model: nn.Module, stages: Sequence[Sequence[str]]) -> None:
        """Refuse a forward that cannot run a stage: one that calls a top-level module
        some stage deletes without skipping it when None, or indexes a container a split
        point divides. Reads the forward's source; one it cannot read is checked by
        ``dry_run`` at the first step."""
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward)))
        except (OSError, TypeError, SyntaxError):
            return
        guarded: set[str] = set()
        called: set[str] = set()
        indexed: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
                guarded |= _self_attrs(node.test)
            elif isinstance(node, ast.BoolOp):
                guarded |= _self_attrs(node)
            elif isinstance(node, ast.Call) and _is_self_attr(node.func):
                called.add(node.func.attr)  # type: ignore[attr-defined]
            elif isinstance(node, ast.Subscript) and _is_self_attr(node.value):
                indexed.add(node.value.attr)  # type: ignore[attr-defined]
        name = type(model).__name__
        split = {u.split('.')[0] for s in stages for u in s if '.' in u}
        split = {c for c in split if sum(any(u.startswith(c + '.') for u in s) for s in stages) > 1}
        for unit in (u for s in stages for u in s if '.' not in u):
            if unit in called and unit not in guarded:
                raise ValueError(
                    f'pipeline: {name}.forward calls self.{unit} without skipping it when it '
                    f'is None, and every stage but one holds {unit} as None; write e.g. '
                    f"`if self.{unit} is not None: x = self.{unit}(x)` (torchtitan's "
                    "convention: a stage is the model with the other stages' modules deleted)"
                )
        for container in sorted(split & indexed):
            raise ValueError(
                f'pipeline: {name}.forward indexes self.{container}[...], which the split '
                f'points divide between stages (each stage keeps its own entries under their '
                f'names); iterate over it instead: `for block in self.{container}: ...`'
            )

    def keep_stages(self, model: nn.Module, indices: Sequence[int]) -> nn.Module:
        """Delete, in place, the units of every stage but ``indices``; returns ``model``."""
        stages = self.stage_modules(model)
        keep = {u for i in indices for u in stages[i]}
        for unit in (u for s in stages for u in s if u not in keep):
            _delete_unit(model, unit)
        return model

    def stage_view(
        self, model: nn.Module, index: int, stages: Sequence[Sequence[str]]
    ) -> nn.Module:
        """A module that runs stage ``index`` of ``model`` (which may hold several stages;
        ``stages``: every stage's units, from :meth:`stage_modules` on the whole model): a
        shallow copy of the root whose other units are deleted, sharing every kept module,
        parameter and buffer with ``model``."""
        keep = set(stages[index])
        memo: dict[int, Any] = {}
        for unit, module in model.named_children():
            if isinstance(module, _CONTAINERS):
                for key, entry in module.named_children():
                    memo[id(entry)] = entry if f'{unit}.{key}' in keep else None
                    # an entry no stage of this model holds stays deleted
            else:
                memo[id(module)] = module if unit in keep else None
        for tensor in itertools.chain(
            model.parameters(recurse=False), model.buffers(recurse=False)
        ):
            memo[id(tensor)] = tensor
        view = copy.deepcopy(model, memo)
        for unit in (u for i, s in enumerate(stages) if i != index for u in s):
            parent, _, key = unit.rpartition('.')
            owner = model.get_submodule(parent)
            # an entry of a container that ``model`` holds: deepcopy left it None
            if isinstance(owner, _CONTAINERS) and key in dict(owner.named_children()):
                _delete_unit(view, unit)
        return view

    def dry_run(
        self,
        skeleton: nn.Module,
        inputs: tuple,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    ) -> torch.dtype | None:
        """Run every stage of ``skeleton`` (the model on the meta device) in order on one
        microbatch of meta tensors: a stage whose forward fails (a deleted module it does not
        skip) is refused naming it, on every rank alike, before any communication. Returns
        the loss's dtype (None without ``loss_fn``)."""
        args = tuple(_to_meta(x) for x in inputs)
        stages = self.stage_modules(skeleton)
        for index, units in enumerate(stages):
            view = self.stage_view(skeleton, index, stages)
            try:
                out = view(*args)
            except Exception as exc:  # any failure of the user's forward is the refusal
                raise ValueError(
                    f'pipeline: stage {index} ({", ".join(units)}) of '
                    f'{type(skeleton).__name__} fails on its own: {type(exc).__name__}: '
                    f"{exc}. A stage is the model with the other stages' modules deleted "
                    '(None, or removed from their ModuleList): its forward must skip a '
                    "module that is None and take the previous stage's output as input"
                ) from exc
            args = out if isinstance(out, tuple) else (out,)
        if loss_fn is not None:
            loss = loss_fn(args[0] if len(args) == 1 else args, _to_meta(targets))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(
                    'train_step: loss_fn(outputs, targets) must return a scalar tensor (the '
                    f'mean over the microbatch), got {type(loss).__name__}'
                    + (f' of shape {tuple(loss.shape)}' if isinstance(loss, torch.Tensor) else '')
                )
            return loss.dtype
        return None


_REFUSAL = (
    'under a pipeline (FSDPStrategy mesh.pipeline > 1) the schedule runs forward and '
    'backward over the microbatches, so optim_context / update_params cannot run a step: '
    'call loss = strategy.train_step(inputs, targets, loss_fn) instead'
)


class PipelineRun:
    """A pipelined run's steps: this rank's stage modules (stage index → module), the
    schedule over them (built at the first :meth:`step`, which checks the batch), the
    forward-only ones of :meth:`evaluate`, and the meta skeleton of the whole model for the
    first call's dry run."""

    def __init__(
        self,
        spec: PipelineSpec,
        skeleton: nn.Module,
        stages: dict[int, nn.Module],
        mesh: Any,
        device: torch.device,
    ) -> None:
        self.spec = spec
        self.stages = stages
        # the whole model's parameter names, in its order (merged_param_groups sorts by it)
        self.names = [n for n, _ in skeleton.named_parameters()]
        self._skeleton: nn.Module | None = skeleton
        self._mesh = mesh
        self._device = device
        self._schedule: Any = None
        self._batch: int | None = None
        self._dtype: torch.dtype | None = None
        self._loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self._wrapper: Any = None
        self._losses: list[torch.Tensor] = []
        # (batch, microbatches) -> evaluate's schedule
        self._eval_schedules: dict[tuple[int, int], Any] = {}

    def merged_param_groups(self, groups: list[dict]) -> list[dict]:
        """The whole model's param groups from this rank's (FQN-keyed; collective over the
        pipeline ranks): group ``i`` of every stage joined when every stage has the same
        groups with the same hyperparameters (a plain optimizer cfg), else every stage's
        groups side by side (``paramwise_cfg``'s group per parameter); parameters in the
        model's order. What a checkpoint saves, so it loads at any stage count."""
        import torch.distributed as dist

        per_rank: list[Any] = [None] * self.spec.ranks
        dist.all_gather_object(per_rank, groups, group=self._mesh['pipeline'].get_group())
        order = {name: i for i, name in enumerate(self.names)}

        def hyper(g: Mapping) -> dict:
            return {k: v for k, v in g.items() if k != 'params'}

        def key(name: str) -> int:
            return order.get(name, len(order))

        first = per_rank[0]
        try:
            same = all(len(gs) == len(first) for gs in per_rank) and all(
                hyper(a) == hyper(b) for gs in per_rank for a, b in zip(gs, first, strict=True)
            )
        except (RuntimeError, ValueError):  # tensors as hyperparameters: not comparable
            same = False
        if same:
            return [
                {**g, 'params': sorted((p for gs in per_rank for p in gs[i]['params']), key=key)}
                for i, g in enumerate(first)
            ]
        joined = [g for gs in per_rank for g in gs]
        return sorted(joined, key=lambda g: min((key(p) for p in g['params']), default=0))

    def adopt(self, wrapper: Any) -> None:
        """Make the optim wrapper refuse a step of its own (pointing to ``train_step``);
        refuse a loss scaler (float16 AMP), which a schedule's backward would bypass."""
        for w in wrapper.values() if hasattr(wrapper, 'values') else [wrapper]:
            if getattr(w, 'loss_scaler', None) is not None:
                raise ValueError(
                    f'{type(w).__name__}(dtype=float16) scales the loss, but under a '
                    "pipeline the schedule runs backward itself; use dtype='bfloat16' "
                    "(no loss scaling), or FSDP's model_wrapper.mixed_precision"
                )
            if not hasattr(w, 'set_step_owner'):
                raise TypeError(
                    f'{type(w).__name__}: a pipeline needs an OptimWrapper (its scale_loss '
                    'and after_backward run around the schedule)'
                )
            w.set_step_owner(_REFUSAL)

    def step(
        self,
        model: nn.Module,
        wrapper: Any,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    ) -> torch.Tensor:
        """One step over the schedule; see ``FSDPStrategy.train_step``."""
        spec = self.spec
        args, targets = self._tensors(inputs, targets, loss_fn, 'train_step')
        batch, m = args[0].shape[0], spec.microbatches
        if batch % m:
            raise ValueError(
                f"pipeline.microbatches={m} must divide this rank's batch: inputs and "
                f'targets have [{batch}] samples (dimension 0); use a batch size that {m} '
                'divides, or other microbatches'
            )
        self._dry_run(args, targets, loss_fn, batch // m)
        if self._schedule is None:
            self._schedule = self._build(m, train=True)
            self._batch = batch
        elif batch != self._batch:
            raise ValueError(
                f'a pipeline runs microbatches of one size: this batch has {batch} samples, '
                f'the first had {self._batch}; use drop_last=True'
            )
        self._loss_fn, self._wrapper, self._losses = loss_fn, wrapper, []
        first, last = 0 in self.stages, spec.stages - 1 in self.stages
        wrapper.set_step_owner(None)
        try:
            with wrapper.optim_context(model):
                self._schedule.step(*(args if first else ()), target=targets if last else None)
        finally:
            wrapper.set_step_owner(_REFUSAL)
        # the microbatches' losses: the last ones (the first step's shape inference computes
        # one more on uninitialised tensors, which nothing backpropagates)
        loss = self._last_stage_mean(self._losses[-spec.microbatches :])
        # a step guard counts the loss once, on the last stage's ranks
        wrapper.after_backward(loss=loss if last else None)
        return loss

    def evaluate(
        self,
        model: nn.Module,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    ) -> torch.Tensor:
        """One batch's loss, forward only; see ``FSDPStrategy.eval_step``.

        torch's ``schedule.eval`` under ``torch.no_grad`` on a schedule of its own per batch
        size, over stages of its own around the same modules (a stage fixes its microbatch
        shapes at its first batch, and the last validation batch is often shorter): GPipe,
        or LoopedBFS for several stages a rank, which run the forwards as any schedule
        would; the training schedule is left as it is."""
        args, targets = self._tensors(inputs, targets, loss_fn, 'eval_step')
        batch = args[0].shape[0]
        m = self._eval_microbatches(batch)
        self._dry_run(args, targets, loss_fn, batch // m)
        schedule = self._eval_schedules.get((batch, m))
        if schedule is None:
            schedule = self._eval_schedules[batch, m] = self._build(m, train=False)
        for stage in self.stages.values():  # several stages a rank: views with roots of
            stage.training = model.training  # their own, whose mode model.eval() misses
        first, last = 0 in self.stages, self.spec.stages - 1 in self.stages
        losses: list[torch.Tensor] = []
        self._loss_fn = loss_fn
        with torch.no_grad():
            schedule.eval(*(args if first else ()), target=targets if last else None, losses=losses)
        return self._last_stage_mean(losses)

    def _eval_microbatches(self, batch: int) -> int:
        """The most microbatches, up to ``microbatches``, that divide this rank's batch and
        every other rank's: the data-parallel ranks' batches may differ (a validation set's
        shards differ by a sample), and every forward of a sharded stage is a collective over
        them, so they run as many (one all-gather of the sizes when the mesh has more than
        the pipeline)."""
        import torch.distributed as dist

        sizes = [batch]
        if dist.get_world_size() > self.spec.ranks:
            mine = torch.tensor([batch], device=self._device)
            every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            sizes = [int(t) for t in every]
        fits = range(1, min(self.spec.microbatches, *sizes) + 1)
        return max(d for d in fits if all(n % d == 0 for n in sizes))

    def _tensors(
        self, inputs: Any, targets: Any, loss_fn: Any, what: str
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """``(inputs as a tuple, targets)`` on this rank's device, checked: tensors of one
        size along dimension 0, and a ``loss_fn``."""
        if loss_fn is None or targets is None:
            raise ValueError(
                f'{what} under a pipeline needs targets and loss_fn: the last stage '
                'computes loss_fn(outputs, targets) per microbatch'
            )
        args = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
        if not args or not all(isinstance(a, torch.Tensor) for a in (*args, targets)):
            raise TypeError(
                f'{what} under a pipeline takes tensors (inputs a tensor or a tuple of '
                'them, targets a tensor), split into microbatches along dimension 0'
            )
        args = tuple(a.to(self._device) for a in args)
        targets = targets.to(self._device)
        sizes = sorted({a.shape[0] for a in (*args, targets)})
        if len(sizes) > 1:
            raise ValueError(
                f'{what} under a pipeline: inputs and targets have {sizes} samples '
                '(dimension 0), which the schedule cuts into microbatches alike; give '
                'them one batch size'
            )
        return args, targets

    def _dry_run(self, args: tuple, targets: Any, loss_fn: Any, micro: int) -> None:
        """The first call's check of every stage on meta tensors (``dry_run``), once."""
        if self._skeleton is not None:
            self._dtype = self.spec.dry_run(
                self._skeleton, tuple(a[:micro] for a in args), targets[:micro], loss_fn
            )
            self._skeleton = None  # checked: release it

    def _last_stage_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the last stage's microbatch losses, on every pipeline rank."""
        import torch.distributed as dist

        spec = self.spec
        if spec.stages - 1 in self.stages:
            loss = torch.stack(losses).mean().to(self._dtype)
        else:
            loss = torch.zeros((), dtype=self._dtype, device=self._device)
        if spec.ranks > 1:
            dist.broadcast(
                loss,
                group=self._mesh['pipeline'].get_group(),
                group_src=spec.stage_rank(spec.stages - 1),
            )
        return loss

    def _eval_loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._loss_fn is not None
        loss = self._loss_fn(output, target)
        self._losses.append(loss.detach())
        # the mean over microbatches through the loss, not the schedule's scale_grads: that
        # divides every gradient, also those an accumulation window's earlier steps left
        return self._wrapper.scale_loss(loss) / self.spec.microbatches

    def _build(self, microbatches: int, train: bool) -> Any:
        """A schedule over new stages around this rank's modules: the configured one for
        :meth:`step` (``train``), else GPipe or LoopedBFS for :meth:`evaluate`."""
        import warnings

        import torch.distributed.pipelining as pipelining

        # a stage's output is often a view (a Linear over 3-D activations); FSDP warns about
        # in-place ops on it, which the schedule never does: the warning would only repeat
        warnings.filterwarnings('ignore', message=r'FSDP2-wrapped module .* returned a view')
        spec = self.spec
        group = self._mesh['pipeline'].get_group()
        stages = [
            pipelining.PipelineStage(module, index, spec.stages, self._device, group=group)
            for index, module in sorted(self.stages.items())
        ]
        one = spec.placement == 'one'
        if train:
            cls, loss = spec.schedule_class(), self._loss
        else:
            cls = pipelining.ScheduleGPipe if one else pipelining.ScheduleLoopedBFS
            loss = self._eval_loss
        kwargs = dict(n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
        return cls(stages[0], **kwargs) if one else cls(stages, **kwargs)


def shard_stages(
    model: nn.Module,
    spec: PipelineSpec,
    stages: Sequence[Sequence[str]],
    local: Sequence[int],
    *,
    wrap_cfg: Any,
    tp_plan: Any,
    tensor: int,
    build_mesh: Callable[[], Any],
    shard: Callable[..., Any],
) -> tuple[list[nn.Module], Any, list[nn.Module]]:
    """Cut ``model`` to this rank's stages ``local`` and shard each; returns ``(stage
    modules, device mesh, sharded blocks)``. ``FSDPStrategy`` and ``stratagem doctor``'s
    memory estimate (a meta model, torch's fake process group) both shard through it.

    The wrap policy's blocks, the ignored parameters and the tensor-parallel plan are matched
    on the whole model, and the plan checked, before ``build_mesh()`` (a collective) and
    before the model is touched (a stage may hold no block a class name picks, no module a
    pattern names); then ``keep_stages``, a ``stage_view`` per stage when the rank runs
    several, and ``shard(stage, mesh=, blocks=, ignored=, tp_plan=)`` (``shard.py``'s
    ``shard_model`` with the strategy's settings) with each stage's share.
    """
    blocks = wrap_cfg.targets(model)
    ignored = wrap_cfg.ignored_params(model)
    chosen: dict[str, Any] = {}
    if tp_plan is not None:
        tp_plan.check(model, tensor, blocks)
        chosen = tp_plan.resolve(model, tensor)
    mesh = build_mesh()
    spec.keep_stages(model, local)
    views = [model] if len(local) == 1 else [spec.stage_view(model, i, stages) for i in local]
    targets: list[nn.Module] = []
    for view in views:
        own = {id(m) for m in view.modules()}
        held = {id(p) for p in view.parameters()}
        plan = tp_plan
        if tp_plan is not None and tp_plan.fn is None:
            from .tensor_parallel import parse_tensor_parallel_plan

            names = {n for n, _ in view.named_modules()}
            plan = parse_tensor_parallel_plan({n: s for n, s in chosen.items() if n in names})
        targets += shard(
            view,
            mesh=mesh,
            blocks=[b for b in blocks if id(b) in own],
            ignored={p for p in ignored if id(p) in held},
            tp_plan=plan,
        )[2]
    return views, mesh, targets


def model_units(model: nn.Module) -> list[str]:
    """The units a pipeline splits ``model`` into, in order: top-level modules, and the
    entries of top-level containers (a model that is an ``nn.Sequential``: its entries, and
    the entries of those that are containers)."""
    units: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, _CONTAINERS):
            units += [f'{name}.{key}' for key, _ in child.named_children()]
        else:
            units.append(name)
    return units


def split_positions(model: nn.Module) -> dict[str, int]:
    """Every name a split point may take → the index, in :func:`model_units`, of the unit
    where a stage beginning there begins: each unit, and each top-level container that holds
    any (its first entry: ``'blocks'`` is ``'blocks.0'``). The one resolution of split points:
    ``FSDPStrategy`` and ``stratagem doctor`` both read them through it."""
    units = model_units(model)
    index = {u: i for i, u in enumerate(units)}
    positions: dict[str, int] = {}
    for name, child in model.named_children():
        if isinstance(child, _CONTAINERS):
            entries = [f'{name}.{key}' for key, _ in child.named_children()]
            if entries:  # the container, then its entries
                positions[name] = index[entries[0]]
            positions.update((e, index[e]) for e in entries)
        else:
            positions[name] = index[name]
    return positions


def _did_you_mean(point: str, names: Mapping[str, int]) -> str:
    """``"did you mean 'x'? "`` for a split point that names no unit, at the level the user
    wrote: the unit that holds the module named (``'blocks.2.mlp'``: ``'blocks.2'``), else
    the closest name with as many dots (``'blocks.9'``: ``'blocks.3'``; ``'blok'``:
    ``'blocks'``), else the closest of all; ``''`` for none."""
    parts = point.split('.')
    for i in range(len(parts) - 1, 0, -1):
        prefix = '.'.join(parts[:i])
        if prefix in names and not any(n.startswith(prefix + '.') for n in names):
            return f"did you mean '{prefix}'? "
    level = [n for n in names if n.count('.') == point.count('.')]
    close = difflib.get_close_matches(point, level, n=1) or difflib.get_close_matches(
        point, list(names), n=1
    )
    return f"did you mean '{close[0]}'? " if close else ''


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device (no memory: its parameters and buffers are
    meta tensors of the same shapes), for ``dry_run``."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device='meta'), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device='meta')
    return copy.deepcopy(model, memo)


def parse_pipeline(cfg: Any, mesh: MeshSpec, key: str = 'pipeline') -> PipelineSpec | None:
    """``pipeline`` (a dict; None without a pipeline) → :class:`PipelineSpec`.

    Raises ``ValueError`` naming the key and what would fit: a pipeline without
    ``mesh.pipeline`` (or the reverse), an unknown key or schedule, ``microbatches`` not a
    positive int, ``split_points`` missing or not giving the stages the schedule runs on
    ``mesh.pipeline`` ranks (one per rank; two or more per rank for the looped schedules;
    exactly two for the V schedules).
    """
    if cfg is None:
        if mesh.pipeline > 1:
            raise ValueError(
                f'mesh.pipeline={mesh.pipeline} needs the stages: give '
                "pipeline=dict(split_points=[...], microbatches=M, schedule='1F1B') "
                '(split_points: the module names where stages 2, 3, ... begin)'
            )
        return None
    if not isinstance(cfg, Mapping):
        raise TypeError(
            f"{key}={cfg!r}: give a dict, e.g. dict(schedule='1F1B', microbatches=4, "
            "split_points=['layers.2'])"
        )
    cfg = dict(cfg)
    for alias, name in _ALIASES.items():
        if alias in cfg:
            if name in cfg:
                raise ValueError(f'{key}: {alias!r} and {name!r} both set {name}; give one')
            cfg[name] = cfg.pop(alias)
    unknown = sorted(set(cfg) - set(_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], _KEYS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ''
        raise ValueError(f'{key}: unknown key(s) {unknown}{hint}; valid: {", ".join(_KEYS)}')
    if mesh.pipeline == 1:
        raise ValueError(
            f'{key}={cfg!r} needs a pipeline dimension in the mesh: '
            'mesh=dict(pipeline=P, ...) with P the number of pipeline ranks'
        )
    schedule = _schedule_name(cfg.get('schedule', '1F1B'), key)
    splits = cfg.get('split_points')
    if isinstance(splits, str):
        splits = [splits]
    if (
        not isinstance(splits, (list, tuple))
        or not splits
        or not all(isinstance(s, str) and s for s in splits)
    ):
        raise ValueError(
            f'{key}.split_points={splits!r}: give the names of the modules where stages 2, '
            f"3, ... begin, e.g. split_points=['layers.2'] for 2 stages"
        )
    if len(set(splits)) != len(splits):
        raise ValueError(f'{key}.split_points={list(splits)}: a split point is given twice')
    stages, ranks = len(splits) + 1, mesh.pipeline
    placement = SCHEDULES[schedule][1]
    one = placement == 'one'
    if (stages != ranks) if one else (stages % ranks or stages < 2 * ranks):
        want = ranks if one else 2 * ranks
        raise ValueError(
            f"{key}: schedule '{schedule}' runs "
            f'{"exactly one stage" if one else "the same number of stages, two or more,"} '
            f'per pipeline rank; mesh.pipeline={ranks} with {len(splits)} split point(s) '
            f'gives {stages} stages, which do not divide into the ranks so: give '
            f'{want - 1} split point(s) ({want} stages)'
            + ('' if one else f' or a multiple of {ranks} stages')
            + f", or schedule='{'Interleaved1F1B' if one else '1F1B'}'"
        )
    microbatches = cfg.get('microbatches', stages)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(
            f'{key}.microbatches={microbatches!r}: an int >= 1 that divides the local batch '
            f'(at least {ranks} keeps every pipeline rank busy)'
        )
    return PipelineSpec(schedule, microbatches, tuple(splits), ranks)


def _schedule_name(value: Any, key: str) -> str:
    if isinstance(value, str):
        wanted = value.lower().removeprefix('schedule')
        for name, (cls, _) in SCHEDULES.items():
            if wanted in (name.lower(), cls.lower().removeprefix('schedule')):
                return name
        for name, why in _REFUSED.items():
            if wanted == name.lower():
                raise ValueError(
                    f'{key}.schedule={value!r}: with FSDP2 under torch 2.13 {why} gives '
                    'gradients that differ from the unpipelined model (measured), so it is '
                    f'not offered; use one of {", ".join(SCHEDULES)}'
                )
    raise ValueError(
        f'{key}.schedule={value!r}: unknown; valid: {", ".join(SCHEDULES)} '
        "(torch's pipelining schedules that run on CPU and GPU)"
    )


def _delete_unit(model: nn.Module, unit: str) -> None:
    parent, _, key = unit.rpartition('.')
    owner = model.get_submodule(parent)
    if isinstance(owner, _CONTAINERS):  # an entry of a container: removed, the others keep
        delattr(owner, key)  # their names (a model that is a Sequential: its own entries)
    else:  # a top-level module: None, which the forward skips
        setattr(owner, key, None)


def _is_self_attr(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == 'self'
    )


def _self_attrs(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if _is_self_attr(n)}  # type: ignore[attr-defined]


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device='meta')
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _to_meta(v) for k, v in value.items()}
    return value
