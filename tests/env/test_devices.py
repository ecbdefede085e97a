"""The device peak table (stratagem/env/devices.py): names as CUDA reports them."""

import pytest
import torch

from stratagem.env.devices import DEVICE_PEAKS, device_peak, measured_cpu_peak, peak_flops


@pytest.mark.parametrize(
    ('cuda_name', 'card', 'bf16_tflops', 'fp16_tflops'),
    [
        ('NVIDIA H200', 'H200 SXM', 989, 989),
        ('NVIDIA H200 NVL', 'H200 NVL', 835, 835),
        ('NVIDIA H100 80GB HBM3', 'H100 SXM', 989, 989),
        ('NVIDIA H100 PCIe', 'H100 PCIe', 756, 756),
        ('NVIDIA A100-SXM4-80GB', 'A100', 312, 312),
        ('NVIDIA A100 80GB PCIe', 'A100', 312, 312),
        ('NVIDIA L4', 'L4', 121, 121),
        ('NVIDIA L40S', 'L40S', 362, 362),
        ('NVIDIA A10', 'A10', 125, 125),
        ('Tesla T4', 'T4', None, 65),
        ('Tesla V100-SXM2-16GB', 'V100 SXM2', None, 125),
        ('Tesla V100-PCIE-32GB', 'V100 PCIe', None, 112),
    ],
)
def test_cards_are_found_by_their_cuda_names(cuda_name, card, bf16_tflops, fp16_tflops):
    assert device_peak(cuda_name).name == card
    bf16 = peak_flops(cuda_name, torch.bfloat16)
    assert (bf16 and bf16 / 1e12) == bf16_tflops
    assert peak_flops(cuda_name, torch.float16) / 1e12 == fp16_tflops


def test_unknown_cards_have_no_peak_and_other_dtypes_are_refused():
    # A10G is not an A10 (word boundary), an A100 not an A10
    assert device_peak('NVIDIA A10G') is None and device_peak('NVIDIA GeForce GTX 1080') is None
    assert peak_flops('NVIDIA A10G') is None
    with pytest.raises(ValueError, match=r'torch.bfloat16 or torch.float16.*torch.float32'):
        peak_flops('NVIDIA H100', torch.float32)
    if not torch.cuda.is_available():
        assert device_peak() is None and peak_flops() is None
    # a variant before its family, or the family's entry would shadow it
    names = [e.name for e in DEVICE_PEAKS]
    assert names.index('H100 PCIe') < names.index('H100 SXM')
    assert names.index('H200 NVL') < names.index('H200 SXM')


def test_the_measured_cpu_peak_leaves_the_runs_random_streams_alone():
    """Measured in a resumed process after its RNG states are restored: a draw from the
    global stream there would make the resume inexact."""
    before = torch.get_rng_state()
    assert measured_cpu_peak(size=32, seconds=0.001) > 0
    assert torch.equal(torch.get_rng_state(), before)
