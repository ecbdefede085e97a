"""Failure soak: SIGKILL a random rank of a 2-process ``stratagem train --max-restarts 1`` run
at a random iteration, many times (half the runs with asynchronous saves), and compare every
finished run bit for bit (weights, optimizer state, schedulers) with an uninterrupted run.

Reports the runs that finished, those equal to the uninterrupted run, and the time from each
kill to the first sample the restarted workers read (their first resumed step).

    python benchmarks/failure_soak.py [--kills 20] [--seed 1]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'tests'))
from failure_helpers import (  # noqa: E402
    ITERS_2,
    clean_env,
    equal,
    final_state,
    finish,
    start,
    wait_reads,
    workers,
    write_config,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--kills', type=int, default=20)
    parser.add_argument('--seed', type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix='failure-soak-'))
    try:
        cfg = write_config(tmp)
        code, out = finish(start(cfg, tmp / 'ref', '--nproc', '2'))
        assert code == 0, out[-3000:]
        want = final_state(tmp / 'ref')
        finished = same = 0
        delays = []
        for i in range(args.kills):
            work, count = tmp / f'run{i}', tmp / f'count{i}'
            count.mkdir()
            opts = ['--cfg-options', 'strategy.async_checkpoint=True'] if i % 2 else []
            env = clean_env(COUNT_DIR=str(count), SLOW='0.01')
            proc = start(cfg, work, '--nproc', '2', '--max-restarts', '1', *opts, env=env)
            pids = workers(proc.pid)
            victim = rng.randrange(2)
            at = rng.randrange(4 * 2, 4 * (ITERS_2 - 2))  # a read, 4 per iteration
            wait_reads(count, pids[victim], at)
            os.kill(pids[victim], signal.SIGKILL)
            killed = time.monotonic()
            first = None
            while proc.poll() is None and first is None:
                fresh = [n for n in os.listdir(count) if int(n.split('.')[0]) not in pids.values()]
                if fresh:
                    first = time.monotonic() - killed
                time.sleep(0.01)
            code, out = finish(proc)
            ok = code == 0
            eq = ok and equal(final_state(work), want)
            finished += ok
            same += eq
            if first is not None:
                delays.append(first)
            print(
                f'kill {i + 1:2d}: rank {victim} at iteration {at // 4 + 1:2d} '
                f'({"async" if i % 2 else "sync"} saves): finished={ok} equal={eq} '
                f'kill->resumed step {first if first is None else round(first, 2)} s',
                flush=True,
            )
            if not ok:
                print(out[-3000:])
        print(
            f'{args.kills} kills: {finished} runs finished, {same} equal to the uninterrupted '
            f'run; kill -> first resumed step: median {statistics.median(delays):.2f} s, '
            f'min {min(delays):.2f} s, max {max(delays):.2f} s'
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == '__main__':
    main()
