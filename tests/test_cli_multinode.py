"""`stratagem train --nnodes N --node-rank R --master-addr A`: the torchrun command it builds,
its errors, and two "nodes" on localhost (two commands started at once) training to the end."""

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import free_port
from failure_helpers import end_together
from launcher_env import without_launcher
from stratagem.cli import launch, main

ROOT = Path(__file__).resolve().parents[1]
_PORT_TAKEN = ('address already in use', 'EADDRINUSE')
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


def _node_env(tmp_path):
    env = without_launcher()
    env.pop('MKL_NUM_THREADS', None)  # unset: the run sets it, and says so (checked below)
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    if any(name == 'lo' for _, name in socket.if_nameindex()):
        env['GLOO_SOCKET_IFNAME'] = 'lo'
    return env


def _two_nodes(tmp_path, config, work, attempt):
    """Start node 1 then node 0 (it hosts the rendezvous); return (return codes, outputs).

    A node that fails ends the wait 5 s later: the other would wait for it up to torchrun's
    rendezvous timeout (600 s)."""
    port = free_port()
    logs = {r: open(tmp_path / f'node{r}.{attempt}.log', 'w') for r in (0, 1)}  # noqa: SIM115
    procs = {
        r: subprocess.Popen(
            [
                sys.executable,
                '-m',
                'stratagem',
                'train',
                config,
                '--work-dir',
                str(work),
                '--nnodes',
                '2',
                '--node-rank',
                str(r),
                '--nproc',
                '1',
                '--master-addr',
                '127.0.0.1',
                '--master-port',
                str(port),
            ],
            cwd=tmp_path,
            env=_node_env(tmp_path),
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for r in (1, 0)
    }
    try:
        codes = end_together(procs)
    finally:
        for log in logs.values():
            log.close()
    return codes, {r: (tmp_path / f'node{r}.{attempt}.log').read_text() for r in (0, 1)}


def test_two_nodes_on_localhost_train_to_the_end(tmp_path, config):
    work = tmp_path / 'shared'  # the work dir all nodes share
    codes, out = _two_nodes(tmp_path, config, work, 0)
    if codes != {0: 0, 1: 0} and any(s in out[0] + out[1] for s in _PORT_TAKEN):
        # the free port was taken (by another job on this machine) before node 0 bound it
        shutil.rmtree(work, ignore_errors=True)
        codes, out = _two_nodes(tmp_path, config, work, 1)
    node0, node1 = out[0], out[1]
    assert codes == {0: 0, 1: 0}, (
        f'exit codes {codes} (None: still running, killed)\nnode 0:\n{node0}\nnode 1:\n{node1}'
    )
    # 64 samples over 2 ranks, batch 8: 4 iterations per epoch, 8 in all
    final = torch.load(work / 'iter_8.pth', weights_only=True)
    assert (final['meta']['iter'], final['meta']['epoch']) == (8, 2)
    assert final['meta']['world_size'] == 2 and len(final['rng_states']) == 2
    assert all(torch.isfinite(v).all() for v in final['state_dict'].values())
    assert sorted(p.name for p in work.glob('iter_*.pth')) == [
        'iter_3.pth',
        'iter_6.pth',
        'iter_8.pth',
    ]
    # a line every rank would print alike comes once, from rank 0 (torchrun set only OMP)
    assert node0.count('set MKL_NUM_THREADS=1') == 1, node0
    assert 'MKL_NUM_THREADS' not in node1, node1
    assert 'iter 8/8' in node0 and 'iter 8/8' not in node1
