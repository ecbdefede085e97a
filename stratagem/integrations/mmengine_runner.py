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
   command line's ``--resume`` / ``--load-from``; a key that neither the runner nor stratagem
   reads is an error when it is close to a valid one, else a warning naming it.
3. ``FlexibleRunner.from_cfg(cfg).train()``.

The config was loaded by stratagem's ``Config.fromfile`` (``--cfg-options`` merged, its
``custom_imports`` imported from the config's directory and the working directory:
``stratagem.config.imports``), in every process of a ``--nproc`` run alike; a config given as
a dict has its ``custom_imports`` imported by the same function here.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

import stratagem.integrations.mmengine  # noqa: F401  (1: registrations and fallbacks)
from stratagem import registry as ours
from stratagem.config import (
    Config,
    ConfigError,
    ConfigWarning,
    config_search_dirs,
    import_custom_modules,
)
from stratagem.schema import LOOP_TOP_KEYS, RUNNER_TOP_KEYS, unread_top_level_keys

__all__ = ['runner_config', 'stratagem_strategy', 'train_with_flexible_runner']

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
        ConfigError: a top-level key close to a valid one (a typo), or a ``train_cfg`` key
            of the reference loop that mmengine's loops do not take (naming its place).
    """
    from stratagem.env import infer_launcher

    out = dict(cfg.to_dict() if isinstance(cfg, Config) else cfg)
    where = f'config {getattr(cfg, "filename", None) or ""}'.rstrip()
    _check_keys(out, where)
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


def _check_keys(cfg: dict, where: str) -> None:
    unread = unread_top_level_keys(cfg, RUNNER_TOP_KEYS | LOOP_TOP_KEYS)
    typos = {k: h for k, h in unread.items() if h.startswith('did you mean')}
    if typos:
        raise ConfigError(
            f'{where}: unknown top-level key(s) '
            + '; '.join(f'{k!r} ({h})' for k, h in typos.items())
            + f'. valid: {", ".join(sorted(RUNNER_TOP_KEYS))}'
        )
    rest = {k: h for k, h in unread.items() if k not in typos}
    if rest:
        # mmengine's config files carry helper variables (data_root, train_pipeline,
        # vis_backends, ...) that its runner never reads either: said, not refused
        warnings.warn(
            f'{where}: top-level key(s) {", ".join(repr(k) for k in rest)} are read by '
            "neither mmengine's FlexibleRunner nor stratagem ("
            + '; '.join(f'{k}: {h}' for k, h in rest.items())
            + ')',
            ConfigWarning,
            stacklevel=3,
        )
    train_cfg = cfg.get('train_cfg') or {}
    ours_only = [k for k in train_cfg if k in _LOOP_ONLY_TRAIN_CFG]
    if ours_only:
        raise ConfigError(
            f"{where}: train_cfg {', '.join(repr(k) for k in ours_only)} belong to stratagem's "
            "reference loop; this config runs under mmengine's FlexibleRunner, whose loop "
            'does not take them. Use instead: '
            + '; '.join(f'{k} -> {_LOOP_ONLY_TRAIN_CFG[k]}' for k in ours_only)
        )


def train_with_flexible_runner(
    cfg: Config | Mapping,
    *,
    launcher: str | None = None,
    resume: bool | str = False,
    load_from: str | None = None,
) -> Any:
    """Build mmengine's ``FlexibleRunner`` from ``cfg`` (:func:`runner_config`) and train;
    returns the runner (its ``strategy`` is stratagem's)."""
    from mmengine.config import Config as MMConfig
    from mmengine.runner import FlexibleRunner

    # a config given as a dict has not been through Config.fromfile: its own modules now,
    # as loop.train does (imported once: a second call finds them loaded)
    import_custom_modules(cfg.get('custom_imports'), config_search_dirs(cfg))
    runner_cfg = runner_config(cfg, launcher=launcher, resume=resume, load_from=load_from)
    filename = getattr(cfg, 'filename', None)
    mm_cfg = MMConfig(runner_cfg, filename=str(filename) if filename else None)
    runner = FlexibleRunner.from_cfg(mm_cfg)
    runner.train()
    return runner
