"""The training batches: the dataset, the rank's shard (``data.ResumableSampler``), the loader,
the per-epoch seeding and the skip to a resumed position.

A resumed run reads from the same sample, in the same order, with the same worker seeds as the
uninterrupted run: the sampler's permutation is drawn from ``seed + epoch``, the loader's
generator (worker seeds) is seeded with ``seed + epoch`` at each epoch's start, and the first
epoch after a resume skips the samples already read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from stratagem.registry import DATASETS

from .plan import DataPlan

__all__ = ['Batches', 'batch_problem', 'build_dataset', 'epoch_length_from_config']


def build_dataset(cfg: Any) -> Dataset:
    """A Dataset instance as is, a DATASETS cfg, or a zero-argument callable returning one."""
    if isinstance(cfg, Mapping):
        return DATASETS.build(cfg)
    if isinstance(cfg, Dataset):
        return cfg
    if callable(cfg):
        return cfg()
    raise TypeError(
        'train_dataloader.dataset should be a DATASETS cfg dict, a Dataset or a '
        f'callable returning one; got {type(cfg).__name__}'
    )


def epoch_length_from_config(cfg: Mapping, world_size: int = 1) -> int | None:
    """Iterations per epoch of ``cfg.train_dataloader`` (building its dataset), or None."""
    loader = cfg.get('train_dataloader')
    if not isinstance(loader, Mapping) or 'dataset' not in loader:
        return None
    n = len(build_dataset(loader['dataset']))  # type: ignore[arg-type]
    per_rank = n // world_size if loader.get('drop_last') else math.ceil(n / world_size)
    batch = int(loader.get('batch_size', 1))
    return per_rank // batch if loader.get('drop_last') else math.ceil(per_rank / batch)


def batch_problem(samples: int, batch_size: int, data_parallel: int, drop_last: bool) -> str | None:
    """Why ``train_dataloader`` cannot give the configured batch (None when it can): a rank's
    shard of the dataset is smaller than ``batch_size``, so the real batch (``batch_size`` x
    data-parallel ranks) exceeds the dataset, an epoch is one short step (none at all with
    ``drop_last``) and the batch the lr was set for never occurs. ``stratagem doctor``
    reports the same text."""
    per_rank = samples // data_parallel if drop_last else math.ceil(samples / data_parallel)
    if per_rank >= batch_size:
        return None
    where = (
        f'{samples} samples over {data_parallel} data-parallel rank(s) with '
        f'batch_size={batch_size} and drop_last={drop_last}'
    )
    if drop_last:
        return (
            f'train_dataloader yields no batch per epoch: {where}; use a smaller batch_size '
            f'(at most {max(per_rank, 1)}) or drop_last=False'
        )
    return (
        f'the real batch {batch_size * data_parallel} (batch_size={batch_size} x '
        f'{data_parallel} data-parallel rank(s)) exceeds the dataset: {where}, so every step '
        f'would read {per_rank} sample(s) a rank, not {batch_size}; use batch_size <= '
        f'{per_rank} or fewer processes'
    )


# a DataLoader given a batch sampler and no workers refuses these
_NOT_WITH_BATCH_SAMPLER = (
    'drop_last',
    'shuffle',
    'sampler',
    'num_workers',
    'persistent_workers',
    'prefetch_factor',
)


class Batches:
    """This rank's training batches. ``epoch_length``: batches per epoch (a ValueError when
    there is none); :meth:`seed_from` sets the shuffling seed once a resume has restored the
    run's; :meth:`at` returns iteration ``it``'s batch, iterations being read in order."""

    def __init__(self, plan: DataPlan, strategy: Any) -> None:
        from stratagem.data import ResumableSampler

        self.plan = plan
        self.batch_size = plan.batch_size
        dataset = build_dataset(plan.dataset)
        self.sampler = ResumableSampler(
            len(dataset),  # type: ignore[arg-type]
            strategy.data_parallel_rank,  # the ranks of one tensor group read the same batch
            strategy.data_parallel_size,
            shuffle=plan.shuffle,
            drop_last=plan.drop_last,
        )
        # a private generator: creating a loader iterator must not draw from the global RNG,
        # or a resumed run's random stream would drift from an uninterrupted one
        self.generator = torch.Generator()
        self.loader = DataLoader(
            dataset,
            batch_size=plan.batch_size,
            sampler=self.sampler,
            generator=self.generator,
            **plan.loader_kwargs,
        )
        self.epoch_length = len(self.loader)
        problem = batch_problem(
            len(dataset),  # type: ignore[arg-type]
            plan.batch_size,
            strategy.data_parallel_size,
            plan.drop_last,
        )
        if problem is not None:
            raise ValueError(problem)
        self.seed = 0
        self._iter: Iterator | None = None
        self.stream: Any = None  # a replica group's (follow)

    def follow(self, group: Any, optim_wrapper: Any, seed: int) -> None:
        """Read the job's sample stream of a replica group instead of this rank's shard
        (``strategies.replica_groups.ReplicaStream``): each batch is drawn after the
        step's quorum, so the loader has no workers."""
        from stratagem.strategies.replica_groups import ReplicaStream

        if self.plan.loader_kwargs.get('num_workers'):
            raise ValueError(
                f'replica group {group.replica_id}: train_dataloader.num_workers='
                f'{self.plan.loader_kwargs["num_workers"]}: under strategy.fault_tolerance a '
                "batch is chosen by its step's quorum (which groups are live), so it cannot be "
                'prefetched by workers; set num_workers=0'
            )
        kwargs = {
            k: v for k, v in self.plan.loader_kwargs.items() if k not in _NOT_WITH_BATCH_SAMPLER
        }
        self.stream = ReplicaStream(
            group,
            len(self.loader.dataset),  # type: ignore[arg-type]
            self.batch_size,
            optim_wrapper,
            shuffle=self.plan.shuffle,
            seed=seed,
        )
        self.loader = DataLoader(self.loader.dataset, batch_sampler=self.stream, **kwargs)
        self._iter = None

    def seed_from(self, strategy: Any) -> int:
        """The shuffling seed: ``sampler.seed`` of the config, else the run's seed (the same
        on every rank, also under ``diff_rank_seed``), read after a resume restored it."""
        self.seed = strategy.randomness['seed'] if self.plan.seed is None else int(self.plan.seed)
        self.sampler.seed = self.seed
        return self.seed

    def restart(self) -> None:
        """The next :meth:`at` starts an iterator at its position (a rollback went back)."""
        self._iter = None

    def at(self, it: int) -> Any:
        """Iteration ``it``'s batch (0-based): a new epoch, or the first batch read, starts an
        iterator from the epoch's seed and position."""
        if self.stream is not None:  # the job's stream: where the group's quorum says
            if self._iter is None:
                self._iter = iter(self.loader)
            return next(self._iter)
        epoch, pos = divmod(it, self.epoch_length)
        if self._iter is None or pos == 0:
            self.sampler.set_epoch(epoch)
            self.sampler.skip(pos * self.batch_size)
            # worker seeds come from this generator: fix them per epoch, so a resumed
            # epoch's workers are seeded as the uninterrupted run's were
            self.generator.manual_seed(self.seed + epoch)
            self._iter = iter(self.loader)
        return next(self._iter)
