"""Gradient clipping over a mix of sharded (DTensor) and plain gradients, or of DTensors on
several meshes.

``torch.nn.utils.clip_grad_norm_`` handles all-DTensor gradients on one mesh (FSDP2) and
all-plain ones, but raises on a mix ("got mixed torch.Tensor and DTensor"), which is what a
model with parameters kept out of sharding (FSDP's ``ignored_modules``) has, and on DTensors of
different meshes ("must have the same mesh"), which is what FSDP + tensor parallelism gives
(split parameters on the 2-D mesh, the others on its data-parallel dimension). These
functions take the same arguments and return the same value as torch's, and are used only for
such mixes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from stratagem._torch import foreach_mul_

__all__ = ['clip_grad_norm_mixed', 'clip_grad_value_mixed', 'split_sharded']


def by_mesh(sharded: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Sharded parameters grouped by their gradients' device mesh, in first-seen order."""
    groups: dict[int, list[torch.Tensor]] = {}
    meshes: list = []
    for p in sharded:
        mesh = _grad(p).device_mesh  # type: ignore[attr-defined]
        key = next((i for i, m in enumerate(meshes) if m == mesh), None)
        if key is None:
            key = len(meshes)
            meshes.append(mesh)
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def split_sharded(parameters: Iterable[torch.Tensor]) -> tuple[list, list]:
    """(sharded, plain) parameters that have a gradient; sharded ones have DTensor grads."""
    from torch.distributed.tensor import DTensor

    sharded: list[torch.Tensor] = []
    plain: list[torch.Tensor] = []
    for p in parameters:
        if p.grad is not None:
            (sharded if isinstance(p.grad, DTensor) else plain).append(p)
    return sharded, plain


def clip_grad_norm_mixed(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    stages: int = 1,
) -> torch.Tensor:
    """``clip_grad_norm_`` for sharded + plain gradients; returns the total norm (a plain
    tensor, the same on every rank).

    ``stages``: the pipeline ranks the parameters are split over (each rank holds its
    stages' parameters only): the one all-reduce sums the stages' norms, each parameter
    counted once, so every stage clips by the whole model's norm.

    The sharded part's norm is the unsharded one, over every mesh, in one all-reduce of
    each rank's share (float64 sums; a replicated piece counted once). The plain
    gradients are not reduced by FSDP (each rank has its own); their ``norm_type``-th powers
    are averaged over the mesh's ranks (the maximum, for ``inf``), so every rank clips by
    the same factor and the shards stay consistent. When the plain gradients are the same on
    every rank (replicated, as FSDP1 assumes), that is their norm: FSDP1's result.
    """
    import torch.distributed as dist
    from torch.nn.utils import clip_grads_with_norm_

    sharded, plain = split_sharded(parameters)
    if not sharded and not plain:
        if stages == 1:
            return torch.tensor(0.0)
        # a stage without gradients still joins the other stages' all-reduce
        on = 'cuda' if dist.get_backend() == 'nccl' else 'cpu'
        share = torch.zeros((), dtype=torch.float64, device=on)
        dist.all_reduce(share, dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
        return share if math.isinf(norm_type) else share ** (1.0 / norm_type)
    world = dist.get_world_size() if dist.is_initialized() else 1
    inf = math.isinf(norm_type)
    # this rank's share of the total: one all-reduce then gives every rank the same total
    # (reducing each mesh's norm on its own takes a collective per mesh dimension, whose
    # reduction orders may differ between ranks)
    parts = [
        _local_power(
            [_local(p) for p in group],
            norm_type,
            1 if inf else world / (stages * _spread(_grad(group[0]))),
        )
        for group in _by_spread(sharded)
    ]
    if plain:  # FSDP does not reduce these: each rank's own, averaged over the ranks
        averaged = world // stages if sharded and not inf else 1
        parts.append(_local_power([_grad(p) for p in plain], norm_type, averaged))
    device = _grad((sharded or plain)[0]).device
    share = torch.stack([x.to(device) for x in parts])
    share = share.max() if inf else share.sum()
    if world > 1 and sharded:  # (plain gradients alone: each rank's own, as torch's)
        dist.all_reduce(share, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    total = share if inf else share ** (1.0 / norm_type)
    dtype = _grad((sharded or plain)[0]).dtype
    total = total.to(dtype if dtype.is_floating_point else torch.float32)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f'The total norm of order {norm_type} for gradients from `parameters` is '
            'non-finite, so it cannot be clipped (error_if_nonfinite=True)'
        )
    clip_grads_with_norm_(plain, max_norm, total, foreach)
    if sharded:  # scale the local shards in place: a DTensor times a plain tensor raises
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        local = [_local(p) for p in sharded]
        foreach_mul_(local, coef.to(local[0].device))
    return total


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None  # split_sharded keeps only parameters with a gradient
    return p.grad


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor gradient."""
    return _grad(p).to_local()  # type: ignore[attr-defined]


def _spread(grad: torch.Tensor) -> int:
    """How many ranks hold different pieces of ``grad`` (a DTensor): the sizes of the mesh
    dimensions it is sharded over. Every other rank of the world holds a replica."""
    mesh, placements = grad.device_mesh, grad.placements  # type: ignore[attr-defined]
    if any(pl.is_partial() for pl in placements):
        raise RuntimeError('clip_grad_norm: a gradient is still Partial (unreduced)')
    # FSDP over tensor-parallel slices shards with _StridedShard, which is not a Shard
    return math.prod(mesh.size(i) for i, pl in enumerate(placements) if not pl.is_replicate())


def _by_spread(sharded: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[int, list[torch.Tensor]] = {}
    for p in sharded:
        groups.setdefault(_spread(_grad(p)), []).append(p)
    return list(groups.values())


def _local_power(grads: list[torch.Tensor], norm_type: float, replicas: float) -> torch.Tensor:
    """sum(|g|^p) / replicas over these local tensors, in float64 (max |g| for inf)."""
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type).double() for g in grads])
    if math.isinf(norm_type):
        return norms.max()
    return (norms**norm_type).sum() / replicas


def clip_grad_value_mixed(
    parameters: Iterable[torch.Tensor], clip_value: float, foreach: bool | None = None
) -> None:
    """``clip_grad_value_`` for sharded + plain gradients (each kind, each mesh, clipped on
    its own)."""
    sharded, plain = split_sharded(parameters)
    for group in [*by_mesh(sharded), plain]:
        if group:
            torch.nn.utils.clip_grad_value_(group, clip_value, foreach=foreach)
