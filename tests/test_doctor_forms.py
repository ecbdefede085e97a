"""`stratagem doctor` finds each problem in every config form the strategies accept: wrap
policies, ignored modules and activation checkpointing (FSDP), DeepSpeed configs (dict, JSON
file, keyword sections), several optim wrappers, and every scheduler count against the run."""

import copy
import json

import pytest
from torch import nn

from stratagem import doctor

LM = dict(type='TransformerLM', vocab_size=16, dim=16, depth=2, heads=4, max_len=8)
BASE = dict(
    model=LM,
    train_dataloader=dict(
        dataset=dict(type='SyntheticLanguageModeling', num_samples=256, seq_len=8, vocab_size=16),
        batch_size=8,
    ),
    optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
    train_cfg=dict(max_iters=100),
)


def _findings(tmp_path, nproc=1, **top):
    cfg = dict(copy.deepcopy(BASE), work_dir=str(tmp_path), **top)
    findings, _ = doctor.diagnose(cfg, nproc, probe_disk=False, memory=False)
    return {f.where: f for f in findings}


def _fsdp(tmp_path, **strategy):
    return _findings(tmp_path, 2, strategy=dict(type='FSDPStrategy', **strategy))


@pytest.mark.parametrize(
    'policy',
    [
        ['Blok'],
        'Blok',
        ('TransformerBlock', 'Blok'),
        dict(type='transformer_auto_wrap_policy', transformer_layer_cls=['Blok']),
        dict(type='ModuleWrapPolicy', module_classes=['Blok']),
        dict(type='torch.distributed.fsdp.wrap.ModuleWrapPolicy', module_classes=('Blok',)),
    ],
)
def test_wrap_policy_class_that_is_not_in_the_model(tmp_path, policy):
    f = _fsdp(tmp_path, model_wrapper=dict(auto_wrap_policy=policy))
    wrap = f['strategy.model_wrapper.auto_wrap_policy']
    assert "['Blok'] are not in the model" in wrap.problem
    assert 'TransformerBlock' in wrap.fix


@pytest.mark.parametrize(
    'policy',
    [
        dict(transformer_layer_cls=['TransformerBlock']),  # no type: read as size-based
        dict(type='size_based', min_num_params=0),
        dict(type='no.such.policy'),
        42,
    ],
)
def test_wrap_policy_forms_the_run_refuses(tmp_path, policy):
    f = _fsdp(tmp_path, model_wrapper=dict(auto_wrap_policy=policy))
    assert 'auto_wrap_policy' in f['strategy.model_wrapper.auto_wrap_policy'].problem


def _is_block(module):
    return type(module).__name__ == 'TransformerBlock'


@pytest.mark.parametrize(
    'policy',
    [
        ['TransformerBlock'],
        'TransformerBlock',
        dict(type='transformer_auto_wrap_policy', transformer_layer_cls=['TransformerBlock']),
        dict(type='size_based_auto_wrap_policy', min_num_params=100),
        _is_block,
        f'{__name__}._is_block',
    ],
)
def test_wrap_policy_forms_that_fit(tmp_path, policy):
    assert _fsdp(tmp_path, model_wrapper=dict(auto_wrap_policy=policy)) == {}


def test_wrap_policy_that_selects_nothing(tmp_path):
    f = _fsdp(tmp_path, model_wrapper=dict(auto_wrap_policy=dict(min_num_params=10**9)))
    assert 'selects no submodule' in f['strategy.model_wrapper.auto_wrap_policy'].problem


@pytest.mark.parametrize('ignored', [['hed'], 'hed', ['Linaer']])
def test_ignored_modules_not_in_the_model(tmp_path, ignored):
    f = _fsdp(
        tmp_path, model_wrapper=dict(auto_wrap_policy=['TransformerBlock'], ignored_modules=ignored)
    )
    assert 'name neither a submodule nor a module class' in (
        f['strategy.model_wrapper.ignored_modules'].problem
    )
    ok = _fsdp(
        tmp_path,
        model_wrapper=dict(auto_wrap_policy=['TransformerBlock'], ignored_modules=['head']),
    )
    assert ok == {}


@pytest.mark.parametrize(
    'ac',
    [
        ['Blok'],
        dict(check_fn=['Blok']),
        dict(module_classes=['Blok']),
        dict(auto_wrap_policy=['Blok']),
        dict(check_fn='no.such.fn'),
        dict(check_fn=['TransformerBlock'], module_classes=['TransformerBlock']),
        True,
    ],
)
def test_activation_checkpointing_forms(tmp_path, ac):
    wrap = dict(auto_wrap_policy=['TransformerBlock'])
    f = _fsdp(tmp_path, model_wrapper=wrap, activation_checkpointing=ac)
    assert 'strategy.activation_checkpointing' in f
    good = [['TransformerBlock'], dict(check_fn=_is_block), dict(module_classes=[nn.Linear])]
    for ok in good:
        assert _fsdp(tmp_path, model_wrapper=wrap, activation_checkpointing=ok) == {}


@pytest.mark.parametrize(
    'key,value',
    [
        ('sharding_strategy', 'HYBRID_SHARD'),
        ('sharding_strategy', 'FULL_SHARDD'),
        ('mixed_precision', dict(param_dtype='bfloat16', keep_low_precision_grads=True)),
        ('use_orig_params', False),
        ('limit_all_gathers', True),
    ],
)
def test_model_wrapper_keys_the_run_refuses(tmp_path, key, value):
    f = _fsdp(tmp_path, model_wrapper={'auto_wrap_policy': ['TransformerBlock'], key: value})
    assert any(w.startswith('strategy.model_wrapper') for w in f), f


def test_state_dict_cfg(tmp_path):
    f = _fsdp(tmp_path, state_dict_cfg='fulll')
    assert "state_dict_cfg='fulll' is not supported" in f['strategy.state_dict_cfg'].problem


def _ds(tmp_path, nproc=2, **strategy):
    return _findings(tmp_path, nproc, strategy=dict(type='DeepSpeedStrategy', **strategy))


def test_deepspeed_config_forms(tmp_path):
    path = tmp_path / 'ds.json'
    path.write_text(json.dumps(dict(train_batch_size=64, optimizer=dict(type='Adam'))))
    f = _ds(tmp_path, config=str(path))
    assert "has a 'optimizer' section" in f['strategy.config'].problem
    path.write_text(json.dumps(dict(train_batch_size=64)))
    f = _ds(tmp_path, config=str(path))  # the batch from a JSON file: 2 x 8 = 16
    assert f['strategy.config.train_batch_size'].problem.startswith(
        'DeepSpeed train_batch_size=64 disagrees with the config: 16'
    )
    f = _ds(tmp_path, config=str(tmp_path / 'missing.json'))
    assert 'does not exist' in f['strategy.config'].problem
    f = _ds(tmp_path, config=dict(zero_optimization=dict(stage=2)), zero_optimization=dict(stage=3))
    assert 'disagrees' in f['strategy.config'].problem
    f = _ds(tmp_path, zero_optimization=dict(stage=4))
    assert 'stage=4' in f['strategy.config'].problem
    f = _ds(tmp_path, gradient_clipping=1.0)  # no clip_grad: DeepSpeed would clip anyway
    assert 'gradient_clipping=1.0 disagrees' in f['strategy.gradient_clipping'].problem
    f = _ds(tmp_path, train_micro_batch_size_per_gpu=4)  # a keyword section counts as well
    assert 'strategy.config.train_micro_batch_size_per_gpu' in f
    assert _ds(tmp_path, zero_optimization=dict(stage=3), bf16=dict(enabled=True)) == {}


def test_several_optim_wrappers(tmp_path):
    amp = dict(type='AmpOptimWrapper', dtype='bfloat16', loss_scale='dynamic')
    f = _findings(
        tmp_path,
        optim_wrapper=dict(
            constructor='MultiOptimWrapperConstructor',
            gen=dict(optimizer=dict(type='AdamW', lr=1e-3), accumulative_counts=2),
            disc=dict(amp, optimizer=dict(type='SGD', lr=0.1)),
        ),
    )
    assert f['optim_wrapper.disc.loss_scale'].fix == 'remove loss_scale'


# ------------------------------------------------------------------------------- schedulers
# 256 samples / 8 = 32 iterations per epoch (one process); max_iters=100 unless max_epochs
@pytest.mark.parametrize(
    'sched,where,text',
    [
        (dict(type='CosineAnnealingLR', by_epoch=False, T_max=500), '.T_max', 'never reaches'),
        (dict(type='CosineAnnealingLR', by_epoch=False, T_max=40), '.T_max', 'rises again'),
        (dict(type='CosineAnnealingMomentum', by_epoch=False, T_max=500), '.T_max', 'never'),
        (
            dict(
                type='CosineAnnealingParamScheduler',
                param_name='weight_decay',
                T_max=500,
                by_epoch=False,
            ),
            '.T_max',
            'never reaches',
        ),  # fmt: skip
        (dict(type='MultiStepLR', by_epoch=False, milestones=[50, 120]), '.milestones', '[120]'),
        (
            dict(type='MultiStepLR', by_epoch=False, begin=40, milestones=[30, 70]),
            '.milestones',
            '[70]',
        ),  # fmt: skip
        (dict(type='StepLR', by_epoch=False, step_size=100), '.step_size', 'never steps'),
        (
            dict(
                type='CosineRestartLR',
                by_epoch=False,
                periods=[60, 60],
                restart_weights=[1, 1],
                eta_min=0,
            ),
            '.periods',
            'sum to 120',
        ),  # fmt: skip
        (
            dict(type='OneCycleLR', by_epoch=False, eta_max=0.1, total_steps=500),
            '.total_steps',
            'cut short',
        ),  # fmt: skip
        (
            dict(type='OneCycleLR', by_epoch=False, eta_max=0.1, total_steps=50),
            '.total_steps',
            'steps past the cycle',
        ),  # fmt: skip
        (dict(type='LinearLR', by_epoch=False, end=200), '.end', 'ends at 200'),
        (dict(type='LinearLR', by_epoch=False, begin=150, end=160), '.begin', 'never runs'),
    ],
)
def test_scheduler_counts_against_the_run(tmp_path, sched, where, text):
    f = _findings(tmp_path, param_scheduler=[sched])
    assert text in f[f'param_scheduler[0]{where}'].problem, f


def test_scheduler_counts_in_epochs_and_converted(tmp_path):
    run = dict(max_epochs=3)  # 96 iterations
    f = _findings(
        tmp_path,
        train_cfg=run,
        param_scheduler=[
            dict(type='CosineAnnealingLR', T_max=5, convert_to_iter_based=True),
            dict(type='MultiStepLR', milestones=[1, 4], begin=0),
        ],
    )
    assert 'T_max=160 (convert_to_iter_based)' in f['param_scheduler[0].T_max'].problem
    assert '96 iterations' in f['param_scheduler[0].T_max'].problem
    assert 'milestone(s) [4]' in f['param_scheduler[1].milestones'].problem
    fits = [dict(type='CosineAnnealingLR', T_max=3, convert_to_iter_based=True)]
    assert _findings(tmp_path, train_cfg=run, param_scheduler=fits) == {}


def test_schedulers_as_one_dict_and_as_a_dict_of_lists(tmp_path):
    bad = dict(type='CosineAnnealingLR', by_epoch=False, T_max=500)
    f = _findings(tmp_path, param_scheduler=bad)
    assert 'param_scheduler.T_max' in f
    f = _findings(
        tmp_path,
        param_scheduler=dict(gen=[dict(type='LinearLR', by_epoch=False, end=10), bad], disc=bad),
    )
    assert 'param_scheduler.gen[1].T_max' in f and 'param_scheduler.disc[0].T_max' in f
    assert not any(', ' in w for w in f)  # schedules of different optimizers never overlap


def test_default_t_max_fits(tmp_path):
    fits = [dict(type='CosineAnnealingLR', by_epoch=False), dict(type='OneCycleLR', eta_max=0.1,
             by_epoch=False)]  # fmt: skip
    assert _findings(tmp_path, param_scheduler=fits[:1]) == {}
    assert _findings(tmp_path, param_scheduler=fits[1:]) == {}
