"""Overhead of ``stratagem.optim`` against hand-written loops (not a timed test).

1. µs per training step on a tiny MLP (2 x Linear(32, 32), batch 8, 1 thread): a raw loop
   (zero_grad, forward, backward, step), a second identical raw loop (its ratio shows the
   noise floor of the machine), versus ``optim_context`` + ``update_params`` of an
   ``OptimWrapper``, and a naive wrapper that always computes ``loss / accumulative_counts``
   (the ``loss / 1`` that DESIGN.md's "Hot path" forbids). Runs are interleaved in one
   process (the order alternates each round); we report medians of µs/step and the median
   of the per-round ratios.
2. AdamW(foreach=True) ``step()`` time on a ResNet-50-sized parameter set built with
   ``paramwise_cfg=dict(norm_decay_mult=0., bias_decay_mult=0.)``: merged param groups
   (the default) versus one group per tensor (``reduce_param_groups=False``). Merging pays
   off on GPUs (one kernel set per group instead of per tensor); on a CPU a foreach op is a
   loop over tensors anyway, and one huge group streams all 25M parameters through memory
   once per sub-operation, so per-tensor groups (cache-resident tensors) can be faster there.

Run: ``.venv/bin/python benchmarks/optim_overhead.py`` (about a minute; ``--quick`` for a
smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from stratagem.optim import OptimWrapper, build_optim_wrapper


def tiny_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))


class NaiveOptimWrapper(OptimWrapper):
    """What the hot-path rule forbids: the loss is always divided, even by 1."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss / self._accumulative_counts


def bench_step_overhead(rounds: int, iters: int) -> dict[str, float]:
    x = torch.randn(8, 32)

    def make_opt(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    raw_model = tiny_mlp()
    raw_opt = make_opt(raw_model)

    def raw() -> None:
        raw_opt.zero_grad()
        loss = raw_model(x).square().mean()
        loss.backward()
        raw_opt.step()

    handles = {}

    def wrapped_runner(cls: type) -> callable:
        model = tiny_mlp()
        wrapper = cls(make_opt(model))
        handles[cls] = (model, wrapper)

        def run() -> None:
            with wrapper.optim_context(model):
                loss = model(x).square().mean()
            wrapper.update_params(loss)

        return run

    ours = wrapped_runner(OptimWrapper)
    ours_model, ours_wrapper = handles[OptimWrapper]

    def raw_on_ours() -> None:  # a raw loop over the OptimWrapper's own model and optimizer
        ours_wrapper.optimizer.zero_grad()
        loss = ours_model(x).square().mean()
        loss.backward()
        ours_wrapper.optimizer.step()

    control_model = tiny_mlp()
    control_opt = make_opt(control_model)

    def control() -> None:  # a second raw loop: the ratio it gets is the noise floor
        control_opt.zero_grad()
        loss = control_model(x).square().mean()
        loss.backward()
        control_opt.step()

    contestants = {
        'raw loop': raw,
        'raw loop again (control)': control,
        'OptimWrapper': ours,
        "raw loop, OptimWrapper's model": raw_on_ours,
        'naive wrapper (loss / 1)': wrapped_runner(NaiveOptimWrapper),
    }
    times: dict[str, list[float]] = {name: [] for name in contestants}
    for fn in contestants.values():  # warm-up
        for _ in range(iters // 2):
            fn()
    names = list(contestants)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            fn = contestants[name]
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times[name].append((time.perf_counter() - t0) / iters * 1e6)
    raw_t = times['raw loop']
    print(f'1) tiny MLP step, {rounds} rounds x {iters} steps, interleaved, 1 thread')
    print(f'   {"":32s} {"median us/step":>15s} {"min us/step":>12s} {"median ratio":>13s}')
    result = {}
    for name in names:
        med = statistics.median(times[name])
        ratio = statistics.median(t / b for t, b in zip(times[name], raw_t))
        result[name] = ratio
        print(f'   {name:32s} {med:15.2f} {min(times[name]):12.2f} {ratio:12.3f}x')
    return result


def _bottleneck(cin: int, mid: int, stride: int, downsample: bool) -> nn.Module:
    cout = mid * 4

    class Bottleneck(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(mid)
            self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(mid)
            self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(cout)
            self.downsample = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if downsample
                else None
            )

    return Bottleneck()


def resnet50_params() -> nn.Module:
    """A module with ResNet-50's parameter tensors (shapes and module types); no forward."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)]
    cin = 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(_bottleneck(cin, mid, stride if b == 0 else 1, b == 0))
            cin = mid * 4
    layers.append(nn.Linear(2048, 1000))
    return nn.Sequential(*layers)


def bench_param_groups(rounds: int, steps: int) -> dict[str, float]:
    base = dict(optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05, foreach=True))
    variants = {
        'merged groups': dict(norm_decay_mult=0.0, bias_decay_mult=0.0),
        'one group per tensor': dict(
            norm_decay_mult=0.0, bias_decay_mult=0.0, reduce_param_groups=False
        ),
    }
    runs = {}
    for name, paramwise in variants.items():
        model = resnet50_params()
        wrapper = build_optim_wrapper(model, dict(base, paramwise_cfg=paramwise))
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        wrapper.step()  # allocate the optimizer state outside the timing
        runs[name] = (wrapper, len(wrapper.param_groups))
    n_params = sum(p.numel() for p in resnet50_params().parameters())
    n_tensors = len(list(resnet50_params().parameters()))
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wrapper = runs[name][0]
            t0 = time.perf_counter()
            for _ in range(steps):
                wrapper.step()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    print(
        f'2) AdamW(foreach) step, ResNet-50 parameter set ({n_params / 1e6:.1f}M params, '
        f'{n_tensors} tensors), {rounds} rounds x {steps} steps, interleaved, 1 thread'
    )
    base_t = times['merged groups']
    result = {}
    for name in names:
        med = statistics.median(times[name])
        ratio = statistics.median(t / b for t, b in zip(times[name], base_t))
        result[name] = med
        print(f'   {name:22s} {runs[name][1]:4d} groups {med:9.2f} ms/step {ratio:7.3f}x')
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true', help='a short smoke run')
    parser.add_argument('--rounds', type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (3 if args.quick else 201)
    print(f'torch {torch.__version__}, {torch.get_num_threads()} thread(s)')
    bench_step_overhead(rounds, 50)
    bench_param_groups(3 if args.quick else 7, 1 if args.quick else 3)


if __name__ == '__main__':
    main()
