import torch

from stratagem.registry import OPTIMIZERS


def test_every_torch_optimizer_is_registered():
    for name in ('SGD', 'Adam', 'AdamW', 'RMSprop', 'Adagrad', 'LBFGS'):
        assert OPTIMIZERS.get(name) is getattr(torch.optim, name)
    assert 'ZeroRedundancyOptimizer' in OPTIMIZERS


def test_zero_is_our_mmengine_style_subclass():
    zero = OPTIMIZERS.get('ZeroRedundancyOptimizer')  # imports torch.distributed.optim quietly
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    assert issubclass(zero, TorchZeRO) and zero.__module__ == 'stratagem.optim.zero'
