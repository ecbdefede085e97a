"""The keys a config's sections accept: one public home for the readers and for ``doctor``.

Each set is the whole list of keys its reader takes; any other key is an error there
(``config.check_keys``), and ``stratagem doctor`` flags it, with the closest valid name,
before a run. The readers import these sets rather than keeping their own, so the two
cannot drift apart. This module imports nothing of stratagem: any layer may depend on it.

The top level of a config: :data:`LOOP_TOP_KEYS` (what ``stratagem train``'s reference loop
reads), :data:`RUNNER_TOP_KEYS` (what mmengine's ``FlexibleRunner`` reads),
:func:`runner_reasons` (why a config needs the runner) and :func:`read_top_level_keys` (the
one decision about the keys nothing reads: a typo of a known key is an error, plain data a
helper variable of the config file, an imported object no key).
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    'CHECKPOINT_HOOK_KEYS',
    'DEFAULT_HOOK_TYPES',
    'ENV_KEYS',
    'LOGGER_HOOK_KEYS',
    'LOOP_TOP_KEYS',
    'RANDOMNESS_KEYS',
    'RUNNER_TOP_KEYS',
    'TRAIN_DATALOADER_KEYS',
    'TRAIN_CFG_KEYS',
    'TRAIN_LOOP_TYPES',
    'VAL_CFG_KEYS',
    'VAL_DATALOADER_KEYS',
    'TYPO_CUTOFF',
    'TopLevelKeys',
    'is_plain_data',
    'read_top_level_keys',
    'runner_reasons',
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
        'sampler',
        'num_workers',
        'drop_last',
        'pin_memory',
        'collate_fn',
        'persistent_workers',
    }
)
"""``train_dataloader`` (read by the reference loop, ``stratagem train``): ``dataset`` (a
DATASETS cfg, a Dataset, or a callable returning one), ``batch_size`` (per process; default
1), ``shuffle`` (default True) or mmengine's ``sampler=dict(type='DefaultSampler',
shuffle=True)`` (or ``'InfiniteSampler'``; ``seed``: the shuffling seed, default the run's;
``round_up`` True only: the loop shards, shuffles and resumes the data itself), and
``DataLoader``'s ``num_workers``, ``drop_last``, ``pin_memory``, ``collate_fn`` (a function,
or mmengine's ``dict(type='default_collate')``), ``persistent_workers``."""

TRAIN_CFG_KEYS: frozenset[str] = frozenset(
    {
        'type',
        'max_epochs',
        'max_iters',
        'checkpoint_interval',
        'max_keep_ckpts',
        'log_interval',
        'by_epoch',
        'preemption',
        'metrics',
        'straggler',
        'refit_schedulers',
        'val_interval',
        'val_begin',
        'anomaly',
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
``anomaly`` (``dict(nonfinite='skip' | 'rollback' | 'stop', spike=dict(window=100,
zscore=6.0, action='skip'))``; default None: off; see ``stratagem.loop.anomaly``),
``preemption`` (``dict(signals=['SIGTERM', 'SIGUSR1'], requeue=False, exit_code=75)``, the
default; None: off; see ``stratagem.env.preemption``), ``straggler`` (``dict(factor=1.5,
intervals=3, min_seconds=0.01)``, the default: a rank ``factor`` × slower than the others'
median, and ``min_seconds`` more, before the gradient all-reduce in ``intervals`` log
intervals in a row is named; None: off; see
``stratagem.loop.stragglers``), ``refit_schedulers`` (default False: a
resumed run keeps the saved length of a scheduler whose ``end`` was fitted to the earlier
run's length, with a warning when this run's length differs; True: those schedulers take
this run's length, and their values from the resumed iteration on are those of a fresh run
of this length), ``type`` (mmengine's loop names, :data:`TRAIN_LOOP_TYPES`:
``'EpochBasedTrainLoop'`` is ``by_epoch=True`` and takes ``max_epochs``,
``'IterBasedTrainLoop'`` is ``by_epoch=False`` and takes ``max_iters``). mmengine's
``default_hooks.checkpoint`` / ``default_hooks.logger`` give the same settings (see
:data:`CHECKPOINT_HOOK_KEYS`)."""

TRAIN_LOOP_TYPES: dict[str, tuple[bool, str]] = {
    'EpochBasedTrainLoop': (True, 'max_epochs'),
    'IterBasedTrainLoop': (False, 'max_iters'),
}
"""mmengine's training loops that ``train_cfg.type`` may name for the reference loop (also
with the ``mmengine.`` scope): whether each counts in epochs (``by_epoch``) and the run
length it takes (mmengine's ``EpochBasedTrainLoop(max_epochs, val_begin, val_interval)``,
``IterBasedTrainLoop(max_iters, val_begin, val_interval)``)."""

VAL_DATALOADER_KEYS: frozenset[str] = TRAIN_DATALOADER_KEYS
"""``val_dataloader`` (read by the reference loop; validation runs when it is given):
``dataset`` (as in ``train_dataloader``), ``batch_size`` (per process; default 1), ``shuffle``
(default False) or mmengine's ``sampler=dict(type='DefaultSampler', shuffle=False)``
(``seed`` accepted; ``round_up`` True only, and it pads nothing: every sample is read once,
on one rank), ``drop_last`` (False only: validation reads every sample), and
``DataLoader``'s ``num_workers``, ``pin_memory``, ``collate_fn`` (as in
``train_dataloader``), ``persistent_workers``: the keys of :data:`TRAIN_DATALOADER_KEYS`.
Every scalar the model
returns (a dict's scalars, or a bare tensor as ``loss``) is taken as its batch's mean and
averaged over the whole set, each sample counted once; logged as ``val/<name>``."""

VAL_CFG_KEYS: frozenset[str] = frozenset({'type', 'fp16'})
"""``val_cfg`` (read by the reference loop): empty, or ``dict(type='ValLoop')``, with
mmengine's ``fp16`` (default False; True: the validation forwards run under autocast, float16
on CUDA and bfloat16 elsewhere, as mmengine's ``autocast`` picks); how often
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
        'out_dir',
        'backend_args',
        'peer_interval',
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
end), ``out_dir`` (a local path or an fsspec URL, ``'s3://bucket/prefix'``: checkpoints go to
``out_dir/<work_dir's last component>``, with a ``last_checkpoint`` pointer there and one in
the work_dir; logs and metrics stay in the work_dir; ``resume=True`` resumes from there, so a
new machine with an empty work_dir resumes from the bucket alone), ``backend_args`` (the
store's options, e.g. ``dict(endpoint_url=..., key=..., secret=...)`` for S3; without them the
client reads ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ... from the environment),
``peer_interval`` (ours; iterations between peer copies of each rank's state, in this node's
``/dev/shm`` and at a holder rank on another node where there is one: a restart of the whole
job (``--max-restarts``, ``--resume``) loads them when they are at least as new as the newest
checkpoint and verify, else the checkpoint; default 0: none; ``stratagem.checkpoint.peer``).
A key given both here and in ``train_cfg`` must agree."""

LOGGER_HOOK_KEYS: frozenset[str] = frozenset({'type', 'interval'})
"""``default_hooks.logger`` (mmengine's ``LoggerHook``, read by the reference loop):
``interval`` (iterations between log lines and ``metrics.csv`` rows; as
``train_cfg.log_interval``, which must agree when both are given)."""


# ------------------------------------------------------------------ the top level
LOOP_TOP_KEYS: frozenset[str] = frozenset(
    {
        'model',
        'strategy',
        'optim_wrapper',
        'param_scheduler',
        'train_dataloader',
        'train_cfg',
        'val_dataloader',
        'val_cfg',
        'default_hooks',
        'randomness',
        'env_cfg',
        'auto_scale_lr',
        'compile',
        'work_dir',
        'load_from',
        'resume',
        'launcher',
        'log_level',
        'experiment_name',
        'default_scope',
        'custom_imports',
        'runner_type',
    }
)
"""The top-level keys of the reference loop (``stratagem.loop.train``, ``stratagem train``
without mmengine's keys). mmengine's own keys keep mmengine's meaning: ``env_cfg`` gives the
strategy's ``env_kwargs`` defaults (``launcher`` and ``log_level`` its launcher and log
level, ``experiment_name`` its run name), ``auto_scale_lr`` the strategy's, ``compile`` is
``prepare``'s, ``load_from`` / ``resume`` the defaults of ``--load-from`` / ``--resume``
(``resume=True`` with ``load_from``: resume from that file), ``default_hooks`` only its
``checkpoint`` and ``logger`` entries (and mmengine's other default entries, each its default
type with no arguments: the loop does their work), ``default_scope`` only ``'mmengine'`` or
``'stratagem'``, ``runner_type`` only ``'FlexibleRunner'`` (which routes).
``custom_imports`` is imported first (``stratagem.config.imports``). Any other top-level key
is decided by :func:`read_top_level_keys`: a helper variable of the config file when it is
plain data and no known key's typo, else an error."""

RUNNER_TOP_KEYS: frozenset[str] = frozenset(
    {
        'model',
        'work_dir',
        'experiment_name',
        'train_dataloader',
        'optim_wrapper',
        'param_scheduler',
        'train_cfg',
        'val_dataloader',
        'val_evaluator',
        'val_cfg',
        'test_dataloader',
        'test_evaluator',
        'test_cfg',
        'strategy',
        'auto_scale_lr',
        'default_hooks',
        'custom_hooks',
        'data_preprocessor',
        'load_from',
        'resume',
        'launcher',
        'env_cfg',
        'log_processor',
        'log_level',
        'visualizer',
        'default_scope',
        'randomness',
        'compile',
        'custom_imports',
        'runner_type',
    }
)
"""The top-level keys mmengine's ``FlexibleRunner.from_cfg`` reads (mmengine 0.10), plus
``custom_imports`` (read when the config is loaded) and ``runner_type``. The keys here and
not in :data:`LOOP_TOP_KEYS` (``val_evaluator``, ``test_*``, ``custom_hooks``,
``data_preprocessor``, ``log_processor``, ``visualizer``) make ``stratagem train`` run the
config under ``FlexibleRunner`` on stratagem's strategies (:func:`runner_reasons`)."""

DEFAULT_HOOK_TYPES: dict[str, str] = {
    'runtime_info': 'RuntimeInfoHook',
    'timer': 'IterTimerHook',
    'sampler_seed': 'DistSamplerSeedHook',
    'param_scheduler': 'ParamSchedulerHook',
    'visualization': 'VisualizationHook',
    'checkpoint': 'CheckpointHook',
    'logger': 'LoggerHook',
}
"""mmengine's ``default_hooks`` names and their default types. The reference loop reads
``checkpoint`` and ``logger``; each of the others, given as its default type without
arguments, does what the loop does anyway (counters, timing, sampler seeding, scheduler
steps) and stays in the loop, as does a ``VisualizationHook`` without ``draw=True`` (it does
nothing). Another type,
arguments, a hook switched off with None, or another name is mmengine's: the config runs
under ``FlexibleRunner``."""

# keys of older configs that nothing reads now: where their meaning went
_MOVED = {
    'optimizer': "mmcv's; goes in optim_wrapper=dict(optimizer=dict(...))",
    'optimizer_config': "mmcv's; optim_wrapper (clip_grad, accumulative_counts) holds it",
    'lr_config': "mmcv's; param_scheduler=[dict(type=...)] replaces it",
    'runner': "mmcv's; train_cfg=dict(by_epoch=True, max_epochs=N) replaces it",
    'checkpoint_config': "mmcv's; default_hooks=dict(checkpoint=dict(...)) replaces it",
    'log_config': "mmcv's; default_hooks=dict(logger=dict(...)) replaces it",
    'evaluation': "mmcv's; val_cfg, train_cfg.val_interval and val_evaluator replace it",
    'dist_params': "mmcv's; env_cfg=dict(dist_cfg=dict(...)) replaces it",
    'model_wrapper_cfg': "mmengine's Runner's; under stratagem the strategy wraps the model: "
    "strategy=dict(type='DDPStrategy', ...)",
}


def runner_reasons(cfg: Any) -> list[str]:
    """Why ``cfg`` (a config or a mapping) needs mmengine's ``FlexibleRunner`` rather than the
    reference loop: one entry per key (``'val_evaluator'``, ``"runner_type='FlexibleRunner'"``,
    ``'default_hooks.visualization'``, ...); empty when the reference loop reads it all.
    A ``runner_type`` other than ``'FlexibleRunner'`` is a ValueError."""
    reasons = [k for k in sorted(RUNNER_TOP_KEYS - LOOP_TOP_KEYS) if cfg.get(k) is not None]
    runner = cfg.get('runner_type')
    if runner is not None:
        if runner != 'FlexibleRunner':
            raise ValueError(
                f"runner_type={runner!r}: stratagem train runs runner_type='FlexibleRunner' "
                "(mmengine's runner driving stratagem's strategies) or, without runner_type, "
                "its reference loop; mmengine's Runner drives no stratagem strategy"
            )
        reasons.insert(0, "runner_type='FlexibleRunner'")
    scope = cfg.get('default_scope')
    if scope not in (None, 'mmengine', 'stratagem'):
        reasons.append(f'default_scope={scope!r}')
    hooks = cfg.get('default_hooks')
    if isinstance(hooks, Mapping):
        for name, hook in hooks.items():
            if not _default_hook(name, hook):
                reasons.append(f'default_hooks.{name}')
    elif hooks is not None:
        reasons.append('default_hooks')
    return reasons


def _default_hook(name: str, hook: Any) -> bool:
    """Whether the reference loop does what ``default_hooks[name] = hook`` asks."""
    default = DEFAULT_HOOK_TYPES.get(name)
    if default is None or not isinstance(hook, Mapping):
        return False
    if hook.get('type', default) not in (default, f'mmengine.{default}'):
        return False
    if name == 'visualization' and not hook.get('draw', False):
        return True  # mmengine's VisualizationHook does nothing unless it draws
    # checkpoint's and logger's arguments are the loop's to read (and check)
    return name in ('checkpoint', 'logger') or set(hook) <= {'type'}


_PLAIN = (str, int, float, bool, type(None))

# how close an unread key must be to a known one to be its typo (difflib's ratio): 0.8 takes
# 'tran_cfg' (0.94) and 'launch' (0.86), and leaves OpenMMLab's helper names alone
# ('train_dataset' 0.76 to 'train_dataloader', 'norm_cfg' 0.67 to 'env_cfg')
TYPO_CUTOFF = 0.8


def is_plain_data(value: Any) -> bool:
    """Whether ``value`` is data a config file writes: str, int, float, bool, None, and
    lists, tuples and dicts (ConfigDicts) of those."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain_data(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, _PLAIN) and is_plain_data(v) for k, v in value.items())
    return False


@dataclass(frozen=True)
class TopLevelKeys:
    """What :func:`read_top_level_keys` found at a config's top level besides the known keys.

    ``unknown``: the keys that are errors, each with its hint (the close known name, or where
    an older config's key went); ``helpers``: plain data nothing reads and no known key's
    typo, the config file's own variables (``data_root``, ``train_pipeline``, ...),
    accepted; ``objects``: modules, classes, functions and other objects (an imported
    registry), which are no keys at all."""

    unknown: dict[str, str] = field(default_factory=dict)
    helpers: tuple[str, ...] = ()
    objects: tuple[str, ...] = ()


def read_top_level_keys(cfg: Any, known: frozenset[str]) -> TopLevelKeys:
    """The one decision about a config's top-level keys that a reader of ``known`` keys
    does not read (``stratagem train``'s reference loop, its FlexibleRunner route and
    ``stratagem doctor`` all ask it):

    1. a key starting with ``_`` is the config file's own and is never reported;
    2. a module, class or function is no key (mmengine's ``Config`` drops them);
    3. a key of an older config (mmcv's ``optimizer``, ``lr_config``, ...) is an error saying
       where its meaning went;
    4. a key within did-you-mean distance of a known one (``tran_cfg``) is an error naming it;
    5. any other key holding plain data (:func:`is_plain_data`) is a helper variable, as in
       OpenMMLab's configs (``dataset_type``, ``data_root``, ``train_pipeline``): accepted;
       any other object (an imported registry) is no key either."""
    unknown: dict[str, str] = {}
    helpers: list[str] = []
    objects: list[str] = []
    for key in cfg:
        value = cfg[key]
        if not isinstance(key, str) or key.startswith('_') or key in known:
            continue
        if isinstance(
            value, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
        ):
            objects.append(key)
        elif key in _MOVED:
            unknown[key] = _MOVED[key]
        elif close := difflib.get_close_matches(key, sorted(known), n=1, cutoff=TYPO_CUTOFF):
            unknown[key] = f'did you mean {close[0]!r}?'
        else:
            (helpers if is_plain_data(value) else objects).append(key)
    return TopLevelKeys(unknown, tuple(helpers), tuple(objects))
