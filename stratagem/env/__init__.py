"""The process environment: launcher, process group, seeds, resources, logging.

Importing this package imports torch and nothing heavier; it changes no environment
variable and configures no logging. ``collect_env`` is resolved on first use because it
is only needed by ``stratagem env`` and bug reports.
"""

from importlib import import_module
from typing import Any

from .dist import (
    all_gather_keys,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    default_device,
    get_dist_info,
    get_local_rank,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_process,
    key_of,
    master_only,
)
from .launcher import LAUNCHERS, infer_launcher, init_dist
from .logging import (
    get_logger,
    log_rank_zero,
    print_log,
    rank_prefix,
    warn_per_rank,
    warn_rank_zero,
)
from .resources import set_resource_limit, setup_multi_processing
from .seed import get_rng_state, set_random_seed, set_rng_state
from .slurm import expand_slurm_nodelist

__all__ = [
    'LAUNCHERS',
    'infer_launcher',
    'init_dist',
    'expand_slurm_nodelist',
    'is_distributed',
    'get_rank',
    'get_world_size',
    'get_dist_info',
    'get_local_rank',
    'default_device',
    'is_main_process',
    'master_only',
    'barrier',
    'broadcast',
    'broadcast_object',
    'all_reduce',
    'all_gather_object',
    'all_gather_keys',
    'key_of',
    'set_random_seed',
    'get_rng_state',
    'set_rng_state',
    'set_resource_limit',
    'setup_multi_processing',
    'get_logger',
    'print_log',
    'log_rank_zero',
    'warn_rank_zero',
    'warn_per_rank',
    'rank_prefix',
    'collect_env',
]


def __getattr__(name: str) -> Any:
    if name == 'collect_env':
        return import_module('.collect', __name__).collect_env
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
