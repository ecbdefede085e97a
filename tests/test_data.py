"""The synthetic dataset and the resumable distributed sampler."""

import pytest
import torch

from stratagem.data import ResumableSampler, SyntheticClassification
from stratagem.registry import DATASETS


def test_synthetic_dataset_is_deterministic_and_private():
    state = torch.get_rng_state()
    a = SyntheticClassification(num_samples=50, num_features=3, num_classes=4, seed=1)
    b = DATASETS.build(
        dict(type='SyntheticClassification', num_samples=50, num_features=3, num_classes=4, seed=1)
    )
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not touched
    assert len(a) == 50 and torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    x, y = a[3]
    assert x.shape == (3,) and 0 <= int(y) < 4
    with pytest.raises(ValueError, match='num_classes >= 2'):
        SyntheticClassification(num_classes=1)


def test_ranks_get_disjoint_shards_covering_the_epoch():
    shards = [list(ResumableSampler(10, rank=r, world_size=3, seed=4)) for r in range(3)]
    assert [len(s) for s in shards] == [4, 4, 4]  # padded to 12
    flat = sorted(i for s in shards for i in s)
    assert set(flat) == set(range(10)) and len(flat) == 12
    dropped = [
        list(ResumableSampler(10, rank=r, world_size=3, seed=4, drop_last=True)) for r in range(3)
    ]
    assert [len(s) for s in dropped] == [3, 3, 3] and len(set(sum(dropped, []))) == 9


def test_set_epoch_reshuffles_and_skip_resumes_mid_epoch():
    s = ResumableSampler(20, rank=1, world_size=2, seed=0)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert e0 != e1 and sorted(e0) != sorted(range(20))
    again = ResumableSampler(20, rank=1, world_size=2, seed=0)
    again.set_epoch(1)
    again.skip(4)
    assert list(again) == e1[4:]
    assert list(again) == e1  # the skip applies to one iteration only
    unshuffled = ResumableSampler(6, shuffle=False)
    assert list(unshuffled) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r'skip: n=11 not in \[0, 10\]'):
        again.skip(11)
    with pytest.raises(ValueError, match=r'rank 2 not in \[0, world_size=2\)'):
        ResumableSampler(4, rank=2, world_size=2)


def test_synthetic_language_modeling_follows_its_chain():
    from stratagem.data import SyntheticLanguageModeling

    state = torch.get_rng_state()
    a = SyntheticLanguageModeling(num_samples=40, seq_len=12, vocab_size=10, branching=2, seed=3)
    b = DATASETS.build(
        dict(
            type='SyntheticLanguageModeling',
            num_samples=40,
            seq_len=12,
            vocab_size=10,
            branching=2,
            seed=3,
        )
    )
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not touched
    assert len(a) == 40 and torch.equal(a.tokens, b.tokens)
    x, y = a[5]
    assert x.shape == y.shape == (12,) and x.dtype == torch.long
    assert torch.equal(x[1:], y[:-1])  # the target is the input shifted by one
    # every token is followed by at most `branching` distinct tokens
    pairs = torch.stack([a.tokens[:, :-1].flatten(), a.tokens[:, 1:].flatten()], 1).unique(dim=0)
    assert pairs[:, 0].bincount(minlength=10).max() == 2
    with pytest.raises(ValueError, match='branching <= vocab_size'):
        SyntheticLanguageModeling(vocab_size=4, branching=5)
