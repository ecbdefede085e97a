"""`stratagem train` end to end, `--resume` continuing exactly, and the CLI's errors."""

import os
import shutil

import pytest
import torch

from stratagem import checkpoint as ckpt
from stratagem.cli import main

CONFIG = """
model = dict(type='MLPClassifier', in_features=8, num_classes=3, hidden=16, dropout=0.2)
train_dataloader = dict(dataset=dict(type='SyntheticClassification', num_samples=96,
                                     num_features=8, num_classes=3, noise=2.0),
                        batch_size=16, shuffle=True)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9), accumulative_counts=2)
param_scheduler = [dict(type='LinearLR', start_factor=0.2, by_epoch=False, end=5),
                   dict(type='CosineAnnealingLR', by_epoch=True, begin=0, T_max=4,
                        convert_to_iter_based=True)]
train_cfg = dict(max_epochs=4, checkpoint_interval=5, log_interval=4)
randomness = dict(seed=3)
"""


@pytest.fixture()
def config(tmp_path):
    path = tmp_path / 'cfg.py'
    path.write_text(CONFIG)
    return str(path)


def _final_weights(work_dir, it=24):
    return torch.load(os.path.join(work_dir, f'iter_{it}.pth'), weights_only=True)['state_dict']


@pytest.mark.parametrize('options', [[], ['randomness.seed=None']], ids=['seed', 'drawn-seed'])
def test_train_end_to_end_and_resume_is_exact(tmp_path, config, options):
    full = str(tmp_path / 'full')
    opts = ['--cfg-options', *options] if options else []
    assert main(['train', config, '--work-dir', full, *opts]) == 0
    names = sorted(os.listdir(full))
    # 96 samples / 16 = 6 iterations per epoch, 24 in all; a checkpoint every 5 and at the end
    for it in (5, 10, 15, 20, 24):
        assert f'iter_{it}.pth' in names
    assert ckpt.find_latest_checkpoint(full).name == 'iter_24.pth'
    meta = torch.load(os.path.join(full, 'iter_24.pth'), weights_only=True)['meta']
    assert (meta['iter'], meta['epoch']) == (24, 4)
    assert meta['seed'] == 3 or options  # a drawn seed is recorded too, and restored below

    # an interrupted run: same training, but only the checkpoints up to iteration 15 survive
    part = str(tmp_path / 'part')
    shutil.copytree(full, part)
    for it in (20, 24):
        os.remove(os.path.join(part, f'iter_{it}.pth'))
    os.remove(os.path.join(part, ckpt.POINTER_NAME))
    with pytest.warns(UserWarning):  # no pointer: fall back to the newest, with a warning
        assert main(['train', config, '--work-dir', part, '--resume', *opts]) == 0
    # iteration 15 is mid-epoch (epoch 2, batch 3) and mid accumulation window
    want, got = _final_weights(full), _final_weights(part)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_train_with_cfg_options_and_load_from(tmp_path, config):
    a = str(tmp_path / 'a')
    assert (
        main(
            [
                'train',
                config,
                '--work-dir',
                a,
                '--cfg-options',
                'train_cfg.max_epochs=1',
                'train_cfg.checkpoint_interval=0',
            ]
        )
        == 0
    )
    assert sorted(p for p in os.listdir(a) if p.endswith('.pth')) == ['iter_6.pth']
    b = str(tmp_path / 'b')
    assert (
        main(
            [
                'train',
                config,
                '--work-dir',
                b,
                '--load-from',
                os.path.join(a, 'iter_6.pth'),
                '--cfg-options',
                'train_cfg.max_iters=1',
            ]
        )
        == 0
    )
    assert torch.load(os.path.join(b, 'iter_1.pth'), weights_only=True)['meta']['iter'] == 1


@pytest.mark.parametrize('async_checkpoint', [False, True], ids=['sync', 'async'])
def test_train_retention_keeps_newest(tmp_path, config, async_checkpoint):
    d = str(tmp_path / 'keep')
    extra = ['strategy.async_checkpoint=True'] if async_checkpoint else []
    assert (
        main(
            [
                'train',
                config,
                '--work-dir',
                d,
                '--cfg-options',
                'train_cfg.max_keep_ckpts=2',
                *extra,
            ]
        )
        == 0
    )
    assert sorted(p for p in os.listdir(d) if p.endswith('.pth')) == ['iter_20.pth', 'iter_24.pth']
    assert ckpt.verify_checkpoint(ckpt.find_latest_checkpoint(d))['step'] == 24


def _cli_error(capsys, argv):
    """Run the CLI expecting a user error: exit status 1 and a short message, no traceback."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert 'stratagem: error: ' in err and 'Traceback' not in err
    return err


def test_train_bad_config_keys(tmp_path, config, capsys):
    err = _cli_error(
        capsys,
        [
            'train',
            config,
            '--work-dir',
            str(tmp_path / 'x'),
            '--cfg-options',
            'train_cfg.max_epoch=2',
        ],
    )
    # refused as an override, before the config is even merged (ConfigError: a ValueError)
    assert "unknown key 'train_cfg.max_epoch' in --cfg-options" in err
    assert "did you mean 'train_cfg.max_epochs'?" in err and '(ConfigError;' in err
    err = _cli_error(
        capsys,
        [
            'train',
            config,
            '--work-dir',
            str(tmp_path / 'y'),
            '--cfg-options',
            'model.type=MLPClassifer',
        ],
    )
    assert "unknown type 'MLPClassifer'" in err and "did you mean 'MLPClassifier'" in err
    assert "error: 'unknown" not in err  # a KeyError's message without repr quotes
    err = _cli_error(capsys, ['train', str(tmp_path / 'nope.py')])
    assert 'config file not found' in err and 'nope.py' in err


def test_train_with_no_batch_per_epoch_says_why(tmp_path, config, capsys):
    err = _cli_error(
        capsys,
        [
            'train',
            config,
            '--work-dir',
            str(tmp_path / 'z'),
            '--cfg-options',
            'train_dataloader.batch_size=128',
            'train_dataloader.drop_last=True',
        ],
    )
    assert 'yields no batch per epoch: 96 samples' in err and 'batch_size=128' in err


def test_cli_help_and_unknown_command(capsys):
    assert main(['--help']) == 0
    assert 'plot-schedule' in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(['trian'])
    assert info.value.code == 2


def test_plot_schedule_takes_epoch_length_from_the_dataloader(tmp_path, config, capsys):
    # 96 samples / batch 16 = 6 iterations per epoch, 4 epochs; no --epoch-length needed
    assert main(['plot-schedule', config, '--ascii']) == 0
    out = capsys.readouterr().out
    assert '24 iterations, 4 epochs of 6' in out and 'learning rate' in out


def test_nproc_relaunch_uses_the_arguments_main_received(monkeypatch, config):
    from stratagem.cli import launch

    calls = []
    monkeypatch.setattr(launch, 'run_torchrun', lambda cmd, *_: calls.append(cmd) or 0)
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    assert (
        main(
            [
                'train',
                config,
                '--nproc=2',
                '--launcher=pytorch',
                '--cfg-options',
                'train_cfg.max_iters=3',
            ]
        )
        == 0
    )
    (cmd,) = calls
    assert cmd[1:6] == ['-m', 'torch.distributed.run', '--standalone', '--nproc-per-node=2', '-m']
    assert cmd[6:] == [
        'stratagem',
        'train',
        config,
        '--launcher=pytorch',
        '--cfg-options',
        'train_cfg.max_iters=3',
    ]  # no --nproc, no second --launcher


def test_nproc_checks_the_config_before_torchrun_starts(monkeypatch, config, capsys):
    from stratagem.cli import launch

    calls = []
    monkeypatch.setattr(launch, 'run_torchrun', lambda cmd, *_: calls.append(cmd) or 0)
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    for options, said in [
        (['model.type=MLPClasifier'], "model: unknown type 'MLPClasifier'"),
        (['param_scheduler.1.type=CosineLR'], 'param_scheduler[1]: unknown type'),
        (['train_cfg.max_epoch=2'], "did you mean 'train_cfg.max_epochs'?"),
    ]:
        assert main(['train', config, '--nproc=2', '--cfg-options', *options]) == 1
        assert said in capsys.readouterr().err, options
    # the loop's own checks (loop.check_train_config): a config without a run length
    short = os.path.join(os.path.dirname(config), 'no_length.py')
    with open(short, 'w') as f:
        f.write(CONFIG.replace('max_epochs=4, ', ''))
    assert main(['train', short, '--nproc=2']) == 1
    assert 'train_cfg needs max_epochs or max_iters' in capsys.readouterr().err
    assert calls == []  # torchrun never started


def test_unknown_cfg_options_key_is_an_error_naming_the_key_meant(tmp_path, config, capsys):
    work = str(tmp_path / 'w')
    assert main(['train', config, '--work-dir', work, '--cfg-options', 'lr=0.1']) == 1
    err = capsys.readouterr().err
    assert "unknown key 'lr' in --cfg-options" in err
    assert "did you mean 'optim_wrapper.optimizer.lr'?" in err
    assert not os.path.exists(work)  # refused before anything was written


def test_version_and_debug_are_listed_everywhere(capsys):
    import stratagem
    from stratagem.cli import COMMANDS, build_sub_parser

    assert main(['--version']) == 0
    assert capsys.readouterr().out == f'stratagem {stratagem.__version__}\n'
    with pytest.raises(SystemExit) as info:
        main(['train', '--version'])
    assert info.value.code == 0
    assert capsys.readouterr().out == f'stratagem {stratagem.__version__}\n'
    assert main(['--help']) == 0
    out = capsys.readouterr().out
    assert '--debug' in out and '--version' in out
    for name in COMMANDS:
        text = build_sub_parser(name).format_help()
        assert '--debug' in text and '--version' in text, name
    text = build_sub_parser('train').format_help()
    for flag in ('--seed N', '--deterministic', '--amp [{auto,bf16,fp16}]'):
        assert flag in text, flag


def test_seed_deterministic_and_amp_flags_write_the_config(monkeypatch, config):
    from stratagem.cli import build_sub_parser
    from stratagem.cli import train as cli_train
    from stratagem.config import Config

    args = build_sub_parser('train').parse_args(
        [config, '--seed', '11', '--deterministic', '--amp', 'bf16']
    )
    assert (args.seed, args.deterministic, args.amp) == (11, True, 'bf16')
    assert build_sub_parser('train').parse_args([config, '--amp']).amp == 'auto'
    assert build_sub_parser('train').parse_args([config]).amp is None
    cfg = Config.fromfile(config)
    cli_train.apply_run_flags(cfg, seed=11, deterministic=True, amp='bf16')
    assert cfg.randomness.to_dict() == {'seed': 11, 'deterministic': True}
    ow = cfg.optim_wrapper.to_dict()
    assert (ow['type'], ow['dtype'], ow['accumulative_counts']) == (
        'AmpOptimWrapper',
        'bfloat16',
        2,
    )
    # a config that seeds in the strategy (which wins) gets the flag there too
    cfg = Config(dict(strategy=dict(env_kwargs=dict(randomness=dict(seed=1))), randomness={}))
    cli_train.apply_run_flags(cfg, seed=5)
    assert cfg.strategy.env_kwargs.randomness.seed == 5 and cfg.randomness.seed == 5
    # several optimizers: each wrapper; another wrapper type: refused, named
    cfg = Config(dict(optim_wrapper=dict(g=dict(optimizer={}), d=dict(optimizer={}))))
    cli_train.apply_run_flags(cfg, amp='bf16')
    assert cfg.optim_wrapper.g.type == cfg.optim_wrapper.d.type == 'AmpOptimWrapper'
    cfg = Config(dict(optim_wrapper=dict(type='MyWrapper', optimizer={})))
    with pytest.raises(ValueError, match=r"--amp: optim_wrapper.type='MyWrapper'"):
        cli_train.apply_run_flags(cfg, amp='bf16')
    # on a CPU: bare --amp is bf16, fp16 refused with the way out
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    assert cli_train.amp_dtype('auto') == 'bfloat16'
    with pytest.raises(ValueError, match='--amp fp16 needs a CUDA device.*use --amp bf16'):
        cli_train.amp_dtype('fp16')
    # a GPU without bfloat16 (before Ampere): bare --amp is fp16, bf16 refused naming it
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda *a: 'Tesla V100')
    assert cli_train.amp_dtype('auto') == 'float16' == cli_train.amp_dtype('fp16')
    with pytest.raises(ValueError, match='--amp bf16: Tesla V100 does not support bfloat16'):
        cli_train.amp_dtype('bf16')
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda *a, **k: True)
    assert cli_train.amp_dtype('auto') == 'bfloat16'


def test_amp_trains_under_autocast(tmp_path, config, monkeypatch):
    from stratagem.cli import train as cli_train

    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    seen = {}
    real = cli_train.train

    def spy(cfg, **kwargs):
        out = real(cfg, **kwargs)
        seen['wrapper'] = out['strategy'].optim_wrapper
        seen['seed'] = out['strategy'].randomness['seed']
        return out

    monkeypatch.setattr(cli_train, 'train', spy)
    work = str(tmp_path / 'amp')
    options = ['--cfg-options', 'train_cfg.max_iters=2']
    assert main(['train', config, '--work-dir', work, '--amp', '--seed', '9', *options]) == 0
    assert type(seen['wrapper']).__name__ == 'AmpOptimWrapper'
    assert seen['wrapper'].cast_dtype == torch.bfloat16 and seen['seed'] == 9


def test_ctrl_c_in_one_process_names_the_checkpoint_and_the_log_says_why(
    tmp_path, config, monkeypatch, capsys
):
    """Ctrl-C in a single process prints the line ``--nproc 2`` prints (one function), exit
    130; the run's .log ends saying it was interrupted."""
    from stratagem.cli import train as train_cli

    real_train = train_cli.train

    def interrupted_at_5(cfg, **kwargs):
        def stop(path, iteration):
            if iteration == 5:
                raise KeyboardInterrupt

        return real_train(cfg, progress=False, on_checkpoint=stop, **kwargs)

    monkeypatch.setattr(train_cli, 'train', interrupted_at_5)
    work = tmp_path / 'w'
    assert main(['train', config, '--work-dir', str(work)]) == 130
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if 'interrupted' in line]
    assert lines == [
        'stratagem train: interrupted (SIGINT); nothing half-written; --resume continues '
        f'from {work / "iter_5.pth"}'
    ]
    assert 'Traceback' not in err and 'KeyboardInterrupt' not in err
    (log,) = work.glob('*/*.log')
    last = log.read_text().splitlines()[-1]
    assert last.endswith('WARNING: run ended: interrupted (Ctrl-C, SIGINT)')


def test_a_failed_run_leaves_its_reason_and_no_empty_folder(tmp_path, config, capsys):
    """An error after the strategy was built: the .log's last line is the error on one line,
    even under log_level='WARNING' (which once left an empty log folder); an error before
    leaves no work_dir at all."""
    work = tmp_path / 'w'
    argv = ['train', config, '--work-dir', str(work), '--cfg-options']
    assert main([*argv, 'optim_wrapper.optimizer.bogus=1', 'log_level=WARNING']) == 1
    assert 'stratagem: error: ' in capsys.readouterr().err
    (folder,) = [p for p in work.iterdir() if p.is_dir()]
    (log,) = folder.iterdir()
    lines = log.read_text().splitlines()
    assert len(lines) == 1, lines  # WARNING: only the end line
    assert (
        lines[0]
        .split(' stratagem ')[1]
        .startswith(
            "ERROR: run ended: error: TypeError: cannot build 'SGD' from the 'optimizer' registry"
        )
    )
    # a config refused before anything is built: no work_dir at all
    fresh, endless = tmp_path / 'v', tmp_path / 'endless.py'
    endless.write_text(CONFIG.replace('max_epochs=4, ', ''))
    assert main(['train', str(endless), '--work-dir', str(fresh)]) == 1
    assert 'train_cfg needs max_epochs or max_iters' in capsys.readouterr().err
    assert not fresh.exists()


def test_nproc_below_one_is_refused_and_above_the_cores_warned(monkeypatch, config, capsys):
    from stratagem.cli import launch

    monkeypatch.delenv('LOCAL_RANK', raising=False)
    assert main(['train', config, '--nproc', '0']) == 1
    err = capsys.readouterr().err
    assert (
        'stratagem: error: --nproc 0: the number of processes on this machine should be >= 1' in err
    )
    monkeypatch.setattr(launch.os, 'sched_getaffinity', lambda pid: {0, 1}, raising=False)
    with pytest.warns(UserWarning, match=r'--nproc 8 on a machine with 2 CPU cores') as said:
        launch.check_nproc(8)
    assert len(said) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter('error')
        launch.check_nproc(2)  # as many as the cores: nothing said


def test_convert_help_describes_every_layout(capsys):
    with pytest.raises(SystemExit) as info:
        main(['convert', '--help'])
    assert info.value.code == 0
    text = ' '.join(capsys.readouterr().out.split())
    for said in (
        'DeepSpeed',
        'Hugging Face',
        '.safetensors',
        'file|sharded|hf|safetensors',
        "transformers' from_pretrained",
        'the full model weights alone',
    ):
        assert said in text, said
