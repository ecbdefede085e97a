"""``stratagem plot-schedule CONFIG``: draw a config's lr and momentum over iterations.

Reads ``optim_wrapper``, ``param_scheduler`` and ``train_cfg`` from the config,
runs :func:`~stratagem.scheduler.simulate`, and draws a PNG with matplotlib (the
``plot`` extra, imported only here and only then) or, with ``--ascii`` or
without matplotlib, a chart in the terminal.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .simulate import ScheduleTrace, simulate

__all__ = ['add_arguments', 'run', 'ascii_chart', 'plot_png', 'traces_from_config']


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plot-schedule`` arguments to ``parser``."""
    parser.add_argument('config', help='config file (.py, .json, .yaml)')
    parser.add_argument(
        '--out', default='lr.png', help='PNG to write (default: lr.png); ignored with --ascii'
    )
    parser.add_argument(
        '--ascii', action='store_true', help='print a terminal chart instead of writing a PNG'
    )
    parser.add_argument(
        '--epoch-length',
        type=int,
        default=None,
        metavar='N',
        help='iterations per epoch (len(train_dataloader)); needed when '
        'epoch- and iteration-based schedules mix',
    )
    parser.add_argument(
        '--max-iters',
        type=int,
        default=None,
        metavar='N',
        help='length of an iteration-based run, or where to cut an epoch-based one',
    )


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


def _summary(name: str, trace: ScheduleTrace) -> str:
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


def run(args: argparse.Namespace) -> int:
    """Run ``plot-schedule``; returns the exit code (2 for a config problem)."""
    from stratagem.config import Config

    try:
        cfg = Config.fromfile(args.config)
        epoch_length = args.epoch_length
        if epoch_length is None:
            # the reference loop's data config knows it: one process, as `stratagem train`
            from stratagem.loop import epoch_length_from_config

            epoch_length = epoch_length_from_config(cfg)  # type: ignore[arg-type]
        traces = traces_from_config(cfg, epoch_length=epoch_length, max_iters=args.max_iters)  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError, OSError) as e:
        print(f'stratagem plot-schedule: error: {e}', file=sys.stderr)
        return 2
    title = f'{Path(args.config).name}: ' + ', '.join(
        dict.fromkeys(n for t in traces.values() for n in t.scheduler_names)
    )
    for name, trace in traces.items():
        print(_summary(name, trace))
    use_ascii = args.ascii
    if not use_ascii:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                'matplotlib is not installed (pip install "stratagem[plot]"); printing a '
                'terminal chart instead',
                file=sys.stderr,
            )
            use_ascii = True
    if use_ascii:
        for name, trace in traces.items():
            prefix = f'{name} ' if name else ''
            print(
                ascii_chart(
                    trace.lr[0], epoch_length=trace.epoch_length, title=f'{prefix}learning rate'
                )
            )
            if trace.momentum is not None:
                print(
                    ascii_chart(
                        trace.momentum[0],
                        epoch_length=trace.epoch_length,
                        height=8,
                        title=f'{prefix}momentum',
                    )
                )
        return 0
    out = plot_png(traces, args.out, title=title)
    print(f'wrote {out}')
    return 0
