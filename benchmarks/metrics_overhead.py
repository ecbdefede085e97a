"""What ``stratagem train``'s run metrics cost: the reference loop with its metrics writers on
(CSV + TensorBoard, the default) against the same loop with them off, interleaved rounds.

The tiny MLP of ``benchmarks/overhead.py`` (2×Linear(32), batch 8, SGD): the worst case,
since its steps are the shortest. Each round trains ``--iters`` iterations (``log_interval``
10, the default: a row every 10 iterations) with the writers on and off, the order alternating;
the figures: the time the training thread spends in ``RunMetrics.write`` per row and as a
share of the run; the same for the whole metrics path on that thread (``Meter.log_row``: the
host sync, the row, tokens/s and MFU, the writers' hand-over, the log line; plus
``Meter.saw_batch``, the tokens counted every iteration); the same with ``Meter.after_step``
too (each iteration's loss and scalars kept for the row) (medians over rounds); and the
whole runs' times (which carry the machine's noise, and the writers' own thread) and CPU
times (every thread of the process: the writers' cost without the noise of other programs).
``--log``: the log line written too (the strategy's logger at INFO, to its file and the
console; the default leaves INFO off, as the figures above were taken).

    python benchmarks/metrics_overhead.py [--rounds 7] [--iters 3000] [--log]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from typing import Any

import torch


def _cfg(work_dir: str, iters: int, on: bool, log: bool = False) -> dict:
    return dict(
        model=dict(type='MLPClassifier', in_features=32, num_classes=4, hidden=32),
        train_dataloader=dict(
            dataset=dict(type='SyntheticClassification', num_samples=8 * iters, num_features=32),
            batch_size=8,
            shuffle=False,
        ),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
        train_cfg=dict(
            max_iters=iters,
            log_interval=10,
            metrics=dict(csv=on, tensorboard=on),
        ),
        strategy=dict(
            type='SingleDeviceStrategy', log_kwargs=dict(log_level='INFO' if log else 'WARNING')
        ),
        work_dir=work_dir,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--iters', type=int, default=3000)
    parser.add_argument('--log', action='store_true')
    parser.add_argument(
        '--clock',
        choices=('wall', 'cpu'),
        default='wall',
        help="cpu: the training thread's CPU time, for the parts and the run (steadier on a "
        'machine other programs load: a system call there is where the thread is switched '
        'out)',
    )
    args = parser.parse_args()
    clock = time.thread_time if args.clock == 'cpu' else time.perf_counter
    # what one reading of the clock adds between two readings (a system call for the CPU
    # clock), taken off each timed call
    lag = statistics.median(-clock() + clock() for _ in range(20001))
    torch.set_num_threads(1)
    if not args.log:
        logging.disable(logging.INFO)
    import stratagem.loop.meter as meter_mod
    import stratagem.metrics as metrics_mod
    from stratagem.loop import train

    # the time the training thread spends in RunMetrics.write (the row, handed to the
    # writers), and in the whole metrics path (Meter.log_row and Meter.saw_batch), measured
    # inside each run
    spent = {'s': 0.0, 'rows': 0, 'path': 0.0, 'step': 0.0}
    inside = dict.fromkeys(spent, False)

    def timed(cls: Any, name: str, key: str, count: bool) -> None:
        original = getattr(cls, name)

        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            if inside[key]:  # a call inside a timed one (an older write_later's): once
                return original(self, *a, **k)
            inside[key] = True
            t = clock()
            try:
                out = original(self, *a, **k)
            finally:
                inside[key] = False
            spent[key] += clock() - t - lag
            if count:
                spent['rows'] += 1
            return out

        setattr(cls, name, wrapper)

    timed(metrics_mod.RunMetrics, 'write', 's', True)
    if hasattr(metrics_mod.RunMetrics, 'write_later'):  # an older version's write(later=True)
        timed(metrics_mod.RunMetrics, 'write_later', 's', True)
    timed(meter_mod.Meter, 'log_row', 'path', False)
    timed(meter_mod.Meter, 'saw_batch', 'path', False)
    timed(meter_mod.Meter, 'after_step', 'step', False)
    share: dict[bool, list[float]] = {True: [], False: []}
    per_row: dict[bool, list[float]] = {True: [], False: []}
    path: dict[bool, list[float]] = {True: [], False: []}
    with_step: dict[bool, list[float]] = {True: [], False: []}
    whole: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        train(_cfg(f'{tmp}/warm', 50, True, args.log), progress=False)  # imports, first use
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                spent.update(s=0.0, rows=0, path=0.0, step=0.0)
                start, cpu_start = clock(), time.process_time()
                train(_cfg(f'{tmp}/{r}_{on}', args.iters, on, args.log), progress=False)
                cpu[on].append(time.process_time() - cpu_start)
                total = clock() - start
                whole[on].append(total)
                share[on].append(spent['s'] / total)
                per_row[on].append(spent['s'] / spent['rows'])
                path[on].append(spent['path'] / total)
                with_step[on].append((spent['path'] + spent['step']) / total)
    med = statistics.median
    print(
        f'{args.clock} clock; tiny MLP, {args.iters} iterations, a row every 10: a row '
        f'costs the loop '
        f'{med(per_row[True]) * 1e6:.1f} µs with the writers on '
        f'({med(share[True]) * 100:.2f}% of the run), {med(per_row[False]) * 1e6:.1f} µs '
        f'with them off ({med(share[False]) * 100:.2f}%: the row itself, the log line '
        f'excluded); the whole metrics path on the training thread (sync, row, tokens, MFU, '
        f'log line): {med(path[True]) * 100:.2f}% of the run on, '
        f"{med(path[False]) * 100:.2f}% off; with each iteration's loss and scalars kept "
        f'(Meter.after_step) {med(with_step[True]) * 100:.2f}% on, '
        f'{med(with_step[False]) * 100:.2f}% off; whole runs ({args.clock} time) '
        f'{med(whole[False]) / args.iters * 1e6:.1f} µs/it off, '
        f'{med(whole[True]) / args.iters * 1e6:.1f} on (median of {args.rounds} interleaved '
        f'rounds: {(med(whole[True]) / med(whole[False]) - 1) * 100:+.2f}%, noise included); '
        f'CPU time of the process, every thread: {med(cpu[False]) / args.iters * 1e6:.1f} '
        f'µs/it off, {med(cpu[True]) / args.iters * 1e6:.1f} on '
        f'({(med(cpu[True]) / med(cpu[False]) - 1) * 100:+.2f}%: what the writers cost on a '
        f'machine whose other work makes wall times noisy)'
    )


if __name__ == '__main__':
    main()
