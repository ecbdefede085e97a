import pytest
import torch
import torch.distributed as dist
from torch import nn

from stratagem.optim import build_optim_wrapper


@pytest.fixture
def single_rank_group(tmp_path):
    if not dist.is_available():
        pytest.skip('torch.distributed is not available')
    store = dist.FileStore(str(tmp_path / 'store'), 1)
    dist.init_process_group('gloo', store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1))


def test_zero_built_from_cfg_matches_adamw(single_rank_group, weights_only_roundtrip):
    x = torch.randn(8, 4)
    paramwise = dict(norm_decay_mult=0.0, bias_decay_mult=0.0)
    ref = make_model()
    ref_w = build_optim_wrapper(
        ref, dict(optimizer=dict(type='AdamW', lr=0.01, weight_decay=0.1), paramwise_cfg=paramwise)
    )
    model = make_model()
    wrapper = build_optim_wrapper(
        model,
        dict(
            optimizer=dict(
                type='ZeroRedundancyOptimizer', optimizer_type='AdamW', lr=0.01, weight_decay=0.1
            ),
            paramwise_cfg=paramwise,
        ),
    )
    assert type(wrapper.optimizer).__name__ == 'ZeroRedundancyOptimizer'
    for m, w in ((ref, ref_w), (model, wrapper)):
        for _ in range(3):
            w.update_params(m(x).square().mean())
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    sd = weights_only_roundtrip(wrapper.state_dict())
    assert len(sd['param_groups']) == 2 and sd['optim_wrapper']['inner_count'] == 3


def test_zero_needs_a_process_group_and_an_optimizer():
    from stratagem.optim import ZeroRedundancyOptimizer

    params = list(make_model().parameters())
    with pytest.raises(ValueError, match='exactly one of optimizer_type'):
        ZeroRedundancyOptimizer(params)
    with pytest.raises(KeyError, match="did you mean 'AdamW'"):
        ZeroRedundancyOptimizer(params, optimizer_type='AdamWW')
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match='initialised process group'):
            ZeroRedundancyOptimizer(params, optimizer_type='AdamW', lr=0.1)
