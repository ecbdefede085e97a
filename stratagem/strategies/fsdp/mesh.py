"""FSDPStrategy's device mesh: ``mesh=dict(pipeline=P, replicate=R, shard=S, tensor=T)``.

Ranks are laid out row-major over ``(pipeline, replicate, shard, tensor)``: rank ``g`` is
tensor slice ``g % T`` of data-parallel rank ``(g % (R·S·T)) // T`` on pipeline stage rank
``g // (R·S·T)``, so a tensor group is ``T`` consecutive ranks (one node's fast links), shard
groups come next, then ``replicate``, and ``pipeline`` spans the most (only activations cross
it, point to point). Parameters are split into stages over ``pipeline`` (``pipeline.py``),
sharded over ``shard``, replicated over ``replicate`` (HSDP: only the gradient all-reduce
crosses ``replicate``) and split over ``tensor`` by the tensor-parallel plan. Data is split
over ``replicate × shard``: the ``P·T`` ranks of one data-parallel index read the same batch.

Aliases, for configs written for other libraries: ``dp_replicate`` /
``data_parallel_replicate_degree`` (replicate), ``dp_shard`` /
``data_parallel_shard_degree`` (shard), ``tp`` / ``tensor_parallel_degree`` (tensor), ``pp`` /
``pipeline_parallel_degree`` (pipeline).
``shard=-1`` (or leaving it out) means "the ranks that remain".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ['MeshSpec', 'parse_mesh']

_ALIASES = {
    'pipeline': ('pipeline', 'pp', 'pipeline_parallel_degree'),
    'replicate': ('replicate', 'dp_replicate', 'data_parallel_replicate_degree'),
    'shard': ('shard', 'dp_shard', 'data_parallel_shard_degree'),
    'tensor': ('tensor', 'tp', 'tensor_parallel_degree'),
}


@dataclass(frozen=True)
class MeshSpec:
    """A validated mesh: sizes whose product is the world size."""

    replicate: int = 1
    shard: int = 1
    tensor: int = 1
    pipeline: int = 1

    @property
    def world_size(self) -> int:
        return self.pipeline * self.replicate * self.shard * self.tensor

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different batches: ``replicate × shard``."""
        return self.replicate * self.shard

    def data_parallel_rank(self, rank: int) -> int:
        """The batch ``rank`` reads: its index over ``replicate × shard``."""
        return (rank % (self.replicate * self.shard * self.tensor)) // self.tensor

    def pipeline_rank(self, rank: int) -> int:
        """Which pipeline position ``rank`` holds, 0 .. pipeline - 1."""
        return rank // (self.replicate * self.shard * self.tensor)

    @property
    def flat(self) -> bool:
        """Today's FSDP: one shard dimension over every rank."""
        return self.replicate == 1 and self.tensor == 1 and self.pipeline == 1

    def as_dict(self) -> dict[str, int]:
        """The sizes, outermost first (``pipeline`` only when > 1, so a checkpoint's ``meta``
        without a pipeline reads as before)."""
        sizes = {'pipeline': self.pipeline} if self.pipeline > 1 else {}
        return {**sizes, 'replicate': self.replicate, 'shard': self.shard, 'tensor': self.tensor}

    def describe(self) -> str:
        """``pipeline 2 × shard 2``: the dimensions larger than one (shard always)."""
        parts = [f'{name} {size}' for name, size in self.as_dict().items() if size > 1]
        return ' × '.join(parts or ['shard 1'])

    def build(self, device_type: str) -> Any:
        """The ``DeviceMesh`` (collective; every rank calls it): dimensions ``pipeline`` and
        ``replicate`` (when > 1), ``shard`` (always) and ``tensor`` (when > 1), in that
        order."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = [(n, s) for n, s in self.as_dict().items() if s > 1 or n == 'shard']
        if len(dims) == 1:  # the flat mesh, built exactly as before meshes were configurable
            return init_device_mesh(device_type, (self.shard,))
        return init_device_mesh(
            device_type,
            tuple(s for _, s in dims),
            mesh_dim_names=tuple(n for n, _ in dims),
        )

    def data_mesh(self, mesh: Any) -> Any:
        """The mesh ``fully_shard`` shards over: ``(replicate, shard)`` for HSDP, else the
        shard dimension."""
        if mesh.mesh_dim_names is None:
            return mesh
        if self.replicate > 1:
            return mesh['replicate', 'shard']
        return mesh['shard']


def parse_mesh(cfg: Any, world_size: int, key: str = 'mesh') -> MeshSpec:
    """``mesh`` (a dict of sizes, None for ``dict(shard=world_size)``) → :class:`MeshSpec`.

    Raises ``ValueError`` naming the key, the value and what would fit: an unknown or
    repeated (alias) key, a size that is not a positive int, a product that is not
    ``world_size``.
    """
    if cfg is None:
        return MeshSpec(shard=world_size)
    if isinstance(cfg, MeshSpec):
        spec = cfg
    else:
        if not isinstance(cfg, Mapping):
            raise TypeError(
                f'{key}={cfg!r}: give a dict of sizes, e.g. dict(replicate=2, shard=4) (HSDP) '
                'or dict(shard=2, tensor=2) (FSDP + tensor parallel)'
            )
        sizes = _sizes(dict(cfg), key)
        known = sizes['pipeline'] * sizes['replicate'] * sizes['tensor']
        if sizes['shard'] == -1:
            if world_size % known:
                raise ValueError(
                    f'{key}={dict(cfg)!r}: pipeline × replicate × tensor = {known} does not '
                    f'divide the world size {world_size}, so no shard size fits; '
                    f'{_fits(world_size)}'
                )
            sizes['shard'] = world_size // known
        spec = MeshSpec(**sizes)
    if spec.world_size != world_size:
        raise ValueError(
            f'{key}={dict(cfg) if isinstance(cfg, Mapping) else spec.as_dict()!r}: '
            f'pipeline × replicate × shard × tensor = {spec.pipeline} × {spec.replicate} × '
            f'{spec.shard} × {spec.tensor} = {spec.world_size}, but the world size is '
            f'{world_size}; {_fits(world_size)}'
        )
    return spec


def _sizes(cfg: dict, key: str) -> dict[str, int]:
    sizes: dict[str, int] = {}
    given: dict[str, str] = {}
    for name, aliases in _ALIASES.items():
        for alias in aliases:
            if alias not in cfg:
                continue
            value = cfg.pop(alias)
            if name in given:
                raise ValueError(
                    f'{key}: {given[name]!r} and {alias!r} both set the {name} size; give one'
                )
            given[name] = alias
            allowed_auto = name == 'shard' and value == -1
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or (value < 1 and not allowed_auto)
            ):
                raise ValueError(
                    f'{key}.{alias}={value!r}: a mesh size is an int >= 1'
                    + (' (shard may be -1: the ranks that remain)' if name == 'shard' else '')
                )
            sizes[name] = value
    if cfg:
        valid = [a for aliases in _ALIASES.values() for a in aliases]
        raise ValueError(
            f'{key}: unknown key(s) {sorted(cfg)}; valid: pipeline, replicate, shard, tensor '
            f'(aliases: {", ".join(a for a in valid if a not in _ALIASES)})'
        )
    return {
        'pipeline': sizes.get('pipeline', 1),
        'replicate': sizes.get('replicate', 1),
        'shard': sizes.get('shard', -1),
        'tensor': sizes.get('tensor', 1),
    }


def _fits(world_size: int) -> str:
    """Meshes that fit ``world_size``: a few, for the error message."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    shapes = [f'dict(shard={world_size})']
    if len(divisors) > 2:
        d = divisors[1]
        shapes += [
            f'dict(replicate={d}, shard={world_size // d})',
            f'dict(shard={world_size // d}, tensor={d})',
            f'dict(pipeline={d}, shard={world_size // d})',
        ]
    return 'meshes that fit: ' + ', '.join(shapes)
