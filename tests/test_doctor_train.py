"""`stratagem doctor` = `stratagem train`: for every example config and every refusal the suite's
config tests exercise, doctor has no finding exactly when train starts (reaches its first
iteration), and a refusal's text is in both; train refuses before its first step."""

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from stratagem import doctor
from stratagem.cli import main
from stratagem.config import Config
from stratagem.loop import run as loop_run
from stratagem.models import MLPClassifier
from stratagem.registry import MODELS

ROOT = Path(__file__).resolve().parents[1]

BASE = dict(
    model=dict(type='MLPClassifier', in_features=8, num_classes=3, hidden=8),
    train_dataloader=dict(
        dataset=dict(type='SyntheticClassification', num_samples=64, num_features=8, num_classes=3),
        batch_size=16,
    ),
    val_dataloader=dict(
        dataset=dict(type='SyntheticClassification', num_samples=16, num_features=8, num_classes=3),
        batch_size=8,
    ),
    val_cfg=dict(type='ValLoop'),
    optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
    train_cfg=dict(max_iters=4, val_interval=2, metrics=dict(tensorboard=False)),
    default_hooks=dict(checkpoint=dict(type='CheckpointHook', save_best='acc')),
    strategy=dict(type='SingleDeviceStrategy'),
)


class Packed(nn.Module):
    """A model whose constructor takes one settings dict (as a Hugging Face model its config)."""

    def __init__(self, settings):
        super().__init__()
        self.net = MLPClassifier(**settings)

    def forward(self, inputs, targets):
        return self.net(inputs, targets)


@MODELS.register_module(name='test_doctor_train.Unpacked', force=True)
class Unpacked(Packed):
    """``class TinyLlama(LlamaForCausalLM): def __init__(self, **kw)``: its keywords reach the
    parent as one dict, which no signature shows."""

    def __init__(self, **kw):
        super().__init__(dict(kw))


class Logits(nn.Module):
    """Returns its logits in validation: no scalar to average."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, inputs, targets):
        logits = self.fc(inputs)
        if self.training:
            return nn.functional.cross_entropy(logits, targets)
        return {'logits': logits}


@MODELS.register_module(name='test_doctor_train.build_mlp', force=True)
def build_mlp(width=8):
    return MLPClassifier(in_features=8, num_classes=3, hidden=width)


class _Started(Exception):
    """train reached its first iteration."""


def _changed(changes):
    cfg = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, last = dotted.split('.')
        node = cfg
        for key in parents:
            node = node[key]
        node[last] = value
    return cfg


def _train_start(cfg, monkeypatch):
    """None when ``stratagem.loop.train`` reaches its first iteration, else its error."""

    def loop(parts, preemption):
        raise _Started

    monkeypatch.setattr(loop_run, '_loop', loop)
    try:
        loop_run.train(Config(copy.deepcopy(cfg)), progress=False)
    except _Started:
        return None
    except Exception as err:  # noqa: BLE001 - the refusal under test
        return f'{type(err).__name__}: {err}'
    raise AssertionError('train ran without reaching its loop')


def _agree(cfg, tmp_path, monkeypatch, expected=None):
    cfg = {**cfg, 'work_dir': str(tmp_path / 'work')}
    findings, _ = doctor.diagnose(copy.deepcopy(cfg), 1, probe_disk=False, memory=False)
    refused = _train_start(cfg, monkeypatch)
    text = ' | '.join(f'{f.where}: {f.problem} {f.fix}' for f in findings)
    assert bool(findings) == (refused is not None), f'doctor: {text or "ready"}; train: {refused}'
    if expected is not None:
        assert expected in text and expected in refused, (text, refused)
    assert not list((tmp_path / 'work').glob('*/metrics.csv'))  # no iteration ran
    return findings, refused


CASES = {
    # the issue's configs doctor called ready and train refused
    'save_best not a validation value': (
        {'default_hooks.checkpoint.save_best': 'accuracy'},
        "save_best='accuracy' is not a validation value: the model's validation output has "
        "['loss', 'acc']",
    ),
    'model built by a registered function': (
        {'model': dict(type='test_doctor_train.build_mlp', width=4)},
        None,
    ),
    'misspelt argument of a registered function': (
        {'model': dict(type='test_doctor_train.build_mlp', widht=4)},
        'widht',
    ),
    '**kwargs reaching the parent as one dict': (
        {'model': dict(type='test_doctor_train.Unpacked', in_features=8, num_classes=3, hidden=4)},
        None,
    ),
    'no scalar in validation': (
        {'model': dict(type=Logits), 'default_hooks.checkpoint.save_best': 'auto'},
        'returned no scalar in validation',
    ),
    'real batch beyond the dataset': (
        {'train_dataloader.batch_size': 128},
        'the real batch 128 (batch_size=128 x 1 data-parallel rank(s)) exceeds the dataset',
    ),
    'plateau monitor not a validation value': (
        {
            'param_scheduler': [dict(type='ReduceOnPlateauLR', monitor='val_loss', by_epoch=True)],
            'train_cfg': dict(max_epochs=2),
        },
        "monitor 'val_loss' is not a validation value: the model's validation output has "
        "['loss', 'acc']",
    ),
    'plateau monitor of the validation': (
        {
            'param_scheduler': [dict(type='ReduceOnPlateauLR', monitor='loss', by_epoch=True)],
            'train_cfg': dict(max_epochs=2),
        },
        None,
    ),
    'metrics key typo': ({'train_cfg.metrics': dict(tensorbord=False)}, "['tensorbord']"),
    # helper variables and imported objects: whatever train decides, doctor says the same
    'helper variable': ({'data_root': 'data/blobs/'}, None),
    'private helper variable': ({'_data_root': 'data/blobs/'}, None),
    'imported registry': ({'MODELS': MODELS}, None),
    # the refusals of tests/test_loop.py, test_loop_parts.py, test_cli_train.py, test_doctor.py
    'top-level typo': ({'traincfg': {}}, "'traincfg'"),
    'train_cfg typo': ({'train_cfg.max_keep': 1}, 'max_keep'),
    'no run length': ({'train_cfg': dict(val_interval=2)}, 'max_epochs or max_iters'),
    'rule not inferable': (
        {'default_hooks.checkpoint.save_best': 'score'},
        "higher or a lower 'score'",
    ),
    'hook interval disagrees': (
        {'default_hooks.checkpoint.interval': 2, 'train_cfg.checkpoint_interval': 3},
        'default_hooks.checkpoint.interval=2',
    ),
    'val_cfg type': ({'val_cfg.type': 'TestLoop'}, "val_cfg.type='TestLoop'"),
    'save_best without validation': (
        {'val_dataloader': None, 'val_cfg': None},
        "save_best='acc'",
    ),
    'val shuffle disagrees': (
        {
            'val_dataloader.shuffle': True,
            'val_dataloader.sampler': dict(type='DefaultSampler', shuffle=False),
        },
        'val_dataloader.shuffle=True and val_dataloader.sampler.shuffle=False',
    ),
    'no batch per epoch': (
        {'train_dataloader.batch_size': 128, 'train_dataloader.drop_last': True},
        'yields no batch per epoch: 64 samples',
    ),
    'unbuildable dataset': ({'train_dataloader.dataset.num_samples': 0}, 'num_samples'),
    'unbuildable val dataset': ({'val_dataloader.dataset.num_samples': 0}, 'num_samples'),
    'model argument typo': ({'model.hiden': 3}, 'hiden'),
    'optimizer type typo': ({'optim_wrapper.optimizer.type': 'SDG'}, "'SDG'"),
    'clip_grad typo': ({'optim_wrapper.clip_grad': dict(max_nrom=5.0)}, 'max_nrom'),
    'strategy type typo': ({'strategy.type': 'SingleDevise'}, "'SingleDevise'"),
}


@pytest.mark.parametrize('name', list(CASES))
def test_doctor_finds_what_train_refuses_at_its_start(name, tmp_path, monkeypatch):
    changes, expected = CASES[name]
    _agree(_changed(changes), tmp_path, monkeypatch, expected)


def test_the_issue_cases_by_their_text(tmp_path, monkeypatch, capsys):
    findings, _ = _agree(
        _changed({'default_hooks.checkpoint.save_best': 'accuracy'}), tmp_path, monkeypatch
    )
    (best,) = findings
    assert best.where == 'default_hooks.checkpoint.save_best'
    assert best.fix.startswith('stratagem train stops here, before its first step')
    # the registered function and the **kwargs model: built, so no signature finding
    for model in (
        dict(type='test_doctor_train.build_mlp', width=4),
        dict(type='test_doctor_train.Unpacked', in_features=8, num_classes=3, hidden=4),
    ):
        assert _agree(_changed({'model': model}), tmp_path / 'k', monkeypatch) == ([], None)
    # the real batch at 64 processes: 2048 > 512 samples, as train's Batches refuses it
    cfg = _changed({'train_dataloader.dataset.num_samples': 512, 'train_dataloader.batch_size': 32})
    f = {x.where: x for x in doctor.diagnose(cfg, 64, probe_disk=False, memory=False)[0]}
    assert f['train_dataloader.batch_size'].problem.startswith(
        'the real batch 2048 (batch_size=32 x 64 data-parallel rank(s)) exceeds the dataset: '
        '512 samples over 64 data-parallel rank(s)'
    )
    assert 'every step would read 8 sample(s) a rank, not 32' in (
        f['train_dataloader.batch_size'].problem
    )
    # the CLI: --nproc per node, as train's; --nnodes multiplies
    path = tmp_path / 'big.py'
    path.write_text(
        '\n'.join(f'{k} = {v!r}' for k, v in {**cfg, 'work_dir': str(tmp_path)}.items())
    )
    argv = ['doctor', str(path), '--no-disk-probe', '--nproc', '32', '--nnodes', '2']
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert 'on 64 process(es)' in out and 'the real batch 2048' in ' '.join(out.split())
    from types import SimpleNamespace

    from stratagem.loop.batches import Batches
    from stratagem.loop.plan import DataPlan

    ranks = SimpleNamespace(data_parallel_rank=3, data_parallel_size=64)
    data = DataPlan(TensorDataset(torch.zeros(512, 1)), 32, True, None, {})
    with pytest.raises(ValueError, match=r'the real batch 2048 .*exceeds the dataset'):
        Batches(data, ranks)


def test_train_refuses_save_best_before_its_first_step(tmp_path, capsys):
    """The issue's late failure: a save_best typo cost a training interval and a validation;
    now `stratagem train` stops before iteration 1: no metrics row, no checkpoint."""
    cfg = _changed({'default_hooks.checkpoint.save_best': 'accuracy'})
    path = tmp_path / 'cfg.py'
    path.write_text('\n'.join(f'{k} = {v!r}' for k, v in cfg.items()))
    assert main(['doctor', str(path), '--no-disk-probe']) == 1
    out = ' '.join(capsys.readouterr().out.split())
    assert '1 finding(s)' in out and "save_best='accuracy'" in out and "['loss', 'acc']" in out
    work = tmp_path / 'work'
    assert main(['train', str(path), '--work-dir', str(work)]) == 1
    err = capsys.readouterr().err
    assert "stratagem: error: default_hooks.checkpoint.save_best='accuracy' is not a " in err
    assert not list(work.rglob('metrics.csv')) and not list(work.rglob('*.pth'))


def test_the_start_check_leaves_the_run_unchanged(tmp_path, monkeypatch):
    """One validation forward at the start draws nothing from the RNG streams: the run's
    losses and validations are the same with and without it."""
    from stratagem.loop import validation

    cfg = _changed({'model.dropout': 0.5, 'train_dataloader.shuffle': True})
    cfg['randomness'] = dict(seed=3)
    cfg['val_dataloader']['num_workers'] = 0
    with_check = loop_run.train({**cfg, 'work_dir': str(tmp_path / 'a')}, progress=False)
    monkeypatch.setattr(validation.Validation, 'output_names', lambda self, model: ['acc'])
    without = loop_run.train({**cfg, 'work_dir': str(tmp_path / 'b')}, progress=False)
    assert with_check['losses'] == without['losses']
    assert with_check['val'] == without['val']


EXAMPLES = [
    'examples/configs/classifier.py',
    'examples/byo/config.py',
]


@pytest.mark.parametrize('path', EXAMPLES)
def test_examples_are_ready_and_start(path, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / 'examples' / 'byo'))
    cfg = Config.fromfile(str(ROOT / path)).to_dict()
    findings, refused = _agree(cfg, tmp_path, monkeypatch)
    assert findings == [] and refused is None


# the examples that need several processes or mmengine's runner: doctor at the process count
# their header documents, and a two-iteration `stratagem train` at the same count
MULTI = [
    ('examples/configs/transformer_fsdp.py', 2),
    ('examples/configs/transformer_pp.py', 2),
    ('examples/configs/transformer_2d.py', 4),
    ('examples/configs/classifier_deepspeed.py', 2),
    ('examples/byo/flexible_config.py', 1),
]


@pytest.mark.slow
@pytest.mark.parametrize('path, nproc', MULTI)
def test_multi_process_examples_are_ready_and_start(path, nproc, tmp_path, capsys, monkeypatch):
    from failure_helpers import clean_env, finish, start

    pytest.importorskip('deepspeed' if 'deepspeed' in path else 'torch')
    pytest.importorskip('mmengine' if 'flexible' in path else 'torch')
    monkeypatch.syspath_prepend(str(ROOT / 'examples' / 'byo'))
    argv = ['doctor', str(ROOT / path), '--no-disk-probe', '--nproc', str(nproc)]
    status = main(argv)
    assert status == 0, capsys.readouterr().out
    options = ['--cfg-options', 'train_cfg.max_iters=2'] if 'flexible' not in path else []
    launch = ['--nproc', str(nproc)] if nproc > 1 else []
    env = clean_env(PYTHONPATH=f'{ROOT / "examples" / "byo"}:{ROOT}:{ROOT / "tests"}')
    code, out = finish(start(ROOT / path, tmp_path / 'work', *launch, *options, env=env), 600)
    assert code == 0, out[-4000:]


@pytest.mark.slow
def test_a_hugging_face_subclass_with_kwargs_is_ready_and_starts(tmp_path, monkeypatch):
    """The issue's ``class TinyLlama(LlamaForCausalLM): def __init__(self, **kw)``: 7 false
    findings from the signature before; built, it has none, and train starts."""
    transformers = pytest.importorskip('transformers')

    class TinyLlama(transformers.LlamaForCausalLM):
        def __init__(self, **kw):
            super().__init__(transformers.LlamaConfig(**kw))

        def forward(self, inputs, targets):
            return {'loss': super().forward(input_ids=inputs, labels=targets).loss}

    MODELS.register_module(name='test_doctor_train.TinyLlama', module=TinyLlama, force=True)
    model = dict(
        type='test_doctor_train.TinyLlama',
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    data = dict(type='SyntheticLanguageModeling', num_samples=16, seq_len=8, vocab_size=16)
    cfg = _changed({'model': model, 'train_dataloader.dataset': data})
    cfg['val_dataloader']['dataset'] = data
    cfg['default_hooks']['checkpoint']['save_best'] = 'loss'
    assert _agree(cfg, tmp_path, monkeypatch) == ([], None)
