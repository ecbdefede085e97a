from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch
from torch import nn

from stratagem.optim import (
    LossScaler,
    auto_fp16,
    cast_tensor_type,
    force_fp32,
    patch_forward_method,
    patch_norm_fp32,
    wrap_fp16_model,
)

Pair = namedtuple('Pair', 'a b')


def test_cast_tensor_type_recurses_and_only_changes_src_type():
    f, i = torch.ones(2), torch.ones(2, dtype=torch.long)
    arr, mod = np.ones(2, dtype=np.float32), nn.Linear(1, 1)
    dd = defaultdict(list, x=f)
    inputs = {
        'f': f,
        'i': i,
        's': 'text',
        'arr': arr,
        'mod': mod,
        'n': 3,
        'nested': [f, (f, i), Pair(f, 'b')],
        'od': OrderedDict(y=f),
        'dd': dd,
    }
    out = cast_tensor_type(inputs, torch.float, torch.half)
    assert out['f'].dtype == torch.half and out['i'] is i
    assert out['s'] == 'text' and out['arr'] is arr and out['mod'] is mod and out['n'] == 3
    assert mod.weight.dtype == torch.float32
    assert out['nested'][0].dtype == torch.half and isinstance(out['nested'][1], tuple)
    assert out['nested'][1][0].dtype == torch.half and out['nested'][1][1] is i
    assert isinstance(out['nested'][2], Pair) and out['nested'][2].a.dtype == torch.half
    assert type(out['od']) is OrderedDict and out['od']['y'].dtype == torch.half
    assert type(out['dd']) is defaultdict and out['dd']['missing'] == []
    assert inputs['f'].dtype == torch.float  # input untouched
    assert (
        cast_tensor_type(torch.ones(1, dtype=torch.half), torch.float, torch.half).dtype
        == torch.half
    )


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fp16_enabled = False
        self.fc = nn.Linear(4, 4)

    @auto_fp16(apply_to=('x',))
    def forward(self, x, y, *extra):
        return x, y, self.fc(x), extra

    @auto_fp16(out_fp32=True)
    def forward_out32(self, x):
        return x * 2

    @force_fp32(apply_to=('x',))
    def loss(self, x, y):
        return x, y, torch.mm(x, x.t())

    @force_fp32(out_fp16=True)
    def loss_out16(self, x):
        return x + 1


def test_decorators_are_no_ops_without_fp16_enabled():
    head = Head()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    ox, oy, z, extra = head(x, y, 'e')
    assert ox is x and oy is y and z.dtype == torch.float32 and extra == ('e',)
    lx, ly, _ = head.loss(x.half(), y.half())
    assert lx.dtype == torch.half and ly.dtype == torch.half


def test_auto_fp16_and_force_fp32_with_fp16_enabled():
    head = wrap_fp16_model(Head())
    assert head.fp16_enabled and head.fc.weight.dtype == torch.float32
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    ox, oy, z, extra = head(x, y, 'e')
    assert ox.dtype == torch.half and oy.dtype == torch.float32  # only apply_to is cast
    assert z.dtype == torch.half  # fp32 weights under autocast
    assert extra == ('e',)  # mmcv drops extra positional arguments; we keep them
    assert head.forward_out32(x).dtype == torch.float32
    lx, ly, mm = head.loss(x.half(), y=y.half())
    assert lx.dtype == torch.float32 and ly.dtype == torch.half and mm.dtype == torch.float32
    assert head.loss_out16(x.half()).dtype == torch.half
    with pytest.raises(TypeError, match='auto_fp16'):
        Head.forward(object(), x, y)


def test_force_fp32_turns_autocast_off():
    head = wrap_fp16_model(Head())
    with torch.autocast('cpu', dtype=torch.half):
        _, _, mm = head.loss(torch.randn(2, 4).half(), torch.randn(2, 4))
    assert mm.dtype == torch.float32


def test_patch_norm_fp32_and_half_model():
    model = nn.Sequential(nn.Conv2d(2, 4, 1), nn.Sequential(nn.BatchNorm2d(4), nn.GroupNorm(2, 4)))
    wrap_fp16_model(model, half=True)
    assert model[0].weight.dtype == torch.half
    assert model[1][0].weight.dtype == torch.float32 and model[1][1].weight.dtype == torch.float32
    out = model[1][1](torch.randn(1, 4, 2, 2).half())
    assert out.dtype == torch.half
    assert patch_norm_fp32(nn.Linear(1, 1)).weight.dtype == torch.float32


def test_patch_forward_method():
    fwd = patch_forward_method(
        lambda x, k=None: (x, k), torch.half, torch.float, convert_output=False
    )
    x, k = fwd(torch.ones(1).half(), k=torch.ones(1).half())
    assert x.dtype == torch.float and k.dtype == torch.float
    fwd = patch_forward_method(lambda x: x * 2, torch.half, torch.float)
    assert fwd(torch.ones(1).half()).dtype == torch.half


def test_loss_scaler_dynamic_updates():
    scaler = LossScaler(init_scale=8.0, mode='dynamic', scale_factor=2.0, scale_window=2)
    history = []
    for overflow in (True, False, False, False, True, True, True, True):
        scaler.update_scale(overflow)
        history.append(scaler.loss_scale)
    # overflow at it 0: 4; it 1: (1-0)%2 no; it 2: (2-0)%2==0 -> 8; it 3: no; then 4, 2, 1, 1
    assert history == [4.0, 4.0, 8.0, 8.0, 4.0, 2.0, 1.0, 1.0]
    state = scaler.state_dict()
    assert state == {
        'cur_scale': 1.0,
        'cur_iter': 8,
        'mode': 'dynamic',
        'last_overflow_iter': 7,
        'scale_factor': 2.0,
        'scale_window': 2,
    }
    other = LossScaler()
    other.load_state_dict(state)
    assert other.state_dict() == state


def test_loss_scaler_static_and_overflow_check():
    scaler = LossScaler(init_scale=512.0, mode='static')
    scaler.update_scale(True)
    assert scaler.loss_scale == 512.0
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2).half())
    p.grad, q.grad = torch.ones(3), torch.ones(2).half()
    assert not scaler.has_overflow([p, q, nn.Parameter(torch.ones(1))])
    q.grad[0] = float('nan')
    assert scaler.has_overflow([p, q])  # checked in static mode too
    with pytest.raises(ValueError, match="'dynamic' or 'static'"):
        LossScaler(mode='auto')
