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

__all__ = ['clip_grad_norm_mixed', 'clip_grad_value_mixed', 'split_sharded']


def by_mesh(sharded: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Sharded parameters grouped by their gradients' device mesh, in first-seen order."""
    groups: dict[int, list[torch.Tensor]] = {}
    meshes: list = []
    for p in sharded:
        mesh = p.grad.device_mesh  # type: ignore[union-attr]
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
) -> torch.Tensor:
    """``clip_grad_norm_`` for sharded + plain gradients; returns the total norm (a plain
    tensor, the same on every rank).

    The sharded part's norm is the unsharded one (reduced over its mesh). The plain
    gradients are not reduced by FSDP (each rank has its own); their ``norm_type``-th powers
    are averaged over the mesh's ranks (the maximum, for ``inf``), so every rank clips by
    the same factor and the shards stay consistent. When the plain gradients are the same on
    every rank (replicated, as FSDP1 assumes), that is their norm: FSDP1's result.
    """
    import torch.distributed as dist
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    sharded, plain = split_sharded(parameters)
    norms = []
    for same_mesh in by_mesh(sharded):  # each mesh's norm is reduced over that mesh
        grads = [p.grad for p in same_mesh if p.grad is not None]
        norm = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        norms.append(norm.full_tensor())  # type: ignore[attr-defined]  # a DTensor
    if plain:
        norm = get_total_norm([p.grad for p in plain], norm_type, error_if_nonfinite, foreach)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if sharded and world > 1:  # the meshes span every rank: average over all of them
            if math.isinf(norm_type):
                dist.all_reduce(norm, dist.ReduceOp.MAX)
            else:  # gloo has no AVG: sum the powers, divide
                power = norm.double() ** norm_type
                dist.all_reduce(power)
                norm = (power / world) ** (1.0 / norm_type)
                norm = norm.to(norms[0].dtype)
        norms.append(norm.to(norms[0].device) if norms else norm)
    if not norms:
        return torch.tensor(0.0)
    total = get_total_norm(norms, norm_type, error_if_nonfinite, foreach)
    clip_grads_with_norm_(plain, max_norm, total, foreach)
    if sharded:  # scale the local shards in place: a DTensor times a plain tensor raises
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        local = [p.grad.to_local() for p in sharded]
        torch._foreach_mul_(local, coef.to(local[0].device))
    return total


def clip_grad_value_mixed(
    parameters: Iterable[torch.Tensor], clip_value: float, foreach: bool | None = None
) -> None:
    """``clip_grad_value_`` for sharded + plain gradients (each kind, each mesh, clipped on
    its own)."""
    sharded, plain = split_sharded(parameters)
    for group in [*by_mesh(sharded), plain]:
        if group:
            torch.nn.utils.clip_grad_value_(group, clip_value, foreach=foreach)
