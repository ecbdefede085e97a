"""``stratagem env``: :func:`stratagem.env.collect_env` as ``key: value`` lines, then what
:func:`stratagem.env.launcher.describe_launch` infers about the launch and from which
variables."""

from __future__ import annotations

import argparse

from stratagem.env.collect import collect_env
from stratagem.env.launcher import describe_launch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``stratagem env``."""
    parser.add_argument(
        '--details', action='store_true', help="also print torch's build configuration"
    )


def run(args: argparse.Namespace) -> int:
    """Print :func:`collect_env` and :func:`describe_launch` as ``key: value`` lines; return
    the exit code (0: a refused launch is reported, not an error of this command)."""
    for key, value in collect_env(details=args.details).items():
        print(f'{key}: {value}')
    for key, value in describe_launch().items():
        print(f'{key}: {value}')
    return 0
