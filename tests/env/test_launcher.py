"""infer_launcher, init_dist (faked process group, and a real 1-process gloo group), nodelists,
Slurm steps vs batch scripts, master address and port, MPI implementations."""

import ipaddress
import logging
import os
import socket
import subprocess
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from stratagem.cli import main
from stratagem.env import (
    cluster,
    expand_slurm_nodelist,
    get_dist_info,
    infer_launcher,
    init_dist,
    is_distributed,
    launcher,
    slurm,
)

CONFIG = """
model = dict(type='MLPClassifier', in_features=4, num_classes=2, hidden=8)
train_dataloader = dict(dataset=dict(type='SyntheticClassification', num_samples=16,
                                     num_features=4, num_classes=2), batch_size=8)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1))
train_cfg = dict(max_iters=2)
"""

TORCHRUN = dict(
    RANK='1', WORLD_SIZE='4', LOCAL_RANK='1', MASTER_ADDR='10.0.0.1', MASTER_PORT='1234'
)
# a task of `srun` in job 4242: the step variables are what tell it from the batch script
SLURM = dict(
    SLURM_JOB_ID='4242',
    SLURM_STEP_ID='0',
    SLURM_STEPID='0',
    SLURM_PROCID='5',
    SLURM_NTASKS='8',
    SLURM_STEP_NUM_TASKS='8',
    SLURM_LOCALID='1',
    SLURM_NODEID='1',
    SLURM_TASKS_PER_NODE='4(x2)',
    SLURM_STEP_TASKS_PER_NODE='4(x2)',
    SLURM_JOB_NODELIST='node[07-08]',
    SLURM_STEP_NODELIST='node[07-08]',
)
# the batch script of `sbatch --ntasks=2` (what Slurm's env_array_for_batch_job sets, plus
# slurmstepd's task ids): no SLURM_STEP_*
SLURM_BATCH = dict(
    SLURM_JOB_ID='4242',
    SLURM_NTASKS='2',
    SLURM_NPROCS='2',
    SLURM_PROCID='0',
    SLURM_LOCALID='0',
    SLURM_NODEID='0',
    SLURM_TASKS_PER_NODE='2',
    SLURM_JOB_NODELIST='node07',
    SLURM_NODELIST='node07',
)
OMPI = dict(
    OMPI_COMM_WORLD_RANK='3',
    OMPI_COMM_WORLD_SIZE='4',
    OMPI_COMM_WORLD_LOCAL_RANK='1',
    OMPI_COMM_WORLD_LOCAL_SIZE='2',
)
MPICH = dict(PMI_RANK='3', PMI_SIZE='4', MPI_LOCALRANKID='1', MPI_LOCALNRANKS='2')
MVAPICH = dict(
    MV2_COMM_WORLD_RANK='3',
    MV2_COMM_WORLD_SIZE='4',
    MV2_COMM_WORLD_LOCAL_RANK='1',
    MV2_COMM_WORLD_LOCAL_SIZE='2',
)


@pytest.mark.parametrize(
    'env, expected',
    [
        ({}, 'none'),
        (TORCHRUN, 'pytorch'),
        (dict(RANK='0', WORLD_SIZE='1'), 'none'),  # a world of one, no master: alone
        # a Kubeflow PyTorchJob pod: env://'s four variables and no LOCAL_RANK
        (
            dict(RANK='1', WORLD_SIZE='2', MASTER_ADDR='job-master-0', MASTER_PORT='23456'),
            'pytorch',
        ),
        (SLURM, 'slurm'),
        (dict(SLURM_PROCID='0', SLURM_NTASKS='1'), 'none'),  # one task: an interactive job
        (dict(SLURM_NTASKS='4'), 'none'),  # no task id: an salloc shell, one process
        # `srun -n 1` inside a 4-task allocation: the step's size counts, not the job's
        ({**SLURM, 'SLURM_NTASKS': '4', 'SLURM_STEP_NUM_TASKS': '1'}, 'none'),
        (OMPI, 'mpi'),
        (MPICH, 'mpi'),
        (MVAPICH, 'mpi'),
        ({**SLURM, **TORCHRUN}, 'pytorch'),  # torchrun inside a Slurm allocation
        ({**SLURM, **OMPI, 'OMPI_COMM_WORLD_SIZE': '8'}, 'slurm'),  # srun --mpi=pmix: sizes agree
        ({**SLURM, **OMPI}, 'mpi'),  # mpirun's daemons started by srun: the MPI world is the truth
        ({**SLURM_BATCH, **MPICH}, 'mpi'),  # mpiexec in the batch script
    ],
)
def test_infer_launcher(clean_env, env, expected):
    clean_env.update(env)
    assert infer_launcher() == expected


def test_slurm_batch_step_without_srun_fails_fast(clean_env, monkeypatch, tmp_path, capsys):
    """`sbatch --ntasks=2` running python itself: an error naming srun, never a wait."""
    inits = []
    monkeypatch.setattr(launcher.dist, 'init_process_group', lambda **kw: inits.append(kw))
    clean_env.update(SLURM_BATCH)
    start = time.monotonic()
    for call in (infer_launcher, lambda: init_dist('slurm')):
        with pytest.raises(
            RuntimeError,
            match=r'batch script of Slurm job 4242 \(SLURM_NTASKS=2'
            r'.*Start the tasks with srun.*--launcher none',
        ):
            call()
    # through the command, as the issue saw it hang: fails before any process group exists
    config = tmp_path / 'cfg.py'
    config.write_text(CONFIG)
    assert main(['train', str(config), '--work-dir', str(tmp_path / 'w')]) == 1
    assert 'Start the tasks with srun' in capsys.readouterr().err
    assert time.monotonic() - start < 30 and inits == []
    assert not (tmp_path / 'w').exists()  # nothing written on the way to the error
    # the documented way out: one process on purpose
    assert (
        main(['train', str(config), '--work-dir', str(tmp_path / 'w'), '--launcher', 'none']) == 0
    )


def test_slurm_master_port_from_the_job_id(clean_env, fake_group):
    assert [slurm.master_port(j) for j in (4242, '4243', 19242)] == [19242, 19243, 19242]
    assert all(15000 <= slurm.master_port(j) < 30000 for j in (0, 1, 14999, 10**9, 'het+1'))
    ports = []
    for job in ('1001', '1002'):  # two jobs on one host: two rendezvous ports
        clean_env.clear()
        clean_env.update(SLURM, SLURM_JOB_ID=job)
        init_dist('slurm')
        ports.append(os.environ['MASTER_PORT'])
    assert ports == ['16001', '16002']
    clean_env.clear()
    clean_env.update(SLURM)
    del clean_env['SLURM_JOB_ID']
    init_dist('slurm')
    assert os.environ['MASTER_PORT'] == '29500'  # no job id: torch's default


@pytest.mark.parametrize(
    'nodelist, hosts',
    [
        ('node1', ['node1']),
        ('node[01-03,07],gpu5', ['node01', 'node02', 'node03', 'node07', 'gpu5']),
        ('gpu5,node[8-10]', ['gpu5', 'node8', 'node9', 'node10']),
        ('n[008-010]', ['n008', 'n009', 'n010']),
        ('r[1-2]n[1-2]', ['r1n1', 'r1n2', 'r2n1', 'r2n2']),
        ('a-b[1,3].x', ['a-b1.x', 'a-b3.x']),
    ],
)
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize('bad', ['', 'node[1-3', 'node]1[', 'node[a-b]', 'node[3-1]', 'a,,b'])
def test_expand_slurm_nodelist_rejects(bad):
    with pytest.raises(ValueError, match='Slurm node list'):
        expand_slurm_nodelist(bad)


HOSTS = {'node07': '10.0.0.7', 'hostA': '10.0.0.8', 'head': '10.0.0.9', 'localhost': '127.0.0.1'}


@pytest.fixture
def fake_group(monkeypatch):
    """Record init_process_group calls; make CUDA absent and any CUDA call an error; no
    scontrol; resolve only the names of HOSTS (and numeric addresses)."""
    calls = []
    monkeypatch.setattr(launcher.dist, 'init_process_group', lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)

    def no_cuda(*args, **kwargs):
        raise AssertionError('a CUDA API was called on a CPU-only machine')

    monkeypatch.setattr(torch.cuda, 'set_device', no_cuda)
    monkeypatch.setattr(torch.cuda, 'device_count', no_cuda)
    monkeypatch.setattr(slurm.subprocess, 'run', no_scontrol)

    def resolve(host, port, *args, **kwargs):
        try:
            address = str(ipaddress.ip_address(host))
        except ValueError:
            if host not in HOSTS:
                raise socket.gaierror(-2, 'Name or service not known') from None
            address = HOSTS[host]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, '', (address, port))]

    monkeypatch.setattr(launcher.socket, 'getaddrinfo', resolve)
    return calls


def no_scontrol(*args, **kwargs):
    raise FileNotFoundError('scontrol')


def test_init_dist_slurm_on_cpu(clean_env, fake_group):
    clean_env.update(SLURM)
    init_dist('slurm', timeout=90)
    assert fake_group == [dict(backend='gloo', rank=5, world_size=8, timeout=timedelta(seconds=90))]
    assert {
        k: os.environ[k]
        for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_SIZE', 'MASTER_ADDR', 'MASTER_PORT')
    } == dict(
        RANK='5',
        WORLD_SIZE='8',
        LOCAL_RANK='1',
        LOCAL_SIZE='4',
        MASTER_ADDR='node07',
        MASTER_PORT='19242',
    )  # 15000 + 4242


def test_init_dist_slurm_step_smaller_than_the_job(clean_env, fake_group):
    """`srun -n 2 --preserve-env` in an 8-task job: the step's size and layout count."""
    clean_env.update(
        SLURM,
        SLURM_PROCID='1',
        SLURM_STEP_NUM_TASKS='2',
        SLURM_NODEID='0',
        SLURM_STEP_TASKS_PER_NODE='2',
        SLURM_STEP_NODELIST='node07',
    )
    del clean_env['SLURM_LOCALID']
    init_dist('slurm')
    assert fake_group[0]['world_size'] == 2
    assert (os.environ['LOCAL_RANK'], os.environ['LOCAL_SIZE']) == ('1', '2')


def test_init_dist_slurm_uses_scontrol_and_keeps_port(clean_env, fake_group, monkeypatch):
    clean_env.update(SLURM, MASTER_PORT='4321')
    del clean_env['SLURM_LOCALID']  # derived from the rank and the tasks on this node
    seen = []

    def scontrol(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='hostA\nhostB\n')

    monkeypatch.setattr(slurm.subprocess, 'run', scontrol)
    init_dist('slurm')
    assert seen == [['scontrol', 'show', 'hostnames', 'node[07-08]']]
    assert (os.environ['MASTER_ADDR'], os.environ['MASTER_PORT']) == ('hostA', '4321')
    assert os.environ['LOCAL_RANK'] == '1'  # 5 % 4
    init_dist('slurm', port=2222)
    assert os.environ['MASTER_PORT'] == '2222'


def test_init_dist_slurm_keeps_the_users_master(clean_env, fake_group, monkeypatch, caplog):
    """A MASTER_ADDR / MASTER_PORT set for the step wins over the node list and the job id."""
    clean_env.update(SLURM, MASTER_ADDR='head', MASTER_PORT='23456')
    monkeypatch.setattr(slurm.subprocess, 'run', lambda *a, **k: pytest.fail('scontrol ran'))
    with caplog.at_level(logging.INFO, logger='stratagem'):
        init_dist('slurm')
    assert (os.environ['MASTER_ADDR'], os.environ['MASTER_PORT']) == ('head', '23456')
    assert 'rendezvous at head:23456 (MASTER_ADDR, set in the environment' in caplog.text


def test_unresolvable_master_names_the_host_and_its_origin(clean_env, fake_group):
    clean_env.update(SLURM, SLURM_STEP_NODELIST='gpu-x[01-02]')
    with pytest.raises(
        ValueError,
        match=r"master host 'gpu-x01' \(from the first host of "
        r"SLURM_STEP_NODELIST='gpu-x\[01-02\]'\) does not "
        r'resolve: .*Name or service not known',
    ):
        init_dist('slurm')
    # checked before anything changed: no variable exported, no rendezvous attempted
    assert not {'RANK', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'} & set(os.environ)
    clean_env['MASTER_ADDR'] = 'typo-head'
    with pytest.raises(
        ValueError,
        match=r"'typo-head' \(from MASTER_ADDR, set in the "
        'environment of the job step',
    ):
        init_dist('slurm')
    clean_env.clear()
    clean_env.update(MPICH, MASTER_ADDR='typo-head')
    with pytest.raises(
        ValueError,
        match=r"'typo-head' \(from MASTER_ADDR, exported to the "
        r'MPICH / Intel MPI ranks\)',
    ):
        init_dist('mpi')
    clean_env.clear()
    clean_env.update(TORCHRUN, MASTER_ADDR='typo-head')
    with pytest.raises(ValueError, match=r"'typo-head' \(from MASTER_ADDR, set by torchrun"):
        init_dist('pytorch')
    assert fake_group == []  # nothing was attempted


def test_unresolvable_master_with_the_real_resolver(clean_env, monkeypatch):
    # RFC 2606: .invalid never resolves; the failure is immediate, not a rendezvous timeout
    monkeypatch.setattr(launcher.dist, 'init_process_group', lambda **kw: pytest.fail('init'))
    clean_env.update(TORCHRUN, MASTER_ADDR='stratagem-no-such-host.invalid')
    start = time.monotonic()
    with pytest.raises(ValueError, match="'stratagem-no-such-host.invalid'.*does not resolve"):
        init_dist('pytorch', backend='gloo')
    assert time.monotonic() - start < 20


def test_loopback_master_in_a_multi_node_step_is_refused(clean_env, fake_group):
    # e.g. `export MASTER_ADDR=localhost` left in the shell that ran sbatch
    clean_env.update(SLURM, SLURM_STEP_NUM_NODES='2', MASTER_ADDR='localhost')
    with pytest.raises(
        ValueError, match="'localhost'.*is a loopback address, but the job step spans 2 nodes"
    ):
        init_dist('slurm')
    clean_env['SLURM_STEP_NUM_NODES'] = '1'  # one node: loopback is fine
    init_dist('slurm')
    assert fake_group[0]['rank'] == 5


def test_init_dist_mpi(clean_env, fake_group):
    clean_env.update(OMPI)
    with pytest.raises(ValueError, match='MASTER_ADDR.*mpirun -x MASTER_ADDR -x MASTER_PORT'):
        init_dist('mpi')
    clean_env['MASTER_ADDR'] = 'head'
    init_dist('mpi', backend='gloo')
    assert fake_group == [dict(backend='gloo', rank=3, world_size=4)]
    assert (
        os.environ['RANK'],
        os.environ['LOCAL_RANK'],
        os.environ['LOCAL_SIZE'],
        os.environ['MASTER_PORT'],
    ) == ('3', '1', '2', '29500')


@pytest.mark.parametrize(
    'variables',
    [MPICH, MVAPICH, dict(PMI_RANK='3', PMI_SIZE='4', PMI_LOCAL_RANK='1', PMI_LOCAL_SIZE='2')],
    ids=['mpich-hydra', 'mvapich', 'pmi-local'],
)
def test_init_dist_mpich_and_mvapich(clean_env, fake_group, variables):
    clean_env.update(variables, MASTER_ADDR='head', MASTER_PORT='2345')
    assert infer_launcher() == 'mpi'
    init_dist('mpi')
    assert fake_group == [dict(backend='gloo', rank=3, world_size=4)]
    assert {
        k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_SIZE', 'MASTER_PORT')
    } == dict(RANK='3', WORLD_SIZE='4', LOCAL_RANK='1', LOCAL_SIZE='2', MASTER_PORT='2345')


def test_init_dist_mpi_errors(clean_env, fake_group):
    with pytest.raises(
        ValueError,
        match=r"launcher 'mpi' needs the rank and size.*Open MPI: "
        r'OMPI_COMM_WORLD_RANK.*MVAPICH: MV2_COMM_WORLD_RANK.*'
        'MPICH / Intel MPI: PMI_RANK, PMI_SIZE',
    ):
        init_dist('mpi')
    clean_env.update(PMI_RANK='0', PMI_SIZE='2', MASTER_ADDR='head')
    with pytest.raises(
        ValueError, match='needs the rank on the node from MPI_LOCALRANKID or PMI_LOCAL_RANK'
    ):
        init_dist('mpi')
    clean_env.update(MPI_LOCALRANKID='0', MASTER_PORT='99999')
    with pytest.raises(ValueError, match=r"MASTER_PORT='99999' is not a TCP port"):
        init_dist('mpi')
    assert fake_group == []


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
    with pytest.raises(
        ValueError, match='needs the environment variables RANK, WORLD_SIZE, LOCAL_RANK'
    ):
        init_dist('pytorch')
    with pytest.raises(
        ValueError,
        match='needs the environment variables SLURM_PROCID, '
        'SLURM_STEP_ID.*start the tasks with srun',
    ):
        init_dist('slurm')
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


def test_the_tests_remove_every_launcher_variable_the_library_reads():
    """tests/launcher_env.py is the tests' one list; the library's own tuples (the variables
    infer_launcher, init_dist and the logger read) are the source it must cover."""
    from launcher_env import is_launcher_variable
    from stratagem.env import logging as env_logging

    read = {*launcher._TORCHRUN_VARS, 'MASTER_ADDR', 'MASTER_PORT', 'LOCAL_SIZE'}
    for _, rank, size, local_ranks, local_sizes in launcher._MPI_FAMILIES:
        read.update((rank, size, *local_ranks, *local_sizes))
    read.update(slurm._STEP_ID_VARS, slurm._NODELIST_VARS)
    read.update(env_logging._RANK_VARS, env_logging._SIZE_VARS)
    # a scheduler's node variables; HOSTNAME is read only beside JOB_COMPLETION_INDEX
    read.update(n for names in cluster.NODE_VARIABLES.values() for n in names if n != 'HOSTNAME')
    assert [name for name in sorted(read) if not is_launcher_variable(name)] == []
    # the test's own reading of the tuples is not empty: each family is there
    assert {'RANK', 'OMPI_COMM_WORLD_RANK', 'PMI_RANK', 'MV2_COMM_WORLD_RANK'} <= read
    assert {'SLURM_STEP_ID', 'SLURM_STEP_NODELIST', 'SLURM_PROCID'} <= read
