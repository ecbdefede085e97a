"""Preview a schedule: the lr and momentum of every iteration, without a model or data.

:func:`simulate` builds the optimizer on dummy parameters, builds the schedulers
as a strategy would, and steps them the way mmengine's ``ParamSchedulerHook``
does: iteration-based schedulers after every iteration, epoch-based ones after
every epoch, ``ReduceOnPlateau`` with the given validation metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stratagem.registry import OPTIMIZERS

from .builder import build_param_schedulers

__all__ = ['ScheduleTrace', 'simulate', 'optimizer_cfg_of']


@dataclass
class ScheduleTrace:
    """Per-iteration values of a simulated run.

    Attributes:
        lr: ``lr[g][i]``: learning rate of param group ``g`` during iteration ``i``.
        momentum: Same layout for momentum (``betas[0]`` for Adam-family
            optimizers); None when the optimizer has neither.
        epoch_length: Iterations per epoch (epoch ticks); None for a purely
            iteration-based run.
        num_iters: Number of iterations simulated.
        scheduler_names: Class names of the schedulers, in build order.
    """

    lr: list[list[float]]
    momentum: list[list[float]] | None
    epoch_length: int | None
    num_iters: int
    scheduler_names: list[str] = field(default_factory=list)


def optimizer_cfg_of(cfg: Mapping[str, Any]) -> dict:
    """The optimizer config inside an optim-wrapper config, or ``cfg`` itself."""
    if isinstance(cfg.get('optimizer', None), Mapping):
        return dict(cfg['optimizer'])
    return dict(cfg)


def _momentum(group: Mapping[str, Any]) -> float | None:
    if 'betas' in group:
        return float(group['betas'][0])
    if 'momentum' in group:
        return float(group['momentum'])
    return None


def simulate(
    param_scheduler_cfgs: Any,
    optimizer_cfg: Mapping[str, Any],
    max_epochs: int | None = None,
    max_iters: int | None = None,
    epoch_length: int | None = None,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
    metrics: Sequence[Mapping[str, float]] | None = None,
) -> ScheduleTrace:
    """Step the schedulers of a config and record lr/momentum of every iteration.

    Args:
        param_scheduler_cfgs: The ``param_scheduler`` config (dict or list).
        optimizer_cfg: Optimizer config (``dict(type='SGD', lr=0.1, ...)``) or an
            optim-wrapper config holding one under ``optimizer``.
        max_epochs: Length of an epoch-based run. With ``max_iters`` too, the
            run is epoch-based and cut after ``max_iters`` iterations.
        max_iters: Length of an iteration-based run (when ``max_epochs`` is None).
        epoch_length: Iterations per epoch. Needed when an epoch-based run has
            iteration-based schedulers, when ``convert_to_iter_based`` is used,
            and when an iteration-based run has epoch-based schedulers. An
            epoch-based run of epoch-based schedulers alone defaults to 1 (one
            value per epoch).
        param_groups: Per-group overrides of the optimizer config, e.g.
            ``[{}, {'lr': 0.01}]`` for two groups. Defaults to one group.
        metrics: Validation results after each epoch, for ``ReduceOnPlateau``.

    Returns:
        A :class:`ScheduleTrace`.
    """
    run_epoch_length, total, build_epochs, build_iters = _lengths(
        max_epochs, max_iters, epoch_length
    )
    groups = [dict(g) for g in (param_groups or [{}])]
    for entry in groups:
        entry['params'] = [torch.nn.Parameter(torch.zeros(1))]
    optimizer = OPTIMIZERS.build(optimizer_cfg_of(optimizer_cfg), default_args={'params': groups})
    schedulers = build_param_schedulers(
        param_scheduler_cfgs,
        optimizer,
        epoch_length=epoch_length,
        max_epochs=build_epochs,
        max_iters=build_iters,
    )
    assert isinstance(schedulers, list)  # one optimizer: a list
    _check_placeable(schedulers, max_epochs is not None, epoch_length)
    # a dry step (no gradients: nothing changes) so the schedulers know the optimizer went
    # first, as in training, and do not warn about the order
    optimizer.step()
    lrs, moms = _record(optimizer, schedulers, total, run_epoch_length, metrics)
    return ScheduleTrace(
        lr=lrs,
        momentum=moms,
        epoch_length=run_epoch_length,
        num_iters=total,
        scheduler_names=[type(s).__name__ for s in schedulers],
    )


def _lengths(
    max_epochs: int | None, max_iters: int | None, epoch_length: int | None
) -> tuple[int | None, int, int | None, int]:
    """``(epoch_length of the run, iterations simulated, max_epochs and max_iters the
    schedulers are built for)``; a ValueError for a run without a length or a bad
    ``epoch_length``. An epoch-based run without ``epoch_length`` has epochs of 1."""
    if max_epochs is None and max_iters is None:
        raise ValueError(
            'simulate: give max_epochs (epoch-based run) or max_iters (iteration-based run)'
        )
    if epoch_length is not None and (not isinstance(epoch_length, int) or epoch_length <= 0):
        raise ValueError(f'simulate: epoch_length must be a positive int, got {epoch_length!r}')
    if max_epochs is not None:
        run_epoch_length = epoch_length if epoch_length is not None else 1
        build_iters = max_epochs * run_epoch_length
        total = build_iters if max_iters is None else min(build_iters, max_iters)
        return run_epoch_length, total, max_epochs, build_iters
    assert max_iters is not None
    build_epochs = math.ceil(max_iters / epoch_length) if epoch_length else None
    return epoch_length, max_iters, build_epochs, max_iters


def _check_placeable(schedulers: list, by_epoch_run: bool, epoch_length: int | None) -> None:
    """Without ``epoch_length``, refuse a scheduler whose steps cannot be placed: an
    iteration-based one in an epoch-based run, an epoch-based one in an iteration-based run."""
    if epoch_length is not None:
        return
    for s in schedulers:
        name = type(s).__name__
        if by_epoch_run and not s.by_epoch:
            raise ValueError(
                f'simulate: {name} is iteration-based (by_epoch=False); an '
                'epoch-based run needs epoch_length (iterations per epoch) to place '
                'its steps; pass epoch_length= / --epoch-length'
            )
        if not by_epoch_run and s.by_epoch:
            raise ValueError(
                f'simulate: {name} is epoch-based (by_epoch=True) but the run is '
                'iteration-based; pass epoch_length= / --epoch-length to say when '
                'an epoch ends'
            )


def _record(
    optimizer: torch.optim.Optimizer,
    schedulers: list,
    total: int,
    epoch_length: int | None,
    metrics: Sequence[Mapping[str, float]] | None,
) -> tuple[list[list[float]], list[list[float]] | None]:
    """Each group's lr and momentum (None without one) during each of ``total`` iterations,
    the schedulers stepped as mmengine's ParamSchedulerHook does: iteration-based ones after
    every iteration, epoch-based ones after every epoch, ``need_val_args`` ones with that
    epoch's ``metrics``."""
    has_momentum = _momentum(optimizer.param_groups[0]) is not None
    lrs: list[list[float]] = [[] for _ in optimizer.param_groups]
    moms: list[list[float]] = [[] for _ in optimizer.param_groups]
    for it in range(total):
        for g, group in enumerate(optimizer.param_groups):
            lrs[g].append(float(group['lr']))
            if has_momentum:
                moms[g].append(_momentum(group))  # type: ignore[arg-type]
        for s in schedulers:
            if not s.by_epoch:
                s.step()
        if epoch_length is not None and (it + 1) % epoch_length == 0:
            _end_epoch(schedulers, (it + 1) // epoch_length - 1, metrics)
    return lrs, moms if has_momentum else None


def _end_epoch(schedulers: list, epoch: int, metrics: Sequence[Mapping[str, float]] | None) -> None:
    """After epoch ``epoch`` (0-based): the epoch-based schedulers, then the metric-driven
    ones with that epoch's metrics (when given)."""
    for s in schedulers:
        if s.by_epoch:
            s.step()
    if metrics is not None and epoch < len(metrics):
        for s in schedulers:
            if getattr(s, 'need_val_args', False):
                s.step(metrics[epoch])
