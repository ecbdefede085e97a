"""mmengine runner configs under ``stratagem train``: routed to mmengine's FlexibleRunner on
stratagem's strategies (``integrations/mmengine_runner.py``), with stratagem's registries
falling back to mmengine's; without mmengine, an error naming the keys and the extra."""

import glob
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from stratagem.cli import main
from stratagem.config import ConfigError, ConfigWarning

pytest.importorskip('mmengine', reason='mmengine is not installed (pip install "stratagem[test]")')

ROOT = Path(__file__).resolve().parents[2]
BYO = ROOT / 'examples' / 'byo'


def test_a_flexible_runner_config_runs_its_metric_through_stratagem_train(tmp_path, monkeypatch):
    """examples/byo/flexible_config.py: a BaseModel, a BaseMetric and a dataset of the user's
    own, in mmengine's registries; 2 processes (the torchrun workers take the same route),
    50 validation samples, batch 8. The metric mmengine logs equals the one computed here from
    the last checkpoint's weights on the whole validation set."""
    work_dir = tmp_path / 'work'
    env = {**os.environ, 'PYTHONPATH': str(ROOT), 'OMP_NUM_THREADS': '1'}
    env.pop('PYTHONWARNINGS', None)
    # a best checkpoint replaced and one past max_keep_ckpts deleted by mmengine's hook
    proc = subprocess.run(
        [sys.executable, '-m', 'stratagem', 'train', str(BYO / 'flexible_config.py'),
         '--work-dir', str(work_dir), '--nproc', '2', '--cfg-options',
         'default_hooks.checkpoint.save_best=tiny/nll', 'default_hooks.checkpoint.rule=less',
         'default_hooks.checkpoint.max_keep_ckpts=1'],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # rank 0 alone prints mmengine's banner (the config, the hooks)
    said = proc.stdout + proc.stderr
    assert said.count('Hooks will be executed in the following order') == 1, said[-3000:]
    assert said.count(' INFO: Config:\n') == 1, said[-3000:]
    (log,) = [p for p in work_dir.glob('*/*.log') if '_rank' not in p.name]
    assert log.read_text().splitlines()[-1].endswith('INFO: run ended: finished, iteration 8/8')
    # no manifest without its checkpoint: mmengine deleted epoch_1.pth and the first best
    names = sorted(p.name for p in work_dir.iterdir())
    manifests = [n for n in names if n.endswith('.manifest.json')]
    assert manifests == [
        f'{n}.manifest.json' for n in ('best_tiny_nll_epoch_2.pth', 'epoch_2.pth')
    ], names
    # the strategy mmengine's runner built is stratagem's, named so once
    dumped = (work_dir / 'flexible_config.py').read_text()
    assert "strategy = dict(type='stratagem.DDPStrategy')" in dumped
    (scalars,) = glob.glob(str(work_dir / '*' / 'vis_data' / 'scalars.json'))
    rows = [json.loads(line) for line in Path(scalars).read_text().splitlines()]
    val = [r for r in rows if 'tiny/nll' in r]
    assert [r['step'] for r in val] == [1, 2]  # validation after each of the 2 epochs

    import stratagem.integrations.mmengine  # noqa: F401  (the allow-list for the hub)
    from stratagem.checkpoint import load_checkpoint_file

    monkeypatch.syspath_prepend(str(BYO))  # undone after the test
    from tinyproj import Blobs
    from tinyproj_mm import TinyMMNet

    model = TinyMMNet()
    model.load_state_dict(load_checkpoint_file(str(work_dir / 'epoch_2.pth'))['state_dict'])
    data = Blobs(num_samples=50, seed=1)
    with torch.no_grad():
        logits = model(data.points, data.labels, mode='tensor')
    nll = torch.nn.functional.cross_entropy(logits, data.labels).item()
    acc = (logits.argmax(1) == data.labels).float().mean().item()
    assert val[-1]['tiny/nll'] == pytest.approx(nll, rel=1e-5)
    assert val[-1]['tiny/acc'] == pytest.approx(acc, abs=1e-6)


def test_a_model_only_mmengines_registry_holds_builds_under_flexible_runner(tmp_path):
    from mmengine.model import BaseModel
    from mmengine.registry import MODELS as MM_MODELS
    from mmengine.runner import FlexibleRunner

    import stratagem.integrations.mmengine  # noqa: F401
    from stratagem.registry import MODELS

    class OnlyInMMEngine(BaseModel):
        def __init__(self, width=3):
            super().__init__()
            self.linear = torch.nn.Linear(2, width)

        def forward(self, inputs, mode='tensor'):
            out = self.linear(inputs)
            return {'loss': out.pow(2).mean()} if mode == 'loss' else out

    name = f'OnlyInMMEngine{os.getpid()}'
    MM_MODELS.register_module(name=name, module=OnlyInMMEngine)
    assert name not in MODELS.names()
    runner = FlexibleRunner.from_cfg(
        dict(
            model=dict(type=name, width=5),
            work_dir=str(tmp_path),
            strategy=dict(type='stratagem.SingleDeviceStrategy'),
            env_cfg=dict(dist_cfg=dict(backend='gloo')),
            train_dataloader=dict(
                dataset=[dict(inputs=torch.ones(2)) for _ in range(4)],
                batch_size=2,
                sampler=dict(type='DefaultSampler', shuffle=False),
                collate_fn=dict(type='default_collate'),
            ),
            optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
            train_cfg=dict(by_epoch=False, max_iters=2),
            default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=100)),
            log_level='WARNING',
        )
    )
    runner.train()
    assert type(runner.strategy.model).__name__ == 'OnlyInMMEngine'
    assert runner.strategy.model.linear.out_features == 5 and runner.iter == 2
    with pytest.raises(KeyError, match="also searched: mmengine's 'model' registry"):
        MODELS.build(dict(type='NoSuchModelAnywhere'))


def test_runner_config_names_our_strategies_and_fills_what_mmengine_lacks(monkeypatch):
    from stratagem.integrations import mmengine_runner as mr

    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    monkeypatch.setattr(mr, '_SAID_STRATEGY', set())
    base = dict(model=dict(type='MLPClassifier'), val_evaluator=dict(type='E'), work_dir='w')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        one = mr.runner_config(
            {**base, 'strategy': dict(type='DDPStrategy', x=1)}, launcher='pytorch'
        )
        two = mr.runner_config({**base, 'strategy': dict(type='DDPStrategy')}, launcher='pytorch')
    assert one['strategy'] == dict(type='stratagem.DDPStrategy', x=1)
    assert two['strategy'] == dict(type='stratagem.DDPStrategy')
    said = [str(w.message) for w in caught if 'runs as stratagem' in str(w.message)]
    assert len(said) == 1 and "'stratagem.DDPStrategy'" in said[0]  # once per name
    # no strategy, or 'auto': by the launcher; no env_cfg: one that runs here (no CUDA: gloo)
    plain = mr.runner_config(base, launcher='none')
    assert plain['strategy'] == dict(type='stratagem.SingleDeviceStrategy')
    assert plain['env_cfg'] == dict(dist_cfg=dict(backend='gloo'))
    assert plain['launcher'] == 'none' and 'resume' not in plain
    auto = mr.runner_config({**base, 'strategy': dict(type='auto')}, launcher='slurm')
    assert auto['strategy'] == dict(type='stratagem.DDPStrategy')
    # scoped names, classes and names only mmengine's registry holds stay as they are
    for kept in ('stratagem.FSDPStrategy', 'MyOwnMMEngineStrategy', torch.nn.Module):
        assert mr.runner_config({**base, 'strategy': dict(type=kept)})['strategy']['type'] is kept
    given = dict(dist_cfg=dict(backend='nccl'), cudnn_benchmark=True)
    assert mr.runner_config({**base, 'env_cfg': given})['env_cfg'] == given  # fitted later
    # --resume PATH is mmengine's resume=True with load_from; --resume alone resume=True
    path = mr.runner_config(base, resume='w/epoch_1.pth', launcher='none')
    assert (path['resume'], path['load_from']) == (True, 'w/epoch_1.pth')
    assert mr.runner_config(base, resume=True)['resume'] is True
    assert mr.runner_config(base, load_from='a.pth')['load_from'] == 'a.pth'
    # the manifests of checkpoints mmengine's CheckpointHook deletes are swept, by one hook
    debris = dict(type='stratagem.CheckpointDebrisHook')
    assert plain['custom_hooks'] == [debris]
    mine = dict(type='stratagem.PreemptionHook')
    assert mr.runner_config({**base, 'custom_hooks': [mine]})['custom_hooks'] == [mine, debris]
    assert mr.runner_config({**base, 'custom_hooks': [debris]})['custom_hooks'] == [debris]


def test_runner_config_refuses_typos_and_keeps_helper_variables(recwarn):
    """Under FlexibleRunner as in the reference loop (``schema.read_top_level_keys``): a
    typo is an error, plain data nothing reads a helper variable (kept, no warning), an
    imported object dropped; every error of the config in one message."""
    from stratagem.integrations.mmengine_runner import runner_config
    from stratagem.registry import DATASETS

    base = dict(model=dict(type='MLPClassifier'), val_evaluator=dict(type='E'))
    with pytest.raises(ConfigError, match=r"'val_evalutor' \(did you mean 'val_evaluator'\?\)"):
        runner_config({**base, 'val_evalutor': {}}, launcher='none')
    out = runner_config({**base, 'data_root': 'data/', '_ok': 1, 'DATASETS': DATASETS})
    assert out['data_root'] == 'data/' and 'DATASETS' not in out
    assert not [w for w in recwarn if issubclass(w.category, ConfigWarning)]
    with pytest.raises(ConfigError) as caught:
        runner_config(
            {
                **base,
                'tran_cfg': {},
                'train_cfg': dict(max_epochs=1, checkpoint_interval=4),
                'train_dataloader': dict(dataset=dict(type='SyntheticClasification')),
            }
        )
    message = str(caught.value)
    assert "'tran_cfg' (did you mean 'train_cfg'?)" in message
    assert 'checkpoint_interval -> default_hooks.checkpoint.interval' in message
    assert "train_dataloader.dataset.type: unknown type 'SyntheticClasification'" in message
    assert "did you mean 'SyntheticClassification'?" in message


def test_without_mmengine_the_error_names_the_keys_and_the_extra(tmp_path, monkeypatch, capsys):
    path = tmp_path / 'cfg.py'
    path.write_text(
        "model = dict(type='MLPClassifier', in_features=4, num_classes=2)\n"
        "val_evaluator = dict(type='Accuracy')\ncustom_hooks = [dict(type='EMAHook')]\n"
    )
    monkeypatch.setitem(sys.modules, 'mmengine', None)  # as if it were not installed
    assert main(['train', str(path), '--work-dir', str(tmp_path / 'w')]) == 1
    err = capsys.readouterr().err
    assert 'custom_hooks, val_evaluator are read only by mmengine' in err
    assert 'pip install "stratagem[mmengine]"' in err and 'Traceback' not in err
    assert not (tmp_path / 'w').exists()  # stopped before anything was written


def test_doctor_checks_a_routed_config_as_train_runs_it(tmp_path, monkeypatch):
    """doctor = train's checks: a config that runs under FlexibleRunner has mmengine's
    dataloader keys and a model only mmengine's registry holds, and no finding for them;
    without mmengine, the finding train stops with."""
    from mmengine.model import BaseModel
    from mmengine.registry import MODELS as MM_MODELS

    from stratagem import doctor

    class DoctoredNet(BaseModel):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, inputs, targets=None, mode='tensor'):
            logits = self.linear(inputs)
            return {'loss': F.cross_entropy(logits, targets)} if mode == 'loss' else logits

    name = f'DoctoredNet{os.getpid()}'
    MM_MODELS.register_module(name=name, module=DoctoredNet)
    cfg = dict(
        model=dict(type=name),
        train_dataloader=dict(
            dataset=dict(type='SyntheticClassification', num_samples=16, num_features=4),
            batch_size=4,
            sampler=dict(type='DefaultSampler', shuffle=True),
        ),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
        train_cfg=dict(by_epoch=True, max_epochs=1, val_interval=1),
        val_evaluator=dict(type='Accuracy'),
        work_dir=str(tmp_path),
    )
    findings, notes = doctor.diagnose(cfg, 1, probe_disk=False)
    assert [f for f in findings if f.where.startswith(('model', 'train_'))] == []
    # the memory estimate runs the step as mmengine's train_step does: mode='loss'
    (memory,) = [n for n in notes if n.startswith('estimated peak memory per device')]
    assert 'parameters 40 B' in memory, memory  # the Linear(4, 2)'s 10 fp32 parameters
    # the top-level keys as the runner path judges them: a typo refused, a helper variable kept
    findings, notes = doctor.diagnose(
        {**cfg, 'data_root': 'data/', 'val_evalutor': {}}, 1, probe_disk=False, memory=False
    )
    assert [(f.where, f.fix) for f in findings] == [
        ('val_evalutor', "did you mean 'val_evaluator'? rename it")
    ]
    assert not any('data_root' in n for n in notes), notes
    monkeypatch.setitem(sys.modules, 'mmengine', None)
    findings, _ = doctor.diagnose(cfg, 1, probe_disk=False)
    (missing,) = [f for f in findings if f.where == 'val_evaluator']
    assert 'pip install "stratagem[mmengine]"' in missing.fix


class _Points(torch.utils.data.Dataset):
    """Four points of 2 features, as mmengine's models take them (dicts)."""

    def __init__(self, n=4):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return dict(inputs=torch.full((2,), float(i)))


def test_one_registry_space_a_dataset_of_stratagems_under_flexible_runner(tmp_path):
    """A dataset registered in stratagem's DATASETS (as the own-model guide teaches) builds
    under FlexibleRunner, through stratagem train's route (runner_config)."""
    from mmengine.model import BaseModel
    from mmengine.registry import DATASETS as MM_DATASETS
    from mmengine.registry import MODELS as MM_MODELS

    from stratagem.integrations.mmengine_runner import train_with_flexible_runner
    from stratagem.registry import DATASETS

    class Squares(BaseModel):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, inputs, mode='tensor'):
            out = self.linear(inputs)
            return {'loss': out.pow(2).mean()} if mode == 'loss' else out

    name = f'OursOnlyPoints{os.getpid()}'
    DATASETS.register_module(name=name, module=_Points)
    MM_MODELS.register_module(name=f'Squares{os.getpid()}', module=Squares)
    assert MM_DATASETS.get(name) is None
    runner = train_with_flexible_runner(
        dict(
            model=dict(type=f'Squares{os.getpid()}'),
            work_dir=str(tmp_path),
            train_dataloader=dict(
                dataset=dict(type=name, n=4),
                batch_size=2,
                sampler=dict(type='DefaultSampler', shuffle=False),
                collate_fn=dict(type='default_collate'),
            ),
            optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
            train_cfg=dict(by_epoch=False, max_iters=2),
            default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=100)),
            log_level='WARNING',
            data_root='unused/',  # a helper variable: kept, nothing said
        ),
        launcher='none',
    )
    assert runner.iter == 2 and len(runner.train_dataloader.dataset) == 4
    assert type(runner.train_dataloader.dataset) is _Points


def test_one_registry_space_a_dataset_of_mmengines_in_the_reference_loop(tmp_path):
    from mmengine.registry import DATASETS as MM_DATASETS

    from stratagem.loop import train
    from stratagem.registry import DATASETS

    class Blobs(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.full((4,), float(i % 2)), torch.tensor(i % 2)

    name = f'MMEngineOnlyBlobs{os.getpid()}'
    MM_DATASETS.register_module(name=name, module=Blobs)
    result = train(
        dict(
            model=dict(type='MLPClassifier', in_features=4, num_classes=2, hidden=4),
            optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
            train_dataloader=dict(dataset=dict(type=name), batch_size=4),
            train_cfg=dict(max_iters=2, preemption=None),
            work_dir=str(tmp_path),
        ),
        progress=False,
    )
    assert result['iter'] == 2 and DATASETS.get(name) is Blobs


def test_a_type_neither_registry_holds_is_refused_before_mmengine_prints(tmp_path, capfd):
    """One line naming both registries and the closest names of both, before mmengine's
    runner prints its banner (or anything)."""
    from mmengine.registry import DATASETS as MM_DATASETS

    name = f'MMEnginePoints{os.getpid()}'
    MM_DATASETS.register_module(name=name, module=_Points)
    path = tmp_path / 'cfg.py'
    path.write_text(
        "model = dict(type='MLPClassifier')\n"
        "val_evaluator = dict(type='Accuracy')\n"
        f"train_dataloader = dict(dataset=dict(type='{name[:-2]}x'), batch_size=2)\n"
        "val_dataloader = dict(dataset=dict(type='SyntheticClasification'), batch_size=2)\n"
        "optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1))\n"
        'train_cfg = dict(max_epochs=1)\n'
        "dataset_type = 'Unused'\n"
    )
    assert main(['train', str(path), '--work-dir', str(tmp_path / 'w')]) == 1
    out, err = capfd.readouterr()
    assert out == ''
    first, *rest = err.splitlines()
    assert first.startswith('stratagem: error: config'), err
    assert f"train_dataloader.dataset.type: unknown type '{name[:-2]}x'" in err
    assert f"did you mean '{name}'" in err  # mmengine's name, from stratagem's side
    assert "val_dataloader.dataset.type: unknown type 'SyntheticClasification'" in err
    assert "did you mean 'SyntheticClassification'?" in err  # stratagem's name
    assert "also searched: mmengine's 'dataset' registry" in err
    assert 'Environment' not in err and 'Config:' not in err and len(rest) <= 3, err
