"""Run mmengine's own optimizer-wrapper and scheduler unit tests, unchanged, against stratagem.

The four files of mmengine v0.10.7 (160 tests) are obtained, copied into a scratch directory
beside a ``conftest.py`` that installs ``mmengine_alias`` (``mmengine.optim`` -> stratagem),
and run with pytest in a new process. Not part of ``make test``: the default source needs
the network.

Usage (from the repository root)::

    python tests/compat/run_mmengine_tests.py                      # GitHub, tag v0.10.7
    python tests/compat/run_mmengine_tests.py --source ~/mmengine  # a git clone, bare or not
    python tests/compat/run_mmengine_tests.py --source DIR         # a checkout (DIR/tests/...)
    python tests/compat/run_mmengine_tests.py -- -k plateau -x     # after --: pytest's arguments

Exit status: pytest's (0 when every test passed). The last line is pytest's summary.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

REF = 'v0.10.7'
FILES = (
    'tests/test_optim/test_scheduler/test_lr_scheduler.py',
    'tests/test_optim/test_scheduler/test_momentum_scheduler.py',
    'tests/test_optim/test_scheduler/test_param_scheduler.py',
    'tests/test_optim/test_optimizer/test_optimizer_wrapper_dict.py',
)
RAW_URL = 'https://raw.githubusercontent.com/open-mmlab/mmengine/{ref}/{path}'
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFTEST = f'''"""Written by {Path(__file__).name}: mmengine.optim is stratagem here."""
import mmengine_alias  # tests/compat/, on PYTHONPATH
mmengine_alias.install()
'''


def fetch(source: str, ref: str, files: tuple[str, ...] = FILES) -> dict[str, bytes]:
    """The files' bytes by path, from GitHub (``source='github'``), a git clone at ``ref``,
    or a plain checkout directory."""
    found = {}
    for path in files:
        if source == 'github':
            with urllib.request.urlopen(RAW_URL.format(ref=ref, path=path), timeout=60) as r:
                found[path] = r.read()
        elif _is_git(source):
            found[path] = subprocess.run(
                ['git', '-C', source, 'show', f'{ref}:{path}'], check=True, capture_output=True
            ).stdout
        elif (Path(source) / path).is_file():
            found[path] = (Path(source) / path).read_bytes()
        else:
            raise SystemExit(
                f'{source}: no git repository and no {path} in it; pass a clone '
                f'or checkout of mmengine, or --source github'
            )
    return found


def _is_git(source: str) -> bool:
    """A clone, bare or not (``git rev-parse`` succeeds in it)."""
    return (
        Path(source).is_dir()
        and subprocess.run(
            ['git', '-C', source, 'rev-parse', '--git-dir'], capture_output=True
        ).returncode
        == 0
    )


def run(source: str, ref: str, pytest_args: list[str], keep: str | None) -> int:
    workdir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix='mmengine-compat-'))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        for path, data in fetch(source, ref).items():
            (workdir / Path(path).name).write_bytes(data)
        (workdir / 'conftest.py').write_text(CONFTEST)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                [str(REPO), str(HERE)]  # stratagem, and mmengine_alias for the conftest
                + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
            ),
        )
        cmd = [
            sys.executable,
            '-m',
            'pytest',
            '-q',
            '-p',
            'no:cacheprovider',
            '--rootdir',
            str(workdir),
            str(workdir),
            *pytest_args,
        ]
        print(
            f'running mmengine {ref} tests from {source} against stratagem ({REPO}) in {workdir}',
            flush=True,
        )
        return subprocess.run(cmd, cwd=workdir, env=env).returncode
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument(
        '--source',
        default='github',
        help="'github' (default, needs the network), a git clone of mmengine, "
        'or a checkout directory',
    )
    parser.add_argument('--ref', default=REF, help=f'tag or commit (default {REF})')
    parser.add_argument('--keep', metavar='DIR', help='write the tests here and keep them')
    parser.add_argument('pytest_args', nargs='*', help="pytest's arguments, after --")
    args = parser.parse_args(argv)
    return run(args.source, args.ref, args.pytest_args, args.keep)


if __name__ == '__main__':
    sys.exit(main())
