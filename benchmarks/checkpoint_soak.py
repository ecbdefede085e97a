"""Fault soak: SIGKILL a saving process at random instants, many times, sync and async.

The rounds are ``tests/checkpoint/test_ckpt_crash.py``'s (``run_kill_rounds``): a zygote forks
a child that saves ~6 MiB checkpoints in a loop (with same-name overwrites and retention); it
is killed after a random delay, and after every kill ``last_checkpoint`` must name a
checkpoint that verifies and loads with every tensor equal to its counter, every committed
file must verify, the step must never go backwards, and a later retention must remove every
temp entry the dead writers left. Any violation stops the run with the assertion.

    python benchmarks/checkpoint_soak.py [--kills 120] [--modes sync async] [--seed 1]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'tests' / 'checkpoint'))
from test_ckpt_crash import run_kill_rounds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--kills', type=int, default=120, help='kills per mode')
    parser.add_argument(
        '--modes',
        nargs='+',
        default=['sync', 'async', 'strategy'],
        choices=['sync', 'async', 'strategy'],
    )
    parser.add_argument('--seed', type=int, default=1)
    args = parser.parse_args()
    total = 0
    for mode in args.modes:
        directory = Path(
            tempfile.mkdtemp(prefix=f'soak-{mode}-', dir=ROOT / 'work_dirs')
            if (ROOT / 'work_dirs').is_dir()
            else tempfile.mkdtemp()
        )
        try:
            r = run_kill_rounds(directory, args.kills, mode, seed=args.seed)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        assert r['debris_after_cleanup'] == [], r
        total += r['kills']
        print(
            f'{mode:>5}: {r["kills"]} kills in {r["elapsed"]:.0f}s; {r["resumed"]} rounds '
            f'resumed from a verified checkpoint; {r["mid_save"]} kills left a temp entry '
            f'(landed mid-save); last step {r["last"]}; 0 invariant violations'
        )
    print(f'total: {total} kills, all invariants held')


if __name__ == '__main__':
    main()
