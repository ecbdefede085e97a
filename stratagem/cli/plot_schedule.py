"""``stratagem plot-schedule CONFIG``: a config's lr and momentum over iterations, drawn by
:mod:`stratagem.scheduler.plot` as a PNG (matplotlib, the ``plot`` extra) or, with
``--ascii`` or without matplotlib, as a chart in the terminal."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stratagem.config import Config
from stratagem.loop import epoch_length_from_config
from stratagem.scheduler.plot import ascii_chart, plot_png, trace_summary, traces_from_config


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


def run(args: argparse.Namespace) -> int:
    """Run ``plot-schedule``; returns the exit code (2 for a config problem)."""
    try:
        cfg = Config.fromfile(args.config)
        epoch_length = args.epoch_length
        if epoch_length is None:
            # the reference loop's data config knows it: one process, as `stratagem train`
            epoch_length = epoch_length_from_config(cfg)  # type: ignore[arg-type]
        traces = traces_from_config(cfg, epoch_length=epoch_length, max_iters=args.max_iters)  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError, OSError) as e:
        print(f'stratagem plot-schedule: error: {e}', file=sys.stderr)
        return 2
    title = f'{Path(args.config).name}: ' + ', '.join(
        dict.fromkeys(n for t in traces.values() for n in t.scheduler_names)
    )
    for name, trace in traces.items():
        print(trace_summary(name, trace))
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
