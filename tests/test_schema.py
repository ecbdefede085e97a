"""The top level of a config: which keys route to mmengine's runner, which nothing reads, and
the reference loop refusing both (``stratagem.schema``, ``stratagem.loop``)."""

import pytest

from stratagem.config import ConfigError
from stratagem.schema import (
    LOOP_TOP_KEYS,
    RUNNER_TOP_KEYS,
    read_top_level_keys,
    runner_reasons,
)

# mmengine's default_runtime.py: its default hooks, each its default type
DEFAULT_RUNTIME_HOOKS = dict(
    runtime_info=dict(type='RuntimeInfoHook'),
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', interval=1, save_best='acc'),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='VisualizationHook', interval=5),  # draws nothing
)


def test_runner_reasons():
    plain = dict(model={}, train_dataloader={}, val_dataloader={}, val_cfg={}, env_cfg={})
    assert runner_reasons(plain) == []
    assert runner_reasons({**plain, 'default_hooks': DEFAULT_RUNTIME_HOOKS}) == []
    assert runner_reasons({**plain, 'default_scope': 'mmengine'}) == []
    mm = {**plain, 'val_evaluator': {}, 'test_dataloader': {}, 'runner_type': 'FlexibleRunner'}
    assert runner_reasons(mm) == [
        "runner_type='FlexibleRunner'",
        'test_dataloader',
        'val_evaluator',
    ]
    hooks = dict(
        DEFAULT_RUNTIME_HOOKS,
        visualization=dict(type='VisualizationHook', draw=True),  # it draws: mmengine's work
        param_scheduler=None,  # switched off: the loop always steps schedulers
        ema=dict(type='EMAHook'),
        timer=dict(type='MyTimerHook'),
    )
    assert runner_reasons({**plain, 'default_hooks': hooks, 'default_scope': 'mmdet'}) == [
        "default_scope='mmdet'",
        'default_hooks.timer',
        'default_hooks.param_scheduler',
        'default_hooks.visualization',
        'default_hooks.ema',
    ]
    with pytest.raises(ValueError, match=r"runner_type='Runner'.*'FlexibleRunner'"):
        runner_reasons({'runner_type': 'Runner'})
    assert {'val_evaluator', 'custom_hooks', 'visualizer', 'log_processor'} <= (
        RUNNER_TOP_KEYS - LOOP_TOP_KEYS
    )


def test_read_top_level_keys_tells_typos_from_helper_variables_and_objects():
    """The one decision (train, its FlexibleRunner route and doctor ask it): a known key's
    typo and an older config's key are errors; plain data nothing reads is the config
    file's helper variable (OpenMMLab's dataset_type, data_root, train_pipeline, ...);
    modules, classes, functions and other objects are no keys."""
    import math

    from stratagem.registry import DATASETS

    cfg = dict(
        model={},
        train_cgf={},
        launch='pytorch',
        lr_config={},
        dataset_type='CocoDataset',
        data_root='data/coco/',
        train_pipeline=[dict(type='LoadImageFromFile'), dict(type='Resize', scale=(1333, 800))],
        train_dataset=dict(type='RepeatDataset', times=3),  # 0.76 to train_dataloader: kept
        max_epochs=12,
        base_lr=0.02,
        backend_args=None,
        _helper=1,  # the config file's own variable
        SGD=type('SGD', (), {}),  # a class imported into a .py config
        DATASETS=DATASETS,  # an imported registry
        math=math,
        sqrt=math.sqrt,
    )
    keys = read_top_level_keys(cfg, LOOP_TOP_KEYS)
    assert keys.unknown == {
        'train_cgf': "did you mean 'train_cfg'?",
        'launch': "did you mean 'launcher'?",
        'lr_config': "mmcv's; param_scheduler=[dict(type=...)] replaces it",
    }
    assert keys.helpers == (
        'dataset_type',
        'data_root',
        'train_pipeline',
        'train_dataset',
        'max_epochs',
        'base_lr',
        'backend_args',
    )
    assert keys.objects == ('SGD', 'DATASETS', 'math', 'sqrt')
    # under the runner's keys too: max_epochs is no key there either, val_evalutor a typo
    runner = read_top_level_keys({'val_evalutor': {}, 'max_epochs': 3}, RUNNER_TOP_KEYS)
    assert runner.unknown == {'val_evalutor': "did you mean 'val_evaluator'?"}
    assert runner.helpers == ('max_epochs',)


def test_the_reference_loop_refuses_keys_it_does_not_read(tmp_path):
    from stratagem.loop import train

    cfg = dict(
        model=dict(type='MLPClassifier', in_features=4, num_classes=2),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
        train_dataloader=dict(dataset=dict(type='SyntheticClassification'), batch_size=4),
        train_cfg=dict(max_iters=1),
        work_dir=str(tmp_path / 'w'),
    )
    with pytest.raises(ConfigError, match=r"val_evaluator are read only by mmengine's runner.*"
                       r'stratagem train CONFIG.*FlexibleRunner'):  # fmt: skip
        train({**cfg, 'val_evaluator': dict(type='Accuracy')}, progress=False)
    with pytest.raises(ConfigError, match=r"'tran_cfg' \(did you mean 'train_cfg'\?\)"):
        train({**cfg, 'tran_cfg': {}}, progress=False)
    assert not (tmp_path / 'w').exists()  # refused before anything was built or written
