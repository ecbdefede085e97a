"""Seeding, determinism, and RNG state that survives ``torch.load(weights_only=True)``."""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import torch

from .dist import broadcast_object, get_rank
from .logging import log_rank_zero, rank_prefix

logger = logging.getLogger(__name__)

_MAX_SEED = 2**32  # numpy's legacy seeding accepts [0, 2**32)
_RNG_KEYS = ('python', 'numpy', 'torch', 'cuda')


def set_random_seed(
    seed: int | None = None, deterministic: bool = False, diff_rank_seed: bool = False
) -> int:
    """Seed python ``random``, numpy, torch and every CUDA device; return the seed used.

    Args:
        seed: in [0, 2**32). Default ``None``: rank 0 draws one from the OS and
            broadcasts it, so all ranks agree (the call is then collective).
        deterministic: also set ``cudnn.deterministic=True``, ``cudnn.benchmark=False``,
            ``torch.use_deterministic_algorithms(True)`` and, when CUDA is present and the
            variable is unset, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS needs it).
        diff_rank_seed: add the global rank to the seed, so ranks draw different
            streams (e.g. different augmentations) from one configured seed.
    """
    if seed is None:
        # The OS, not the global RNG: an earlier seeding would make every "random" seed equal.
        drawn = random.SystemRandom().randrange(2**31) if get_rank() == 0 else None
        seed = broadcast_object(drawn, src=0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f'seed must be an int in [0, 2**32) or None, got {seed!r}')
    if diff_rank_seed:
        seed += get_rank()
    if not 0 <= seed < _MAX_SEED:
        raise ValueError(
            f'seed {seed} is outside [0, 2**32)'
            + (' after adding the rank (diff_rank_seed=True)' if diff_rank_seed else '')
            + '; choose a smaller seed'
        )
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        _enable_determinism()
    return seed


def _enable_determinism() -> None:
    if torch.backends.cudnn.benchmark:
        log_rank_zero(
            logger,
            logging.WARNING,
            'deterministic=True turns off '
            'torch.backends.cudnn.benchmark, which may slow training down',
        )
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available() and 'CUBLAS_WORKSPACE_CONFIG' not in os.environ:
        # Without it, deterministic cuBLAS matmuls raise under use_deterministic_algorithms.
        os.environ['CUBLAS_WORKSPACE_CONFIG'] = ':4096:8'
    torch.use_deterministic_algorithms(True)


def get_rng_state() -> dict[str, Any]:
    """The state of python ``random``, numpy's global RNG, torch CPU and every CUDA device.

    Holds only tensors and plain values, so it can be saved with ``torch.save`` and
    loaded with ``torch.load(weights_only=True)``. Keys: ``'python'``, ``'numpy'``,
    ``'torch'`` (uint8 tensor), ``'cuda'`` (list of uint8 tensors, one per device;
    empty without CUDA).
    """
    import numpy as np

    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    return {
        'python': {
            'version': version,
            'state': torch.tensor(internal, dtype=torch.int64),
            'gauss_next': gauss_next,
        },
        'numpy': {
            'bit_generator': np_state['bit_generator'],
            'key': torch.from_numpy(np_state['state']['key'].astype(np.int64)),
            'pos': int(np_state['state']['pos']),
            'has_gauss': int(np_state['has_gauss']),
            'gauss': float(np_state['gauss']),
        },
        'torch': torch.get_rng_state(),
        'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a state from :func:`get_rng_state`; keys that are absent are left alone.

    CUDA states are restored for the devices both the state and this machine have; a
    mismatch in device count is logged, not fatal (resuming on other hardware).
    """
    if not isinstance(state, dict):
        raise TypeError(f'state must be the dict from get_rng_state(), got {type(state)}')
    unknown = sorted(set(state) - set(_RNG_KEYS))
    if unknown:
        raise ValueError(f'unknown RNG state keys {unknown}; valid keys: {list(_RNG_KEYS)}')
    if 'python' in state:
        py = state['python']
        # .cpu(): a checkpoint loaded with map_location='cuda' puts these tensors on the GPU
        internal = tuple(int(v) for v in torch.as_tensor(py['state']).cpu().tolist())
        random.setstate((int(py['version']), internal, py['gauss_next']))
    if 'numpy' in state:
        import numpy as np

        npy = state['numpy']
        key = torch.as_tensor(npy['key']).cpu().numpy().astype(np.uint32)
        np.random.set_state(
            (npy['bit_generator'], key, int(npy['pos']), int(npy['has_gauss']), float(npy['gauss']))
        )
    if 'torch' in state:
        torch.set_rng_state(torch.as_tensor(state['torch'], dtype=torch.uint8).cpu())
    cuda_states = list(state.get('cuda') or [])
    if cuda_states:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available != len(cuda_states):
            logger.warning(
                '%sRNG state holds %d CUDA device states but %d devices are '
                'available; restoring the first %d',
                rank_prefix(),
                len(cuda_states),
                available,
                min(available, len(cuda_states)),
            )
        for index, cuda_state in enumerate(cuda_states[:available]):
            torch.cuda.set_rng_state(
                torch.as_tensor(cuda_state, dtype=torch.uint8).cpu(), device=index
            )
