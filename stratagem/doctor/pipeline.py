"""``stratagem doctor``'s pipeline check: FSDPStrategy's ``pipeline`` against the mesh, the
model and one batch, on the meta device; and the cut of a pipeline rank's stages that the
memory estimate (``memory.py``) measures.

The checks are the strategy's own (``strategies/fsdp/pipeline.py``): ``parse_pipeline`` (the
keys, the schedule, the stage count against ``mesh.pipeline``), ``stage_modules`` (split
points against the model), ``check_forward`` (a forward that calls a deleted module without
skipping it) and ``dry_run`` (every stage run in order on one microbatch of meta tensors, the
check of the first ``train_step``), and ``stratagem train``'s own refusal (``loop/step.py``: a
model without a ``loss`` method), so the doctor and a run agree on what is wrong.
Besides, what the first or a later ``train_step`` refuses about the batch: ``microbatches``
must divide the micro batch the loader gives each rank, and every batch must have that size.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from stratagem.strategies.fsdp.pipeline import PipelineSpec

__all__ = ['inflight_microbatches', 'pipeline_findings', 'pipeline_spec', 'split_batch']


def pipeline_spec(strategy: Mapping, nproc: int) -> PipelineSpec | None:
    """The strategy's :class:`PipelineSpec` at ``nproc`` processes; None without a pipeline
    or when the mesh or the pipeline does not parse (their findings say why)."""
    if not _has_pipeline(strategy):
        return None
    from stratagem.strategies.fsdp.mesh import parse_mesh
    from stratagem.strategies.fsdp.pipeline import parse_pipeline

    try:
        return parse_pipeline(strategy.get('pipeline'), parse_mesh(strategy.get('mesh'), nproc))
    except (TypeError, ValueError):
        return None


def split_batch(batch: Any) -> tuple[tuple, Any]:
    """``(inputs as a tuple, targets)`` of a loader's batch, as ``stratagem train`` hands them
    to ``train_step`` under a pipeline (``loop.pipeline_batch``, which refuses another form)."""
    from stratagem.loop import pipeline_batch

    inputs, targets = pipeline_batch(batch)
    return (tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)), targets


def inflight_microbatches(spec: PipelineSpec, stage: int) -> int:
    """The most microbatches whose activations ``stage`` holds at once: all of them under
    GPipe and the looped schedules (an upper bound for the latter), ``stages - stage`` under
    1F1B (torch's warm-up: the first stage runs as many forwards as there are stages before
    its first backward, the last one)."""
    if spec.schedule == '1F1B':
        return min(spec.microbatches, spec.stages - stage)
    return spec.microbatches


def pipeline_findings(
    strategy: Mapping,
    nproc: int,
    model: nn.Module | None,
    batch: Any,
    loader: Mapping,
    dataset_length: int | None,
) -> list[tuple[str, str, str]]:
    """(where, problem, fix) for ``strategy.pipeline``; none without one, or when the mesh
    does not fit ``nproc`` (the mesh check's finding). ``loader``: ``train_dataloader``."""
    from stratagem.strategies.capabilities import capabilities_of

    if not capabilities_of(strategy.get('type'), nproc).pipeline or not _has_pipeline(strategy):
        return []
    from stratagem.strategies.fsdp.mesh import parse_mesh
    from stratagem.strategies.fsdp.pipeline import parse_pipeline

    try:
        mesh = parse_mesh(strategy.get('mesh'), nproc, 'strategy.mesh')
    except (TypeError, ValueError):
        return []  # mesh.py's finding
    try:
        spec = parse_pipeline(strategy.get('pipeline'), mesh, 'strategy.pipeline')
    except (TypeError, ValueError) as err:
        return [(_where(str(err)), str(err), 'change strategy.pipeline as the message says')]
    if spec is None or model is None:
        return []
    try:
        stages = spec.stage_modules(model)
    except ValueError as err:
        where = 'model' if 'of its own' in str(err) else 'strategy.pipeline.split_points'
        return [(where, str(err), 'name the modules where stages begin, as the message says')]
    try:
        spec.check_forward(model, stages)
    except ValueError as err:
        return [('model', str(err), "make the model's forward skip a module that is None")]
    from stratagem.loop import pipeline_loss_fn

    try:  # what stratagem train refuses before its first step: the strategy's pipeline_spec
        pipeline_loss_fn(SimpleNamespace(pipeline_spec=spec), model)
    except ValueError as err:
        return [('model', str(err), 'stratagem train stops here: do as the message says')]
    out = _batch_findings(spec, mesh.data_parallel_size, loader, dataset_length)
    if out:
        return out
    try:
        inputs, targets = split_batch(batch)
    except ValueError as err:
        return [('train_dataloader.dataset', str(err), 'give (inputs, targets) pairs')]
    micro = len(targets) // spec.microbatches
    loss_fn = getattr(model, 'loss', None)
    try:
        spec.dry_run(
            model,
            tuple(x[:micro] for x in inputs),
            targets[:micro],
            loss_fn if callable(loss_fn) else None,
        )
    except ValueError as err:
        return [('model', str(err), "make every stage's forward run on its own")]
    return []


def _has_pipeline(strategy: Mapping) -> bool:
    mesh = strategy.get('mesh')
    sizes = dict(mesh) if isinstance(mesh, Mapping) else {}
    staged = any(sizes.get(k, 1) != 1 for k in ('pipeline', 'pp', 'pipeline_parallel_degree'))
    return strategy.get('pipeline') is not None or staged


def _where(message: str) -> str:
    """The key a ``parse_pipeline`` message names: ``strategy.pipeline.<key>``, or
    ``strategy.mesh`` for a pipeline the mesh has no dimension for."""
    m = re.match(r'strategy\.pipeline\.(\w+)', message)
    if m:
        return f'strategy.pipeline.{m.group(1)}'
    return 'strategy.mesh' if 'pipeline dimension in the mesh' in message else 'strategy.pipeline'


def _batch_findings(
    spec: PipelineSpec, data_parallel: int, loader: Mapping, dataset_length: int | None
) -> list[tuple[str, str, str]]:
    """What ``train_step`` refuses about the batch: ``microbatches`` must divide the loader's
    batch size, and every batch must have that size (the last one of an epoch too)."""
    size = loader.get('batch_size')
    if not isinstance(size, int):
        return []
    m = spec.microbatches
    if size % m:
        fits = [d for d in range(1, size + 1) if size % d == 0]
        return [
            (
                'strategy.pipeline.microbatches',
                f'microbatches={m} does not divide train_dataloader.batch_size={size}: the '
                'first train_step refuses it on every rank',
                f'use microbatches in {fits}, or a batch size that {m} divides',
            )
        ]
    if dataset_length and not loader.get('drop_last'):
        per_rank = -(-dataset_length // data_parallel)
        if per_rank % size:
            return [
                (
                    'train_dataloader.drop_last',
                    f'each of the {data_parallel} data-parallel rank(s) reads {per_rank} '
                    f'samples a epoch, so its last batch holds {per_rank % size}, not {size}; '
                    'a pipeline runs microbatches of one size and train_step refuses it',
                    'set train_dataloader.drop_last=True (or a dataset length that the '
                    'batch size times the data-parallel ranks divides)',
                )
            ]
    return []
