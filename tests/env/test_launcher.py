"""infer_launcher, init_dist (faked process group, and a real 1-process gloo group), nodelists."""
import logging
import os
import subprocess
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from stratagem.env import get_dist_info, infer_launcher, init_dist, is_distributed, launcher
from stratagem.env.launcher import expand_slurm_nodelist

TORCHRUN = dict(RANK='1', WORLD_SIZE='4', LOCAL_RANK='1', MASTER_ADDR='10.0.0.1',
                MASTER_PORT='1234')
SLURM = dict(SLURM_PROCID='5', SLURM_NTASKS='8', SLURM_LOCALID='1', SLURM_NODEID='1',
             SLURM_TASKS_PER_NODE='4(x2)', SLURM_JOB_NODELIST='node[07-08]')
OMPI = dict(OMPI_COMM_WORLD_RANK='3', OMPI_COMM_WORLD_SIZE='4', OMPI_COMM_WORLD_LOCAL_RANK='1',
            OMPI_COMM_WORLD_LOCAL_SIZE='2')


@pytest.mark.parametrize('env, expected', [
    ({}, 'none'),
    (TORCHRUN, 'pytorch'),
    (dict(RANK='0', WORLD_SIZE='2'), 'none'),  # LOCAL_RANK missing: not torchrun
    (SLURM, 'slurm'),
    (dict(SLURM_PROCID='0', SLURM_NTASKS='1'), 'none'),  # one task: an interactive job
    (dict(SLURM_NTASKS='4'), 'none'),  # no task id: the batch script, not an srun task
    (OMPI, 'mpi'),
    ({**SLURM, **TORCHRUN}, 'pytorch'),  # torchrun inside a Slurm allocation
    ({**SLURM, **OMPI}, 'slurm'),
])
def test_infer_launcher(clean_env, env, expected):
    clean_env.update(env)
    assert infer_launcher() == expected


@pytest.mark.parametrize('nodelist, hosts', [
    ('node1', ['node1']),
    ('node[01-03,07],gpu5', ['node01', 'node02', 'node03', 'node07', 'gpu5']),
    ('gpu5,node[8-10]', ['gpu5', 'node8', 'node9', 'node10']),
    ('n[008-010]', ['n008', 'n009', 'n010']),
    ('r[1-2]n[1-2]', ['r1n1', 'r1n2', 'r2n1', 'r2n2']),
    ('a-b[1,3].x', ['a-b1.x', 'a-b3.x']),
])
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize('bad', ['', 'node[1-3', 'node]1[', 'node[a-b]', 'node[3-1]', 'a,,b'])
def test_expand_slurm_nodelist_rejects(bad):
    with pytest.raises(ValueError, match='Slurm node list'):
        expand_slurm_nodelist(bad)


@pytest.fixture
def fake_group(monkeypatch):
    """Record init_process_group calls; make CUDA absent and any CUDA call an error."""
    calls = []
    monkeypatch.setattr(launcher.dist, 'init_process_group', lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)

    def no_cuda(*args, **kwargs):
        raise AssertionError('a CUDA API was called on a CPU-only machine')
    monkeypatch.setattr(torch.cuda, 'set_device', no_cuda)
    monkeypatch.setattr(torch.cuda, 'device_count', no_cuda)
    return calls


def no_scontrol(*args, **kwargs):
    raise FileNotFoundError('scontrol')


def test_init_dist_slurm_on_cpu(clean_env, fake_group, monkeypatch):
    clean_env.update(SLURM)
    monkeypatch.setattr(launcher.subprocess, 'run', no_scontrol)
    init_dist('slurm', timeout=90)
    assert fake_group == [dict(backend='gloo', rank=5, world_size=8,
                               timeout=timedelta(seconds=90))]
    assert {k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_SIZE',
                                       'MASTER_ADDR', 'MASTER_PORT')} == dict(
        RANK='5', WORLD_SIZE='8', LOCAL_RANK='1', LOCAL_SIZE='4', MASTER_ADDR='node07',
        MASTER_PORT='29500')


def test_init_dist_slurm_uses_scontrol_and_keeps_port(clean_env, fake_group, monkeypatch):
    clean_env.update(SLURM, MASTER_PORT='4321', MASTER_ADDR='stale-host')
    del clean_env['SLURM_LOCALID']  # derived from the rank and the tasks on this node
    seen = []

    def scontrol(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='hostA\nhostB\n')
    monkeypatch.setattr(launcher.subprocess, 'run', scontrol)
    init_dist('slurm')
    assert seen == [['scontrol', 'show', 'hostnames', 'node[07-08]']]
    assert (os.environ['MASTER_ADDR'], os.environ['MASTER_PORT']) == ('hostA', '4321')
    assert os.environ['LOCAL_RANK'] == '1'  # 5 % 4
    init_dist('slurm', port=2222)
    assert os.environ['MASTER_PORT'] == '2222'


def test_init_dist_mpi(clean_env, fake_group):
    clean_env.update(OMPI)
    with pytest.raises(ValueError, match='MASTER_ADDR'):
        init_dist('mpi')
    clean_env['MASTER_ADDR'] = 'head'
    init_dist('mpi', backend='gloo')
    assert fake_group == [dict(backend='gloo', rank=3, world_size=4)]
    assert (os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['LOCAL_SIZE'],
            os.environ['MASTER_PORT']) == ('3', '1', '2', '29500')


def test_init_dist_binds_cuda_device_only_when_available(clean_env, monkeypatch):
    calls, devices = [], []
    monkeypatch.setattr(launcher.dist, 'init_process_group', lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    monkeypatch.setattr(torch.cuda, 'set_device', devices.append)
    clean_env.update(TORCHRUN)
    init_dist('pytorch')
    assert devices == [1] and calls[0]['backend'] == 'nccl'
    clean_env['LOCAL_RANK'] = '2'
    with pytest.raises(ValueError, match='local rank 2 has no GPU: 2 visible'):
        init_dist('pytorch')


def test_init_dist_errors(clean_env, fake_group):
    with pytest.raises(ValueError, match="unknown launcher 'torchrun'.*'pytorch', 'slurm', 'mpi'"):
        init_dist('torchrun')
    with pytest.raises(ValueError, match="launcher 'none' means a single process"):
        init_dist('none')
    with pytest.raises(ValueError, match='needs the environment variables RANK, WORLD_SIZE, '
                                         'LOCAL_RANK'):
        init_dist('pytorch')
    clean_env.update(TORCHRUN)
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA"):
        init_dist('pytorch', backend='nccl')
    with pytest.raises(TypeError, match='timeout must be seconds'):
        init_dist('pytorch', timeout='30')
    with pytest.raises(ValueError, match='timeout must be positive'):
        init_dist('pytorch', timeout=0)
    clean_env['RANK'] = 'one'
    with pytest.raises(ValueError, match="RANK='one' is not an integer"):
        init_dist('pytorch')
    assert fake_group == []


def test_init_dist_real_gloo_group_and_no_reinit(clean_env, tmp_path, caplog):
    """A real 1-process gloo group; a second init_dist uses it instead of re-initialising."""
    clean_env.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', GLOO_SOCKET_IFNAME='lo')
    assert not is_distributed()
    try:
        init_dist('pytorch', init_method=f'file://{tmp_path / "store"}', timeout=30)
        group = dist.group.WORLD
        assert is_distributed() and get_dist_info() == (0, 1)
        assert dist.get_backend() == 'gloo'
        with caplog.at_level(logging.INFO, logger='stratagem'):
            init_dist('pytorch')  # no MASTER_ADDR: it would fail if it tried to rendezvous
            init_dist('none')  # a host trainer made the group; our config says single process
        assert dist.group.WORLD is group
        assert caplog.text.count('already initialised') == 2
        with pytest.raises(ValueError, match="unknown launcher 'pytroch'"):
            init_dist('pytroch')  # a typo still fails loudly
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
