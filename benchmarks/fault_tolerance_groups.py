"""Replica groups over torchft (``strategy.fault_tolerance``): what they cost without a
failure, and the goodput with one group SIGKILLed every K iterations.

- ``--part overhead``: the same training as 2 replica groups of 1 process (a lighthouse, gloo)
  and as plain DDP of 2 processes, the same global batch; the steady step time of each run
  (the median of ``metrics.csv``'s ``step_time_s`` rows after the first) and the ratio. Runs
  interleaved (groups, DDP, groups, ...), medians over ``--runs``.
- ``--part goodput``: 2 groups, group 1 started with ``--max-restarts`` and its worker
  SIGKILLed every ``--kill-every`` iterations of group 0: useful steps per minute of wall time
  (``--iters`` / group 0's launch-to-exit time), updates dropped per failure (group 0's
  uncommitted steps: the only work a kill costs the survivor), and the recovery time (kill ->
  group 1's heal line: torchrun's restart, imports, the build and the transfer), the heal's
  own transfer-and-load seconds. A kill needs the run to outlast the relaunch (torchrun's
  restart and the imports: several seconds on a loaded machine), hence the long default.

    python benchmarks/fault_tolerance_groups.py [--runs 3] [--iters 600] [--kill-every 150]
                                                [--part all|overhead|goodput]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'tests'))
from failure_helpers import Lighthouse, start, workers  # noqa: E402

# the training of benchmarks/fault_tolerance.py: 2.4M parameters, AdamW, batch 32 a process
CONFIG = """
model = dict(type='MLPClassifier', in_features=256, num_classes=10, hidden=1024, num_layers=3)
train_dataloader = dict(dataset=dict(type='SyntheticClassification', num_samples=4096,
                                     num_features=256, num_classes=10),
                        batch_size=32, shuffle=True, num_workers=0)
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3))
train_cfg = dict(max_iters={iters}, checkpoint_interval={iters}, log_interval=10)
randomness = dict(seed=0)
strategy = dict(type='DDPStrategy', checkpoint_timeout=60,
                env_kwargs=dict(dist_cfg=dict(backend='gloo', timeout=60)){ft})
"""
FT = ',\n                fault_tolerance=dict(min_replicas={min_replicas}, timeout=30)'


def _config(directory: Path, iters: int, min_replicas: int | None) -> Path:
    ft = '' if min_replicas is None else FT.format(min_replicas=min_replicas)
    path = directory / ('ft.py' if ft else 'ddp.py')
    path.write_text(CONFIG.format(iters=iters, ft=ft))
    return path


@contextlib.contextmanager
def _job(d: Path, iters: int, min_replicas: int) -> Iterator[tuple[Path, Lighthouse]]:
    """The replica groups' config in ``d`` and a lighthouse, closed after."""
    lighthouse = Lighthouse(min_replicas)
    try:
        yield _config(d, iters, min_replicas), lighthouse
    finally:
        lighthouse.close()


def _group(cfg: Path, d: Path, i: int, lighthouse: Lighthouse, *args: str) -> subprocess.Popen:
    """Replica group ``i`` in ``d/ft``, its output in ``d/g<i>.out``."""
    return start(
        cfg,
        d / 'ft',
        *('--replica-id', str(i), '--lighthouse', lighthouse.address, *args),
        out=d / f'g{i}.out',
        start_new_session=True,
    )


def _step_time(work_dir: Path, pattern: str = '*/metrics.csv') -> float:
    times = []
    for path in sorted(work_dir.glob(pattern)):
        rows = [r for r in csv.DictReader(path.open()) if r.get('step_time_s')]
        times += [float(r['step_time_s']) for r in rows[1:]]
    return statistics.median(times)


def _wait(proc: subprocess.Popen, out: Path, timeout: float = 900) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    if proc.returncode != 0:
        raise RuntimeError(f'{out} failed:\n' + out.read_text(errors='replace')[-3000:])


def overhead(runs: int, iters: int) -> dict:
    groups, ddp = [], []
    for r in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            with _job(d, iters, 2) as (cfg, lh):
                procs = [_group(cfg, d, i, lh) for i in (0, 1)]
                for i, p in enumerate(procs):
                    _wait(p, d / f'g{i}.out')
            groups.append(_step_time(d / 'ft', '*_replica0/metrics.csv'))
            ddp_cfg = _config(d, iters, None)
            p = start(ddp_cfg, d / 'ddp', '--nproc', '2', out=d / 'ddp.out', start_new_session=True)
            _wait(p, d / 'ddp.out')
            ddp.append(_step_time(d / 'ddp'))
        print(
            f'  run {r + 1}: groups {groups[-1] * 1e3:.2f} ms/step, plain DDP '
            f'{ddp[-1] * 1e3:.2f} ms/step',
            flush=True,
        )
    g, p = statistics.median(groups), statistics.median(ddp)
    return {'groups_ms': g * 1e3, 'ddp_ms': p * 1e3, 'ratio': g / p}


def _heals(out: Path) -> int:
    return len(re.findall(r'healed from replica group', out.read_text(errors='replace')))


def _last_row(out: Path) -> int:
    rows = re.findall(r'Iter\(train\) \[(\d+)/', out.read_text(errors='replace'))
    return int(rows[-1]) if rows else 0


def goodput(runs: int, iters: int, kill_every: int) -> dict:
    rates, dropped, recoveries, heals = [], [], [], []
    for r in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            with _job(d, iters, 1) as (cfg, lh):
                kills = max(1, iters // kill_every - 1)
                t0 = time.perf_counter()
                g0 = _group(cfg, d, 0, lh)
                g1 = _group(cfg, d, 1, lh, '--max-restarts', str(kills))
                killed = []
                for k in range(1, kills + 1):
                    while _last_row(d / 'g0.out') < k * kill_every and g0.poll() is None:
                        time.sleep(0.05)
                    if g0.poll() is not None or g1.poll() is not None:
                        break
                    victim = workers(g1.pid, 1, timeout=60)[0]
                    healed = _heals(d / 'g1.out')
                    os.kill(victim, signal.SIGKILL)
                    killed.append(time.perf_counter())
                    # recovery: until the relaunched group logs its heal
                    while _heals(d / 'g1.out') == healed and g0.poll() is None:
                        time.sleep(0.05)
                    if _heals(d / 'g1.out') > healed:
                        recoveries.append(time.perf_counter() - killed[-1])
                _wait(g0, d / 'g0.out')
                wall = time.perf_counter() - t0
                _wait(g1, d / 'g1.out')
            text0 = (d / 'g0.out').read_text(errors='replace')
            text1 = (d / 'g1.out').read_text(errors='replace')
            heals += [
                float(s)
                for s in re.findall(
                    r'healed from replica group 0 at step \d+ '
                    r'in ([\d.]+) s',
                    text1,
                )
            ]
            dropped.append(len(re.findall(r'not committed', text0)) / max(len(killed), 1))
            rates.append(iters / wall * 60)
        print(
            f'  run {r + 1}: {rates[-1]:.1f} steps/min, {len(killed)} kills, '
            f'{dropped[-1]:.2f} updates dropped a kill',
            flush=True,
        )
    return {
        'steps_per_min': statistics.median(rates),
        'dropped_per_kill': statistics.median(dropped),
        'recovery_s': statistics.median(recoveries) if recoveries else None,
        'heal_s': statistics.median(heals) if heals else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--runs', type=int, default=3)
    parser.add_argument('--iters', type=int, default=600)
    parser.add_argument('--kill-every', type=int, default=150)
    parser.add_argument('--part', choices=['all', 'overhead', 'goodput'], default='all')
    args = parser.parse_args()
    print(f'load: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores', flush=True)
    if args.part in ('all', 'overhead'):
        o = overhead(args.runs, args.iters)
        print(
            f'no failure: replica groups {o["groups_ms"]:.2f} ms/step, plain DDP '
            f'{o["ddp_ms"]:.2f} ms/step: {o["ratio"]:.3f}x (medians of {args.runs})'
        )
    if args.part in ('all', 'goodput'):
        g = goodput(args.runs, args.iters, args.kill_every)
        rec = 'n/a' if g['recovery_s'] is None else f'{g["recovery_s"]:.1f} s'
        heal = 'n/a' if g['heal_s'] is None else f'{g["heal_s"]:.3f} s'
        print(
            f'kill every {args.kill_every}: {g["steps_per_min"]:.1f} useful steps/min, '
            f'{g["dropped_per_kill"]:.2f} updates dropped a kill, recovery (kill -> healed) '
            f'{rec}, the heal itself {heal} (medians of {args.runs})'
        )


if __name__ == '__main__':
    main()
