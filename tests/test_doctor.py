"""`stratagem doctor`: each check finds its problem (with the fix), a clean config has none,
exit codes 0 / 1 / 2, and nothing heavy is built (no process group, the model on meta)."""

import copy

import torch

from stratagem import doctor
from stratagem.cli import main
from stratagem.doctor import checks

CLEAN = dict(
    model=dict(type='MLPClassifier', in_features=16, num_classes=4, hidden=64),
    train_dataloader=dict(
        dataset=dict(
            type='SyntheticClassification', num_samples=2048, num_features=16, num_classes=4
        ),
        batch_size=32,
        shuffle=True,
    ),
    optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9)),
    param_scheduler=[
        dict(type='LinearLR', start_factor=0.1, by_epoch=False, end=20),
        dict(type='CosineAnnealingLR', by_epoch=True, begin=0, T_max=4, convert_to_iter_based=True),
    ],
    train_cfg=dict(max_epochs=4, checkpoint_interval=64, max_keep_ckpts=2),
    strategy=dict(type='SingleDeviceStrategy'),
)


def _diagnose(tmp_path, nproc=1, **changes):
    cfg = copy.deepcopy(CLEAN)
    cfg['work_dir'] = str(tmp_path)
    for dotted, value in changes.items():
        *parents, last = dotted.split('__')
        node = cfg
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value
    findings, notes = doctor.diagnose(cfg, nproc, probe_disk=False)
    return {f.where: f for f in findings}, notes


def test_clean_config_has_no_findings_and_builds_nothing_heavy(tmp_path, monkeypatch):
    built = []
    real = torch.nn.Module.__init__
    monkeypatch.setattr(
        torch.nn.Module,
        '__init__',
        lambda self, *a, **k: (built.append(torch.empty(0).device), real(self, *a, **k))[1],
    )
    findings, notes = _diagnose(tmp_path)
    assert findings == {}
    assert set(built) == {torch.device('meta')}  # the model exists only on the meta device
    assert not torch.distributed.is_initialized()
    assert 'real batch = 1 data-parallel rank(s) x 32 micro batch x 1 accumulation = 32' in notes
    # (16*64+64) + (64*64+64) + (64*4+4) = 5508 fp32 params; SGD momentum: one copy
    assert 'estimated checkpoint: 1 MiB (5,508 fp32 parameters, 1 optimizer state copies)' in notes


def test_misspelt_keys_everywhere(tmp_path):
    f, _ = _diagnose(
        tmp_path,
        model__hiden=3,
        train_dataloader__shufle=True,
        strategy__devic='cpu',
        optim_wrapper__optimizer__momentun=0.9,
        train_cfg__max_keep=1,
        param_scheduler__0__ennd=5,
        traincfg={},
    )
    assert f['model.hiden'].fix.startswith("did you mean 'hidden'?")
    assert f['train_dataloader.shufle'].fix.startswith("did you mean 'shuffle'?")
    assert f['strategy.devic'].problem == "SingleDeviceStrategy has no argument 'devic'"
    assert f['optim_wrapper.optimizer.momentun'].fix.startswith("did you mean 'momentum'?")
    assert f['train_cfg.max_keep'].fix.startswith("did you mean 'max_keep_ckpts'?")
    assert f['param_scheduler[0].ennd'].fix.startswith("did you mean 'end'?")
    assert f['traincfg'].fix == "did you mean 'train_cfg'? rename it"
    assert 'model' not in f  # the model that cannot be built is reported once, by its key
    f, _ = _diagnose(tmp_path, strategy__type='SingleDevise')
    assert "did you mean 'SingleDeviceStrategy'" in f['strategy.type'].problem


def test_batch_arithmetic(tmp_path):
    f, notes = _diagnose(
        tmp_path,
        nproc=4,
        optim_wrapper__accumulative_counts=2,
        strategy__auto_scale_lr=dict(enable=False, base_batch_size=64),
    )
    assert 'real batch = 4 data-parallel rank(s) x 32 micro batch x 2 accumulation = 256' in notes
    assert f['auto_scale_lr'].problem.startswith(
        'the lr was tuned for base_batch_size=64 but the real batch is 256'
    )
    assert 'lr x 4' in f['auto_scale_lr'].fix
    f, notes = _diagnose(
        tmp_path, nproc=4, strategy__auto_scale_lr=dict(enable=True, base_batch_size=64)
    )
    assert f == {} and 'auto_scale_lr scales every lr by 128/64 = 2' in notes
    f, _ = _diagnose(
        tmp_path,
        nproc=2,
        strategy=dict(
            type='auto', config=dict(train_batch_size=128, train_micro_batch_size_per_gpu=32)
        ),
    )
    assert f['strategy.config.train_batch_size'].problem.startswith(
        'DeepSpeed train_batch_size=128 disagrees with the config: 64'
    )
    assert 'strategy.config.train_micro_batch_size_per_gpu' not in f


def test_precision(tmp_path):
    f, _ = _diagnose(
        tmp_path,
        optim_wrapper=dict(
            type='AmpOptimWrapper',
            dtype='bfloat16',
            loss_scale='dynamic',
            optimizer=dict(type='SGD', lr=0.1),
        ),
    )
    assert f['optim_wrapper.loss_scale'].fix == 'remove loss_scale'
    f, _ = _diagnose(
        tmp_path,
        optim_wrapper=dict(
            type='AmpOptimWrapper', dtype='float16', optimizer=dict(type='SGD', lr=0.1)
        ),
    )
    if torch.cuda.is_available():
        assert 'optim_wrapper.dtype' not in f
    else:
        assert f['optim_wrapper.dtype'].problem.startswith('fp16 autocast on a machine without')


def test_wrap_policy_and_activation_checkpointing(tmp_path):
    f, _ = _diagnose(
        tmp_path,
        strategy=dict(
            type='auto',
            activation_checkpointing=dict(check_fn=['Linear']),
            model_wrapper=dict(
                auto_wrap_policy=dict(
                    type='transformer_auto_wrap_policy', transformer_layer_cls=['Linear', 'Lineer']
                )
            ),
        ),
    )
    wrap = f['strategy.model_wrapper.auto_wrap_policy']
    assert "module class(es) ['Lineer'] are not in the model" in wrap.problem
    assert wrap.fix.startswith("did you mean 'Linear'?")
    assert 'strategy.activation_checkpointing' not in f  # it has a wrap policy
    f, _ = _diagnose(tmp_path, strategy=dict(type='auto', activation_checkpointing=['Linear']))
    assert 'without an auto_wrap_policy' in f['strategy.activation_checkpointing'].problem


def test_scheduler_end_and_overlap(tmp_path):
    # 2048 samples / 32 = 64 iterations per epoch; 4 epochs = 256 iterations
    f, _ = _diagnose(
        tmp_path,
        param_scheduler=[
            dict(type='LinearLR', start_factor=0.1, by_epoch=False, end=20),
            dict(type='CosineAnnealingLR', by_epoch=False, begin=0, T_max=100, end=300),
            dict(type='StepLR', by_epoch=True, begin=2, end=3, step_size=1),
        ],
    )
    assert f['param_scheduler[1].end'].problem.startswith(
        'CosineAnnealingLR ends at 300 but the run has 256 iterations'
    )
    overlap = f['param_scheduler[1], param_scheduler[2]']
    assert overlap.problem.startswith('CosineAnnealingLR [0, 256) and StepLR [128, 192) overlap')
    assert (
        'param_scheduler[0], param_scheduler[1]' not in f
    )  # a warmup over the main schedule is expected


def test_checkpoint_disk_and_stall(tmp_path, monkeypatch):
    monkeypatch.setattr(
        checks.shutil, 'disk_usage', lambda path: type('U', (), {'free': 2 << 20})()
    )
    f, _ = _diagnose(tmp_path)
    assert f['train_cfg.max_keep_ckpts'].problem.startswith('3 checkpoint(s) of ~1 MiB need')
    monkeypatch.undo()
    cfg = copy.deepcopy(CLEAN)
    cfg.update(
        work_dir=str(tmp_path),
        model=dict(
            type='MLPClassifier', in_features=4096, num_classes=10, hidden=4096, num_layers=4
        ),
    )
    monkeypatch.setattr(checks, '_disk_write_speed', lambda d: 20 * 2**20)
    findings, notes = doctor.diagnose(cfg, 1)
    stall = {x.where: x for x in findings}['train_cfg.checkpoint_interval']
    assert '5 synchronous saves stall training' in stall.problem
    assert 'async_checkpoint=True' in stall.fix
    cfg['strategy']['async_checkpoint'] = True
    assert doctor.diagnose(cfg, 1)[0] == []


def test_missing_packages(tmp_path, monkeypatch):
    monkeypatch.setattr(checks, '_find_spec', lambda name: None)
    f, _ = _diagnose(tmp_path)
    assert f['environment'].fix.startswith('pip install xxhash')


def test_cli_exit_codes(tmp_path, capsys):
    good = tmp_path / 'good.py'
    good.write_text(
        '\n'.join(f'{k} = {v!r}' for k, v in {**CLEAN, 'work_dir': str(tmp_path)}.items())
    )
    assert main(['doctor', str(good), '--no-disk-probe']) == 0
    assert 'no findings' in capsys.readouterr().out
    bad = tmp_path / 'bad.py'
    bad.write_text(good.read_text() + '\ntraincfg = dict()\n')
    assert main(['doctor', str(bad), '--no-disk-probe', '--nproc', '2']) == 1
    out = capsys.readouterr().out
    assert 'on 2 process(es)' in out and '1 finding(s)' in out
    assert "did you mean 'train_cfg'? rename it" in out
    assert main(['doctor', str(tmp_path / 'missing.py')]) == 2
    assert 'cannot read' in capsys.readouterr().err


LM = dict(type='TransformerLM', vocab_size=16, dim=16, depth=2, heads=4, max_len=8)
PLAN = {'blocks.*.[qkv]': 'colwise', 'blocks.*.proj': 'rowwise'}


def _mesh(tmp_path, nproc, **strategy):
    return _diagnose(
        tmp_path,
        nproc,
        model=LM,
        train_dataloader__dataset=dict(
            type='SyntheticLanguageModeling', num_samples=2048, seq_len=8, vocab_size=16
        ),
        strategy=dict(
            type='FSDPStrategy',
            model_wrapper=dict(auto_wrap_policy=['TransformerBlock']),
            **strategy,
        ),
    )


def test_mesh_and_tensor_parallel_plan(tmp_path):
    # a 2-D mesh that fits, a plan that fits: nothing; the batch counts data-parallel ranks
    f, notes = _mesh(tmp_path, 4, mesh=dict(shard=2, tensor=2), tensor_parallel_plan=PLAN)
    assert f == {}
    # the memory estimate runs on the 2-D mesh too (fake process group of 4)
    assert any(n.startswith('estimated peak memory per device') for n in notes), notes
    assert 'real batch = 2 data-parallel rank(s) x 32 micro batch x 1 accumulation = 64' in notes
    f, _ = _mesh(tmp_path, 4, mesh=dict(replicate=2, shard=2))  # HSDP
    assert f == {}
    # the mesh arithmetic at this world size
    f, _ = _mesh(tmp_path, 6, mesh=dict(shard=2, tensor=2), tensor_parallel_plan=PLAN)
    assert '1 × 2 × 2 = 4, but the world size is 6' in f['strategy.mesh'].problem
    assert 'dict(shard=3, tensor=2)' in f['strategy.mesh'].problem
    # the plan against the model, on the meta device
    f, _ = _mesh(
        tmp_path, 4, mesh=dict(shard=2, tensor=2), tensor_parallel_plan={'blocks.*.fc1': 'colwise'}
    )
    assert "pattern 'blocks.*.fc1' matches no module" in f['strategy.tensor_parallel_plan'].problem
    f, _ = _mesh(tmp_path, 8, mesh=dict(shard=1, tensor=8), tensor_parallel_plan=PLAN)
    assert 'heads=4 is not divisible by the mesh tensor size 8' in (
        f['strategy.tensor_parallel_plan'].problem
    )
    f, _ = _mesh(tmp_path, 4, mesh=dict(shard=4), tensor_parallel_plan=PLAN)
    assert 'has no tensor dimension' in f['strategy.tensor_parallel_plan'].problem
    f, _ = _mesh(tmp_path, 4, mesh=dict(shard=2, tensor=2))
    assert 'has tensor=2 but no tensor_parallel_plan' in f['strategy.tensor_parallel_plan'].problem


def test_what_train_refuses_is_a_finding_at_its_key(tmp_path, capsys):
    # the example: a misspelt clip_grad argument, refused when train builds the
    # optim wrapper; doctor builds it with the same function (on the meta model)
    f, notes = _diagnose(
        tmp_path, optim_wrapper=dict(**CLEAN['optim_wrapper'], clip_grad=dict(max_nrom=5.0))
    )
    assert list(f) == ['optim_wrapper.clip_grad']
    assert 'max_nrom' in f['optim_wrapper.clip_grad'].problem
    assert 'memory estimate skipped (fix the findings above first)' in notes
    # the loop's own key checks (loop.check_train_config): no run length
    f, _ = _diagnose(tmp_path, train_cfg=dict(checkpoint_interval=64))
    assert 'max_epochs or max_iters' in f['train_cfg'].problem
    # a dataset that cannot be built stops train: a finding, not a note
    f, _ = _diagnose(tmp_path, train_dataloader__dataset__num_samples=0)
    assert 'num_samples' in f['train_dataloader.dataset'].problem
    # the same through the CLI, from --cfg-options: exit 1, the key in the table
    good = tmp_path / 'good.py'
    good.write_text(
        '\n'.join(f'{k} = {v!r}' for k, v in {**CLEAN, 'work_dir': str(tmp_path)}.items())
    )
    option = "optim_wrapper.clip_grad=dict(type='norm', max_nrom=5.0)"
    assert main(['doctor', str(good), '--no-disk-probe', '--cfg-options', option]) == 1
    out = capsys.readouterr().out
    assert '1 finding(s)' in out and 'optim_wrapper.clip_grad ' in out and 'max_nrom' in out
    # an unknown --cfg-options key is refused as train refuses it, with the key meant
    assert main(['doctor', str(good), '--no-disk-probe', '--cfg-options', 'lr=0.1']) == 1
    out = capsys.readouterr().out
    assert '1 finding(s)' in out and "unknown key 'lr' in --cfg-options" in out
    assert "'optim_wrapper.optimizer.lr'?" in out


def test_format_table_never_splits_a_word():
    long_key = 'strategy.model_wrapper.auto_wrap_policy.module_classes_to_wrap_everywhere'
    word = 'x' * 70
    text = doctor.format_table([checks.Finding(long_key, f'a problem {word}', 'fix it')])
    rows = [
        line.split()[:2] if line[0].isdigit() else line.split()[:1]
        for line in text.splitlines()[2:]
    ]
    where = [r[-1] for r in rows if r and r[-1] not in ('a', 'problem', word)]
    # the key breaks after dots only; a part longer than the column (28) keeps its line whole
    assert [w for w in where if w.startswith(('strategy', 'auto', 'module'))] == [
        'strategy.model_wrapper.',
        'auto_wrap_policy.',
        'module_classes_to_wrap_everywhere',
    ]
    assert word in text  # a long word overflows its column rather than split
