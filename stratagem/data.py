"""Data for the reference loop: synthetic datasets (no downloads), a resumable sampler and
the validation shards.

Registered in DATASETS. The sampler shards indices across ranks like
``torch.utils.data.DistributedSampler`` and can start mid-epoch, so a resumed
run sees exactly the samples an uninterrupted one would. Validation reads every sample once
instead (:func:`validation_batches`: no padding, weight-0 filler batches).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, Sampler

from stratagem.registry import DATASETS


@DATASETS.register_module()
class SyntheticClassification(Dataset):
    """Gaussian blobs around ``num_classes`` random centres; deterministic for a given ``seed``.

    Args:
        num_samples: Dataset length.
        num_features: Input width.
        num_classes: Number of classes.
        noise: Standard deviation of the points around their centre.
        seed: Seed of the private generator (the global RNG is not touched).
    """

    def __init__(
        self,
        num_samples: int = 1024,
        num_features: int = 16,
        num_classes: int = 4,
        noise: float = 1.0,
        seed: int = 0,
    ) -> None:
        if num_samples < 1 or num_features < 1 or num_classes < 2:
            raise ValueError(
                'SyntheticClassification: need num_samples >= 1, num_features >= 1 '
                f'and num_classes >= 2, got {num_samples}, {num_features}, '
                f'{num_classes}'
            )
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(num_classes, num_features, generator=g) * 3.0
        self.targets = torch.randint(num_classes, (num_samples,), generator=g)
        self.inputs = centres[self.targets] + noise * torch.randn(
            num_samples, num_features, generator=g
        )

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[idx], self.targets[idx]


@DATASETS.register_module()
class SyntheticLanguageModeling(Dataset):
    """Token sequences from a fixed random Markov chain, for next-token prediction.

    Each token has ``branching`` possible successors (drawn uniformly), so a model can learn
    the chain: the loss falls from ``ln(vocab_size)`` towards ``ln(branching)``. Deterministic
    for a given ``seed`` (a private generator; the global RNG is not touched).

    Args:
        num_samples: Dataset length.
        seq_len: Tokens per input (the target is the input shifted by one).
        vocab_size: Number of token ids.
        branching: Successors per token (1 makes the sequence fully predictable).
        seed: Seed of the chain and of the sequences.

    Items are ``(inputs, targets)``: two int64 tensors of shape ``(seq_len,)``.
    """

    def __init__(
        self,
        num_samples: int = 1024,
        seq_len: int = 32,
        vocab_size: int = 64,
        branching: int = 2,
        seed: int = 0,
    ) -> None:
        if num_samples < 1 or seq_len < 1 or vocab_size < 2 or not 1 <= branching <= vocab_size:
            raise ValueError(
                'SyntheticLanguageModeling: need num_samples >= 1, seq_len >= 1, '
                'vocab_size >= 2 and 1 <= branching <= vocab_size, got '
                f'{num_samples}, {seq_len}, {vocab_size}, {branching}'
            )
        g = torch.Generator().manual_seed(seed)
        successors = torch.stack(
            [torch.randperm(vocab_size, generator=g)[:branching] for _ in range(vocab_size)]
        )
        tokens = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab_size, (num_samples,), generator=g)
        choice = torch.randint(branching, (num_samples, seq_len), generator=g)
        for t in range(seq_len):
            tokens[:, t + 1] = successors[tokens[:, t], choice[:, t]]
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[idx, :-1], self.tokens[idx, 1:]


class ResumableSampler(Sampler[int]):
    """Shuffled (or ordered) indices for one rank, resumable from any position in an epoch.

    Each epoch draws a permutation from ``seed + epoch`` (so every rank agrees
    without communication), pads it to a multiple of ``world_size`` (or drops
    the tail with ``drop_last``) and gives rank ``r`` every ``world_size``-th
    index from ``r``. ``set_epoch(e)`` picks the epoch; ``skip(n)`` makes the
    next iteration start after the first ``n`` indices of this rank's shard.

    Args:
        dataset_len: Length of the dataset.
        rank: This process's rank.
        world_size: Number of processes.
        shuffle: Shuffle per epoch.
        seed: Base seed of the shuffle (the same on all ranks).
        drop_last: Drop the tail that does not divide evenly instead of padding.
    """

    def __init__(
        self,
        dataset_len: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f'ResumableSampler: rank {rank} not in [0, world_size={world_size})')
        self.dataset_len = dataset_len
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self._skip = 0
        if drop_last:
            self.num_samples = dataset_len // world_size
        else:
            self.num_samples = math.ceil(dataset_len / world_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, n: int) -> None:
        """Start the next iteration after the first ``n`` indices of this rank's shard."""
        if not 0 <= n <= self.num_samples:
            raise ValueError(f'ResumableSampler.skip: n={n} not in [0, {self.num_samples}]')
        self._skip = n

    def indices(self) -> list[int]:
        """This rank's indices for the current epoch (ignoring any skip)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        total = self.num_samples * self.world_size
        if self.drop_last:
            order = order[:total]
        else:
            while len(order) < total:
                order += order[: total - len(order)]
        return order[self.rank : total : self.world_size]

    def __iter__(self) -> Iterator[int]:
        start, self._skip = self._skip, 0
        return iter(self.indices()[start:])

    def __len__(self) -> int:
        return self.num_samples


def validation_batches(
    dataset_len: int,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int = 1,
    *,
    shuffle: bool = False,
    seed: int = 0,
) -> list[tuple[list[int], int]]:
    """This rank's validation batches: ``(indices, weight)`` pairs, every sample of the set on
    exactly one rank, and as many batches on every rank.

    Rank ``r`` reads every ``world_size``-th index from ``r`` (of a permutation drawn from
    ``seed`` with ``shuffle``), in batches of ``batch_size``; nothing is padded, so shards
    differ by at most one sample. A rank with fewer batches than another gets filler batches
    (the first ``batch_size`` indices of the order) of weight 0: every rank runs as many
    forwards, which sharded models and buffer-broadcasting wrappers need (each forward may be
    a collective), and a filler is never counted. The weight of a real batch is its length.
    """
    if dataset_len < 1:
        raise ValueError('validation_batches: the validation set is empty')
    if not 0 <= rank < world_size:
        raise ValueError(f'validation_batches: rank {rank} not in [0, world_size={world_size})')
    if batch_size < 1:
        raise ValueError(f'validation_batches: batch_size must be >= 1, got {batch_size}')
    if shuffle:
        order = torch.randperm(dataset_len, generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        order = list(range(dataset_len))
    shard = order[rank::world_size]
    batches = [
        (shard[i : i + batch_size], len(shard[i : i + batch_size]))
        for i in range(0, len(shard), batch_size)
    ]
    most = math.ceil(math.ceil(dataset_len / world_size) / batch_size)
    batches += [(order[:batch_size], 0)] * (most - len(batches))
    return batches
