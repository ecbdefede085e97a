"""Failure soak: SIGKILL a random rank of a 2-process ``stratagem train --max-restarts 1`` run
at a random iteration, many times (half the runs with asynchronous saves), and compare every
finished run bit for bit (weights, optimizer state, schedulers) with an uninterrupted run.

Reports the runs that finished, those equal to the uninterrupted run, and the time from each
kill to the first sample the restarted workers read (their first resumed step).

``--preempt N``: instead, N runs each preempted by ``SIGUSR1`` to a random rank at a random
iteration (the first run stops inside an accumulation window, the second signal comes while an
asynchronous save is written; half the runs save asynchronously), then resumed with
``--resume``: reports the final results equal to the uninterrupted run, and the times from
the signal to the committed checkpoint and to the exit (status 75).

``--at-save``: every kill comes while a checkpoint is written (its temporary file exists).

``--hang``: one run under ``--max-restarts 1`` whose rank 1 is SIGSTOPped (``dist_cfg.timeout``
20 s): rank 0 exits naming it, torchrun restarts the job (after SIGKILLing the stopped worker
30 s later) and it ends equal to an uninterrupted run.

    python benchmarks/failure_soak.py [--kills 20] [--seed 1]
    python benchmarks/failure_soak.py --preempt 10 [--seed 1]
    python benchmarks/failure_soak.py --hang
"""

from __future__ import annotations

import argparse
import os
import random
import re
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
    ACC,
    CONFIG,
    ITERS_2,
    clean_env,
    equal,
    final_state,
    finish,
    kill_tree,
    reads,
    start,
    wait_reads,
    workers,
    write_config,
)


def _latest(work: Path) -> str | None:
    try:
        with open(work / 'last_checkpoint') as f:
            return Path(f.read().strip()).name
    except OSError:
        return None


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def kill_soak(args: argparse.Namespace, cfg: Path, want: dict, tmp: Path) -> None:
    rng = random.Random(args.seed)
    finished = same = 0
    delays = []
    for i in range(args.kills):
        work, count = tmp / f'run{i}', tmp / f'count{i}'
        count.mkdir()
        opts = ['--cfg-options', 'strategy.async_checkpoint=True'] if i % 2 else []
        env = clean_env(COUNT_DIR=str(count), SLOW='0.01')
        t0 = time.monotonic()
        proc = start(cfg, work, '--nproc', '2', '--max-restarts', '1', *opts, env=env)
        pids = workers(proc.pid)
        victim = rng.randrange(2)
        at = rng.randrange(4 * 2, 4 * (ITERS_2 - 2))  # a read, 4 per iteration
        if args.at_save:  # as soon as rank 0 writes a checkpoint's temporary file
            while not any(n.startswith('.iter_') for n in _listdir(work)):
                time.sleep(0.001)
            at = reads(count, pids[victim])
        else:
            wait_reads(count, pids[victim], at)
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.monotonic()
        first = None
        while proc.poll() is None and first is None:
            fresh = [
                n
                for n in os.listdir(count)
                if n.endswith('.txt') and int(n.split('.')[0]) not in pids.values()
            ]
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
            f'kill {i + 1:2d}: rank {victim} at iteration {(at - 1) // 4 + 1:2d} '
            f'({"async" if i % 2 else "sync"} saves): finished={ok} equal={eq} '
            f'kill->resumed step {first if first is None else round(first, 2)} s, '
            f'run {time.monotonic() - t0:.1f} s',
            flush=True,
        )
        if not ok:
            print(out[-3000:])
    print(
        f'{args.kills} kills: {finished} runs finished, {same} equal to the uninterrupted '
        f'run; kill -> first resumed step: median {statistics.median(delays):.2f} s, '
        f'min {min(delays):.2f} s, max {max(delays):.2f} s'
    )


def preempt_soak(args: argparse.Namespace, want: dict, tmp: Path) -> None:
    rng = random.Random(args.seed)
    cfg = write_config(
        tmp / 'preempt',
        CONFIG.replace('log_interval=4)', 'log_interval=4, preemption=dict(signals=["SIGUSR1"]))'),
    )
    same = 0
    to_commit, to_exit = [], []
    for i in range(args.preempt):
        work, count = tmp / f'pre{i}', tmp / f'pcount{i}'
        count.mkdir()
        async_save = i % 2 == 1
        if i == 1:  # in the iteration after an asynchronous save of iteration 10
            it = 11
        else:
            it = rng.randrange(3, ITERS_2 - 4)
            if i == 0 and (it + ACC + 1) % ACC == 0:  # stop = it + lead: inside a window
                it += 1
        # a read of iteration `it`; in the second run its first, right after the save of
        # iteration 10 returned while its background write goes on
        at = 4 * (it - 1) + (1 if i == 1 else rng.randrange(1, 5))
        rank = rng.randrange(2)
        opts = ['--cfg-options', 'strategy.async_checkpoint=True'] if async_save else []
        env = clean_env(COUNT_DIR=str(count), SIGNAL_AT=str(at), SIGNAL_RANK=str(rank))
        proc = start(cfg, work, '--nproc', '2', *opts, env=env)
        seen: dict[str, float] = {}
        while proc.poll() is None:
            name = _latest(work)
            if name is not None and name not in seen:
                seen[name] = time.time()
            time.sleep(0.005)
        ended = time.time()
        code, out = finish(proc)
        found = re.search(r'preempted by \S+ after iteration (\d+);', out)
        stop = int(found[1]) if found else None
        sent = float((count / 'signal.time').read_text())
        committed = seen.get(f'iter_{stop}.pth')
        window = stop is not None and stop % ACC != 0
        during = async_save and it % 5 == 1
        ok = code == 75
        if ok:
            code, out = finish(start(cfg, work, '--nproc', '2', '--resume'))
            ok = code == 0
        eq = ok and equal(final_state(work), want)
        same += eq
        if committed is not None:
            to_commit.append(committed - sent)
        to_exit.append(ended - sent)
        how = ('async' if async_save else 'sync') + ' saves'
        how += ', during an async save' if during else ''
        where = ' (inside a window)' if window else ''
        commit = '?' if committed is None else f'{committed - sent:.2f}'
        print(
            f'signal {i + 1:2d}: rank {rank} in iteration {it:2d} ({how}): stopped after '
            f'{stop}{where}; equal={eq}; signal->committed {commit} s, signal->exit '
            f'{ended - sent:.2f} s',
            flush=True,
        )
        if not eq:
            print(out[-3000:])
    print(
        f'{args.preempt} preemptions: {same} of {args.preempt} equal to the uninterrupted run; '
        f'signal -> committed checkpoint median {statistics.median(to_commit):.2f} s '
        f'(max {max(to_commit):.2f} s), signal -> exit median '
        f'{statistics.median(to_exit):.2f} s (max {max(to_exit):.2f} s)'
    )


def hang_run(want: dict, tmp: Path) -> None:
    cfg = write_config(tmp / 'hang', CONFIG.replace('timeout=60', 'timeout=20'))
    count, work = tmp / 'hcount', tmp / 'hang' / 'work'
    count.mkdir()
    env = clean_env(COUNT_DIR=str(count), SLOW='0.01')
    proc = start(cfg, work, '--nproc', '2', '--max-restarts', '1', env=env)
    pids = workers(proc.pid)
    wait_reads(count, pids[1], 4 * 12)  # in iteration 12; the last checkpoint is 10
    os.kill(pids[1], signal.SIGSTOP)
    stopped = time.monotonic()
    first = None
    try:
        while proc.poll() is None and first is None:
            fresh = [
                n
                for n in os.listdir(count)
                if n.endswith('.txt') and int(n.split('.')[0]) not in pids.values()
            ]
            if fresh:
                first = time.monotonic() - stopped
            time.sleep(0.02)
        code, out = finish(proc)
    finally:
        kill_tree(proc.pid)
    eq = code == 0 and equal(final_state(work), want)
    named = 'rank 1' in out and 'stopped answering' in out
    print(
        f'SIGSTOP of rank 1 (timeout 20 s): error naming rank 1: {named}; restarted and '
        f'finished: {code == 0}; equal to the uninterrupted run: {eq}; stop -> first resumed '
        f'step {first if first is None else round(first, 1)} s'
    )
    if not eq:
        print(out[-3000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--kills', type=int, default=20)
    parser.add_argument('--preempt', type=int, default=0, metavar='N')
    parser.add_argument('--hang', action='store_true')
    parser.add_argument('--at-save', action='store_true', help='kill while a checkpoint is written')
    parser.add_argument('--seed', type=int, default=1)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix='failure-soak-'))
    try:
        cfg = write_config(tmp)
        code, out = finish(start(cfg, tmp / 'ref', '--nproc', '2'))
        assert code == 0, out[-3000:]
        want = final_state(tmp / 'ref')
        for sub in ('preempt', 'hang'):
            (tmp / sub).mkdir()
        if args.preempt:
            preempt_soak(args, want, tmp)
        elif args.hang:
            hang_run(want, tmp)
        else:
            kill_soak(args, cfg, want, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == '__main__':
    main()
