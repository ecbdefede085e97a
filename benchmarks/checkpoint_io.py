"""Checkpoint I/O: stratagem's atomic save / verified load against raw torch.save / torch.load.

A ~100M-parameter model (Linear layers) with SGD momentum state (~0.8 GB file):

- save: ``save_checkpoint`` (xxh3 digest while writing, fsync, manifest, rename, dir fsync,
  pointer; default ``zip_crc32=False``) vs ``torch.save(path)`` + fsync of the file;
- async save: ``SingleDeviceStrategy(async_checkpoint=True).save_checkpoint`` (state dicts,
  RNG, validation, every tensor copied into reused CPU staging buffers before the call
  returns, the write on the writer thread): the time the caller is blocked and the time
  until the checkpoint is committed, vs the same raw baseline; beside it the copy floor
  (one thread copying every tensor into reused buffers);
- load in a new process (nothing cached: no verified-hash cache, no Python-level state):
  ``load_checkpoint_file`` (size + digest over a memory map, then a memory-mapped
  ``torch.load(weights_only=True)``) vs ``torch.load(path, weights_only=True)``, timing the
  call alone and then ``model.load_state_dict`` + ``optimizer.load_state_dict`` after it, so
  lazily mapped bytes are paid for; file in the page cache;
- load in this process, warm and cold (evicted first with posix_fadvise), the same pair.

Runs are interleaved (ABAB / BABA), the median of each is reported with ratios. The
verified-hash cache is cleared before each of our loads, so every load hashes the file.
Files go to a temp directory under ``work_dirs/bench`` (same filesystem as the repo), removed
at the end.

    python benchmarks/checkpoint_io.py [--params-millions 100] [--runs 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stratagem.checkpoint import load_checkpoint_file, save_checkpoint
from stratagem.checkpoint.manifest import forget_verified

_CHILD = """
import gc, sys, time
sys.path.insert(0, sys.argv[4])
import torch
from stratagem.checkpoint import load_checkpoint_file
sys.path.insert(0, sys.argv[5])
from checkpoint_io import build
model, optimizer = build(float(sys.argv[3]))
gc.collect()
start = time.perf_counter()
if sys.argv[1] == 'ours':
    checkpoint = load_checkpoint_file(sys.argv[2], map_location='cpu')
else:
    checkpoint = torch.load(sys.argv[2], map_location='cpu', weights_only=True)
loaded = time.perf_counter()
model.load_state_dict(checkpoint['state_dict'])
optimizer.load_state_dict(checkpoint['optimizer'])
print(loaded - start, time.perf_counter() - start)
"""


def build(params_millions: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 4096
    layers = max(1, round(params_millions * 1e6 / (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():  # one step without a forward pass: creates momentum buffers
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        'meta': {'epoch': 1, 'iter': 1000},
        'state_dict': model.state_dict(),
        'optimizer': optimizer.state_dict(),
    }


def raw_save(checkpoint: dict, path: Path) -> None:
    torch.save(checkpoint, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def ours_save(checkpoint: dict, path: Path, zip_crc32: bool = False) -> None:
    save_checkpoint(checkpoint, path, step=1000, zip_crc32=zip_crc32)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def raw_load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    checkpoint = torch.load(path, map_location='cpu', weights_only=True)
    model.load_state_dict(checkpoint['state_dict'])
    optimizer.load_state_dict(checkpoint['optimizer'])


def ours_load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    forget_verified()  # measure a full hash every time
    checkpoint = load_checkpoint_file(path, map_location='cpu')
    model.load_state_dict(checkpoint['state_dict'])
    optimizer.load_state_dict(checkpoint['optimizer'])


def load_in_new_process(which: str, path: Path, params_millions: float) -> tuple[float, float]:
    """(seconds of the load call, seconds including load_state_dict) in a fresh interpreter."""
    import subprocess

    here = Path(__file__).resolve().parent
    proc = subprocess.run(
        [
            sys.executable,
            '-c',
            _CHILD,
            which,
            str(path),
            str(params_millions),
            str(here.parent),
            str(here),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f'the {which} load in a new process failed:\n{proc.stderr[-3000:]}')
    out = proc.stdout.split()
    return float(out[-2]), float(out[-1])


class AsyncSaver:
    """A ``SingleDeviceStrategy(async_checkpoint=True)`` over the model, timed: blocked (the
    ``save_checkpoint`` call: state dicts, RNG, validation, the copy of every tensor into
    the reused staging buffers, submit) and committed (until ``wait_for_checkpoints``
    returns). The copy is complete when the call returns: the checkpoint is the state at
    the call."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        from stratagem.strategies import SingleDeviceStrategy

        self.strategy = SingleDeviceStrategy(
            work_dir=str(directory), async_checkpoint=True, log_kwargs=dict(log_level='WARNING')
        )
        self.strategy.prepare(model, optim_wrapper=dict(optimizer=optimizer))

    @property
    def staged_bytes(self) -> int:
        return self.strategy.checkpointer.writer.staged_bytes

    def __call__(self, path: Path) -> tuple[float, float]:
        gc.collect()
        start = time.perf_counter()
        self.strategy.save_checkpoint(str(path), extra_ckpt={'meta': {'iter': 1000}})
        blocked = time.perf_counter() - start
        self.strategy.wait_for_checkpoints()
        return blocked, time.perf_counter() - start


def copy_floor(checkpoint: dict) -> Callable[[], float]:
    """The floor of a safe snapshot: one thread copying every tensor into reused buffers."""
    sources = [t for t in _tensors(checkpoint)]
    buffers = [torch.empty_like(t) for t in sources]

    def run() -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            start = time.perf_counter()
            for buffer, src in zip(buffers, sources):
                buffer.copy_(src)
            return time.perf_counter() - start
        finally:
            torch.set_num_threads(threads)

    return run


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def timed(fn, *args) -> float:
    gc.collect()
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def interleave(runs: int, a, b) -> tuple[list[float], list[float]]:
    """Run ``a`` and ``b`` (callables returning seconds) alternately, ABAB then BABA."""
    ta, tb = [], []
    for i in range(runs):
        if i % 2 == 0:
            ta.append(a())
            tb.append(b())
        else:
            tb.append(b())
            ta.append(a())
    return ta, tb


def report(name: str, ours: list[float], raw: list[float], raw_name: str) -> None:
    mo, mr = statistics.median(ours), statistics.median(raw)
    print(
        f'{name:<11} median: ours {mo:6.3f}s  {raw_name} {mr:6.3f}s  ratio {mo / mr:4.2f}x  | '
        f'min: ours {min(ours):6.3f}s  raw {min(raw):6.3f}s  ratio {min(ours) / min(raw):4.2f}x'
    )
    print(
        f'{"":<11} runs: ours {" ".join(f"{t:.2f}" for t in ours)}; '
        f'raw {" ".join(f"{t:.2f}" for t in raw)}'
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--params-millions', type=float, default=100.0)
    parser.add_argument('--runs', type=int, default=5)
    parser.add_argument(
        '--zip-crc32',
        action='store_true',
        help='save with the zip CRC32 too (as raw torch.save does)',
    )
    parser.add_argument(
        '--skip-new-process',
        action='store_true',
        help='skip the loads in fresh interpreters (each imports torch)',
    )
    args = parser.parse_args()

    model, optimizer = build(args.params_millions)
    numel = sum(p.numel() for p in model.parameters())
    checkpoint = state(model, optimizer)
    root = Path(__file__).resolve().parents[1] / 'work_dirs' / 'bench'
    root.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix='checkpoint_io-', dir=root))
    try:
        raw_path, ours_path = directory / 'raw.pth', directory / 'ours.pth'

        def save_a() -> float:
            ours_path.unlink(missing_ok=True)
            return timed(ours_save, checkpoint, ours_path, args.zip_crc32)

        def save_b() -> float:
            raw_path.unlink(missing_ok=True)
            return timed(raw_save, checkpoint, raw_path)

        save_a(), save_b()  # warm-up: allocator, page cache, thread pools
        ours_s, raw_s = interleave(args.runs, save_a, save_b)
        size = ours_path.stat().st_size
        print(
            f'model: {numel / 1e6:.1f}M params + SGD momentum; file {size / 2**20:.0f} MiB; '
            f'{args.runs} interleaved runs each, medians; torch {torch.__version__}, '
            f'{os.cpu_count()} CPUs'
        )
        report('save', ours_s, raw_s, 'torch.save+fsync')
        mbps = size / 2**20 / statistics.median(ours_s)
        print(f'            ours {mbps:.0f} MiB/s including xxh3, fsync and manifest')

        saver, timings = AsyncSaver(model, optimizer, directory), []
        async_path = directory / 'async.pth'

        def async_a() -> float:
            async_path.unlink(missing_ok=True)
            timings.append(saver(async_path))
            return timings[-1][0]

        async_a(), save_b()  # warm-up: the first snapshot allocates the staging buffers
        timings.clear()
        blocked, raw_a = interleave(args.runs, async_a, save_b)
        report('async block', blocked, raw_a, 'torch.save+fsync')
        report('async commit', [t[1] for t in timings], raw_a, 'torch.save+fsync')
        floor = copy_floor(checkpoint)
        floor()
        copies = [floor() for _ in range(args.runs)]
        print(
            f'{"copy floor":<11} median: {statistics.median(copies):6.3f}s  ratio '
            f'{statistics.median(copies) / statistics.median(raw_a):4.2f}x  (one thread copying '
            f'every tensor into reused buffers)'
        )
        print(
            f'            staging buffers: {saver.staged_bytes / 2**20:.0f} MiB '
            f'(one copy of the tensors, reused)'
        )
        saver.strategy.checkpointer.writer.release()

        if not args.skip_new_process:
            pairs = []

            def child_a() -> float:
                pairs.append(('ours', load_in_new_process('ours', ours_path, args.params_millions)))
                return pairs[-1][1][0]

            def child_b() -> float:
                pairs.append(('raw', load_in_new_process('raw', raw_path, args.params_millions)))
                return pairs[-1][1][0]

            child_a(), child_b()
            pairs.clear()
            ours_c, raw_c = interleave(args.runs, child_a, child_b)
            report('load new', ours_c, raw_c, 'torch.load  ')
            report(
                '  +apply',
                [t for w, (_, t) in pairs if w == 'ours'],
                [t for w, (_, t) in pairs if w == 'raw'],
                'torch.load  ',
            )

        for cold in (False, True):

            def load_a() -> float:
                if cold:
                    evict(ours_path)
                return timed(ours_load, ours_path, model, optimizer)

            def load_b() -> float:
                if cold:
                    evict(raw_path)
                return timed(raw_load, raw_path, model, optimizer)

            load_a(), load_b()
            ours_l, raw_l = interleave(args.runs, load_a, load_b)
            report(f'load {"cold" if cold else "warm"}', ours_l, raw_l, 'torch.load  ')
        checkpoint.clear()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == '__main__':
    main()
