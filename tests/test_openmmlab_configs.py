"""OpenMMLab configs as people write them (``tests/data/openmmlab/``: ``_base_`` chains in the
style of mmpretrain's and mmdet's, with their helper variables): read as mmengine's
``Config.fromfile`` reads them (``{{_base_.x}}``, ``_base_.x``), run by the reference loop,
a known key's typo still an error, every error of a config in one message; and one
registry space: a type registered in stratagem's or mmengine's registry is found from the
reference loop and from FlexibleRunner alike."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from stratagem.config import Config, ConfigError
from stratagem.loop import check_train_config

DATA = Path(__file__).parent / 'data' / 'openmmlab'
HELPERS = ('dataset_type', 'data_root', 'backend_args', 'train_pipeline', 'test_pipeline')


def _plain(obj):
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


@pytest.mark.parametrize('name', ['mlp_2xb8_blobs.py', 'mlp_iter_blobs.py'])
def test_a_base_chain_reads_as_mmengine_reads_it(name):
    mm_config = pytest.importorskip('mmengine.config', reason='mmengine is not installed')
    ours = Config.fromfile(DATA / name).to_dict()
    theirs = mm_config.Config.fromfile(str(DATA / name)).to_dict()
    assert _plain(ours) == _plain(theirs)
    assert set(HELPERS) <= set(ours)


def test_base_references_take_the_bases_values():
    cfg = Config.fromfile(DATA / 'mlp_2xb8_blobs.py')
    # {{_base_.num_classes}}, as a value and inside a dict; _base_.x in an expression
    assert cfg.num_classes == 4 and cfg.val_dataloader.dataset.num_classes == 4
    assert cfg.model == dict(type='MLPClassifier', in_features=8, num_classes=4, hidden=32)
    assert cfg.optim_wrapper.optimizer.lr == 0.05  # _base_.base_lr / 2
    assert cfg.train_cfg == dict(type='EpochBasedTrainLoop', max_epochs=1, val_interval=1)
    iters = Config.fromfile(DATA / 'mlp_iter_blobs.py')
    # a placeholder in a base of a base, and a whole list from a base
    assert iters.train_dataset.dataset.type == 'SyntheticClassification'
    assert iters.train_pipeline == iters.test_pipeline and len(iters.train_pipeline) == 4


def test_a_missing_base_value_names_it(tmp_path):
    (tmp_path / 'base.py').write_text('max_epochs = 3\nmodel = dict(hidden=8)\n')
    (tmp_path / 'a.py').write_text("_base_ = 'base.py'\nepochs = {{_base_.max_epoch}}\n")
    with pytest.raises(ConfigError, match=r"a.py: \{\{_base_.max_epoch\}\}: the _base_ files "
                       r"have no 'max_epoch'; did you mean 'max_epochs'\?"):  # fmt: skip
        Config.fromfile(tmp_path / 'a.py')
    (tmp_path / 'b.py').write_text("_base_ = 'base.py'\nwidth = _base_.model.hiden\n")
    with pytest.raises(ConfigError, match=r"b.py:2: error while executing config: .*'hiden'"):
        Config.fromfile(tmp_path / 'b.py')
    (tmp_path / 'c.yaml').write_text("_base_: base.py\nepochs: '{{ _base_.max_epochs }}'\n")
    assert Config.fromfile(tmp_path / 'c.yaml').epochs == 3  # in yaml too, quoted or not
    (tmp_path / 'd.json').write_text('{"_base_": "c.yaml", "width": {{_base_.model.hidden}}}')
    assert Config.fromfile(tmp_path / 'd.json').to_dict() == dict(
        max_epochs=3, model=dict(hidden=8), epochs=3, width=8
    )


def test_the_reference_loop_trains_an_openmmlab_config(tmp_path, monkeypatch):
    from stratagem.loop import train

    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)  # env_cfg's nccl: gloo
    cfg = Config.fromfile(DATA / 'mlp_2xb8_blobs.py')
    cfg.work_dir = str(tmp_path / 'work')
    plan = check_train_config(cfg)
    assert (plan.by_epoch, plan.max_epochs, plan.log_interval) == (True, 1, 2)
    assert plan.checkpoints.max_keep == 2 and plan.validation.interval == 1
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        result = train(cfg, progress=False)
    assert result['iter'] == 8  # 32 samples, batch 4, one epoch
    assert [it for it, _ in result['val']] == [8]
    assert os.path.exists(tmp_path / 'work' / 'iter_8.pth')
    iters = check_train_config(Config.fromfile(DATA / 'mlp_iter_blobs.py'))
    assert (iters.by_epoch, iters.max_iters, iters.max_epochs) == (False, 6, None)
    assert iters.validation.interval == 3 and iters.checkpoints.hook_interval == (3, False)


def test_a_config_that_registers_its_own_dataset(tmp_path):
    """``from stratagem.registry import DATASETS`` and a decorated class in the config file:
    neither is a key; the dataset builds."""
    from stratagem.loop import train

    cfg = Config.fromfile(DATA / 'own_dataset.py')
    assert {'DATASETS', 'OwnConfigBlobs', 'torch', 'Dataset', '_double'}.isdisjoint(cfg)
    assert cfg.train_dataloader.batch_size == 4
    cfg.work_dir = str(tmp_path / 'work')
    cfg.train_cfg.preemption = None
    result = train(cfg, progress=False)
    assert result['iter'] == 2


def test_tran_cfg_stays_an_error_and_every_error_comes_in_one_message():
    cfg = Config.fromfile(DATA / 'mlp_2xb8_blobs.py')
    with pytest.raises(ConfigError, match=r"'tran_cfg' \(did you mean 'train_cfg'\?\)"):
        check_train_config({**cfg.to_dict(), 'tran_cfg': dict(max_epochs=2)})
    bad = {
        **cfg.to_dict(),
        'tran_cfg': {},
        'lr_config': {},
        'train_cfg': dict(type='EpochBasedTrainLoop', max_epoch=2, max_epochs=2),
        'val_cfg': dict(type='ValLoop', fp16='yes'),
        'train_dataloader': dict(dataset=dict(type='X'), batch_sise=2),
    }
    with pytest.raises(ConfigError) as caught:
        check_train_config(bad)
    message = str(caught.value)
    assert message.startswith('config: 4 errors:\n'), message
    assert len(caught.value.errors) == 4  # each one, for a caller that lists them apart
    for part in (
        "'tran_cfg' (did you mean 'train_cfg'?)",
        "'lr_config' (mmcv's; param_scheduler=[dict(type=...)] replaces it)",
        "unknown key(s) ['max_epoch'] in train_cfg",
        "did you mean 'max_epoch' -> 'max_epochs'?",
        "unknown key(s) ['batch_sise'] in train_dataloader",
        'val_cfg.fp16 must be True or False',
    ):
        assert part in message
    assert 'dataset_type' not in message and 'data_root' not in message


def test_train_cfg_type_takes_mmengines_loop_names():
    base = Config.fromfile(DATA / 'mlp_2xb8_blobs.py').to_dict()
    base.pop('val_dataloader'), base.pop('val_cfg')

    def plan(train_cfg):
        return check_train_config({**base, 'train_cfg': train_cfg})

    assert plan(dict(type='EpochBasedTrainLoop', max_epochs=2)).by_epoch is True
    scoped = plan(dict(type='mmengine.IterBasedTrainLoop', max_iters=5))
    assert (scoped.by_epoch, scoped.max_iters) == (False, 5)
    with pytest.raises(ValueError, match=r"type='IterBasedTrainLoop' counts iterations: its "
                       r'run length is max_iters, not max_epochs'):  # fmt: skip
        plan(dict(type='IterBasedTrainLoop', max_epochs=2))
    with pytest.raises(ValueError, match=r"type='EpochBasedTrainLoop' and train_cfg.by_epoch"):
        plan(dict(type='EpochBasedTrainLoop', max_epochs=2, by_epoch=False))
    with pytest.raises(ValueError, match=r"train_cfg.type='MyLoop': the reference loop runs as "
                       r"mmengine's 'EpochBasedTrainLoop' \(max_epochs\) or "
                       r"'IterBasedTrainLoop' \(max_iters\)"):  # fmt: skip
        plan(dict(type='MyLoop', max_epochs=2))


def test_a_named_loop_validates_at_mmengines_default_interval():
    """mmengine's IterBasedTrainLoop validates every 1000 iterations unless told; its
    EpochBasedTrainLoop every epoch; without a type the reference loop's default is 1."""
    base = Config.fromfile(DATA / 'mlp_2xb8_blobs.py').to_dict()

    def interval(train_cfg):
        return check_train_config({**base, 'train_cfg': train_cfg}).validation.interval

    assert interval(dict(type='IterBasedTrainLoop', max_iters=5)) == 1000
    assert interval(dict(type='IterBasedTrainLoop', max_iters=5, val_interval=7)) == 7
    assert interval(dict(type='EpochBasedTrainLoop', max_epochs=2)) == 1
    assert interval(dict(max_iters=5)) == 1
