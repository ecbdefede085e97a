"""The launchers clusters use, read from the variables each operator sets: a Kubeflow
PyTorchJob pod running ``python train.py``, Kubeflow's torchrun variables (``PET_*``: Trainer
v2's torch plugin, PyTorchJob's ``nprocPerNode``), JobSet (an Indexed Job's
``JOB_COMPLETION_INDEX`` and its pods' host names), SkyPilot; what ``stratagem train`` makes
of them (torchrun's options, nothing to add), its refusals (a flag that contradicts a
variable; a process alone that is one of several), and ``stratagem env``'s report."""

import argparse
import re

import pytest

from stratagem.cli import build_sub_parser, launch, main
from stratagem.env import cluster, infer_launcher
from stratagem.env.launcher import describe_launch

# what kubeflow/trainer's torch plugin sets in every node of a TrainJob named 'tj' (2 nodes)
TRAINJOB = dict(
    PET_NNODES='2',
    PET_NPROC_PER_NODE='2',
    PET_NODE_RANK='1',
    PET_MASTER_ADDR='tj-node-0-0.tj',
    PET_MASTER_PORT='29400',
    JOB_COMPLETION_INDEX='1',  # the Indexed Job's: PET_NODE_RANK is read from it
)
# what the training-operator sets in a PyTorchJob pod (Master + 1 Worker): worker 0 is rank 1
PYTORCHJOB = dict(RANK='1', WORLD_SIZE='2', MASTER_ADDR='pj-master-0', MASTER_PORT='23456')
SKYPILOT = dict(
    SKYPILOT_NODE_RANK='1',
    SKYPILOT_NODE_IPS='10.0.0.5\n10.0.0.6\n',
    SKYPILOT_NUM_NODES='2',
    SKYPILOT_NUM_GPUS_PER_NODE='0',
)
# a JobSet pod (jobset 'js', replicated job 'workers', job 0, pod 1) whose manifest states the
# count of pods and the master, as the JobSet project's PyTorch example does for the master
JOBSET = dict(
    JOB_COMPLETION_INDEX='1',
    HOSTNAME='js-workers-0-1',
    PET_NNODES='2',
    MASTER_ADDR='js-workers-0-0.js',
    MASTER_PORT='3389',
)
CONFIG = """
model = dict(type='MLPClassifier', in_features=4, num_classes=2, hidden=8)
train_dataloader = dict(dataset=dict(type='SyntheticClassification', num_samples=16,
                                     num_features=4, num_classes=2), batch_size=8)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1))
train_cfg = dict(max_iters=2)
"""


@pytest.fixture()
def config(tmp_path):
    path = tmp_path / 'cfg.py'
    path.write_text(CONFIG)
    return str(path)


def _launch(config, *argv):
    """``stratagem train``'s arguments after the environment filled them, and torchrun's
    command (none when the run starts alone)."""
    args = build_sub_parser('train').parse_args([config, *argv])
    args.cli_argv = [config, *argv]
    node = launch.launch_from_environment(args)
    cmd = launch.torchrun_command(args) if launch.wants_torchrun(args) else None
    return args, node, cmd


def _membership(cmd):
    start = cmd.index('torch.distributed.run') + 1
    return [
        a
        for a in cmd[start : cmd.index('-m', start)]
        if a.startswith(('--nnodes', '--node-', '--master', '--rdzv', '--standalone'))
    ]


@pytest.mark.parametrize(
    'env, expected',
    [
        (PYTORCHJOB, 'pytorch'),
        ({**PYTORCHJOB, 'LOCAL_RANK': '0'}, 'pytorch'),  # torchrun inside a PyTorchJob pod
        ({**TRAINJOB, 'RANK': '3', 'WORLD_SIZE': '4', 'LOCAL_RANK': '1'}, 'pytorch'),  # its worker
        (dict(PET_NNODES='1', PET_NPROC_PER_NODE='1'), 'none'),  # a one-node TrainJob
        (dict(JOB_COMPLETION_INDEX='0'), 'none'),  # an Indexed Job's first pod, no count
        ({**SKYPILOT, 'SKYPILOT_NUM_NODES': '1', 'SKYPILOT_NODE_RANK': '0'}, 'none'),
    ],
)
def test_infer_launcher_on_a_cluster(clean_env, env, expected):
    clean_env.update(env)
    assert infer_launcher() == expected


def test_a_pytorchjob_pod_joins_as_local_rank_0(clean_env):
    """init_dist under a PyTorchJob pod's variables: a real 1-process gloo group."""
    import torch.distributed as dist

    from dist_harness import free_port
    from stratagem.env import init_dist

    clean_env.update(
        RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port())
    )
    assert infer_launcher() == 'pytorch'
    init_dist('pytorch', backend='gloo')
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        assert (clean_env['LOCAL_RANK'], clean_env['LOCAL_WORLD_SIZE']) == ('0', '1')
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    'env, variables',
    [
        (
            TRAINJOB,
            'PET_NNODES=2, PET_NODE_RANK=1, PET_NPROC_PER_NODE=2, PET_MASTER_ADDR=tj-node-0-0.tj, '
            'PET_MASTER_PORT=29400, JOB_COMPLETION_INDEX=1',
        ),
        (
            SKYPILOT,
            "SKYPILOT_NUM_NODES=2, SKYPILOT_NODE_RANK=1, SKYPILOT_NODE_IPS='10.0.0.5\\n10.0.0.6', "
            'SKYPILOT_NUM_GPUS_PER_NODE=0',
        ),
        (
            JOBSET,
            'PET_NNODES=2, JOB_COMPLETION_INDEX=1, MASTER_ADDR=js-workers-0-0.js, MASTER_PORT=3389',
        ),
        (dict(PET_NNODES='2', PET_NODE_RANK='0'), 'PET_NNODES=2, PET_NODE_RANK=0'),  # node 0 too
    ],
)
def test_a_node_started_alone_is_refused_naming_the_variables(clean_env, env, variables):
    clean_env.update(env)
    with pytest.raises(RuntimeError) as info:
        infer_launcher()
    message = str(info.value)
    assert message.startswith('this process would train alone, but ')
    assert f'says this node is one of several: {variables}. Start the node with ' in message
    assert "launcher='none' (`stratagem train --launcher none`)" in message


def test_world_size_without_a_rendezvous_is_refused(clean_env):
    clean_env.update(RANK='1', WORLD_SIZE='2', MASTER_ADDR='pj-master-0')
    with pytest.raises(RuntimeError) as info:
        infer_launcher()
    assert str(info.value).startswith(
        'this process would train alone, but its environment says it is one of 2 (RANK=1, '
        'WORLD_SIZE=2, MASTER_ADDR=pj-master-0) and MASTER_PORT are not set, so no process '
        "group can form (torch's env:// needs RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
    )


def test_a_jobset_pod_without_a_count_is_refused_saying_where_to_state_it(clean_env):
    clean_env.update(JOB_COMPLETION_INDEX='1', HOSTNAME='js-workers-0-1')
    with pytest.raises(RuntimeError) as info:
        infer_launcher()
    assert (
        'one of several: JOB_COMPLETION_INDEX=1, HOSTNAME=js-workers-0-1. The number of nodes '
        'is not among them (JobSet sets none): state it in the manifest as PET_NNODES, or give '
        '`stratagem train --nnodes N`. '
    ) in str(info.value)


def test_jobset_master_is_the_first_pod_of_the_job_in_its_subdomain():
    fqdn = 'js-workers-0-1.js.default.svc.cluster.local'
    assert (
        cluster.jobset_master('js-workers-0-1', fqdn)
        == 'js-workers-0-0.js.default.svc.cluster.local'
    )
    assert cluster.jobset_master('js-workers-2-3', '') == 'js-workers-2-0'
    assert cluster.jobset_master('my-laptop', 'my-laptop.lan') is None


def _options(config, *argv):
    """The launch options ``stratagem train`` takes (from the flags, else the environment)."""
    args = build_sub_parser('train').parse_args([config, *argv])
    launch.launch_from_environment(args)
    return dict(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        nproc=args.nproc,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )


KUBEFLOW_OPTIONS = dict(
    nnodes='2', node_rank=1, nproc=2, master_addr='tj-node-0-0.tj', master_port=29400
)


@pytest.mark.parametrize(
    'env, argv, options',
    [
        (TRAINJOB, [], KUBEFLOW_OPTIONS),
        (  # flags that agree with the environment change nothing
            TRAINJOB,
            ['--nnodes', '2', '--node-rank', '1', '--nproc', '2', '--master-port', '29400'],
            KUBEFLOW_OPTIONS,
        ),
        (  # auto/cpu/gpu resolved as torchrun does; a --nproc given wins over it
            {**TRAINJOB, 'PET_NPROC_PER_NODE': 'cpu'},
            ['--nproc', '3'],
            {**KUBEFLOW_OPTIONS, 'nproc': 3},
        ),
        (
            SKYPILOT,
            [],
            dict(nnodes='2', node_rank=1, nproc=1, master_addr='10.0.0.5', master_port=None),
        ),
        (  # a port the task states
            {**SKYPILOT, 'MASTER_PORT': '8008'},
            [],
            dict(nnodes='2', node_rank=1, nproc=1, master_addr='10.0.0.5', master_port=8008),
        ),
        (  # SkyPilot's count of GPUs is a default, not a demand
            {**SKYPILOT, 'SKYPILOT_NUM_GPUS_PER_NODE': '8'},
            [],
            dict(nnodes='2', node_rank=1, nproc=8, master_addr='10.0.0.5', master_port=None),
        ),
        (
            {**SKYPILOT, 'SKYPILOT_NUM_GPUS_PER_NODE': '8'},
            ['--nproc', '2'],
            dict(nnodes='2', node_rank=1, nproc=2, master_addr='10.0.0.5', master_port=None),
        ),
        (
            JOBSET,
            [],
            dict(
                nnodes='2', node_rank=1, nproc=1, master_addr='js-workers-0-0.js', master_port=3389
            ),
        ),
        (  # JobSet with no master stated: the job's first pod, from this pod's host name
            {**JOBSET, 'MASTER_ADDR': '', 'MASTER_PORT': ''},
            [],
            dict(nnodes='2', node_rank=1, nproc=1, master_addr='js-workers-0-0', master_port=None),
        ),
    ],
)
def test_stratagem_train_takes_its_nodes_from_the_environment(
    clean_env, config, env, argv, options
):
    clean_env.update({k: v for k, v in env.items() if v})
    if env.get('PET_NPROC_PER_NODE') == 'cpu':
        from torch.distributed.run import determine_local_world_size

        clean_env.pop('PET_NPROC_PER_NODE')
        clean_env['PET_NPROC_PER_NODE'] = 'cpu'
        assert _options(config)['nproc'] == determine_local_world_size('cpu')
    assert _options(config, *argv) == options


def test_torchrun_runs_the_whole_world_from_the_environment(clean_env, config):
    """torchrun's command under a scheduler's variables: the nodes, no --standalone."""
    clean_env.update({**TRAINJOB, 'PET_MASTER_ADDR': '127.0.0.1'})
    _, _, cmd = _launch(config)
    assert _membership(cmd) == [
        '--nnodes=2', '--node-rank=1', '--master-addr=127.0.0.1', '--master-port=29400'
    ]  # fmt: skip
    assert '--nproc-per-node=2' in cmd
    clean_env.clear()
    clean_env.update(SKYPILOT)
    _, _, cmd = _launch(config)
    assert _membership(cmd) == ['--nnodes=2', '--node-rank=1', '--master-addr=10.0.0.5']
    clean_env.clear()
    # PyTorchJob's elasticPolicy: a c10d rendezvous, restarts
    clean_env.update(
        PET_NNODES='1:3', PET_RDZV_ENDPOINT='127.0.0.1:29400', PET_RDZV_ID='pj',
        PET_MAX_RESTARTS='2', PET_NPROC_PER_NODE='1',
    )  # fmt: skip
    _, _, cmd = _launch(config)
    assert _membership(cmd) == [
        '--nnodes=1:3', '--rdzv-backend=c10d', '--rdzv-endpoint=127.0.0.1:29400', '--rdzv-id=pj'
    ]  # fmt: skip
    assert '--max-restarts=2' in cmd


def test_a_one_process_pytorchjob_pod_trains_without_torchrun(clean_env, config):
    clean_env.update(PYTORCHJOB)
    args, node, cmd = _launch(config)
    assert node is None and cmd is None
    assert (args.nproc, args.nnodes, args.node_rank) == (1, '1', 0)


def test_without_a_scheduler_the_defaults_are_one_node_one_process(clean_env, config):
    args, node, cmd = _launch(config)
    assert node is None and cmd is None
    _, _, cmd = _launch(config, '--nproc', '2')
    assert _membership(cmd) == ['--standalone'] and '--nproc-per-node=2' in cmd


@pytest.mark.parametrize(
    'env, argv, message',
    [
        (
            TRAINJOB,
            ['--nnodes', '3'],
            "--nnodes 3 contradicts the environment: PET_NNODES=2, set by Kubeflow (torchrun's "
            'PET_* variables) + an Indexed Job (JobSet) for this node. Drop --nnodes (stratagem '
            'train takes it from PET_NNODES), or change the job so that both agree',
        ),
        (
            TRAINJOB,
            ['--nproc', '4'],
            '--nproc 4 contradicts the environment: PET_NPROC_PER_NODE=2, set by Kubeflow',
        ),
        (
            TRAINJOB,
            ['--node-rank', '0'],
            '--node-rank 0 contradicts the environment: PET_NODE_RANK=1, set by Kubeflow',
        ),
        (
            TRAINJOB,
            ['--master-addr', 'localhost'],
            '--master-addr localhost contradicts the environment: PET_MASTER_ADDR=tj-node-0-0.tj',
        ),
        (
            SKYPILOT,
            ['--master-addr', '10.0.0.9'],
            "--master-addr 10.0.0.9 contradicts the environment: SKYPILOT_NODE_IPS='10.0.0.5\\n"
            "10.0.0.6' (read as 10.0.0.5), set by SkyPilot for this node",
        ),
        (
            {**JOBSET, 'MASTER_ADDR': '', 'MASTER_PORT': ''},
            ['--node-rank', '0'],
            '--node-rank 0 contradicts the environment: JOB_COMPLETION_INDEX=1, set by',
        ),
        (
            PYTORCHJOB,
            ['--nproc', '2'],
            '--nproc 2 contradicts the environment: RANK=1, WORLD_SIZE=2, MASTER_ADDR=pj-master-0, '
            'MASTER_PORT=23456 and no LOCAL_RANK (a Kubeflow PyTorchJob pod: its operator gave '
            'this one process its rank in a world of WORLD_SIZE pods)',
        ),
    ],
)
def test_a_flag_that_contradicts_the_environment_is_refused_naming_both(
    clean_env, config, capsys, tmp_path, env, argv, message
):
    clean_env.update({k: v for k, v in env.items() if v})
    work = tmp_path / 'work'
    assert main(['train', config, '--work-dir', str(work), *argv]) == 1
    err = capsys.readouterr().err
    assert re.search(r'stratagem: error( \(rank \d\))?: ' + re.escape(message), err), err
    assert not work.exists()  # refused before anything was written


@pytest.mark.parametrize(
    'env, saw',
    [
        (
            dict(JOB_COMPLETION_INDEX='1'),
            'an Indexed Job (JobSet) says this node is one of several: JOB_COMPLETION_INDEX=1.',
        ),
        (
            dict(RANK='1', WORLD_SIZE='2'),
            'its environment says it is one of 2 (RANK=1, '
            'WORLD_SIZE=2) and MASTER_ADDR, MASTER_PORT are not set',
        ),
    ],
)
def test_stratagem_train_alone_but_one_of_several_is_refused_and_trains_nothing(
    clean_env, config, capsys, tmp_path, env, saw
):
    clean_env.update(env)
    work = tmp_path / 'work'
    assert main(['train', config, '--work-dir', str(work)]) == 1
    err = capsys.readouterr().err
    assert re.search(
        r'stratagem: error( \(rank 1\))?: this process would train alone, but ' + re.escape(saw),
        err,
    ), err
    assert not work.exists()


def test_launcher_none_trains_alone_on_purpose(clean_env, config, tmp_path):
    clean_env.update(PET_NNODES='2', PET_NODE_RANK='1', PET_MASTER_ADDR='127.0.0.1')
    work = tmp_path / 'work'
    assert main(['train', config, '--work-dir', str(work), '--launcher', 'none']) == 0
    assert (work / 'iter_2.pth').is_file()


def test_stratagem_env_says_what_it_inferred_and_why(clean_env, capsys):
    clean_env.update(PYTORCHJOB)
    lines = describe_launch()
    assert lines['launcher'] == 'pytorch'
    assert lines['started by'].startswith('a pod with RANK, WORLD_SIZE, MASTER_ADDR/PORT')
    assert (lines['world size'], lines['rank'], lines['local rank']) == (
        '2',
        '1',
        '0 (one process per pod)',
    )
    assert lines['master'] == 'pj-master-0:23456'
    assert lines['variables read'] == (
        "MASTER_ADDR='pj-master-0', MASTER_PORT='23456', RANK='1', WORLD_SIZE='2'"
    )
    clean_env.clear()
    clean_env.update({k: v for k, v in TRAINJOB.items()})
    assert main(['env']) == 0
    out = dict(line.split(': ', 1) for line in capsys.readouterr().out.splitlines() if ': ' in line)
    assert out['launcher'].startswith('refused: this process would train alone')
    assert out['nodes'] == '2' and out['node rank'] == '1'
    assert out['stratagem train starts torchrun with'] == (
        '--nnodes 2 (from PET_NNODES=2); --node-rank 1 (from PET_NODE_RANK=1); '
        '--nproc-per-node 2 (from PET_NPROC_PER_NODE=2); --master-addr tj-node-0-0.tj (from '
        'PET_MASTER_ADDR=tj-node-0-0.tj); --master-port 29400 (from PET_MASTER_PORT=29400)'
    )


def test_a_torchrun_worker_reads_no_node_variables(clean_env, config):
    """A worker that torchrun started under PET_* (its parent read them) takes nothing."""
    clean_env.update({**TRAINJOB, 'RANK': '3', 'WORLD_SIZE': '4', 'LOCAL_RANK': '1'})
    args = argparse.Namespace(
        nproc=None, nnodes=None, node_rank=None, master_addr=None, master_port=None,
        rdzv_endpoint=None, rdzv_id=None, max_restarts=None, launcher='pytorch',
    )  # fmt: skip
    assert launch.launch_from_environment(args) is None
    assert (args.nproc, args.nnodes, args.node_rank) == (1, '1', 0)
