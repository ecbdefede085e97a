"""`stratagem train --nnodes N --node-rank R --master-addr A`: the torchrun command it builds
and its errors. Two "nodes" on localhost started by it train to the end in
tests/test_multinode.py, whose other checks use that run."""

import re

import pytest

from stratagem.cli import launch, main

CONFIG = """
model = dict(type='MLPClassifier', in_features=8, num_classes=3, hidden=16)
train_dataloader = dict(dataset=dict(type='SyntheticClassification', num_samples=64,
                                     num_features=8, num_classes=3), batch_size=8)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9))
train_cfg = dict(max_epochs=2, checkpoint_interval=3, log_interval=2)
randomness = dict(seed=7)
"""


@pytest.fixture()
def config(tmp_path):
    path = tmp_path / 'cfg.py'
    path.write_text(CONFIG)
    return str(path)


@pytest.fixture()
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(launch, 'run_torchrun', lambda cmd, *_: seen.append(cmd) or 0)
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    return seen


def test_multi_node_command(config, calls):
    assert (
        main(
            [
                'train',
                config,
                '--nnodes',
                '2',
                '--node-rank=1',
                '--master-addr',
                '127.0.0.1',
                '--master-port=29511',
                '--nproc',
                '2',
                '--work-dir',
                'w',
            ]
        )
        == 0
    )
    assert main(['train', config, '--nnodes=3', '--master-addr=localhost']) == 0
    assert calls[0][1:] == [
        '-m',
        'torch.distributed.run',
        '--nnodes=2',
        '--node-rank=1',
        '--master-addr=127.0.0.1',
        '--master-port=29511',
        '--nproc-per-node=2',
        '-m',
        'stratagem',
        'train',
        config,
        '--work-dir',
        'w',
        '--launcher',
        'pytorch',
    ]
    assert calls[1][3:8] == [
        '--nnodes=3',
        '--node-rank=0',
        '--master-addr=localhost',
        '--nproc-per-node=1',
        '-m',
    ]  # torchrun's default port
    assert '--standalone' not in calls[0] + calls[1]


@pytest.mark.parametrize(
    'argv, message',
    [
        (
            ['--nnodes', '2', '--node-rank', '2', '--master-addr', 'localhost'],
            r'--node-rank 2 is not one of the 2 node\(s\): give 0 .. 1',
        ),
        (['--nnodes', '2', '--node-rank', '1'], '--nnodes 2 needs --master-addr'),
        (
            ['--nnodes', '2', '--master-addr', 'no-such-node.invalid'],
            r"master host 'no-such-node.invalid' \(from --master-addr\) does not resolve",
        ),
        (
            ['--nnodes', '2', '--master-addr', 'localhost', '--master-port', '70000'],
            '--master-port 70000 is not a TCP port',
        ),
        (
            ['--nproc', '0', '--nnodes', '2', '--master-addr', 'localhost'],
            '--nproc 0: the number of processes on this machine should be >= 1',
        ),
    ],
)
def test_multi_node_errors_before_launching(config, calls, capsys, argv, message):
    assert main(['train', config, *argv]) == 1
    err = capsys.readouterr().err
    assert re.search(f'stratagem: error: .*{message}', err), err
    assert 'ValueError' in err and calls == []
