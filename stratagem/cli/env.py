"""``stratagem env``: :func:`stratagem.env.collect_env` as ``key: value`` lines."""

from __future__ import annotations

import argparse

from stratagem.env.collect import collect_env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``stratagem env``."""
    parser.add_argument(
        '--details', action='store_true', help="also print torch's build configuration"
    )


def run(args: argparse.Namespace) -> int:
    """Print :func:`collect_env` as ``key: value`` lines; return the exit code."""
    for key, value in collect_env(details=args.details).items():
        print(f'{key}: {value}')
    return 0
