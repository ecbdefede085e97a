"""The example models: shapes, losses, and the transformer's causality."""

import math

import pytest
import torch

from stratagem.registry import MODELS


def test_transformer_lm_is_causal_and_returns_its_loss():
    torch.manual_seed(0)
    model = MODELS.build(
        dict(type='TransformerLM', vocab_size=11, dim=16, depth=2, heads=2, max_len=8)
    )
    model.init_weights()
    assert float(model.head.bias.detach().abs().max()) == 0.0
    assert 0.015 < float(model.tok.weight.detach().std()) < 0.025
    x = torch.randint(11, (3, 8))
    logits = model(x)
    assert logits.shape == (3, 8, 11)
    changed = x.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 11
    other = model(changed)
    assert torch.equal(logits[:, :5], other[:, :5])  # positions before 5 cannot see it
    assert not torch.allclose(logits[:, 5:], other[:, 5:])
    out = model(x, x)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), x.reshape(-1))
    assert torch.allclose(out['loss'], ref)
    assert abs(float(out['loss'].detach()) - math.log(11)) < 0.2  # small init: near uniform
    with pytest.raises(ValueError, match='max_len=8'):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match='heads=3 must divide dim=16'):
        MODELS.build(dict(type='TransformerLM', dim=16, heads=3))
