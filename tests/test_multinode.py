"""Several nodes on localhost (two torchrun "nodes" of one process each) and resuming at
another world size through ``stratagem train``.

One module-scoped 2-node training run serves every test: started as a user starts it,
``stratagem train --nnodes 2 --node-rank R --master-addr A`` on each node, it trains to the
end (rank 0 alone says what every rank would say alike); a shared-work-dir resume (under
torchrun itself, ``--launcher pytorch``) must be bit-exact against it, separate work dirs
must fail on both nodes naming the fix, and its checkpoints resume on 1 process reading
exactly the samples that were left.
"""

import collections
import filecmp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import free_port
from launcher_env import without_launcher

TESTS = Path(__file__).resolve().parent
N, BATCH, EPOCHS = 64, 8, 4
CONFIG = f"""
model = dict(type='MLPClassifier', in_features=8, num_classes=3, hidden=16, dropout=0.2)
train_dataloader = dict(dataset=__import__('counting_dataset').CountingDataset({N}),
                        batch_size={BATCH}, shuffle=True, num_workers=0)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
param_scheduler = [dict(type='LinearLR', start_factor=0.1, by_epoch=False, end=2),
                   dict(type='CosineAnnealingLR', by_epoch=False, eta_min=0.001)]
train_cfg = dict(max_epochs={EPOCHS}, checkpoint_interval=2, log_interval=4)
randomness = dict(seed=7)
"""


def _env(count_dir):
    env = without_launcher()
    env.update(
        OMP_NUM_THREADS='1',
        GLOO_SOCKET_IFNAME='lo',
        COUNT_DIR=str(count_dir),
        # the repository, and tests/ for the config's counting_dataset
        PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), env.get('PYTHONPATH', '')]),
    )
    os.makedirs(count_dir, exist_ok=True)
    return env


def _private_mounts_work() -> bool:
    """Whether this machine lets us give a process its own mount namespace (root, unshare)."""
    try:
        return (
            subprocess.run(
                ['unshare', '-m', '--propagation', 'private', 'true'],
                capture_output=True,
                timeout=10,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


WARMUP_1 = ('--cfg-options', 'param_scheduler.0.end=4')


def _two_nodes(cfg, work_dirs, cwds, count_dir, *extra, hide_from_node1=None, command=False):
    """``stratagem train`` as two torchrun nodes (one process each) on localhost.

    ``hide_from_node1``: a directory node 1 sees as empty (an empty tmpfs mounted over it in
    node 1's own mount namespace), as a machine that does not share node 0's disk would.
    ``command``: each node started as ``stratagem train --nnodes 2 --node-rank R`` (the
    command builds torchrun's), else under ``torch.distributed.run`` with
    ``--launcher pytorch``.
    """
    port = free_port()
    procs = []
    for r in range(2):
        nodes = ['--nnodes', '2', '--node-rank', str(r)]
        master = ['--master-addr', '127.0.0.1', '--master-port', str(port)]
        train = ['-m', 'stratagem', 'train', str(cfg), '--work-dir', str(work_dirs[r])]
        if command:
            cmd = [sys.executable, *train, *nodes, '--nproc', '1', *master, *extra]
        else:
            torchrun = ['-m', 'torch.distributed.run', *nodes, '--nproc-per-node', '1', *master]
            cmd = [sys.executable, *torchrun, *train, '--launcher', 'pytorch', *extra]
        if r == 1 and hide_from_node1 is not None:
            cmd = [
                'unshare',
                '-m',
                '--propagation',
                'private',
                'sh',
                '-c',
                f'mount -t tmpfs none "{hide_from_node1}" && exec "$@"',
                'node1',
                *cmd,
            ]
        env = _env(count_dir)
        env.pop('MKL_NUM_THREADS', None)  # unset: the run sets it, and says so once
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=cwds[r],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outs


def _train(cfg, work_dir, count_dir, *extra, nproc=1):
    """``stratagem train``: ``nproc`` 1 in this process (no start-up of its own; its log
    in pytest's log capture), else launched (returns the process)."""
    if nproc == 1:
        from stratagem.cli import main

        os.makedirs(count_dir, exist_ok=True)
        saved = os.environ.get('COUNT_DIR')
        os.environ['COUNT_DIR'] = str(count_dir)  # the dataset reads it on every sample
        try:
            assert main(['train', str(cfg), '--work-dir', str(work_dir), *extra]) == 0
        finally:
            if saved is None:
                del os.environ['COUNT_DIR']
            else:
                os.environ['COUNT_DIR'] = saved
        return None
    proc = subprocess.run(
        [
            sys.executable,
            '-m',
            'stratagem',
            'train',
            str(cfg),
            '--work-dir',
            str(work_dir),
            '--nproc',
            str(nproc),
            *extra,
        ],
        env=_env(count_dir),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope='module')
def nodes_run(tmp_path_factory):
    """4 epochs on 2 nodes x 1 process: 64 samples / (2 x 8) = 4 iterations per epoch; the
    nodes started by ``stratagem train --nnodes 2``. ``(folder, config, work_dir)``; the
    nodes' outputs in ``folder / 'node<r>.log'``."""
    tmp = tmp_path_factory.mktemp('nodes')
    cfg = tmp / 'cfg.py'
    cfg.write_text(CONFIG)
    work = tmp / 'shared'
    codes, outs = _two_nodes(cfg, [work, work], [tmp, tmp], tmp / 'count-full', command=True)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    for r, out in enumerate(outs):
        (tmp / f'node{r}.log').write_text(out)
    return tmp, cfg, work


def test_two_nodes_started_by_the_command_train_to_the_end(nodes_run):
    tmp, _, work = nodes_run
    node0, node1 = ((tmp / f'node{r}.log').read_text() for r in (0, 1))
    # 64 samples over 2 ranks, batch 8: 4 iterations per epoch, 16 in all
    final = _state(work / 'iter_16.pth')
    assert (final['meta']['iter'], final['meta']['epoch']) == (16, EPOCHS)
    assert final['meta']['world_size'] == 2 and len(final['rng_states']) == 2
    assert all(torch.isfinite(v).all() for v in final['state_dict'].values())
    assert sorted(p.name for p in work.glob('iter_*.pth')) == sorted(
        f'iter_{i}.pth' for i in range(2, 17, 2)
    )
    # a line every rank would print alike comes once, from rank 0 (torchrun set only OMP)
    assert node0.count('set MKL_NUM_THREADS=1') == 1, node0
    assert 'MKL_NUM_THREADS' not in node1, node1
    assert 'iter 16/16' in node0 and 'iter 16/16' not in node1


@pytest.fixture(scope='module')
def single_run(nodes_run):
    """The same 4 epochs on 1 process: 8 iterations per epoch, so the same warmup in samples
    takes 4 iterations."""
    tmp, cfg, _ = nodes_run
    full1, count1 = tmp / 'single', tmp / 'count-single'
    _train(cfg, full1, count1, *WARMUP_1)
    return full1, count1


def _final_lr(path):
    return _state(path)['optimizer']['param_groups'][0]['lr']


def _state(path):
    return torch.load(path, weights_only=True)


def _keep_up_to(src, dst, it):
    """A copy of work dir ``src`` as if training had stopped after iteration ``it``."""
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.startswith('iter_') and name.endswith('.pth') and int(name[5:-4]) > it:
            os.remove(dst / name)
            os.remove(dst / f'{name}.manifest.json')
    os.remove(dst / 'last_checkpoint')
    return dst


def test_two_nodes_with_a_shared_work_dir_resume_bit_exact(nodes_run):
    tmp, cfg, full = nodes_run
    part = _keep_up_to(full, tmp / 'part', 6)  # mid-epoch 1
    codes, outs = _two_nodes(cfg, [part, part], [tmp, tmp], tmp / 'count-part', '--resume')
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    want, got = _state(full / 'iter_16.pth'), _state(part / 'iter_16.pth')
    for k in want['state_dict']:
        assert torch.equal(want['state_dict'][k], got['state_dict'][k]), k
    assert got['meta']['world_size'] == 2 and got['meta']['iter'] == 16


@pytest.mark.skipif(
    not _private_mounts_work(),
    reason='simulating a second machine that '
    "does not see node 0's disk needs a private mount namespace (unshare -m, "
    'root); this machine refuses one',
)
def test_nodes_without_a_shared_work_dir_fail_on_both_and_write_nothing(nodes_run):
    tmp, cfg, full = nodes_run
    # each "machine" has its own disk: node 1 cannot see node 0's work dir, which alone holds
    # the checkpoints (stopped mid-run at iteration 6)
    node0, node1 = tmp / 'machine0', tmp / 'machine1'
    _keep_up_to(full, node0 / 'work', 6)
    (node1 / 'work').mkdir(parents=True)
    files0 = sorted(n for n in os.listdir(node0 / 'work') if (node0 / 'work' / n).is_file())
    codes, outs = _two_nodes(
        cfg,
        [node0 / 'work', node1 / 'work'],
        [node0, node1],
        tmp / 'count-sep',
        '--resume',
        hide_from_node1=node0 / 'work',
    )
    assert codes[0] != 0 and codes[1] != 0
    for out in outs:  # the same clear error on both nodes
        assert 'rank 1 (host ' in out and 'cannot use the checkpoint that rank 0' in out
        assert str(node0 / 'work' / 'iter_6.pth') in out and 'no such file' in out
        assert 'filesystem that all nodes share' in out
    for name in files0:  # node 0's checkpoints are untouched, and nothing new was saved
        assert filecmp.cmp(full / name, node0 / 'work' / name, shallow=False), name
    assert sorted(n for n in os.listdir(node0 / 'work') if (node0 / 'work' / n).is_file()) == files0
    assert not [n for n in os.listdir(node1 / 'work') if n.endswith('.pth')]
    assert not os.listdir(tmp / 'count-sep')  # no sample was read


def _index_counts(lists):
    return collections.Counter(i for lst in lists for i in lst)


def test_two_to_one_process_resume_reads_exactly_the_samples_left(nodes_run, single_run, caplog):
    from counting_dataset import read_counts

    tmp, cfg, full = nodes_run
    ck = full / 'iter_6.pth'  # 2 x 8 x 2 = 32 samples into epoch 1 (of 4 iterations)
    work, count = tmp / 'one', tmp / 'count-one'
    caplog.clear()
    _train(cfg, work, count, '--resume', str(ck))
    assert 'saved with world size 2; this run has 1' in caplog.text
    before = [lst[: 6 * BATCH] for lst in read_counts(tmp / 'count-full')]  # per process
    after = read_counts(count)
    # every sample read exactly once per epoch over the two runs together
    assert _index_counts(before + after) == {i: EPOCHS for i in range(N)}
    assert sum(map(len, after)) == EPOCHS * N - 6 * 2 * BATCH
    # 1 process: 8 iterations per epoch, iteration 6 of the 2-process run is 12 here
    last = _state(work / 'iter_32.pth')
    assert last['meta']['world_size'] == 1 and last['meta']['epoch'] == EPOCHS
    # the schedule, converted to 1-process iterations, ends where a 1-process run's ends
    # (not where the 2-process units would have left it: flat, or finished half-way)
    assert _final_lr(work / 'iter_32.pth') == pytest.approx(
        _final_lr(single_run[0] / 'iter_32.pth'), rel=1e-9
    )
    first = _state(work / 'iter_14.pth')  # the first save after resuming at 12
    assert first['meta']['iter'] == 14


def test_one_to_two_process_resume_reads_exactly_the_samples_left(nodes_run, single_run):
    from counting_dataset import read_counts

    tmp, cfg, full = nodes_run
    full1, count1 = single_run
    # iteration 12 is 32 samples into epoch 1: 2 iterations of 16 samples on 2 processes
    work, count = tmp / 'two', tmp / 'count-two'
    _train(cfg, work, count, '--resume', str(full1 / 'iter_12.pth'), *WARMUP_1, nproc=2)
    before = [read_counts(count1)[0][: 12 * BATCH]]
    after = read_counts(count)
    assert len(after) == 2
    assert _index_counts(before + after) == {i: EPOCHS for i in range(N)}
    last = _state(work / 'iter_16.pth')
    assert last['meta']['world_size'] == 2 and not (work / 'iter_32.pth').exists()
    assert _final_lr(work / 'iter_16.pth') == pytest.approx(
        _final_lr(full / 'iter_16.pth'), rel=1e-9
    )
