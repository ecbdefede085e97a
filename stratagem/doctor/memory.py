"""``stratagem doctor``'s memory estimate: the peak memory per device of one training step of
the config at the given world size, before any real process group or weight exists.

How, per strategy (one process, any world size):

- every strategy: the model is built on the meta device, given fake storage
  (``FakeTensorMode``: shapes and dtypes, no bytes) and runs the loop's step on one fake
  micro batch of the dataset (forward, backward, the optim wrapper's step, as many
  iterations as one accumulation cycle + 1 so that the optimizer state exists), under
  torch's ``MemTracker`` (``_torch.memory_tracker``), which counts every live tensor's storage:
  parameters, gradients, optimizer state, activations and temporaries at the peak;
- FSDP (flat, HSDP, 2-D with tensor parallel): the same under torch's fake process group
  (``init_process_group('fake')``) at the world size, the model sharded on the meta device by
  the strategy's own sequence (``strategies/fsdp/shard.py``: ``model_wrapper`` targets,
  tensor-parallel plan, activation checkpointing, ``fully_shard``) before it gets fake
  storage, measured by ``FSDPMemTracker`` (all-gather and reduce-scatter buffers
  included); the fake group is destroyed afterwards;
- FSDP under a pipeline (``mesh.pipeline``): each pipeline rank measured apart, its stages
  cut from the meta model by the strategy's ``keep_stages`` before ``shard_model``, the
  step as the schedule runs it at its peak (``measure_stage_step``: as many microbatches in
  flight as the schedule holds, a non-last stage's backward fed a gradient of its output's
  shape), the estimate the largest rank's peak (the note names the rank and its stages);
- DDP: the single-device measurement plus the reducer's gradient buckets (one more copy of
  the gradients, none with ``gradient_as_bucket_view=True``): DDP's C++ reducer cannot run on
  fake tensors;
- DeepSpeed ZeRO (formulas of the ZeRO paper, from the single-device measurement): stage 1
  divides the optimizer state by the world size, stage 2 the gradients too, stage 3 the
  parameters too; with bf16 the parameters and gradients take 2 bytes and the optimizer keeps
  an fp32 master copy (4 bytes a parameter). DeepSpeed's own bucket buffers are not counted.
- fairscale (OSS + ShardedDDP): as ZeRO stage 2.

:func:`measure_step` is the measurement itself; a test runs it on a real step too (real
tensors, real gloo groups) and compares.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .pipeline import inflight_microbatches, pipeline_spec, split_batch

__all__ = [
    'MemoryChecks',
    'MemoryEstimate',
    'estimate_memory',
    'measure_stage_step',
    'measure_step',
    'parse_size',
    'format_size',
]

_UNITS = {'': 1, 'b': 1, 'k': 10**3, 'm': 10**6, 'g': 10**9, 't': 10**12}
_IUNITS = {'ki': 2**10, 'mi': 2**20, 'gi': 2**30, 'ti': 2**40}
_PARTS = {  # MemTracker / FSDPMemTracker categories -> ours
    'Parameter': 'parameters',
    'Sharded Param': 'parameters',
    'Unsharded Param': 'parameters',
    'Buffer': 'parameters',
    'Gradient': 'gradients',
    'Sharded Grad': 'gradients',
    'Unsharded Grad': 'gradients',
    'Optstate': 'optimizer',
    'OptState': 'optimizer',
}


def parse_size(text: str | int) -> int:
    """``'16GiB'``, ``'80GB'``, ``'512MiB'``, ``'1e9'``, ``1234`` → bytes (GB = 10**9,
    GiB = 2**30)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r'\s*([0-9.eE+]+)\s*([kKmMgGtT]i?)?[bB]?\s*', str(text))
    if not m:
        raise ValueError(
            f'--device-memory {text!r} is not a size; give bytes or a number with a unit, '
            "e.g. '16GiB', '80GB', '512MiB'"
        )
    unit = (m.group(2) or '').lower()
    return int(float(m.group(1)) * (_IUNITS.get(unit) or _UNITS[unit]))


def format_size(n: float) -> str:
    for unit, size in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
        if abs(n) >= size:
            return f'{n / size:.2f} {unit}'
    return f'{int(n)} B'


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per device, its parts (parameters, gradients, optimizer, activations and
    temporaries) and how it was obtained."""

    peak: int
    parts: dict[str, int] = field(default_factory=dict)
    method: str = ''

    def describe(self) -> str:
        parts = ', '.join(f'{k} {format_size(v)}' for k, v in self.parts.items())
        return f'{format_size(self.peak)} ({parts}; {self.method})'


def _loss(output: Any) -> Any:
    if isinstance(output, Mapping):
        return sum(
            v if not isinstance(v, list) else sum(v) for k, v in output.items() if 'loss' in k
        )
    return output


def _forward(model: Any, batch: Any) -> Any:
    preprocess = getattr(model, 'data_preprocessor', None)
    if callable(getattr(model, 'train_step', None)) and callable(preprocess):
        # an mmengine BaseModel, run as its train_step runs it (a config FlexibleRunner runs)
        data = preprocess(batch, True)
        if isinstance(data, Mapping):
            return model(**data, mode='loss')
        return (
            model(*data, mode='loss')
            if isinstance(data, (list, tuple))
            else model(data, mode='loss')
        )
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def _wrappers(optim_wrapper: Any) -> list:
    return list(optim_wrapper.values()) if hasattr(optim_wrapper, 'values') else [optim_wrapper]


def measure_step(model: Any, optim_wrapper: Any, batch: Any, *, fsdp: bool = False) -> dict:
    """Run one accumulation cycle + 1 iterations of the loop's step under torch's memory
    tracker; returns ``{'peak': bytes, part: bytes, ...}`` at the peak (tensors on any device,
    fake or real)."""
    from stratagem._torch import memory_tracker

    wrappers = _wrappers(optim_wrapper)
    tracker = memory_tracker(model, [w.optimizer for w in wrappers], fsdp=fsdp)
    counts = max(int(getattr(w, 'accumulative_counts', 1) or 1) for w in wrappers)
    with tracker:
        for _ in range(counts + 1):
            with optim_wrapper.optim_context(model):
                loss = _loss(_forward(model, batch))
            if len(wrappers) == 1:
                wrappers[0].update_params(loss)
            else:  # OptimWrapperDict: one backward, every optimizer steps
                loss.backward()
                for w in wrappers:
                    w.step()
                    w.zero_grad()
            tracker.reset_mod_stats()  # per-module stats hold one iteration; the peak stays
    return _snapshot(tracker)


def _snapshot(tracker: Any) -> dict:
    """The tracker's peak: ``{'peak': bytes, part: bytes, ...}``."""
    snap = tracker.get_tracker_snapshot('peak')
    out = {'peak': 0, 'parameters': 0, 'gradients': 0, 'optimizer': 0, 'activations': 0}
    for stats in snap.values():
        for key, value in stats.items():
            name = str(getattr(key, 'value', key))
            if name == 'Total':
                out['peak'] += value
            else:
                out[_PARTS.get(name, 'activations')] += value
    return out


def measure_stage_step(
    model: Any,
    optim_wrapper: Any,
    runs: list[tuple[Any, tuple, int]],
    loss: Callable[[Any], Any] | None,
    *,
    fsdp: bool = False,
) -> dict:
    """A pipeline rank's step under torch's memory tracker, as the schedule runs it at its
    peak: for each of its stages in order (``runs``: ``(module, inputs, microbatches)``),
    that many microbatches forward, their activations held; then backward in reverse order
    (the last stage through ``loss(output)``, any other one with a gradient of ones, as if
    the next stage had sent it); then the optim wrapper's update (``after_backward``), one
    accumulation cycle + 1 times. Returns what :func:`measure_step` returns."""
    import torch

    from stratagem._torch import memory_tracker

    wrapper = optim_wrapper
    tracker = memory_tracker(model, [wrapper.optimizer], fsdp=fsdp)
    counts = int(getattr(wrapper, 'accumulative_counts', 1) or 1)
    last = len(runs) - 1
    forwards = _forwards(runs)
    with tracker:
        for _ in range(counts + 1):
            with wrapper.optim_context(model):
                held = forwards()
                for index, out in reversed(held):
                    if index == last and loss is not None:
                        wrapper.scale_loss(loss(out)).backward()
                    else:
                        out.backward(torch.ones_like(out))
            wrapper.after_backward()
            tracker.reset_mod_stats()
    return _snapshot(tracker)


def _forwards(runs: list[tuple[Any, tuple, int]]) -> Any:
    """A module whose one call runs a pipeline rank's forwards (``runs``: ``(stage module,
    inputs, microbatches)``) and returns ``[(run index, output), ...]``: torch's memory
    trackers refuse a module called twice in one iteration unless the calls happen inside
    another module's forward (as a schedule's do, inside its stage)."""
    from torch import nn

    class Microbatches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList(module for module, _, _ in runs)

        def forward(self) -> list[tuple[int, Any]]:
            return [
                (index, module(*inputs))
                for index, (module, inputs, n) in enumerate(runs)
                for _ in range(n)
            ]

    return Microbatches()


def _fake_batch(batch: Any, mode: Any) -> Any:
    import torch

    from stratagem._torch import tree_map

    return tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)


def estimate_memory(cfg: Mapping, nproc: int, batch: Any) -> MemoryEstimate:
    """The estimate for ``cfg`` on ``nproc`` processes with one real micro ``batch`` (its
    shapes are used, not its values). Raises on a config the estimate cannot run."""
    import torch.distributed as dist

    from stratagem.strategies.capabilities import capabilities_of

    strategy = dict(cfg.get('strategy') or {})
    caps = capabilities_of(strategy.get('type'), nproc)
    if caps.fully_shards and nproc > 1:
        if dist.is_initialized():
            raise RuntimeError('a process group already exists; the fake one cannot be made')
        # no store: torch gives the fake backend its own (and registers the backend then)
        dist.init_process_group('fake', rank=0, world_size=nproc)
        try:
            spec = pipeline_spec(strategy, nproc)
            if spec is not None:
                return _pipelined(cfg, batch, strategy, nproc, spec)
            parts = _fake_run(cfg, batch, lambda model: _shard(strategy, nproc, model))
        finally:
            dist.destroy_process_group()
        return _estimate(parts, f'FSDP over a fake process group of {nproc}, FSDPMemTracker')
    parts = _fake_run(cfg, batch, None)
    if caps.deepspeed_config:
        return _zero(parts, strategy, nproc)
    if caps.zero_stage and nproc > 1:
        stage = {'zero_optimization': {'stage': caps.zero_stage}}
        return _zero(parts, stage, nproc, f'ZeRO-{caps.zero_stage} (fairscale OSS)')
    if nproc > 1 or caps.gradient_buckets:
        wrapper = dict(strategy.get('model_wrapper') or {})
        buckets = 0 if wrapper.get('gradient_as_bucket_view') else parts['parameters']
        parts['gradients'] += buckets
        parts['peak'] += buckets
        return _estimate(parts, 'DDP: one fake step + the gradient buckets')
    return _estimate(parts, 'one fake step, MemTracker')


def _estimate(parts: dict, method: str) -> MemoryEstimate:
    peak = parts.pop('peak')
    return MemoryEstimate(peak, {k: v for k, v in parts.items() if v}, method)


def _zero(parts: dict, strategy: Mapping, nproc: int, name: str = '') -> MemoryEstimate:
    from .sharding import deepspeed_config

    ds, _ = deepspeed_config(strategy)
    stage = int((ds.get('zero_optimization') or {}).get('stage', 0))
    bf16 = bool((ds.get('bf16') or {}).get('enabled') or (ds.get('fp16') or {}).get('enabled'))
    p, g, o, a = (parts[k] for k in ('parameters', 'gradients', 'optimizer', 'activations'))
    if bf16:  # 2-byte parameters and gradients; the optimizer keeps an fp32 master copy
        o, p, g = o + p, p // 2, g // 2
    o = o // nproc if stage >= 1 else o
    g = g // nproc if stage >= 2 else g
    p = p // nproc if stage >= 3 else p
    out = {'parameters': p, 'gradients': g, 'optimizer': o, 'activations': a}
    label = name or f'DeepSpeed ZeRO-{stage}{" bf16" if bf16 else ""}'
    return MemoryEstimate(p + g + o + a, out, f'{label}: ZeRO formulas over one fake step')


def _fake_run(cfg: Mapping, batch: Any, shard: Any) -> dict:
    """Build the model on the meta device, optionally shard it there (as FSDPStrategy's
    ``skip_init_weights`` does), give it fake storage, build the optim wrapper as the
    strategy does, and measure the step."""
    import torch

    from stratagem._torch import fake_tensor_mode
    from stratagem.optim import build_optim_wrapper
    from stratagem.registry import MODELS

    with torch.device('meta'):
        model = MODELS.build(dict(cfg['model']))
    fsdp = shard is not None
    if fsdp:  # outside the fake mode: the mesh reads real rank tensors
        model = shard(model)
    # meta tensors are not fake tensors: the mode accepts them as inputs of to_empty
    with fake_tensor_mode() as mode:
        model.to_empty(device='cpu')
        wrapper = build_optim_wrapper(model, dict(cfg.get('optim_wrapper') or {}))
        if fsdp:  # as FSDPStrategy fits it: clipping over several meshes, no-sync control
            from stratagem.strategies.fsdp.grad_sync import adapt_optim_wrapper

            for w in wrapper.values() if hasattr(wrapper, 'values') else [wrapper]:
                adapt_optim_wrapper(w, model, mixed_precision=False)
        return measure_step(model, wrapper, _fake_batch(batch, mode), fsdp=fsdp)


def _shard(strategy: Mapping, nproc: int, model: Any) -> Any:
    """The meta-device ``model`` sharded by FSDPStrategy's own sequence (``shard_model``) on
    the fake process group, with the strategy's own parsers of its arguments."""
    import torch

    from stratagem.strategies.fsdp.config import parse_model_wrapper
    from stratagem.strategies.fsdp.mesh import parse_mesh
    from stratagem.strategies.fsdp.options import parse_activation_checkpointing
    from stratagem.strategies.fsdp.shard import shard_model
    from stratagem.strategies.fsdp.tensor_parallel import parse_tensor_parallel_plan

    model, _, _ = shard_model(
        model,
        wrap_cfg=parse_model_wrapper(strategy.get('model_wrapper')),
        mesh_spec=parse_mesh(strategy.get('mesh'), nproc),
        device=torch.device('cpu'),
        tp_plan=parse_tensor_parallel_plan(strategy.get('tensor_parallel_plan')),
        ac_check=parse_activation_checkpointing(strategy.get('activation_checkpointing')),
    )
    return model


def _pipelined(cfg: Mapping, batch: Any, strategy: Mapping, nproc: int, spec: Any) -> Any:
    """Under a pipeline, every pipeline rank's stages measured apart (on the fake process
    group's rank 0, which holds the largest shard); the estimate is the largest peak."""
    runs = [(_fake_stage_run(cfg, batch, strategy, nproc, spec, r), r) for r in range(spec.ranks)]
    parts, rank = max(runs, key=lambda run: run[0]['peak'])
    stages = spec.stage_indices(rank)
    # one stage a rank, or the looped schedules' several, each holding every microbatch
    held = inflight_microbatches(spec, stages[0])
    which = f'stage {stages[0]}' if len(stages) == 1 else 'stages ' + ' and '.join(map(str, stages))
    return _estimate(
        parts,
        f'pipeline rank {rank} ({which}, {held} of {spec.microbatches} microbatches in flight'
        f'{" each" if len(stages) > 1 else ""} under {spec.schedule}), the largest of the '
        f'{spec.ranks} pipeline ranks; FSDP over a fake process group of {nproc}, '
        # FSDPMemTracker follows one FSDP root; several stages a rank are several roots
        + ('FSDPMemTracker' if len(stages) == 1 else 'MemTracker'),
    )


def _fake_stage_run(
    cfg: Mapping, batch: Any, strategy: Mapping, nproc: int, spec: Any, rank: int
) -> dict:
    """Pipeline rank ``rank``'s step: the meta model cut to its stages (``keep_stages``) and
    each stage sharded as FSDPStrategy shards it, given fake storage; the stages' inputs are
    the previous stages' outputs on one microbatch (their shapes, from the meta model)."""
    import torch

    from stratagem._torch import fake_tensor_mode
    from stratagem.optim import build_optim_wrapper
    from stratagem.registry import MODELS
    from stratagem.strategies.fsdp.grad_sync import adapt_optim_wrapper

    inputs, targets = split_batch(batch)
    micro = len(targets) // spec.microbatches
    with torch.device('meta'):
        model = MODELS.build(dict(cfg['model']))
    stages = spec.stage_modules(model)
    # each stage's input: the stages run in order on one microbatch of meta tensors
    feeds: list[tuple] = []
    args = tuple(x[:micro].to('meta') for x in inputs)
    for index in range(spec.stages):
        feeds.append(args)
        out = spec.stage_view(model, index, stages)(*args)
        args = out if isinstance(out, tuple) else (out,)
    local = spec.stage_indices(rank)
    views = _shard_stages(strategy, nproc, spec, model, stages, local)
    loss_fn = getattr(model, 'loss', None)
    with fake_tensor_mode() as mode, warnings.catch_warnings():
        # a last stage returns its logits, a view (a Linear over 3-D input): FSDP warns
        # against in-place ops on it, which this step makes none of
        warnings.filterwarnings('ignore', 'FSDP2-wrapped module .* returned a view tensor')
        model.to_empty(device='cpu')
        wrapper = build_optim_wrapper(model, dict(cfg.get('optim_wrapper') or {}))
        adapt_optim_wrapper(wrapper, model, mixed_precision=False, stages=spec.ranks)
        target = mode.from_tensor(targets[:micro])
        runs = []
        for view, index in zip(views, local):
            if index == 0:
                fed = tuple(mode.from_tensor(x[:micro]) for x in inputs)
            else:  # what the previous stage sends: an activation that needs its gradient
                fed = tuple(
                    torch.empty(x.shape, dtype=x.dtype).requires_grad_(x.is_floating_point())
                    for x in feeds[index]
                )
            runs.append((view, fed, inflight_microbatches(spec, index)))
        last = spec.stages - 1 in local
        loss = (lambda out: loss_fn(out, target)) if last and callable(loss_fn) else None
        return measure_stage_step(model, wrapper, runs, loss, fsdp=len(views) == 1)


def _shard_stages(
    strategy: Mapping, nproc: int, spec: Any, model: Any, stages: list, local: list[int]
) -> list:
    """The meta ``model`` cut to stages ``local`` and each stage sharded as FSDPStrategy
    does under a pipeline (``fsdp/pipeline.py``'s ``shard_stages``, which it calls too)."""
    import functools

    import torch

    from stratagem.strategies.fsdp.config import parse_model_wrapper
    from stratagem.strategies.fsdp.mesh import parse_mesh
    from stratagem.strategies.fsdp.options import parse_activation_checkpointing
    from stratagem.strategies.fsdp.pipeline import shard_stages
    from stratagem.strategies.fsdp.shard import shard_model
    from stratagem.strategies.fsdp.tensor_parallel import parse_tensor_parallel_plan

    wrap = parse_model_wrapper(strategy.get('model_wrapper'))
    mesh_spec = parse_mesh(strategy.get('mesh'), nproc)
    shard = functools.partial(
        shard_model,
        wrap_cfg=wrap,
        mesh_spec=mesh_spec,
        device=torch.device('cpu'),
        ac_check=parse_activation_checkpointing(strategy.get('activation_checkpointing')),
    )
    views, _, _ = shard_stages(
        model,
        spec,
        stages,
        local,
        wrap_cfg=wrap,
        tp_plan=parse_tensor_parallel_plan(strategy.get('tensor_parallel_plan')),
        tensor=mesh_spec.tensor,
        build_mesh=lambda: mesh_spec.build('cpu'),
        shard=shard,
    )
    return views


class MemoryChecks:
    """The memory check of ``checks.Doctor`` (which provides ``cfg``, ``nproc``, ``model``,
    ``add``, ``notes``, ``findings`` and ``device_memory``)."""

    cfg: Mapping
    nproc: int
    model: Any
    batch: Any
    dataset_length: int | None
    device_memory: int | None
    add: Callable[[str, str, str], None]
    settle: Callable[..., None]
    notes: list[str]
    findings: list

    def load_batch(self) -> None:
        """One micro batch of the dataset (its shapes feed the memory estimate) and the
        dataset's length (the epoch length)."""
        loader = self.cfg.get('train_dataloader') or {}
        if loader.get('dataset') is None:
            return
        from torch.utils.data import default_collate

        from stratagem.loop.batches import build_dataset

        try:
            dataset = build_dataset(loader['dataset'])  # as the loop builds it
            self.dataset_length = len(dataset)  # type: ignore[arg-type]
            n = min(int(loader.get('batch_size', 1)), self.dataset_length)
            self.batch = default_collate([dataset[i] for i in range(n)])
        except Exception as err:  # noqa: BLE001 - the run would fail the same way
            self.settle(
                'train_dataloader.dataset',
                f'the dataset cannot be built: {type(err).__name__}: {err}',
                'stratagem train fails here: fix the dataset config (the checks that need '
                'its length or a batch were skipped)',
            )
            return
        self.settle('train_dataloader.dataset', None)

    def check_memory(self) -> None:
        if (
            self.model is None
            or self.batch is None
            or any(
                f.where.startswith(('model', 'optim_wrapper', 'strategy')) for f in self.findings
            )
        ):
            self.notes.append('memory estimate skipped (fix the findings above first)')
            return
        try:
            estimate = estimate_memory(self.cfg, self.nproc, self.batch)
        except Exception as err:  # noqa: BLE001 - a note: the estimate is best effort
            self.notes.append(f'memory estimate failed: {type(err).__name__}: {err}')
            return
        self.notes.append(f'estimated peak memory per device: {estimate.describe()}')
        if self.device_memory is not None and estimate.peak > self.device_memory:
            self.add(
                'memory',
                f'the estimated peak {format_size(estimate.peak)} per device does not fit '
                f'--device-memory {format_size(self.device_memory)}',
                'shard more (FSDPStrategy, or DeepSpeed ZeRO-3), lower the micro batch '
                '(raise accumulative_counts to keep the batch), add activation '
                'checkpointing, or train in bf16',
            )
