"""Throughput you can compare with other trainers: tokens per second through a documented
hook, and model FLOPs utilisation (MFU) from FLOPs counted once.

Tokens. The tokens of a batch are what its hook says, the first that applies:

1. ``train_cfg.metrics.num_tokens``: a callable ``(batch) -> int`` (or a 0-d tensor, read at
   the row's host sync) or its import path (``'my_project.data.count_tokens'``, for a config
   file, which cannot hold a function);
2. the model's ``num_tokens(batch)`` method (the plain module's, not its wrapper's);
3. the dataset's ``num_tokens(batch)`` method;
4. the default, as torchtitan counts: a batch whose inputs (the tensor itself, the first of a
   tuple or list, a dict's ``inputs`` or ``input_ids``) are an integer (batch, time) tensor
   holds batch x time tokens; any other batch holds none (no ``tokens_per_s``).

Lightning's ``ThroughputMonitor(length_fn=...)`` is the same idea. Rank 0 counts its own
batches; the rate shown is that times the data-parallel size (every rank reads as much).

FLOPs. The loop's first step on rank 0 runs under ``torch.utils.flop_counter.FlopCounterMode``
(:func:`count_flops`): forward and backward as torch counts them (matmuls, convolutions,
attention; the optimizer's element-wise maths is not counted), on that step's batch. The
numbers it computes are the same as without the counter; the step takes longer (one time:
the first row holds the warm-up anyway). When the counter saw the forward but no backward
(a backward run outside torch's dispatch), the count is 3 x the forward's, the usual
estimate, and says so. MFU is the FLOPs of one iteration x iterations per second / the
device's peak (:func:`device_peak`): the table of ``stratagem.env.devices`` for a GPU (its
dense bf16 peak, fp16 under fp16 AMP), a measured float32 matmul rate on a CPU (labelled
``mfu(cpu-measured)``), or ``train_cfg.metrics.peak_flops`` when given.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    'FlopCount',
    'Peak',
    'count_flops',
    'default_num_tokens',
    'device_peak',
    'num_tokens_hook',
]

TokenHook = Callable[[Any], Any]


def default_num_tokens(batch: Any) -> int | None:
    """batch x time for token data (inputs are an integer (batch, time) tensor), else None."""
    inputs = batch
    if isinstance(batch, dict):
        inputs = batch.get('inputs', batch.get('input_ids'))
    elif isinstance(batch, (tuple, list)) and batch:
        inputs = batch[0]
    if (
        isinstance(inputs, torch.Tensor)
        and inputs.dim() == 2
        and not inputs.is_floating_point()
        and not inputs.is_complex()
        and inputs.dtype is not torch.bool
    ):
        return inputs.numel()
    return None


def num_tokens_hook(
    configured: Any, model: Any = None, dataset: Any = None
) -> tuple[TokenHook, str]:
    """The hook that counts a batch's tokens and where it came from (for the log):
    ``configured`` (``train_cfg.metrics.num_tokens``: a callable or an import path), the
    model's or the dataset's ``num_tokens`` method, else :func:`default_num_tokens`."""
    if configured is not None:
        if isinstance(configured, str):
            from stratagem.registry import dotted_import_problem, import_dotted

            hook = import_dotted(configured)
            if hook is None:
                raise ValueError(
                    f'train_cfg.metrics.num_tokens={configured!r}: nothing to import there '
                    f'({dotted_import_problem(configured)}); give a function (batch) -> '
                    "tokens or its import path 'package.module.function'"
                )
            configured = hook
        if not callable(configured):
            raise TypeError(
                f'train_cfg.metrics.num_tokens must be a function (batch) -> tokens or its '
                f'import path, got {type(configured).__name__}'
            )
        return configured, 'train_cfg.metrics.num_tokens'
    for owner, what in ((model, 'model'), (dataset, 'dataset')):
        method = getattr(owner, 'num_tokens', None)
        if callable(method):
            return method, f'{what}.num_tokens'
    return default_num_tokens, 'integer (batch, time) inputs'


@dataclass(frozen=True)
class FlopCount:
    """The FLOPs of one iteration on this rank: ``total`` (forward + backward), its
    ``forward`` and ``backward`` parts as counted, and ``method``: ``'counted'``, or
    ``'3x forward'`` when no backward was seen (``total`` is then 3 x ``forward``)."""

    total: int
    forward: int
    backward: int
    method: str


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, FlopCount]:
    """``fn(*args, **kwargs)`` run under ``FlopCounterMode``; returns its result and the
    FLOPs it did. Ops run with autograd off count as backward (the autograd engine runs the
    backward so), the others as forward; a forward without backward is counted 3 x."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    backward = [0]

    def tallied(formula: Callable[..., int]) -> Callable[..., int]:
        def count(*a: Any, **k: Any) -> int:
            flops = formula(*a, **k)
            if not torch.is_grad_enabled():
                backward[0] += flops
            return flops

        return count

    # the counter looks its formulas up at each op: wrapped, they say which pass ran them
    counter.flop_registry = {op: tallied(f) for op, f in counter.flop_registry.items()}
    with counter, warnings.catch_warnings():
        # the counter hooks every module for this one call; a compiled module's warning
        # about global module hooks is about those, not about the user's
        warnings.filterwarnings('ignore', message=r'Using `torch.compile\(module\)` when there')
        result = fn(*args, **kwargs)
    total = int(counter.get_total_flops())
    forward, back = total - backward[0], backward[0]
    if back == 0 and forward > 0:
        return result, FlopCount(3 * forward, forward, 0, '3x forward')
    return result, FlopCount(total, forward, back, 'counted')


@dataclass(frozen=True)
class Peak:
    """A device's peak in FLOP/s, what it is (``source``, for the log) and the label its MFU
    is shown under (``'mfu'``, or ``'mfu(cpu-measured)'`` for a measured CPU rate)."""

    flops: float
    source: str
    label: str = 'mfu'


def device_peak(
    device: torch.device, dtype: torch.dtype | None = None, configured: float | None = None
) -> Peak | None:
    """The peak MFU is measured against: ``configured`` (``train_cfg.metrics.peak_flops``,
    FLOP/s) when given; on CUDA the table's dense peak for ``dtype`` (bf16 unless fp16;
    None for a card it does not list); on a CPU the measured float32 matmul rate."""
    if configured is not None:
        return Peak(float(configured), f'train_cfg.metrics.peak_flops {configured:.4g} FLOP/s')
    if device.type == 'cuda':
        from stratagem.env.devices import device_peak as table_entry

        entry = table_entry(torch.cuda.get_device_name(device))
        if entry is None:
            return None
        fp16 = dtype == torch.float16 or entry.bf16 is None  # Volta, Turing: no bf16 cores
        flops = entry.fp16 if fp16 or entry.bf16 is None else entry.bf16
        kind = 'fp16' if fp16 else 'bf16'
        return Peak(flops, f"{entry.name}'s dense {kind} peak, {flops / 1e12:.0f} TFLOP/s")
    if device.type == 'cpu':
        from stratagem.env.devices import measured_cpu_peak

        flops = measured_cpu_peak()
        return Peak(
            flops,
            f"this CPU's float32 matmul rate, measured at start: {flops / 1e9:.1f} GFLOP/s "
            f'at {torch.get_num_threads()} thread(s)',
            'mfu(cpu-measured)',
        )
    return None
