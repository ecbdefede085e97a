"""set_random_seed and RNG state that round-trips through torch.load(weights_only=True)."""

import random

import numpy as np
import pytest
import torch

import stratagem.env.seed as seed_module
from stratagem.env import get_rng_state, set_random_seed, set_rng_state


def draws():
    """The next values of all three RNGs, gaussians included (they have cached halves)."""
    return (
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        float(np.random.standard_normal()),
        torch.rand(3).tolist(),
    )


@pytest.fixture
def restore_determinism():
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1:]


def test_same_seed_same_draws():
    assert set_random_seed(1234) == 1234
    first = draws()
    assert set_random_seed(1234) == 1234
    assert draws() == first
    set_random_seed(1235)
    assert draws() != first


def test_seed_none_draws_a_seed_and_uses_it():
    random.seed(0)  # a seeded global RNG must not make the drawn seed predictable
    a = set_random_seed(None)
    random.seed(0)
    b = set_random_seed(None)
    assert isinstance(a, int) and 0 <= a < 2**31 and a != b
    after = draws()
    set_random_seed(b)
    assert draws() == after


@pytest.mark.parametrize('rank', [0, 3])
def test_diff_rank_seed_adds_the_rank(monkeypatch, rank):
    # the rank as the seeding code reads it; rank 0 alone could not tell adding from ignoring
    monkeypatch.setattr(seed_module, 'get_rank', lambda: rank)
    assert set_random_seed(7, diff_rank_seed=True) == 7 + rank
    seeded = draws()
    set_random_seed(7 + rank)
    assert draws() == seeded  # every RNG was seeded with 7 + rank
    assert set_random_seed(7) == 7  # without diff_rank_seed the rank is not added
    # the sum must stay in [0, 2**32)
    assert set_random_seed(2**32 - 1 - rank, diff_rank_seed=True) == 2**32 - 1
    with pytest.raises(ValueError, match=r'after adding the rank \(diff_rank_seed=True\)'):
        set_random_seed(2**32 - rank, diff_rank_seed=True)


def test_seed_validation():
    with pytest.raises(TypeError, match=r"seed must be an int in \[0, 2\*\*32\) or None, got '1'"):
        set_random_seed('1')
    with pytest.raises(TypeError):
        set_random_seed(True)
    with pytest.raises(ValueError, match=r'seed -1 is outside \[0, 2\*\*32\)'):
        set_random_seed(-1)
    assert set_random_seed(2**32 - 1) == 2**32 - 1


def test_deterministic_sets_flags(restore_determinism, clean_env):
    torch.backends.cudnn.benchmark = True
    set_random_seed(3, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    # CPU-only machine: the cuBLAS variable is only for CUDA.
    assert torch.cuda.is_available() or 'CUBLAS_WORKSPACE_CONFIG' not in clean_env


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    set_random_seed(99)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()  # and one in numpy's
    state = get_rng_state()
    expected = draws()
    path = tmp_path / 'rng.pt'
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    set_random_seed(0)  # move every RNG elsewhere
    assert draws() != expected
    set_rng_state(loaded)
    assert draws() == expected


def test_rng_state_contents_are_tensors_and_plain_values():
    state = get_rng_state()
    assert set(state) == {'python', 'numpy', 'torch', 'cuda'}
    assert state['python']['state'].dtype == torch.int64
    assert state['python']['state'].numel() == 625
    assert state['numpy']['key'].dtype == torch.int64 and state['numpy']['key'].numel() == 624
    assert state['torch'].dtype == torch.uint8
    assert isinstance(state['cuda'], list)


def test_set_rng_state_partial_and_unknown_keys():
    set_random_seed(5)
    state = get_rng_state()
    expected_torch = torch.rand(2).tolist()
    set_rng_state({'torch': state['torch']})
    assert torch.rand(2).tolist() == expected_torch
    with pytest.raises(ValueError, match=r"unknown RNG state keys \['pyhton'\]"):
        set_rng_state({'pyhton': state['python']})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')
def test_cuda_rng_state_round_trip(tmp_path):
    set_random_seed(11)
    state = get_rng_state()
    assert len(state['cuda']) == torch.cuda.device_count()
    expected = torch.rand(4, device='cuda').tolist()
    torch.save(state, tmp_path / 'rng.pt')
    set_random_seed(12)
    set_rng_state(torch.load(tmp_path / 'rng.pt', weights_only=True))
    assert torch.rand(4, device='cuda').tolist() == expected
