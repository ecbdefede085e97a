"""Build schedulers from config dicts, with mmengine's defaults and epoch→iter conversion.

What a strategy calls (numbered sequence):

1. ``build_param_schedulers(cfgs, optim_wrapper, epoch_length=, max_epochs=, max_iters=)``
   with the ``param_scheduler`` config (one dict, a list, or, for several
   optimizers, a dict of lists keyed like the optim wrapper dict).
2. For each cfg: a missing ``end`` becomes ``max_epochs`` (``by_epoch=True``,
   the default) or ``max_iters`` (``by_epoch=False``) when known; the built scheduler's
   ``end_fitted`` is then True (its length follows the run, and a resume into a run of
   another length refits it or warns: ``BaseStrategy.resume(refit_schedulers=)``).
3. ``convert_to_iter_based=True`` builds through ``cls.build_iter_from_epoch``
   with ``epoch_length`` (iterations per epoch), which it then requires.
4. Otherwise the class is called with the cfg keys and ``optimizer``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stratagem.registry import PARAM_SCHEDULERS, Registry, RegistryError, build_from_cfg

from .helpers import check_optimizer

__all__ = [
    'build_scheduler_from_cfg',
    'build_param_scheduler',
    'build_param_schedulers',
    'build_param_scheduler_dict',
]

# keys a builder may pass through default_args; the schedulers themselves take none of them
_BUILD_KEYS = ('epoch_length', 'max_epochs', 'max_iters')


def build_scheduler_from_cfg(
    cfg: Mapping[str, Any], registry: Registry, default_args: Mapping[str, Any] | None = None
) -> Any:
    """The PARAM_SCHEDULERS build function (mmengine's ``build_scheduler_from_cfg``).

    Args:
        cfg: Scheduler config with ``type``; may hold ``convert_to_iter_based``.
        registry: Where ``type`` is looked up.
        default_args: Must provide ``optimizer`` (unless ``cfg`` does); may
            provide ``epoch_length`` (needed by ``convert_to_iter_based``) and
            ``max_epochs`` / ``max_iters`` (the default ``end``).

    Returns:
        The built scheduler.
    """
    if not isinstance(cfg, Mapping):
        raise TypeError(
            f'a param_scheduler entry must be a dict with a type, got '
            f'{type(cfg).__name__}: {cfg!r:.80}'
        )
    args = dict(cfg)
    for key, value in (default_args or {}).items():
        args.setdefault(key, value)
    if 'type' not in args:
        raise RegistryError(
            f"param_scheduler entry {dict(cfg)!r} has no 'type'; add "
            f"type='<name>' with one of: {', '.join(registry.names())}"
        )
    obj_type = args.pop('type')
    if isinstance(obj_type, str):
        cls = registry.get(obj_type)
        if cls is None:
            raise registry.unknown_name_error(obj_type)
    elif isinstance(obj_type, type):
        cls = obj_type
    else:
        raise TypeError(f"param_scheduler 'type' must be a name or a class, got {obj_type!r}")
    name = cls.__name__
    if 'optimizer' not in args:
        raise ValueError(f'{name}: no optimizer to schedule; pass default_args=dict(optimizer=...)')
    epoch_length = args.pop('epoch_length', None)
    max_epochs = args.pop('max_epochs', None)
    max_iters = args.pop('max_iters', None)
    convert = args.pop('convert_to_iter_based', False)
    fitted = False
    if 'end' not in args:
        default_end = max_epochs if args.get('by_epoch', True) else max_iters
        if default_end is not None:
            args['end'] = default_end
            fitted = True
    if not convert:
        return _mark_fitted(build_from_cfg({'type': cls, **args}, registry), fitted)
    if not args.get('by_epoch', True):
        raise ValueError(
            f'{name}: convert_to_iter_based=True needs an epoch-based config, '
            'but by_epoch=False; drop one of the two'
        )
    if epoch_length is None:
        raise ValueError(
            f'{name}: convert_to_iter_based=True needs epoch_length (iterations '
            'per epoch); pass epoch_length= to the builder (e.g. '
            'len(train_dataloader)) or set --epoch-length'
        )
    try:
        return _mark_fitted(cls.build_iter_from_epoch(epoch_length=epoch_length, **args), fitted)
    except TypeError as e:
        raise TypeError(
            f'cannot build {name} (convert_to_iter_based) from cfg keys '
            f'{sorted(k for k in args if k != "optimizer")}: {e}'
        ) from e


def _mark_fitted(scheduler: Any, fitted: bool) -> Any:
    """Record that ``scheduler``'s ``end`` (and what derives from it, e.g. ``T_max``) was
    fitted to the run's length rather than given by its config."""
    if fitted:
        scheduler.end_fitted = True
    return scheduler


# mmengine's PARAM_SCHEDULERS builds through the function above; so does ours once this
# module is imported (the registry imports it on its first lookup).
PARAM_SCHEDULERS.build_func = build_scheduler_from_cfg


def _is_single_optimizer(obj: Any) -> bool:
    try:
        check_optimizer(obj, 'param_scheduler')
    except TypeError:
        return False
    return True


def _is_built(obj: Any) -> bool:
    return not isinstance(obj, Mapping) and hasattr(obj, 'step') and hasattr(obj, 'state_dict')


def build_param_scheduler(
    cfg: Mapping[str, Any] | Any,
    optimizer: Any,
    *,
    epoch_length: int | None = None,
    max_epochs: int | None = None,
    max_iters: int | None = None,
) -> Any:
    """Build one scheduler for ``optimizer`` (an already built scheduler passes through).

    Args:
        cfg: Scheduler config dict (or a built scheduler).
        optimizer: Optimizer or optim wrapper.
        epoch_length: Iterations per epoch; needed by ``convert_to_iter_based``.
        max_epochs: Default ``end`` of epoch-based configs. None: INF.
        max_iters: Default ``end`` of iteration-based configs. None: INF.
    """
    if _is_built(cfg):
        return cfg
    default_args: dict[str, Any] = {'optimizer': optimizer}
    for key, value in zip(_BUILD_KEYS, (epoch_length, max_epochs, max_iters)):
        if value is not None:
            default_args[key] = value
    return build_scheduler_from_cfg(cfg, PARAM_SCHEDULERS, default_args)


def _as_list(cfgs: Any) -> list:
    if cfgs is None:
        return []
    if isinstance(cfgs, Mapping) or _is_built(cfgs):
        return [cfgs]
    if isinstance(cfgs, Sequence) and not isinstance(cfgs, str):
        return list(cfgs)
    raise TypeError(
        f'param_scheduler must be a dict, a list of dicts or a dict of lists, got '
        f'{type(cfgs).__name__}: {cfgs!r:.80}'
    )


def build_param_schedulers(
    cfgs: Any,
    optim_wrapper: Any,
    epoch_length: int | None = None,
    max_epochs: int | None = None,
    max_iters: int | None = None,
) -> list | dict[str, list]:
    """Build the ``param_scheduler`` config for an optimizer, wrapper or wrapper dict.

    Args:
        cfgs: One scheduler dict, a list of them, or None (no schedulers). For a
            dict of optim wrappers also a dict ``{name: list}`` (see
            :func:`build_param_scheduler_dict`).
        optim_wrapper: Optimizer, optim wrapper, or a mapping/``OptimWrapperDict``
            of named wrappers.
        epoch_length: Iterations per epoch; needed by ``convert_to_iter_based``.
        max_epochs: Default ``end`` of epoch-based configs.
        max_iters: Default ``end`` of iteration-based configs.

    Returns:
        A list of schedulers, in config order; a dict of such lists for a dict
        of wrappers.
    """
    if not _is_single_optimizer(optim_wrapper) and hasattr(optim_wrapper, 'items'):
        return build_param_scheduler_dict(
            cfgs,
            optim_wrapper,
            epoch_length=epoch_length,
            max_epochs=max_epochs,
            max_iters=max_iters,
        )
    return [
        build_param_scheduler(
            cfg,
            optim_wrapper,
            epoch_length=epoch_length,
            max_epochs=max_epochs,
            max_iters=max_iters,
        )
        for cfg in _as_list(cfgs)
    ]


def build_param_scheduler_dict(
    cfgs: Any,
    optim_wrappers: Any,
    epoch_length: int | None = None,
    max_epochs: int | None = None,
    max_iters: int | None = None,
) -> dict[str, list]:
    """Build schedulers for several named optimizers (mmengine's OptimWrapperDict case).

    If ``cfgs`` is a dict without ``type``, ``cfgs[name]`` is built for the
    wrapper ``name`` (a name mapped to None gets no schedulers); otherwise the
    same configs are built for every wrapper.

    Returns:
        ``{name: [schedulers]}`` in the wrappers' order.
    """
    per_name = isinstance(cfgs, Mapping) and 'type' not in cfgs
    out: dict[str, list] = {}
    for name, wrapper in optim_wrappers.items():
        if per_name:
            if name not in cfgs:
                raise KeyError(
                    f'param_scheduler has no entry for optimizer {name!r}; keys: '
                    f'{sorted(cfgs)}; give one per optimizer ({name}=None for none)'
                )
            entry = cfgs[name]
        else:
            entry = cfgs
        out[name] = build_param_schedulers(
            entry,
            wrapper,
            epoch_length=epoch_length,  # type: ignore[assignment]
            max_epochs=max_epochs,
            max_iters=max_iters,
        )
    return out
