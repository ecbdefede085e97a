"""What an accelerator can do at best: the dense bf16/fp16 tensor-core peaks of common GPUs.

Model FLOPs utilisation (MFU) is a step's FLOPs over the time the device would need at its
peak; the peak is a property of the card, not something torch reports, so it comes from this
table: the vendors' datasheet figures for dense (not 2:4-sparse) matrix maths with fp32
accumulation, in FLOP/s. A card is found by its CUDA name (``torch.cuda.get_device_name``),
the first pattern that matches in table order, so a variant (``H100 PCIe``) is listed before
its family (``H100``). A card that is not listed has no peak (``None``): an MFU then is not
shown rather than guessed. A CPU has no datasheet figure that a training step could reach, so
its peak is measured: :func:`measured_cpu_peak`, a short timed matmul, once per process.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass

import torch

__all__ = ['DEVICE_PEAKS', 'DevicePeak', 'device_peak', 'measured_cpu_peak', 'peak_flops']

_T = 1e12


@dataclass(frozen=True)
class DevicePeak:
    """One card: ``pattern`` (a regular expression searched in the CUDA device name), its
    printed ``name``, and its dense ``bf16`` and ``fp16`` peaks in FLOP/s (``bf16`` None where
    the card has no bfloat16 tensor cores: Volta, Turing)."""

    pattern: str
    name: str
    bf16: float | None
    fp16: float


# datasheet dense figures, TFLOP/s; the SXM part where a card comes in several forms and the
# name does not say which (CUDA calls an H100 SXM "NVIDIA H100 80GB HBM3")
DEVICE_PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak(r'\bB200\b', 'B200', 2250 * _T, 2250 * _T),
    DevicePeak(r'\bH200 NVL\b', 'H200 NVL', 835 * _T, 835 * _T),
    DevicePeak(r'\bH200\b', 'H200 SXM', 989 * _T, 989 * _T),
    DevicePeak(r'\bH100 NVL\b', 'H100 NVL', 835 * _T, 835 * _T),
    DevicePeak(r'\bH100 PCIe\b', 'H100 PCIe', 756 * _T, 756 * _T),
    DevicePeak(r'\bH100\b', 'H100 SXM', 989 * _T, 989 * _T),
    DevicePeak(r'\bGH200\b', 'GH200', 989 * _T, 989 * _T),
    DevicePeak(r'\bA100\b', 'A100', 312 * _T, 312 * _T),
    DevicePeak(r'\bL40S\b', 'L40S', 362 * _T, 362 * _T),
    DevicePeak(r'\bL40\b', 'L40', 181 * _T, 181 * _T),
    DevicePeak(r'\bL4\b', 'L4', 121 * _T, 121 * _T),
    DevicePeak(r'\bA10\b', 'A10', 125 * _T, 125 * _T),
    DevicePeak(r'\bT4\b', 'T4', None, 65 * _T),
    DevicePeak(r'\bV100\b.*\bPCIE\b', 'V100 PCIe', None, 112 * _T),
    DevicePeak(r'\bV100\b', 'V100 SXM2', None, 125 * _T),
)


def device_peak(name: str | None = None) -> DevicePeak | None:
    """The table's entry for the CUDA device called ``name`` (default: the current CUDA
    device's name; None without CUDA), or None when no entry matches."""
    if name is None:
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
    for entry in DEVICE_PEAKS:
        if re.search(entry.pattern, name, flags=re.IGNORECASE):
            return entry
    return None


def peak_flops(name: str | None = None, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense tensor-core peak of the device called ``name`` (default: the current CUDA
    device) for ``dtype`` (``torch.bfloat16`` or ``torch.float16``), in FLOP/s; None for a
    card the table does not list or a dtype it has no tensor cores for."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f'peak_flops: dtype must be torch.bfloat16 or torch.float16 (the table holds '
            f'tensor-core peaks), got {dtype}'
        )
    entry = device_peak(name)
    if entry is None:
        return None
    return entry.bf16 if dtype == torch.bfloat16 else entry.fp16


@functools.cache
def measured_cpu_peak(size: int = 256, seconds: float = 0.02) -> float:
    """This process's float32 matmul rate on the CPU, in FLOP/s: ``size`` x ``size`` matmuls
    timed for about ``seconds`` at torch's current thread count, the best of three blocks.
    Measured once per process (cached): about ``3 * seconds`` of CPU time."""
    # a generator of its own: the global RNG streams are the run's (drawing from them here
    # would shift every later draw of a resumed process, and its resume would not be exact)
    rng = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=rng), torch.randn(size, size, generator=rng)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)  # first use: the BLAS's own set-up
    start = time.perf_counter()
    torch.mm(a, b, out=out)
    reps = max(1, int(seconds / max(time.perf_counter() - start, 1e-6)))
    best = float('inf')
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * reps / best
