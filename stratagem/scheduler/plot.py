"""Schedule preview: a config's lr and momentum over iterations (``stratagem plot-schedule``).

:func:`traces_from_config` reads ``optim_wrapper``, ``param_scheduler`` and ``train_cfg``
from the config and runs :func:`~stratagem.scheduler.simulate`; :func:`plot_png` draws a PNG
with matplotlib (the ``plot`` extra, imported only here and only then), :func:`ascii_chart`
a chart for the terminal. The command's arguments and output are in
``stratagem.cli.plot_schedule``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .simulate import ScheduleTrace, simulate

__all__ = ['ascii_chart', 'plot_png', 'trace_summary', 'traces_from_config']


def _run_length(
    train_cfg: Mapping[str, Any], max_iters: int | None
) -> tuple[int | None, int | None]:
    """``(max_epochs, max_iters)`` from mmengine's ``train_cfg`` and ``--max-iters``."""
    loop = train_cfg.get('type', None)
    by_epoch = train_cfg.get('by_epoch', None)
    if (
        loop == 'IterBasedTrainLoop'
        or by_epoch is False
        or ('max_iters' in train_cfg and 'max_epochs' not in train_cfg)
    ):
        return None, max_iters if max_iters is not None else train_cfg.get('max_iters', None)
    return train_cfg.get('max_epochs', None), max_iters


def _named_optimizers(optim_wrapper: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """``{'': cfg}`` for one optimizer, ``{name: cfg}`` for an OptimWrapperDict config."""
    # one optimizer: an optim-wrapper cfg (has 'optimizer') or a bare optimizer cfg ('type')
    if 'optimizer' in optim_wrapper or isinstance(optim_wrapper.get('type', None), str):
        return {'': optim_wrapper}
    named = {k: v for k, v in optim_wrapper.items() if isinstance(v, Mapping)}
    if not named:
        raise ValueError(
            'optim_wrapper has neither an optimizer nor named optimizer configs: '
            f'{dict(optim_wrapper)!r:.200}'
        )
    return named


def traces_from_config(
    cfg: Mapping[str, Any], epoch_length: int | None = None, max_iters: int | None = None
) -> dict[str, ScheduleTrace]:
    """Simulate every optimizer of a config; ``{name: trace}`` (name ``''`` for one optimizer)."""
    optim_wrapper = cfg.get('optim_wrapper', None)
    if optim_wrapper is None:
        optim_wrapper = cfg.get('optimizer', None)
    if optim_wrapper is None:
        raise ValueError(
            "the config has no 'optim_wrapper' (nor 'optimizer'); add e.g. "
            "optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))"
        )
    max_epochs, run_iters = _run_length(cfg.get('train_cfg', None) or {}, max_iters)
    if max_epochs is None and run_iters is None:
        raise ValueError(
            "the config's train_cfg has neither max_epochs nor max_iters; set one "
            'or pass --max-iters N'
        )
    schedulers = cfg.get('param_scheduler', None)
    named = _named_optimizers(optim_wrapper)
    per_name = isinstance(schedulers, Mapping) and 'type' not in schedulers and set(named) != {''}
    traces = {}
    for name, optim_cfg in named.items():
        cfgs = schedulers.get(name, None) if per_name else schedulers
        traces[name] = simulate(
            cfgs, optim_cfg, max_epochs=max_epochs, max_iters=run_iters, epoch_length=epoch_length
        )
    return traces


def ascii_chart(
    values: Sequence[float],
    width: int = 72,
    height: int = 12,
    epoch_length: int | None = None,
    title: str = '',
) -> str:
    """A terminal chart of ``values`` (one per iteration), epoch ticks under the axis.

    Args:
        values: One value per iteration.
        width: Plot columns (iterations are bucketed when there are more).
        height: Plot rows.
        epoch_length: Iterations per epoch, for the ticks; None: no ticks.
        title: First line.
    """
    n = len(values)
    if n == 0:
        return f'{title}\n(no iterations)'
    width = max(1, min(width, n))
    lo, hi = min(values), max(values)
    span = hi - lo

    def row(v: float) -> int:
        return height // 2 if span == 0 else round((v - lo) / span * (height - 1))

    grid = [[' '] * width for _ in range(height)]
    for c in range(width):
        bucket = values[c * n // width : max((c + 1) * n // width, c * n // width + 1)]
        # a bucket spans min..max so that a drop inside it draws as a vertical stroke
        for r in range(row(min(bucket)), row(max(bucket)) + 1):
            grid[r][c] = '*'
    label_w = 10
    lines = [title] if title else []
    for r in range(height - 1, -1, -1):
        label = (
            f'{hi:.3g}'
            if r == height - 1
            else f'{lo:.3g}'
            if r == 0
            else (f'{lo + span * r / (height - 1):.3g}' if r == (height - 1) // 2 else '')
        )
        lines.append(f'{label:>{label_w}} |' + ''.join(grid[r]))
    axis = ['-'] * width
    ticks = [' '] * (width + 8)
    if epoch_length:
        epochs = math.ceil(n / epoch_length)
        every = max(1, math.ceil(epochs * 6 / width))  # labels at least ~6 columns apart
        for e in range(0, epochs + 1):
            col = min(width - 1, e * epoch_length * width // n)
            axis[col] = '+'
            if e % every == 0:
                text = str(e)
                for k, ch in enumerate(text):
                    if col + k < len(ticks):
                        ticks[col + k] = ch
    lines.append(' ' * label_w + ' +' + ''.join(axis))
    if epoch_length:
        lines.append(f'{"epoch":>{label_w}}  ' + ''.join(ticks).rstrip())
    lines.append(f'{"":>{label_w}}  iterations 0..{n - 1}')
    return '\n'.join(lines)


def plot_png(traces: Mapping[str, ScheduleTrace], out: str | Path, title: str = '') -> Path:
    """Draw lr (and momentum, if any) over iterations to ``out``; needs matplotlib."""
    import matplotlib

    matplotlib.use('Agg')  # files only: never open a window or need a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    first = next(iter(traces.values()))
    with_momentum = any(t.momentum is not None for t in traces.values())
    rows = 2 if with_momentum else 1
    fig, grid = plt.subplots(rows, 1, sharex=True, figsize=(10, 3.2 * rows + 0.6), squeeze=False)
    axes = [a[0] for a in grid]
    panels = [('lr', 'learning rate')] + ([('momentum', 'momentum')] if with_momentum else [])
    for ax, (attr, ylabel) in zip(axes, panels):
        for name, trace in traces.items():
            series = getattr(trace, attr)
            if series is None:
                continue
            for g, values in enumerate(series):
                label = ':'.join(p for p in (name, f'group {g}' if len(series) > 1 else '') if p)
                ax.plot(range(len(values)), values, lw=1.4, label=label or None)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis='y', alpha=0.3)
        if len(traces) > 1 or any(len(getattr(t, attr) or []) > 1 for t in traces.values()):
            ax.legend(loc='best', fontsize='small')
    L = first.epoch_length
    if L:
        epochs = math.ceil(first.num_iters / L)
        for ax in axes:
            if epochs <= 60:  # boundaries help reading; beyond this they are a grey wash
                for e in range(1, epochs):
                    ax.axvline(e * L, color='0.85', lw=0.6, zorder=0)
        top = axes[0].secondary_xaxis('top', functions=(lambda x: x / L, lambda e: e * L))
        top.set_xlabel('epoch')
        top.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel('iteration')
    axes[-1].set_xlim(0, max(first.num_iters - 1, 1))
    if title:
        fig.suptitle(title, fontsize='medium')
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def trace_summary(name: str, trace: ScheduleTrace) -> str:
    """One line: iterations, epochs, scheduler names, and lr first / max / min / last."""
    lr = trace.lr[0]
    epochs = (
        f', {trace.num_iters / trace.epoch_length:g} epochs of {trace.epoch_length}'
        if trace.epoch_length
        else ''
    )
    head = f'{name}: ' if name else ''
    return (
        f'{head}{trace.num_iters} iterations{epochs}; schedulers: '
        f'{", ".join(trace.scheduler_names) or "(none)"}; lr first {lr[0]:.4g}, '
        f'max {max(lr):.4g}, min {min(lr):.4g}, last {lr[-1]:.4g}'
    )
