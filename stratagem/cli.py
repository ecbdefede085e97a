"""The ``stratagem`` command.

Each sub-command lives in the module that owns its work and exposes
``add_arguments(parser)`` and ``run(args) -> int``; this file only routes, and
imports a sub-command's module only when that sub-command runs.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    'train': ('stratagem.loop', 'train a model from a config file with the reference loop'),
    'demo': ('stratagem.demo', 'train the example classifier and show the loss falling'),
    'plot-schedule': ('stratagem.scheduler.plot',
                      'preview the lr / momentum schedule of a config (PNG or terminal chart)'),
    'env': ('stratagem.env.collect', 'print the environment (python, torch, CUDA, extras)'),
    'convert': ('stratagem.checkpoint.convert',
                'convert a checkpoint: sharded directory <-> single file (--to sharded)'),
    'doctor': ('stratagem.doctor', 'check a config against this machine before a run (no '
               'training); exit 1 with findings'),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; sub-command arguments are added when that sub-command is chosen."""
    parser = argparse.ArgumentParser(prog='stratagem', description=__doc__.splitlines()[0])
    parser.add_argument('command', choices=sorted(COMMANDS), help='sub-command')
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``stratagem`` and ``python -m stratagem``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        build_parser().print_help()
        print('\nsub-commands:')
        for name, (_, help_) in sorted(COMMANDS.items()):
            print(f'  {name:<14} {help_}')
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        build_parser().parse_args([name])  # prints the usage error with valid choices, exits 2
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(prog=f'stratagem {name}', description=help_)
    module.add_arguments(sub)
    args = sub.parse_args(rest)
    args.cli_argv = rest  # for a sub-command that re-launches itself (train --nproc)
    return int(module.run(args) or 0)


if __name__ == '__main__':
    raise SystemExit(main())
