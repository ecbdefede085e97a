"""What ``train_cfg.anomaly`` costs a step on which nothing goes wrong.

The step guard (``stratagem.optim.anomaly.StepGuard``) adds, per update: one pass over the
gradients and the loss that flags a non-finite value (the loss scaler's kernel with a scale
of 1; the loss alone under a float16 loss scaler, whose own check it leaves alone), one
``all_reduce`` of a ``world x 3`` tensor (nothing in one process) and one host read (a skip
must not call ``optimizer.step``, so the decision is needed on the host; on a CPU that read
costs nothing, on an accelerator it waits for the step's kernels, the queue ahead is lost).

Contestants, built side by side and run interleaved as ``overhead.py`` runs them (each
round a block of steps of each, the order reversed every other round; median of the
per-round ratios to the raw loop, with the interquartile range): a hand-written loop, the
same again (the noise floor), stratagem without a guard, with ``nonfinite`` checked, and
with ``nonfinite`` and a spike window of 100; then each guarded one over stratagem without a
guard, round by round (the check's own cost). Cases: the tiny and the medium MLP of
``overhead.py``.

Run: ``python benchmarks/anomaly_overhead.py`` (``--quick`` for a smoke run, ``--device
cuda`` on a GPU). Set ``OMP_NUM_THREADS=1`` for stable step times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from overhead import _optimizer_cfg, _quartiles, _raw_optimizer, interleave, mlp, report


def raw(width: int, depth: int, batch: int, opt: str, device: str) -> Callable[[], None]:
    model, x = mlp(width, depth).to(device), torch.randn(batch, width, device=device)
    optimizer = _raw_optimizer(opt, model)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    return step


def guarded(
    width: int, depth: int, batch: int, opt: str, device: str, guard: dict | None
) -> Callable[[], None]:
    """strategy.prepare + optim_context + update_params, with ``StepGuard(**guard)``."""
    from stratagem.optim.anomaly import StepGuard
    from stratagem.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy(
        work_dir=tempfile.mkdtemp(prefix='stratagem-bench-'),
        log_kwargs=dict(log_level='WARNING'),
        device=device,
    )
    model, wrapper = strategy.prepare(
        mlp(width, depth), optim_wrapper=dict(optimizer=_optimizer_cfg(opt))
    )
    if guard is not None:
        wrapper.set_step_guard(StepGuard(**guard))
    x = torch.randn(batch, width, device=device)

    def step() -> None:
        with wrapper.optim_context(model):
            loss = model(x).square().mean()
        wrapper.update_params(loss)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--case', choices=('tiny', 'medium', 'both'), default='both')
    parser.add_argument('--rounds', type=int, default=41)
    parser.add_argument(
        '--clock',
        choices=('wall', 'cpu'),
        default='wall',
        help="cpu: the thread's CPU time (steadier on a machine other programs load)",
    )
    args = parser.parse_args()
    rounds = 5 if args.quick else args.rounds
    clock = time.thread_time if args.clock == 'cpu' else time.perf_counter
    sync = torch.cuda.synchronize if args.device.startswith('cuda') else lambda: None
    for title, kw, steps in (
        ('tiny MLP 2xLinear(32) batch 8, SGD', dict(width=32, depth=2, batch=8, opt='sgd'), 100),
        (
            'medium MLP 4xLinear(1024) batch 64, AdamW',
            dict(width=1024, depth=4, batch=64, opt='adamw'),
            5,
        ),
    ):
        if args.case != 'both' and not title.startswith(args.case):
            continue
        kw['device'] = args.device
        contestants = {
            'raw loop': raw(**kw),
            'raw loop again (control)': raw(**kw),
            'stratagem, no anomaly cfg': guarded(**kw, guard=None),
            "nonfinite='skip'": guarded(**kw, guard=dict()),
            'nonfinite + spike window 100': guarded(**kw, guard=dict(window=100)),
        }
        timed = {name: _synced(fn, sync, steps) for name, fn in contestants.items()}
        results = interleave(timed, rounds, 1, clock)
        for times, _ in results.values():  # a block's ms -> a step's
            times[:] = [t / steps for t in times]
        report(
            f'{title} on {args.device}: {rounds} rounds x {steps} steps, interleaved, '
            f'{args.clock} time',
            results,
        )
        _against_off(results, 'stratagem, no anomaly cfg')


def _against_off(results: dict[str, tuple[list[float], list[float]]], off: str) -> None:
    """The check's own cost: each guarded contestant over the same loop without a guard,
    round by round (the figure the issue's 1.01x is about), and the time it adds a step."""
    base = results[off][0]
    for name, (times, _) in results.items():
        if name.startswith(('raw', off)):
            continue
        ratios = [t / b for t, b in zip(times, base, strict=True)]
        added = statistics.median(t - b for t, b in zip(times, base, strict=True))
        lo, hi = _quartiles(ratios)
        print(
            f'   {name:28s} over the check off: {statistics.median(ratios):.3f}x '
            f'(IQR {lo:.3f}-{hi:.3f}), {added * 1e3:+.1f} µs a step'
        )


def _synced(fn: Callable[[], None], sync: Callable[[], None], steps: int) -> Callable[[], None]:
    """A block of ``steps`` steps, ended by a device sync (a raw loop's queue counts too)."""

    def block() -> None:
        for _ in range(steps):
            fn()
        sync()

    return block


if __name__ == '__main__':
    main()
