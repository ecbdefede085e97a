"""The keys a config's sections accept: one public home for the readers and for ``doctor``.

Each set is the whole list of keys its reader takes; any other key is an error there
(``config.check_keys``), and ``stratagem doctor`` flags it, with the closest valid name,
before a run. The readers import these sets rather than keeping their own, so the two
cannot drift apart. This module imports nothing: any layer may depend on it.
"""

from __future__ import annotations

__all__ = ['ENV_KEYS', 'RANDOMNESS_KEYS', 'TRAIN_DATALOADER_KEYS', 'TRAIN_CFG_KEYS']

ENV_KEYS: frozenset[str] = frozenset(
    {'launcher', 'cudnn_benchmark', 'mp_cfg', 'dist_cfg', 'resource_limit', 'randomness'}
)
"""``strategy.env_kwargs`` (read by ``BaseStrategy``): ``launcher`` ('none' | 'pytorch' |
'slurm' | 'mpi'; default: inferred), ``cudnn_benchmark`` (bool), ``mp_cfg``
(``setup_multi_processing`` kwargs), ``dist_cfg`` (``init_dist`` kwargs), ``resource_limit``
(RLIMIT_NOFILE soft limit; default 4096), ``randomness`` (see :data:`RANDOMNESS_KEYS`)."""

RANDOMNESS_KEYS: frozenset[str] = frozenset({'seed', 'deterministic', 'diff_rank_seed'})
"""``randomness`` (top level, or ``strategy.env_kwargs.randomness``; read by
``BaseStrategy``): ``seed`` (int; default: drawn on rank 0 and agreed), ``deterministic``
(bool), ``diff_rank_seed`` (bool: each rank seeds with ``seed + rank``)."""

TRAIN_DATALOADER_KEYS: frozenset[str] = frozenset(
    {
        'dataset',
        'batch_size',
        'shuffle',
        'num_workers',
        'drop_last',
        'pin_memory',
        'collate_fn',
        'persistent_workers',
    }
)
"""``train_dataloader`` (read by the reference loop, ``stratagem train``): ``dataset`` (a
DATASETS cfg, a Dataset, or a callable returning one), ``batch_size`` (per process; default
1), ``shuffle`` (default True), and ``DataLoader``'s ``num_workers``, ``drop_last``,
``pin_memory``, ``collate_fn``, ``persistent_workers``."""

TRAIN_CFG_KEYS: frozenset[str] = frozenset(
    {
        'max_epochs',
        'max_iters',
        'checkpoint_interval',
        'max_keep_ckpts',
        'log_interval',
        'by_epoch',
        'preemption',
        'metrics',
        'refit_schedulers',
    }
)
"""``train_cfg`` (read by the reference loop, ``stratagem train``): ``max_epochs`` or
``max_iters`` (the run's length; ``max_iters`` wins), ``checkpoint_interval`` (iterations
between saves; 0: only at the end), ``max_keep_ckpts`` (older checkpoints are deleted),
``log_interval`` (iterations; default 10), ``by_epoch`` (accepted for mmengine configs;
``stratagem plot-schedule`` reads it), ``preemption`` (``dict(signals=['SIGTERM',
'SIGUSR1'], requeue=False, exit_code=75)``, the default; None: off; see
``stratagem.env.preemption``), ``refit_schedulers`` (default False: a resumed run keeps the
saved length of a scheduler whose ``end`` was fitted to the earlier run's length, with a
warning when this run's length differs; True: those schedulers take this run's length, and
their values from the resumed iteration on are those of a fresh run of this length)."""
