"""Overheads a user can measure: step time, minor page faults, start-to-ready, peak RSS.

Every figure is a ratio (or a difference) to a hand-written PyTorch loop measured in the same
run, so machine noise hits both alike; the machine this runs on may be shared, so read the
spread, not only the median.

1. steps, one process: raw loops and stratagem (``SingleDeviceStrategy.prepare`` +
   ``optim_context`` + ``update_params``) built side by side and run interleaved: each round
   runs a block of steps of every contestant, the order reversed every other round. Per
   contestant: median ms/step, median of the per-round ratios to the raw loop (with the
   interquartile range) and median minor page faults per step (``resource.getrusage``).
   A second raw loop ("control") shows the noise floor. Cases: a tiny MLP (2×Linear(32),
   batch 8, SGD), the same with accumulation 4 + clip by norm, and a medium MLP
   (4×Linear(1024), batch 64) with SGD-momentum and with AdamW, where a raw loop that calls
   ``zero_grad()`` after ``step()`` shows what releasing the gradients at the end costs.
2. steps, own process: the medium MLP's raw loop and stratagem, each alone in a fresh
   process (alternating), default malloc settings.
3. start to ready: a fresh interpreter that builds the medium MLP and its optimizer and does
   one step, raw versus through ``SingleDeviceStrategy``; wall time from spawn until the
   child reports the step done, and the child's peak RSS (VmHWM) by then. Alternating runs.

Run: ``python benchmarks/overhead.py`` (a few minutes; ``--quick`` for a smoke run; ``--part
steps|solo|startup`` for one part). Set ``OMP_NUM_THREADS=1`` for stable step times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def mlp(width: int, depth: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _optimizer_cfg(name: str) -> dict:
    return (
        dict(type='SGD', lr=1e-3, momentum=0.9)
        if name == 'sgd'
        else dict(type='AdamW', lr=1e-3, weight_decay=0.01)
    )


def _raw_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    cfg = _optimizer_cfg(name)
    return getattr(torch.optim, cfg.pop('type'))(model.parameters(), **cfg)


def raw_step(
    width: int, depth: int, batch: int, opt: str, accumulate: int = 1, clip: float | None = None
) -> Callable[[], None]:
    """The hand-written loop: zero_grad first, as the PyTorch tutorials write it."""
    model, x = mlp(width, depth), torch.randn(batch, width)
    optimizer = _raw_optimizer(opt, model)
    count = [0]

    def step() -> None:
        if count[0] % accumulate == 0:
            optimizer.zero_grad()
        loss = model(x).square().mean()
        if accumulate > 1:
            loss = loss / accumulate
        loss.backward()
        count[0] += 1
        if count[0] % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()

    return step


def raw_step_zero_last(width: int, depth: int, batch: int, opt: str) -> Callable[[], None]:
    """The same loop with zero_grad() after step(), the order mmengine's update_params has."""
    model, x = mlp(width, depth), torch.randn(batch, width)
    optimizer = _raw_optimizer(opt, model)

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def stratagem_step(
    width: int, depth: int, batch: int, opt: str, accumulate: int = 1, clip: float | None = None
) -> Callable[[], None]:
    """What a user of stratagem writes: strategy.prepare, optim_context, update_params."""
    from stratagem.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy(
        work_dir=tempfile.mkdtemp(prefix='stratagem-bench-'), log_kwargs=dict(log_level='WARNING')
    )
    wrapper_cfg: dict = dict(optimizer=_optimizer_cfg(opt), accumulative_counts=accumulate)
    if clip is not None:
        wrapper_cfg['clip_grad'] = dict(max_norm=clip)
    model, optim_wrapper = strategy.prepare(
        mlp(width, depth), optim_wrapper=wrapper_cfg, dispatch_kwargs=dict(max_iters=10**9)
    )
    x = torch.randn(batch, width)

    def step() -> None:
        with optim_wrapper.optim_context(model):
            loss = model(x).square().mean()
        optim_wrapper.update_params(loss)

    return step


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleave(
    contestants: dict[str, Callable[[], None]],
    rounds: int,
    steps: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, tuple[list[float], list[float]]]:
    """{name: (ms/step per round, minor faults/step per round)}; blocks alternate order.
    ``clock``: wall time, or ``time.thread_time`` (this thread's CPU time: the time other
    programs take the cores away does not count, on a machine they load)."""
    for fn in contestants.values():  # warm-up: optimizer state, allocator, caches
        for _ in range(max(2, steps // 2)):
            fn()
    out: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in contestants}
    names = list(contestants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fn = contestants[name]
            f0, t0 = _faults(), clock()
            for _ in range(steps):
                fn()
            t1, f1 = clock(), _faults()
            out[name][0].append((t1 - t0) / steps * 1e3)
            out[name][1].append((f1 - f0) / steps)
    return out


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def report(
    title: str, results: dict[str, tuple[list[float], list[float]]], base: str = 'raw loop'
) -> dict[str, dict[str, float]]:
    print(title)
    print(f'   {"":28s} {"ms/step":>9s} {"ratio":>7s} {"ratio IQR":>13s} {"faults/step":>12s}')
    base_t = results[base][0]
    summary = {}
    for name, (times, faults) in results.items():
        ratios = [t / b for t, b in zip(times, base_t)]
        lo, hi = _quartiles(ratios)
        summary[name] = dict(
            ms=statistics.median(times),
            ratio=statistics.median(ratios),
            faults=statistics.median(faults),
        )
        print(
            f'   {name:28s} {summary[name]["ms"]:9.3f} {summary[name]["ratio"]:6.3f}x '
            f'{lo:6.3f}-{hi:.3f} {summary[name]["faults"]:12.0f}'
        )
    return summary


def part_steps(quick: bool) -> None:
    rounds = 5 if quick else 41
    tiny = dict(width=32, depth=2, batch=8, opt='sgd')
    for title, kw, steps in (
        ('tiny MLP, update_params', tiny, 100),
        ('tiny MLP, accumulation 4 + clip_grad norm', dict(tiny, accumulate=4, clip=1.0), 100),
        (
            'medium MLP 4xLinear(1024) batch 64, SGD momentum',
            dict(width=1024, depth=4, batch=64, opt='sgd'),
            5,
        ),
        (
            'medium MLP 4xLinear(1024) batch 64, AdamW',
            dict(width=1024, depth=4, batch=64, opt='adamw'),
            5,
        ),
    ):
        contestants = {
            'raw loop': raw_step(**kw),
            'raw loop again (control)': raw_step(**kw),
            'stratagem': stratagem_step(**kw),
        }
        if kw['width'] > 32:  # the free order that made the medium step fault (see README)
            contestants['raw, zero_grad() last'] = raw_step_zero_last(**kw)
        results = interleave(contestants, rounds, steps)
        report(f'1) {title}: {rounds} rounds x {steps} steps, interleaved in one process', results)


_SOLO = r"""
import sys, json, statistics
sys.path[:0] = [{here!r}, {root!r}]
import torch
torch.set_num_threads(1)
import overhead
fn = overhead.{func}(1024, 4, 64, {opt!r})
res = overhead.interleave({{'x': fn}}, {rounds}, 5)['x']
print(json.dumps([statistics.median(res[0]), statistics.median(res[1])]))
"""


def part_solo(quick: bool) -> None:
    runs, rounds = (2, 3) if quick else (7, 15)
    funcs = {
        'raw loop': 'raw_step',
        'stratagem': 'stratagem_step',
        'raw, zero_grad() last': 'raw_step_zero_last',
    }
    for opt in ('sgd', 'adamw'):
        per: dict[str, list[list[float]]] = {name: [] for name in funcs}
        for i in range(runs):
            for name in list(funcs) if i % 2 == 0 else list(funcs)[::-1]:
                code = _SOLO.format(here=HERE, root=ROOT, func=funcs[name], opt=opt, rounds=rounds)
                out = subprocess.run(
                    [sys.executable, '-c', code], check=True, capture_output=True, text=True
                ).stdout
                per[name].append(json.loads(out.strip().splitlines()[-1]))
        print(f'2) medium MLP, {opt}: each loop alone in its own process, {runs} processes each')
        base = per['raw loop']
        for name, vals in per.items():
            ratios = [v[0] / b[0] for v, b in zip(vals, base)]
            print(
                f'   {name:28s} {statistics.median(v[0] for v in vals):9.3f} ms/step '
                f'{statistics.median(ratios):6.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) '
                f'{statistics.median(v[1] for v in vals):8.0f} faults/step '
                f'({min(v[1] for v in vals):.0f}-{max(v[1] for v in vals):.0f})'
            )


# the child's own high-water mark: getrusage/wait4's ru_maxrss of a child starts from the
# parent's RSS at fork (Linux keeps it across exec), which would hide the difference
_PEAK_RSS = r"""
def peak_rss_kib():
    try:
        with open('/proc/self/status') as f:
            return int(next(l for l in f if l.startswith('VmHWM:')).split()[1])
    except OSError:  # no procfs (macOS): ru_maxrss is bytes there
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
"""

# the medium MLP of both start-to-ready scripts (after `from torch import nn`)
_MLP_SRC = """
def mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers[:-1])
"""

_READY_RAW = (
    _PEAK_RSS
    + r"""
import sys, time, torch
t_torch = time.perf_counter()
from torch import nn
"""
    + _MLP_SRC
    + r"""
model = mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
optimizer.zero_grad()
model(torch.randn(64, 1024)).square().mean().backward()
optimizer.step()
print('ready', 'cv2' in sys.modules, peak_rss_kib(), time.perf_counter() - t_torch, flush=True)
"""
)

_READY_STRATAGEM = (
    _PEAK_RSS
    + r"""
import sys, tempfile, time, torch
t_torch = time.perf_counter()
from torch import nn
from stratagem.strategies import SingleDeviceStrategy
"""
    + _MLP_SRC
    + r"""
strategy = SingleDeviceStrategy(work_dir=tempfile.mkdtemp(prefix='stratagem-bench-'))
model, optim_wrapper = strategy.prepare(
    mlp(), optim_wrapper=dict(optimizer=dict(type='SGD', lr=1e-3, momentum=0.9)))
with optim_wrapper.optim_context(model):
    loss = model(torch.randn(64, 1024)).square().mean()
optim_wrapper.update_params(loss)
print('ready', 'cv2' in sys.modules, peak_rss_kib(), time.perf_counter() - t_torch, flush=True)
"""
)


def _start_to_ready(code: str) -> tuple[float, float, bool, float]:
    """A fresh interpreter's (seconds from spawn to 'ready', peak RSS in MiB, cv2 imported,
    seconds from the end of ``import torch`` to 'ready')."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
        ),
    )
    # an installed package has its bytecode; without it each run would compile stratagem
    env.pop('PYTHONDONTWRITEBYTECODE', None)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, '-c', code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    ready = time.perf_counter() - t0
    proc.communicate()
    if not line.startswith('ready') or proc.returncode != 0:
        raise RuntimeError(f'child failed (exit {proc.returncode}): {line!r}')
    rss = int(line.split()[2]) / 1024
    return ready, rss, line.split()[1] == 'True', float(line.split()[3])


def part_startup(quick: bool) -> None:
    runs = 3 if quick else 21
    _start_to_ready(_READY_RAW)  # warm the page cache
    res: dict[str, list[tuple[float, float, bool, float]]] = {'raw script': [], 'stratagem': []}
    for i in range(runs):
        pair = [('raw script', _READY_RAW), ('stratagem', _READY_STRATAGEM)]
        for name, code in pair if i % 2 == 0 else pair[::-1]:
            res[name].append(_start_to_ready(code))
    try:
        import importlib.util

        cv2_installed = importlib.util.find_spec('cv2') is not None
    except ValueError:
        cv2_installed = False
    print(
        f'3) start to ready (medium MLP + SGD, one step), fresh interpreters, {runs} '
        f'alternating runs each; OpenCV installed: {cv2_installed}'
    )
    base = res['raw script']
    for name, vals in res.items():
        dt = [(v[0] - b[0]) * 1e3 for v, b in zip(vals, base)]
        dpost = [(v[3] - b[3]) * 1e3 for v, b in zip(vals, base)]
        drss = [v[1] - b[1] for v, b in zip(vals, base)]
        print(
            f'   {name:12s} ready {statistics.median(v[0] for v in vals) * 1e3:6.0f} ms '
            f'({statistics.median(dt):+5.0f} ms, IQR {_quartiles(dt)[0]:+.0f} to '
            f'{_quartiles(dt)[1]:+.0f}); after import torch '
            f'{statistics.median(v[3] for v in vals) * 1e3:5.0f} ms '
            f'({statistics.median(dpost):+4.0f}, IQR {_quartiles(dpost)[0]:+.0f} to '
            f'{_quartiles(dpost)[1]:+.0f}); peak RSS {statistics.median(v[1] for v in vals):6.1f} '
            f'MiB ({statistics.median(drss):+4.1f}, IQR {_quartiles(drss)[0]:+.1f} to '
            f'{_quartiles(drss)[1]:+.1f}); cv2 imported: {any(v[2] for v in vals)}'
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true', help='a short smoke run')
    parser.add_argument('--part', choices=['steps', 'solo', 'startup', 'all'], default='all')
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f'torch {torch.__version__}, {torch.get_num_threads()} thread(s), '
        f'{os.cpu_count()} cpu(s), load average {os.getloadavg()[0]:.1f}'
    )
    if args.part in ('steps', 'all'):
        part_steps(args.quick)
    if args.part in ('solo', 'all'):
        part_solo(args.quick)
    if args.part in ('startup', 'all'):
        part_startup(args.quick)


if __name__ == '__main__':
    main()
