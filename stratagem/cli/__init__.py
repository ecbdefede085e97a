"""The ``stratagem`` command.

Every sub-command's arguments, output and exit status live in this package, one module per
sub-command exposing ``add_arguments(parser)`` and ``run(args) -> int``; the work is a plain
function of the library module that owns it (``loop.train``, ``scheduler.plot``,
``metrics``, ``checkpoint.convert``, ``doctor.diagnose``, ``env.collect_env``), and no library
module imports this package. This module only routes, and imports a sub-command's module only when
that sub-command runs.

Errors a user can act on (a bad config key or value, a missing or damaged file, a checkpoint
that does not fit) print as ``stratagem: error: <message>`` plus one line of advice, and the
command exits with status 1; ``--debug`` anywhere on the command line, or the environment
variable ``STRATAGEM_DEBUG=1``, shows the full traceback instead. Other exceptions
(``AttributeError``, ``AssertionError``, ...) are bugs and always show their traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pickle
import sys
import warnings

from stratagem.config import ConfigAttributeError

# name -> (module, one-line help)
COMMANDS = {
    'train': ('stratagem.cli.train', 'train a model from a config file with the reference loop'),
    'demo': ('stratagem.cli.demo', 'train the example classifier and show the loss falling'),
    'plot-schedule': (
        'stratagem.cli.plot_schedule',
        'preview the lr / momentum schedule of a config (PNG or terminal chart)',
    ),
    'plot': (
        'stratagem.cli.plot',
        "draw a run's loss, lr and validation curves (plot metrics WORK_DIR: PNG or terminal)",
    ),
    'env': ('stratagem.cli.env', 'print the environment (python, torch, CUDA, extras)'),
    'convert': (
        'stratagem.cli.convert',
        'convert a checkpoint (a file, a sharded, DeepSpeed or Hugging Face directory, '
        '.safetensors) to another layout: --to file|sharded|hf|safetensors',
    ),
    'lighthouse': (
        'stratagem.cli.lighthouse',
        "start torchft's lighthouse for fault-tolerant replica groups (train --replica-id)",
    ),
    'doctor': (
        'stratagem.cli.doctor',
        'check a config against this machine before a run (no training); exit 1 with findings',
    ),
}


DEBUG_ENV = 'STRATAGEM_DEBUG'
DEBUG_FLAG = '--debug'
# what bad input raises: config and registry errors (ValueError, TypeError, KeyError, a missing
# key read as an attribute), files
# (OSError), checkpoints (ValueError, UnpicklingError), torch's complaints about shapes and
# devices (RuntimeError), a missing extra (ImportError)
USER_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    OSError,
    RuntimeError,
    ImportError,
    pickle.UnpicklingError,
    ConfigAttributeError,
)


def debug_enabled(argv: list[str] | None = None) -> bool:
    """Whether tracebacks are wanted: ``--debug`` in ``argv`` or ``STRATAGEM_DEBUG`` set."""
    if argv is not None and DEBUG_FLAG in argv:
        return True
    return os.environ.get(DEBUG_ENV, '').strip().lower() not in ('', '0', 'false', 'no')


def error_message(err: BaseException) -> str:
    """The message of a user error, as it prints."""
    if isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str):
        return err.args[0]  # str(KeyError) would wrap the message in quotes
    return str(err) or repr(err)


def format_error(err: BaseException) -> str:
    """``stratagem: error: <message>`` and a line naming the error type and ``--debug``."""
    message = error_message(err)
    rank = os.environ.get('RANK')
    who = f' (rank {rank})' if rank is not None and os.environ.get('WORLD_SIZE', '1') != '1' else ''
    return (
        f'stratagem: error{who}: {message}\n'
        f'({type(err).__name__}; run with {DEBUG_FLAG} or {DEBUG_ENV}=1 for the traceback)'
    )


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--version`` and ``--debug``, which every parser lists (``--debug`` is read from
    the raw command line by :func:`main`, before parsing)."""
    from stratagem.version import __version__

    parser.add_argument(
        '--version',
        action='version',
        version=f'stratagem {__version__}',
        help='print the version of stratagem and exit',
    )
    parser.add_argument(
        DEBUG_FLAG,
        action='store_true',
        help='show the full traceback of an error instead of the one-line message '
        f'(also: {DEBUG_ENV}=1); anywhere on the command line',
    )


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; sub-command arguments are added when that sub-command is chosen."""
    parser = argparse.ArgumentParser(
        prog='stratagem',
        description='the stratagem command: train from a config, check a config before a run, '
        "convert checkpoints, preview schedules, plot a run's metrics, print the environment",
    )
    parser.add_argument('command', choices=sorted(COMMANDS), help='sub-command')
    add_common_arguments(parser)
    return parser


def build_sub_parser(name: str) -> argparse.ArgumentParser:
    """The parser of sub-command ``name`` (its module's ``add_arguments``, then
    ``--version`` and ``--debug``)."""
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(prog=f'stratagem {name}', description=help_)
    module.add_arguments(sub)
    add_common_arguments(sub)
    return sub


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``stratagem`` and ``python -m stratagem``; returns the exit code.

    0 on success, 1 after an error a user can act on (printed as ``stratagem: error: ...``),
    2 for a usage error, 130 on Ctrl-C.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_enabled(argv)
    # warnings print as one line each, without python's source-line echo; formatwarning (not
    # showwarning) so that a caller recording warnings (pytest.warns) still sees them
    saved_format = warnings.formatwarning
    if not debug:
        warnings.formatwarning = _format_warning
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        from .worker_errors import record_interrupt

        if not record_interrupt():  # a torchrun worker: the parent says it once
            print('stratagem: interrupted', file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        if debug:
            raise
        from .worker_errors import record

        if not record(err, error_message(err)):  # a torchrun worker: the parent prints it
            print(format_error(err), file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = saved_format


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f'stratagem: warning: {message} [{category.__name__}]\n'


def _dispatch(argv: list[str]) -> int:
    debug = DEBUG_FLAG in argv
    argv = [a for a in argv if a != DEBUG_FLAG]
    if not argv or argv[0] in ('-h', '--help'):
        build_parser().print_help()
        print('\nsub-commands:')
        for name, (_, help_) in sorted(COMMANDS.items()):
            print(f'  {name:<14} {help_}')
        return 0 if argv else 2
    if argv[0] == '--version':
        from stratagem.version import __version__

        print(f'stratagem {__version__}')
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        build_parser().parse_args([name])  # --version, or the usage error with the choices
    module = importlib.import_module(COMMANDS[name][0])
    args = build_sub_parser(name).parse_args(rest)
    # for a sub-command that re-launches itself (train --nproc); keeps --debug for the children
    args.cli_argv = [*rest, DEBUG_FLAG] if debug else rest
    return int(module.run(args) or 0)
