"""``stratagem doctor``'s mesh check: FSDPStrategy's ``mesh`` arithmetic at the given world
size and its ``tensor_parallel_plan`` against the model, on the meta device.

The same parsers and checks the strategy runs before it builds anything
(``strategies/fsdp/mesh.py``, ``strategies/fsdp/tensor_parallel.py``), so the doctor and a
real run agree on what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ['data_parallel_size', 'mesh_findings']


def data_parallel_size(strategy: Mapping, nproc: int) -> int:
    """How many batches ``nproc`` processes read: the mesh's ``replicate × shard`` (the
    pipeline and tensor ranks of one data-parallel index read the same batch); ``nproc``
    without a mesh or when the mesh does not fit ``nproc``."""
    from stratagem.strategies.fsdp.mesh import parse_mesh

    if strategy.get('mesh') is None:
        return nproc
    try:
        return parse_mesh(strategy['mesh'], nproc).data_parallel_size
    except (TypeError, ValueError):
        return nproc


def mesh_findings(strategy: Mapping, nproc: int, model: nn.Module | None) -> list[tuple]:
    """(where, problem, fix) for the mesh and the plan; none for other strategies."""
    from stratagem.strategies.capabilities import capabilities_of

    if not capabilities_of(strategy.get('type'), nproc).device_mesh or (
        strategy.get('mesh') is None and strategy.get('tensor_parallel_plan') is None
    ):
        return []
    from stratagem.strategies.fsdp.config import parse_model_wrapper
    from stratagem.strategies.fsdp.mesh import parse_mesh
    from stratagem.strategies.fsdp.tensor_parallel import (
        check_plan_fits_mesh,
        parse_tensor_parallel_plan,
    )

    try:
        spec = parse_mesh(strategy.get('mesh'), nproc, 'strategy.mesh')
    except (TypeError, ValueError) as err:
        return [('strategy.mesh', str(err), f'give sizes whose product is {nproc} (--nproc)')]
    where = 'strategy.tensor_parallel_plan'
    try:
        plan = parse_tensor_parallel_plan(strategy.get('tensor_parallel_plan'))
        check_plan_fits_mesh(plan, spec, strategy.get('mesh'))
    except (TypeError, ValueError) as err:
        return [(where, str(err), 'make the plan and the mesh agree')]
    if plan is None or model is None:
        return []
    try:
        wrap: Any = parse_model_wrapper(strategy.get('model_wrapper'))
        plan.check(model, spec.tensor, wrap.targets(model))
    except (TypeError, ValueError) as err:
        return [(where, str(err), 'fix the plan (or the model) as the message says')]
    return []
