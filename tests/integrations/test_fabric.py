"""stratagem's strategies under Lightning Fabric (``stratagem.integrations.fabric``).

The run: ``lightning_worker.py`` trains 2 processes (gloo, CPU) 10 steps with a
``fabric.save`` at step 5, on our ``StratagemStrategy(dict(type='DDPStrategy'))`` and on
Fabric's own ``'ddp'``, then resumes both from step 5 in a new launch (torchrun); the first
launch is a plain ``python``, so Lightning's launcher starts rank 1.
"""

from __future__ import annotations

import pytest

pytest.importorskip('lightning')

import torch
from lightning_worker import SAVE_AT, STEPS, launch_both, load_results

from stratagem.checkpoint import load_checkpoint_file, verify_checkpoint
from stratagem.checkpoint.latest import read_pointer
from stratagem.integrations.fabric import (
    StratagemStrategy,
    optimizer_cfg,
    rebuild_optimizer,
    reduce_tensor,
)


def _same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope='module')
def out(tmp_path_factory):
    return launch_both(tmp_path_factory)


def test_fabric_trains_and_resumes_bit_identically_to_lightning_ddp(out):
    runs = load_results(out, 'fabric')
    for phase in ('first', 'resume'):
        for rank in (0, 1):
            ours, theirs = runs['ours', phase, rank], runs['ddp', phase, rank]
            assert len(ours['losses']) == (STEPS if phase == 'first' else STEPS - SAVE_AT)
            assert torch.equal(ours['losses'], theirs['losses']), (phase, rank)
            assert _same_params(ours['params'], theirs['params']), (phase, rank)
    for rank in (0, 1):  # the resumed steps are the uninterrupted run's steps 6..10
        first, resumed = runs['ours', 'first', rank], runs['ours', 'resume', rank]
        assert torch.equal(first['losses'][SAVE_AT:], resumed['losses'])
        assert _same_params(first['params'], resumed['params'])
    # the ranks read different batches (DDP averaged their gradients into one model)
    assert not torch.equal(runs['ours', 'first', 0]['losses'], runs['ours', 'first', 1]['losses'])
    assert _same_params(runs['ours', 'first', 0]['params'], runs['ours', 'first', 1]['params'])


def test_fabric_save_is_our_verified_checkpoint_at_the_path(out):
    path = out / 'fabric-ours.ckpt'
    manifest = verify_checkpoint(path)
    assert manifest['step'] == SAVE_AT
    assert read_pointer(out) == path
    checkpoint = load_checkpoint_file(path)
    assert checkpoint['step'] == SAVE_AT
    assert checkpoint['meta']['iter'] == SAVE_AT
    assert checkpoint['meta']['world_size'] == 2
    assert set(checkpoint['state_dict']) == {'0.weight', '0.bias', '2.weight', '2.bias'}
    assert len(checkpoint['rng_states']) == 2
    assert {'state', 'param_groups'} <= set(checkpoint['optimizer'])
    assert set(checkpoint) == {'meta', 'state_dict', 'optimizer', 'step', 'rng_states'}


def test_cfg_and_optim_wrapper_are_checked():
    with pytest.raises(TypeError, match=r"dict\(type='DDPStrategy'\)"):
        StratagemStrategy('ddp')
    with pytest.raises(ValueError, match='must not name an optimizer'):
        StratagemStrategy(dict(type='DDPStrategy'), optim_wrapper=dict(optimizer=dict(type='SGD')))
    with pytest.raises(RuntimeError, match=r'fabric.launch\(\)'):
        _ = StratagemStrategy(dict(type='DDPStrategy')).stratagem


def test_rebuild_optimizer_maps_groups_by_name():
    torch.manual_seed(0)
    old = torch.nn.Linear(3, 2)
    new = torch.nn.Linear(3, 2)
    names = {id(p): n for n, p in old.named_parameters()}
    opt = torch.optim.SGD(
        [{'params': [old.weight], 'lr': 0.5}, {'params': [old.bias]}], lr=0.1, momentum=0.9
    )
    rebuilt = rebuild_optimizer(opt, names, new)
    assert [g['params'] for g in rebuilt.param_groups] == [[new.weight], [new.bias]]
    assert [g['lr'] for g in rebuilt.param_groups] == [0.5, 0.1]
    assert rebuilt.defaults['momentum'] == 0.9
    new.weight.grad = torch.ones_like(new.weight)
    rebuilt.step()
    with pytest.raises(ValueError, match='already holds state'):
        rebuild_optimizer(rebuilt, {id(p): n for n, p in new.named_parameters()}, old)


def test_reduce_tensor_without_a_process_group_is_the_identity():
    t = torch.tensor([1.0, 2.0])
    assert reduce_tensor(t, reduce_op='sum') is t
    assert reduce_tensor(3, reduce_op='mean') == 3


def test_optimizer_cfg_is_the_class_and_its_one_group():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    cfg = optimizer_cfg(opt, model)
    assert cfg['type'] is torch.optim.AdamW
    assert (cfg['lr'], cfg['weight_decay'], cfg['betas']) == (0.01, 0.1, (0.9, 0.999))
    assert 'decoupled_weight_decay' not in cfg  # AdamW's default that its constructor lacks
    two = torch.optim.SGD([{'params': [model.weight]}, {'params': [model.bias]}], lr=0.1)
    with pytest.raises(ValueError, match=r'one param group .* \(got 2 group\(s\)\)'):
        optimizer_cfg(two, model)
