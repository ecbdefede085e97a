"""``stratagem plot metrics WORK_DIR``: a run's loss, lr and validation values over the
iterations, read from its ``metrics.csv`` (:mod:`stratagem.metrics`) and drawn as a PNG
(matplotlib, the ``plot`` extra) or, with ``--ascii`` or without matplotlib, as charts in the
terminal. A config's schedule before a run: ``stratagem plot-schedule CONFIG``."""

from __future__ import annotations

import argparse
import sys

from stratagem.metrics import find_metrics_csv, metrics_ascii, metrics_curves, plot_metrics_png


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plot`` arguments to ``parser``."""
    parser.add_argument(
        'what',
        choices=['metrics'],
        help="what to draw: metrics (a run's loss, lr and validation values)",
    )
    parser.add_argument(
        'path',
        metavar='WORK_DIR',
        help="a run's work_dir (its newest metrics.csv: a resumed run's rows are in the file "
        'of the run it resumed), a log directory work_dir/<timestamp>, or a metrics.csv',
    )
    parser.add_argument(
        '--out',
        default=None,
        help='PNG to write (default: metrics.png beside the metrics.csv); ignored with --ascii',
    )
    parser.add_argument(
        '--ascii', action='store_true', help='print terminal charts instead of writing a PNG'
    )


def run(args: argparse.Namespace) -> int:
    """Run ``plot metrics``; returns the exit code (1: nothing to read)."""
    try:
        table = find_metrics_csv(args.path)
        curves = metrics_curves(table)
    except (OSError, ValueError) as err:
        print(f'stratagem plot: error: {err}', file=sys.stderr)
        return 1
    if not curves:
        print(f'stratagem plot: error: {table} holds no rows yet', file=sys.stderr)
        return 1
    use_ascii = args.ascii
    if not use_ascii:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                'matplotlib is not installed (pip install "stratagem[plot]"); printing '
                'terminal charts instead',
                file=sys.stderr,
            )
            use_ascii = True
    if use_ascii:
        print(f'{table}:')
        print(metrics_ascii(curves))
        return 0
    out = plot_metrics_png(
        curves, args.out or table.with_name('metrics.png'), title=str(table.parent)
    )
    print(f'wrote {out}')
    return 0
