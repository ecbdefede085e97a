"""The keys a config's sections accept: one public home for the readers and for ``doctor``.

Each set is the whole list of keys its reader takes; any other key is an error there
(``config.check_keys``), and ``stratagem doctor`` flags it, with the closest valid name,
before a run. The readers import these sets rather than keeping their own, so the two
cannot drift apart. This module imports nothing: any layer may depend on it.
"""

from __future__ import annotations

__all__ = [
    'CHECKPOINT_HOOK_KEYS',
    'ENV_KEYS',
    'LOGGER_HOOK_KEYS',
    'RANDOMNESS_KEYS',
    'TRAIN_CFG_KEYS',
    'TRAIN_DATALOADER_KEYS',
    'VAL_CFG_KEYS',
    'VAL_DATALOADER_KEYS',
]

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
        'val_interval',
        'val_begin',
    }
)
"""``train_cfg`` (read by the reference loop, ``stratagem train``): ``max_epochs`` or
``max_iters`` (the run's length; ``max_iters`` wins), ``checkpoint_interval`` (iterations
between saves; 0: only at the end), ``max_keep_ckpts`` (older checkpoints are deleted),
``log_interval`` (iterations; default 10), ``by_epoch`` (whether the run counts in epochs:
``val_interval`` and the log line's position are in epochs; default True unless ``max_iters``
is given; ``stratagem plot-schedule`` reads it too), ``val_interval`` (epochs when
``by_epoch``, else iterations, between validations; default 1; there is always one at the
end), ``val_begin`` (the first epoch or iteration after which validation may run; default 1:
none before training, as mmengine), ``metrics`` (see ``stratagem.metrics``),
``preemption`` (``dict(signals=['SIGTERM', 'SIGUSR1'], requeue=False, exit_code=75)``, the
default; None: off; see ``stratagem.env.preemption``). mmengine's
``default_hooks.checkpoint`` / ``default_hooks.logger`` give the same settings (see
:data:`CHECKPOINT_HOOK_KEYS`)."""

VAL_DATALOADER_KEYS: frozenset[str] = frozenset(
    {
        'dataset',
        'batch_size',
        'shuffle',
        'sampler',
        'num_workers',
        'drop_last',
        'pin_memory',
        'collate_fn',
        'persistent_workers',
    }
)
"""``val_dataloader`` (read by the reference loop; validation runs when it is given):
``dataset`` (as in ``train_dataloader``), ``batch_size`` (per process; default 1), ``shuffle``
(default False) or mmengine's ``sampler=dict(type='DefaultSampler', shuffle=False)``
(``seed`` and ``round_up`` accepted: every sample is read once, on one rank, never padded),
``drop_last`` (False only: validation reads every sample), and ``DataLoader``'s
``num_workers``, ``pin_memory``, ``collate_fn``, ``persistent_workers``. Every scalar the model
returns (a dict's scalars, or a bare tensor as ``loss``) is taken as its batch's mean and
averaged over the whole set, each sample counted once; logged as ``val/<name>``."""

VAL_CFG_KEYS: frozenset[str] = frozenset({'type'})
"""``val_cfg`` (read by the reference loop): empty, or ``dict(type='ValLoop')``; how often
validation runs is ``train_cfg.val_interval`` / ``val_begin``."""

CHECKPOINT_HOOK_KEYS: frozenset[str] = frozenset(
    {
        'type',
        'interval',
        'by_epoch',
        'max_keep_ckpts',
        'save_best',
        'rule',
        'greater_keys',
        'less_keys',
        'save_last',
    }
)
"""``default_hooks.checkpoint`` (mmengine's ``CheckpointHook``, read by the reference loop):
``interval`` (epochs when ``by_epoch``, else iterations; ``train_cfg.checkpoint_interval`` in
iterations), ``by_epoch`` (default: ``train_cfg.by_epoch``), ``max_keep_ckpts`` (as
``train_cfg.max_keep_ckpts``; ``-1`` keeps all), ``save_best`` (a validation value's name,
e.g. ``'acc'``, or ``'auto'``: the first; keeps ``best_{name}_{epoch|iter}_{N}.pth``, which
retention never deletes, and removes the previous best), ``rule`` (``'greater'`` or
``'less'``; default inferred from the name: ``'less'`` for names with loss or error,
``'greater'`` for acc, top, precision, recall, f1, map, auc, iou, dice), ``greater_keys`` /
``less_keys`` (replace those name lists), ``save_last`` (True: the loop always saves at the
end). A key given both here and in ``train_cfg`` must agree."""

LOGGER_HOOK_KEYS: frozenset[str] = frozenset({'type', 'interval'})
"""``default_hooks.logger`` (mmengine's ``LoggerHook``, read by the reference loop):
``interval`` (iterations between log lines and ``metrics.csv`` rows; as
``train_cfg.log_interval``, which must agree when both are given)."""
