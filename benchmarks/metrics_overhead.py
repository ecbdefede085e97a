"""What ``stratagem train``'s run metrics cost: the reference loop with its metrics writers on
(CSV + TensorBoard, the default) against the same loop with them off, interleaved rounds.

The tiny MLP of ``benchmarks/overhead.py`` (2×Linear(32), batch 8, SGD): the worst case,
since its steps are the shortest. Each round trains ``--iters`` iterations (``log_interval``
10, the default: a row every 10 iterations) with the writers on and off, the order alternating;
the figure is the median over rounds of (on - off) / off, and the per-row cost in µs.

    python benchmarks/metrics_overhead.py [--rounds 7] [--iters 3000]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch


def _cfg(work_dir: str, iters: int, on: bool) -> dict:
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
        strategy=dict(type='SingleDeviceStrategy', log_kwargs=dict(log_level='WARNING')),
        work_dir=work_dir,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--iters', type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.INFO)
    from stratagem.loop import train

    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        train(_cfg(f'{tmp}/warm', 50, True), progress=False)  # imports, first use
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                start = time.perf_counter()
                train(_cfg(f'{tmp}/{r}_{on}', args.iters, on), progress=False)
                times[on].append(time.perf_counter() - start)
    ratios = [a / b - 1 for a, b in zip(times[True], times[False])]
    rows = args.iters / 10
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(
        f'tiny MLP, {args.iters} iterations, a row every 10: writers off '
        f'{off * 1e6 / args.iters:.1f} µs/it, on {on * 1e6 / args.iters:.1f} µs/it; '
        f'overhead median {statistics.median(ratios) * 100:+.2f}% (rounds: '
        + ', '.join(f'{x * 100:+.1f}%' for x in ratios)
        + f'); {(on - off) * 1e6 / rows:.0f} µs per row'
    )


if __name__ == '__main__':
    main()
