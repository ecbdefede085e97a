"""An mmengine runner config under mmengine's ``FlexibleRunner`` on stratagem's strategies.

``stratagem train CONFIG`` calls :func:`train_with_flexible_runner` for a config that needs
mmengine's runner (``stratagem.schema.runner_reasons``: ``runner_type='FlexibleRunner'``,
``val_evaluator``, ``test_*``, ``custom_hooks``, ``visualizer``, ``log_processor``, mmengine's
``default_hooks`` beyond what the reference loop does, ...). The sequence:

1. ``import stratagem.integrations.mmengine``: stratagem's strategies, optim wrappers and
   schedulers in mmengine's registries (scope ``stratagem``), and stratagem's registries
   falling back to mmengine's (a model registered in mmengine's ``MODELS`` builds).
2. The config as mmengine's runner needs it (:func:`runner_config`): the strategy named as
   stratagem's, a missing ``env_cfg`` filled with one that runs here, the launcher and the
   command line's ``--resume`` / ``--load-from``, a ``CheckpointHook``'s URL ``out_dir``
   reached through fsspec (``mmengine_storage.py``); the checks of :func:`check_runner_config`
   first: a key that neither the runner nor stratagem reads is an error when it is close
   to a valid one (``schema.read_top_level_keys``), else a helper variable of the config
   file (kept, as mmengine keeps it); an object the config's code imported is dropped; a
   ``type`` only stratagem's registry holds is lent to mmengine's, and one neither holds
   is refused, before mmengine prints anything.
3. ``FlexibleRunner.from_cfg(cfg).train()``.

The config was loaded by stratagem's ``Config.fromfile`` (``--cfg-options`` merged, its
``custom_imports`` imported from the config's directory and the working directory:
``stratagem.config.imports``), in every process of a ``--nproc`` run alike; a config given as
a dict has its ``custom_imports`` imported by the same function here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from stratagem import registry as ours
from stratagem.config import (
    Config,
    ConfigError,
    ConfigWarning,
    config_search_dirs,
    import_custom_modules,
)
from stratagem.integrations.mmengine import share_registered_types  # 1: registrations
from stratagem.integrations.mmengine_storage import storage_options, use_fsspec_for_urls
from stratagem.schema import LOOP_TOP_KEYS, RUNNER_TOP_KEYS, read_top_level_keys

__all__ = [
    'check_runner_config',
    'runner_config',
    'stratagem_strategy',
    'train_with_flexible_runner',
]

# train_cfg keys of stratagem's reference loop that mmengine's loops do not take, and where
# their meaning lives under the runner
_LOOP_ONLY_TRAIN_CFG = {
    'checkpoint_interval': 'default_hooks.checkpoint.interval',
    'max_keep_ckpts': 'default_hooks.checkpoint.max_keep_ckpts',
    'log_interval': 'default_hooks.logger.interval',
    'preemption': "custom_hooks=[dict(type='stratagem.PreemptionHook')]",
    'metrics': "mmengine's logger hook and visualizer (vis_backends)",
}
_SAID_STRATEGY: set[str] = set()


def runner_config(
    cfg: Config | Mapping,
    *,
    launcher: str | None = None,
    resume: bool | str = False,
    load_from: str | None = None,
) -> dict:
    """``cfg`` as a dict that ``FlexibleRunner.from_cfg`` builds on stratagem's strategies.

    Args:
        cfg: The loaded config (``--cfg-options`` and ``--work-dir`` applied).
        launcher: ``--launcher``; default: the config's ``launcher``, else the one that
            started this process (``stratagem.env.infer_launcher``).
        resume: ``True`` resumes from the newest checkpoint in ``work_dir``, a path from that
            file (mmengine: ``resume=True, load_from=path``); ``False`` keeps the config's.
        load_from: Weights to load (not the training state); default: the config's.

    Raises:
        ConfigError: a top-level key close to a valid one (a typo), a ``train_cfg`` key
            of the reference loop that mmengine's loops do not take (naming its place), a
            ``type`` neither stratagem's registries nor mmengine's hold; all in one.
    """
    from stratagem.env import infer_launcher

    out = check_runner_config(cfg)
    out['launcher'] = launcher or out.get('launcher') or infer_launcher()
    if out.get('env_cfg') is None:
        # FlexibleRunner's default says nccl, which a machine without CUDA cannot run
        backend = 'nccl' if torch.cuda.is_available() else 'gloo'
        out['env_cfg'] = dict(dist_cfg=dict(backend=backend))
    out['strategy'] = stratagem_strategy(out.get('strategy'), out['launcher'])
    if isinstance(resume, str):
        out['resume'], out['load_from'] = True, resume
    elif resume:
        out['resume'] = True
    if load_from is not None:
        out['load_from'] = load_from
    use_fsspec_for_urls(out, resume)  # an out_dir at a URL: committed as the loop commits
    # the manifest of a checkpoint mmengine's CheckpointHook deletes goes too (mmengine_debris)
    hooks = list(out.get('custom_hooks') or [])
    debris = 'stratagem.CheckpointDebrisHook'
    if not any(isinstance(h, Mapping) and h.get('type') == debris for h in hooks):
        out['custom_hooks'] = [*hooks, dict(type=debris)]
    return out


def stratagem_strategy(strategy: Any, launcher: str) -> Any:
    """The ``strategy`` cfg with its type named as stratagem's in mmengine's registry.

    None or ``'auto'``: ``'stratagem.SingleDeviceStrategy'`` for a single process, else
    ``'stratagem.DDPStrategy'``. A name stratagem registers (``'DDPStrategy'``,
    ``'FSDPStrategy'``, ``'DeepSpeedStrategy'``: mmengine's names too) gets the ``stratagem.``
    scope, said once per name: under ``stratagem train`` stratagem's strategy runs, not
    mmengine's. A scoped name, a class, or a name only mmengine's registry holds (the
    user's own) is left as it is.
    """
    cfg = dict(strategy or {})
    name = cfg.get('type', 'auto')
    if name == 'auto':
        cfg['type'] = f'stratagem.{"SingleDeviceStrategy" if launcher == "none" else "DDPStrategy"}'
    elif isinstance(name, str) and '.' not in name and name in ours.STRATEGIES:
        cfg['type'] = f'stratagem.{name}'
        if name not in _SAID_STRATEGY:
            _SAID_STRATEGY.add(name)
            warnings.warn(
                f"strategy type {name!r} runs as stratagem's {name} ('stratagem.{name}') "
                "under mmengine's FlexibleRunner; to run mmengine's own, build the runner "
                'without stratagem train',
                ConfigWarning,
                stacklevel=3,
            )
    return cfg


def check_runner_config(cfg: Config | Mapping) -> dict:
    """The checks of a config that runs under mmengine's FlexibleRunner, before the runner
    (or torchrun) starts: the top-level keys (``schema.read_top_level_keys``: a known key's
    typo is an error, the config file's helper variables are kept, objects its code
    imported are dropped), the reference loop's ``train_cfg`` keys, and each ``type`` found
    in stratagem's registry or mmengine's (``integrations.mmengine.share_registered_types``).
    Returns the config as a dict; raises one ConfigError listing what is wrong."""
    out = dict(cfg.to_dict() if isinstance(cfg, Config) else cfg)
    where = f'config {getattr(cfg, "filename", None) or ""}'.rstrip()
    errors = _check_keys(out, where)
    try:
        share_registered_types(out)
    except ConfigError as err:
        errors.append(str(err))
    if errors:
        raise ConfigError(f'{where}: ' + '\n'.join(errors))
    return out


def _check_keys(cfg: dict, where: str) -> list[str]:
    """The top-level and ``train_cfg`` keys' errors; the imported objects dropped."""
    keys = read_top_level_keys(cfg, RUNNER_TOP_KEYS | LOOP_TOP_KEYS)
    for name in keys.objects:  # mmengine would write them into its dumped config
        del cfg[name]
    if keys.helpers:
        logging.getLogger('stratagem').debug(
            '%s: helper variables of the config file (nothing reads them): %s',
            where,
            ', '.join(keys.helpers),
        )
    errors = (
        [
            'unknown top-level key(s) '
            + '; '.join(f'{k!r} ({h})' for k, h in keys.unknown.items())
            + f'. valid: {", ".join(sorted(RUNNER_TOP_KEYS))}'
        ]
        if keys.unknown
        else []
    )
    train_cfg = cfg.get('train_cfg') or {}
    ours_only = [k for k in train_cfg if k in _LOOP_ONLY_TRAIN_CFG]
    if ours_only:
        errors.append(
            f"train_cfg {', '.join(repr(k) for k in ours_only)} belong to stratagem's "
            "reference loop; this config runs under mmengine's FlexibleRunner, whose loop "
            'does not take them. Use instead: '
            + '; '.join(f'{k} -> {_LOOP_ONLY_TRAIN_CFG[k]}' for k in ours_only)
        )
    return errors


def train_with_flexible_runner(
    cfg: Config | Mapping,
    *,
    launcher: str | None = None,
    resume: bool | str = False,
    load_from: str | None = None,
) -> Any:
    """Build mmengine's ``FlexibleRunner`` from ``cfg`` (:func:`runner_config`) and train;
    returns the runner (its ``strategy`` is stratagem's)."""
    # a config given as a dict has not been through Config.fromfile: its own modules now,
    # as loop.train does (imported once: a second call finds them loaded)
    import_custom_modules(cfg.get('custom_imports'), config_search_dirs(cfg))
    runner_cfg = runner_config(cfg, launcher=launcher, resume=resume, load_from=load_from)
    # imported once the config passed: mmengine's runner imports DeepSpeed, which prints
    from mmengine.config import Config as MMConfig
    from mmengine.runner import FlexibleRunner

    filename = getattr(cfg, 'filename', None)
    mm_cfg = MMConfig(runner_cfg, filename=str(filename) if filename else None)
    runner = FlexibleRunner.from_cfg(mm_cfg)
    hook = (runner_cfg.get('default_hooks') or {}).get('checkpoint') or {}
    checkpointer = getattr(runner.strategy, 'checkpointer', None)
    if checkpointer is not None and storage_options(hook) is not None:
        # before the runner resumes: the strategy's upload and load reach the hook's store
        checkpointer.backend_args = storage_options(hook)
    runner.train()
    return runner
