"""stratagem's strategies under Lightning's Trainer (``stratagem.integrations.lightning``).

The run (``lightning_worker.py``, shared with test_fabric.py): 2 processes (gloo, CPU) fit
10 steps with two ``ModelCheckpoint``s saving every 5 steps (one keeps all, one keeps the
newest), on ``StratagemStrategy(dict(type='DDPStrategy'))`` and on Lightning's ``'ddp'``;
then a new launch (torchrun) fits from ``ckpt_path=`` step 5 to step 10.
"""

from __future__ import annotations

import pytest

pytest.importorskip('lightning')

import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning_worker import SAVE_AT, STEPS, launch_both, load_results

from stratagem.checkpoint import (
    list_checkpoints,
    load_checkpoint_file,
    save_checkpoint,
    verify_checkpoint,
)
from stratagem.checkpoint.latest import POINTER_NAME, read_pointer
from stratagem.checkpoint.manifest import SIDECAR_SUFFIX
from stratagem.integrations.lightning import StratagemStrategy


def _same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope='module')
def out(tmp_path_factory):
    return launch_both(tmp_path_factory)


def test_trainer_fits_and_resumes_bit_identically_to_lightning_ddp(out):
    runs = load_results(out, 'trainer')
    for phase in ('first', 'resume'):
        for rank in (0, 1):
            ours, theirs = runs['ours', phase, rank], runs['ddp', phase, rank]
            assert len(ours['losses']) == (STEPS if phase == 'first' else STEPS - SAVE_AT)
            assert torch.equal(ours['losses'], theirs['losses']), (phase, rank)
            assert _same_params(ours['params'], theirs['params']), (phase, rank)
    for rank in (0, 1):
        first, resumed = runs['ours', 'first', rank], runs['ours', 'resume', rank]
        assert torch.equal(first['losses'][SAVE_AT:], resumed['losses'])
        assert _same_params(first['params'], resumed['params'])
    # is_distributed: each rank read its own DistributedSampler shard
    assert not torch.equal(runs['ours', 'first', 0]['losses'], runs['ours', 'first', 1]['losses'])


def test_model_checkpoint_writes_ours_and_retention_leaves_no_orphan(out):
    every, latest = out / 'trainer-ours-every', out / 'trainer-ours-latest'
    names = ['epoch=0-step=5.ckpt', 'epoch=1-step=10.ckpt']
    assert [i.path.name for i in list_checkpoints(every)] == names[::-1]
    assert [verify_checkpoint(every / n)['step'] for n in names] == [5, 10]
    assert read_pointer(every) == every / names[1]
    # save_top_k=1 removed step 5 through our deletion: its manifest went with it
    assert sorted(p.name for p in latest.iterdir()) == sorted(
        [names[1], names[1] + SIDECAR_SUFFIX, POINTER_NAME]
    )
    assert read_pointer(latest) == latest / names[1]
    checkpoint = load_checkpoint_file(every / names[0])  # weights_only, verified
    assert checkpoint['meta']['iter'] == checkpoint['global_step'] == SAVE_AT
    assert checkpoint['epoch'] == 0
    assert {'loops', 'callbacks', 'lr_schedulers', 'optimizer', 'rng_states'} <= set(checkpoint)
    assert 'optimizer_states' not in checkpoint


def test_remove_checkpoint_moves_the_pointer_and_deletes_the_manifest(tmp_path):
    older = save_checkpoint({'x': torch.zeros(1)}, tmp_path / 'a.ckpt', step=1)
    newer = save_checkpoint({'x': torch.ones(1)}, tmp_path / 'b.ckpt', step=2)
    foreign = tmp_path / 'c.ckpt'
    torch.save({'x': 1}, foreign)
    assert read_pointer(tmp_path) == newer
    strategy = StratagemStrategy(dict(type='DDPStrategy'))
    strategy.remove_checkpoint(newer)
    assert not newer.exists() and not (tmp_path / ('b.ckpt' + SIDECAR_SUFFIX)).exists()
    assert read_pointer(tmp_path) == older
    strategy.remove_checkpoint(older)
    assert not (tmp_path / POINTER_NAME).exists()
    strategy.remove_checkpoint(foreign)  # not ours: Lightning's CheckpointIO removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_lightning_hyper_parameters_load_weights_only(tmp_path):
    hparams = AttributeDict(lr=0.1, layers=[4, 8])
    path = save_checkpoint({'hyper_parameters': hparams}, tmp_path / 'h.ckpt')
    loaded = load_checkpoint_file(path)['hyper_parameters']
    assert type(loaded) is AttributeDict and loaded == {'lr': 0.1, 'layers': [4, 8]}
    assert loaded.lr == 0.1


def test_cfg_is_checked():
    with pytest.raises(TypeError, match=r"dict\(type='DDPStrategy'\)"):
        StratagemStrategy(dict(work_dir='x'))
    assert StratagemStrategy(dict(type='DDPStrategy')).is_distributed is True
