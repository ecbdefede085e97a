"""Fault-tolerant replica groups over torchft (``strategy.fault_tolerance``,
``strategies/replica_groups.py``, ``loop/replicas.py``, ``stratagem lighthouse``).

First tier: the config's checks, the sample stream's split, the messages of the named
failures that need no second process (torchft missing, an unreachable lighthouse, a replica
id the work_dir lock already holds). The second tier (slow): real processes, a real
lighthouse, real SIGKILLs on gloo, 2 groups x 1 or 2 processes.
"""

from __future__ import annotations

import csv
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from failure_helpers import Lighthouse, clean_env, kill_tree, start, workers
from stratagem.strategies.replica_groups import (
    LIGHTHOUSE_ENV,
    REPLICA_ID_ENV,
    FaultTolerance,
    ReplicaGroup,
    ReplicaGroupError,
    ReplicaStream,
    _signature_difference,
    require_torchft,
    state_digest,
)

pytest.importorskip('torchft')


# ------------------------------------------------------------------------ first tier
def test_config_is_checked_naming_the_key():
    assert FaultTolerance.parse(True) == FaultTolerance()
    spec = FaultTolerance.parse(dict(min_replicas=2, replica_id='3', timeout=5))
    assert (spec.min_replicas, spec.replica_id, spec.timeout) == (2, 3, 5.0)
    with pytest.raises(ValueError, match=r'unknown key\(s\) min_replica;'):
        FaultTolerance.parse(dict(min_replica=1))
    with pytest.raises(ValueError, match=r'min_replicas=0: give an integer >= 1'):
        FaultTolerance.parse(dict(min_replicas=0))
    with pytest.raises(ValueError, match=r"replica_id='a': a replica id is an integer >= 0"):
        FaultTolerance.parse(dict(replica_id='a'))
    with pytest.raises(ValueError, match=r'quorum_timeout=-1: give a number of seconds > 0'):
        FaultTolerance.parse(dict(quorum_timeout=-1))
    with pytest.raises(TypeError, match='should be a dict'):
        FaultTolerance.parse([1])


def test_id_and_lighthouse_come_from_the_environment_or_are_refused(monkeypatch):
    monkeypatch.delenv(REPLICA_ID_ENV, raising=False)
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(
        ValueError, match=r'has no id; start it with stratagem train CFG --replica-id I'
    ):
        FaultTolerance().resolved()
    monkeypatch.setenv(REPLICA_ID_ENV, '2')
    with pytest.raises(
        ValueError,
        match=r'replica group 2 has no lighthouse address; start one with `stratagem lighthouse`',
    ):
        FaultTolerance().resolved()
    monkeypatch.setenv(LIGHTHOUSE_ENV, 'host:29510')
    spec = FaultTolerance().resolved()
    assert (spec.replica_id, spec.lighthouse) == (2, 'http://host:29510')
    assert FaultTolerance(replica_id=0, lighthouse='http://a:1').resolved().replica_id == 0


def test_torchft_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, 'torchft', None)
    with pytest.raises(ImportError, match=r'pip install "stratagem\[torchft\]"'):
        require_torchft()


class _Group:
    """What ReplicaStream reads of a group: the quorum's answer and the cursor."""

    def __init__(self, participants: int, rank: int, committed: int) -> None:
        self.participants, self.participant_rank, self.batches_committed = (
            participants,
            rank,
            committed,
        )
        self.begun = 0

    def begin_step(self) -> None:
        self.begun += 1


class _Wrapper:
    def __init__(self, window: int) -> None:
        self.accumulative_counts, self.inner_count = window, 0


@pytest.mark.parametrize('window', [1, 2])
def test_stream_splits_each_step_over_the_participants_without_repeats(window):
    n, batch = 36, 3
    seen: list[int] = []
    committed = 0
    # 3 participants, then one lost (2), then back to 3: every committed step reads the
    # next participants x group-batch samples of one order, each exactly once
    for participants in (3, 3, 2, 2, 3):
        step: list[int] = []
        for rank in range(participants):
            group, wrapper = _Group(participants, rank, committed), _Wrapper(window)
            stream = ReplicaStream(group, n, batch, wrapper, shuffle=True, seed=5)
            for micro in range(window):
                wrapper.inner_count = micro
                step += stream.next_batch()
        assert len(step) == participants * batch * window
        if len(seen) // n == (len(seen) + len(step) - 1) // n:  # inside one epoch
            assert len(set(step)) == len(step)
        seen += step
        committed += participants
    order = [
        i
        for epoch in range(3)
        for i in torch.randperm(n, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
    ]
    # in order: the epoch's permutation, then the next epoch's (seed + epoch)
    assert seen == order[: len(seen)]
    assert sorted(seen[:n]) == list(range(n))  # an epoch: every sample once


def test_a_peer_with_another_model_is_named():
    mine = {'fc.weight': [[16, 8], 'torch.float32'], 'fc.bias': [[16], 'torch.float32']}
    theirs = {'fc.weight': [[32, 8], 'torch.float32'], 'head.bias': [[3], 'torch.float32']}
    text = _signature_difference(mine, theirs)
    assert 'only here: fc.bias' in text and 'only in the peer: head.bias' in text
    assert 'fc.weight: [16, 8] torch.float32 here, [32, 8] torch.float32 in the peer' in text
    assert _signature_difference(mine, dict(mine)) == ''


def test_state_digest_tells_states_apart():
    from stratagem.optim import build_optim_wrapper

    def trained(lr: float) -> str:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        wrapper = build_optim_wrapper(model, dict(optimizer=dict(type='AdamW', lr=lr)))
        wrapper.update_params(model(torch.ones(4, 3)).sum())  # AdamW's 0-d step tensor
        return state_digest(model, wrapper)

    assert trained(0.1) == trained(0.1) != trained(0.2)


def test_a_sharded_group_heals_shard_by_shard(tmp_path):
    # FSDP: a peer's state travels as plain shards and lands back on this rank's DTensors,
    # the optimizer's buffers included (one process, a 1-rank mesh)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, init_device_mesh

    from stratagem.optim import build_optim_wrapper

    dist.init_process_group(
        'gloo', store=dist.FileStore(str(tmp_path / 'store'), 1), rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh('cpu', (1,))

        def sharded(seed: int) -> ReplicaGroup:
            torch.manual_seed(seed)
            model = fully_shard(
                torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)), mesh=mesh
            )
            cfg = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
            g = ReplicaGroup(FaultTolerance(replica_id=seed, lighthouse='http://127.0.0.1:9'))
            g._module, g._wrapper = model, build_optim_wrapper(model, cfg)
            return g

        peer, healed = sharded(1), sharded(2)
        peer._wrapper.update_params(peer._module(torch.ones(2, 3)).sum())
        buffer = io.BytesIO()  # through bytes, as torchft's transport sends it
        torch.save(peer._state(), buffer)
        state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
        assert not any(isinstance(t, DTensor) for t in state['model'].values())
        healed._load_peer_state(state)
        assert healed.digest() == peer.digest() and healed.heals[-1].peer == 1
        momentum = healed._wrapper.optimizer.state_dict()['state'][0]['momentum_buffer']
        assert isinstance(momentum, DTensor)
        for g in (peer, healed):  # the next update alike
            g._wrapper.update_params(g._module(torch.ones(2, 3)).sum())
        assert healed.digest() == peer.digest()
    finally:
        dist.destroy_process_group()


class _PeerOfOnes:
    """A Manager whose all-reduce averages this group's gradients with a peer's of ones."""

    def allreduce(self, flat):
        flat.add_(1).div_(2)
        return SimpleNamespace(wait=lambda: None)

    def should_commit(self):
        return True


class _OneHeadUsed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize('sharded', [False, True], ids=['plain', 'fsdp'])
def test_allow_averages_every_gradient_with_the_peers_in_one_buffer(tmp_path, sharded):
    # a parameter the forward left without a gradient gets the peer's half, like the
    # parameter (a DTensor under FSDP); the buffer and its views serve every step
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, init_device_mesh

    from stratagem.optim import build_optim_wrapper

    dist.init_process_group(
        'gloo', store=dist.FileStore(str(tmp_path / 'store'), 1), rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        model = _OneHeadUsed()
        if sharded:
            model = fully_shard(model, mesh=init_device_mesh('cpu', (1,)))
        wrapper = build_optim_wrapper(model, dict(optimizer=dict(type='SGD', lr=0.1)))
        group = ReplicaGroup(FaultTolerance(replica_id=0, lighthouse='http://127.0.0.1:9'))
        group.manager = _PeerOfOnes()
        buffers = []
        for _ in range(2):
            wrapper.optimizer.zero_grad(set_to_none=True)
            model(torch.ones(2, 3)).sum().backward()
            mine = {n: (p.grad.full_tensor() if sharded else p.grad).clone()
                    for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip
            group._step.begun = True  # the quorum said so
            assert group.allow(wrapper)
            buffers.append(group._flat[0])
            buffers[-1].zero_()  # the group's buffer: no gradient is a view of it
            for name, p in model.named_parameters():
                assert isinstance(p.grad, DTensor) == sharded and p.grad.dtype == p.dtype
                got = p.grad.full_tensor() if sharded else p.grad
                expected = (mine[name] + 1) / 2 if name in mine else torch.full_like(got, 0.5)
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert buffers[0] is buffers[1] and buffers[0].numel() == 3 * 4 + 4 + 4 * 2 + 2
    finally:
        dist.destroy_process_group()


def test_an_unreachable_lighthouse_is_named():
    group = ReplicaGroup(
        FaultTolerance(replica_id=4, lighthouse='http://127.0.0.1:9', connect_timeout=0.5)
    )
    model = torch.nn.Linear(2, 1)
    from stratagem.optim import build_optim_wrapper

    wrapper = build_optim_wrapper(model, dict(optimizer=dict(type='SGD', lr=0.1)))
    with pytest.raises(ValueError, match=r'replica group 4 commits .* needs optim_wrapper='):
        group.start(model, model, None)  # prepare(model) without one
    with pytest.raises(ReplicaGroupError) as err:
        group.start(model, model, wrapper)
    text = str(err.value)
    assert (
        'replica group 4: the lighthouse at http://127.0.0.1:9 did not answer within 0.5 s' in text
    )
    assert 'stratagem lighthouse' in text


def test_replica_flags_need_a_ddp_strategy(tmp_path, capsys):
    from stratagem.cli import main

    cfg = tmp_path / 'cfg.py'
    cfg.write_text("strategy = dict(type='FSDPStrategy')\nmodel = dict(type='MLPClassifier')\n")
    assert main(['train', str(cfg), '--replica-id', '0', '--lighthouse', 'http://x:1']) == 1
    err = capsys.readouterr().err
    assert "--replica-id: strategy.type='FSDPStrategy' has no fault_tolerance" in err


def test_lighthouse_options_are_checked(capsys):
    from stratagem.cli import main

    assert main(['lighthouse', '--min-replicas', '0']) == 1
    assert '--min-replicas 0: give an integer >= 1' in capsys.readouterr().err


# ------------------------------------------------------------------------ processes
# Each test starts its lighthouses and groups together where they do not depend on one
# another: most of a run here is process start-up and waiting, not training.
N, BATCH = 64, 4
CONFIG = """
model = dict(type='MLPClassifier', in_features=8, num_classes=3, hidden={hidden})
train_dataloader = dict(dataset=__import__('failure_data').FailureDataset({n}),
                        batch_size={batch}, shuffle=True, num_workers=0)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.05, momentum=0.9),
                     accumulative_counts={acc})
param_scheduler = [dict(type='LinearLR', start_factor=0.2, by_epoch=False, end=6)]
train_cfg = dict(max_iters={iters}, checkpoint_interval={every}, log_interval=5)
randomness = dict(seed=7)
strategy = dict({strategy}, checkpoint_timeout=30,
                env_kwargs=dict(dist_cfg=dict(backend='gloo', timeout=60)),
                {ft})
"""


def write_cfg(
    path: Path,
    *,
    iters: int,
    ft: bool = True,
    hidden: int = 16,
    acc: int = 1,
    every: int = 0,
    min_replicas: int = 1,
    quorum_timeout: float = 60,
    strategy: str = "type='DDPStrategy'",
) -> Path:
    fault = (
        f'fault_tolerance=dict(min_replicas={min_replicas}, timeout=10, '
        f'quorum_timeout={quorum_timeout}, connect_timeout=5)'
        if ft
        else ''
    )
    path.write_text(
        CONFIG.format(
            hidden=hidden,
            n=N,
            batch=BATCH,
            acc=acc,
            iters=iters,
            every=every or iters,
            ft=fault,
            strategy=strategy,
        )
    )
    return path


@pytest.fixture()
def lighthouse():
    made: list[Lighthouse] = []

    def make(min_replicas: int = 1) -> Lighthouse:
        made.append(Lighthouse(min_replicas))
        return made[-1]

    yield make
    for lh in made:
        lh.close()


class Group:
    """One replica group's ``stratagem train`` in a session of its own (``replica`` None: a
    plain run), its output in a file (a pipe nobody reads would fill and stall it, while its
    heartbeats go on)."""

    count = 0

    def __init__(
        self,
        cfg: Path,
        work_dir: Path,
        replica: int | None,
        address: str = '',
        *args: str,
        **env: str,
    ) -> None:
        Group.count += 1
        self.out = Path(work_dir).parent / f'group{replica}_{Group.count}.out'
        ft = () if replica is None else ('--replica-id', str(replica), '--lighthouse', address)
        self.proc = start(
            cfg, work_dir, *ft, *args, env=clean_env(**env), out=self.out, start_new_session=True
        )
        self.pid = self.proc.pid

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
            raise AssertionError('group did not end in time:\n' + self.text()[-4000:]) from None
        return self.proc.returncode, self.text()

    def text(self) -> str:
        return self.out.read_text(errors='replace')


group = Group


def succeed(*procs: Group) -> list[str]:
    """The outputs of groups that all ended with 0."""
    outs = [p.finish() for p in procs]
    for code, out in outs:
        assert code == 0, out[-3000:]
    return [out for _, out in outs]


def digest(out: str) -> tuple[int, str]:
    match = re.search(
        r'replica group \d+: finished at iteration (\d+), step \d+; state digest (\w+)', out
    )
    assert match, out[-3000:]
    return int(match.group(1)), match.group(2)


def rows(out: str) -> list[int]:
    return [int(m) for m in re.findall(r'Iter\(train\) \[(\d+)/\d+\]', out)]


def assert_weights_close(work_dir: Path, reference: Path, iters: int, atol: float) -> dict:
    """The two runs' final checkpoints hold the same weights; the first one's ``meta``."""
    mine = torch.load(work_dir / f'iter_{iters}.pth', weights_only=True)
    theirs = torch.load(reference / f'iter_{iters}.pth', weights_only=True)
    assert mine['state_dict'].keys() == theirs['state_dict'].keys()
    for name, tensor in theirs['state_dict'].items():
        torch.testing.assert_close(mine['state_dict'][name], tensor, rtol=0, atol=atol)
    return mine['meta']


@pytest.mark.slow
def test_2x2_with_no_failure_equals_plain_ddp_of_the_same_global_batch(tmp_path, lighthouse):
    # 2 groups x 2 processes: DDP inside a group, torchft across the groups, against one
    # 4-process DDP run (the 2x1 case: the next test)
    lh = lighthouse(min_replicas=2)
    iters = 24
    cfg = write_cfg(tmp_path / 'ft.py', iters=iters, acc=2, min_replicas=2)
    plain = write_cfg(tmp_path / 'ddp.py', iters=iters, acc=2, ft=False)
    ddp = group(plain, tmp_path / 'ddp', None, '', '--nproc', '4')
    outs = succeed(*(group(cfg, tmp_path / 'ft', i, lh.address, '--nproc', '2') for i in (0, 1)))
    succeed(ddp)
    assert digest(outs[0]) == digest(outs[1])
    meta = assert_weights_close(tmp_path / 'ft', tmp_path / 'ddp', iters, atol=1e-6)
    assert meta['replica_group'] == {'step': iters // 2, 'batches_committed': iters}


@pytest.mark.slow
def test_fsdp_2x2_equals_plain_fsdp_and_a_resume_of_the_whole_job_is_exact(tmp_path, lighthouse):
    # each group shards the model over its 2 processes; torchft averages the shards'
    # gradients across the groups (the mesh's replicate dimension). As the 2x1 DDP test
    # below: a, the whole job; b, its first 20 iterations then --resume; the plain FSDP
    # run of 4 processes. One consolidated checkpoint file, to compare the weights.
    iters = 30
    kind = dict(strategy="type='FSDPStrategy', state_dict_type='full'", acc=2, every=10)
    whole = write_cfg(tmp_path / 'whole.py', iters=iters, min_replicas=2, **kind)
    first = write_cfg(tmp_path / 'first.py', iters=20, min_replicas=2, **kind)
    plain = write_cfg(tmp_path / 'fsdp.py', iters=iters, ft=False, **kind)
    lh_a, lh_b = lighthouse(min_replicas=2), lighthouse(min_replicas=2)
    n = ('--nproc', '2')
    fsdp = group(plain, tmp_path / 'fsdp', None, '', '--nproc', '4')
    a = [group(whole, tmp_path / 'a', i, lh_a.address, *n) for i in (0, 1)]
    b = [group(first, tmp_path / 'b', i, lh_b.address, *n) for i in (0, 1)]
    uninterrupted = succeed(*a)
    succeed(*b)
    resumed = succeed(
        *(group(whole, tmp_path / 'b', i, lh_b.address, '--resume', *n) for i in (0, 1))
    )
    succeed(fsdp)
    assert digest(uninterrupted[0]) == digest(uninterrupted[1])
    position = {'step': iters // 2, 'batches_committed': iters}
    meta = assert_weights_close(tmp_path / 'a', tmp_path / 'fsdp', iters, atol=1e-6)
    assert meta['replica_group'] == position
    assert all('resumed after 20' in out for out in resumed)
    assert digest(resumed[0]) == digest(resumed[1]) == digest(uninterrupted[0])
    meta = assert_weights_close(tmp_path / 'b', tmp_path / 'a', iters, atol=0)
    assert meta['replica_group'] == position


@pytest.mark.slow
def test_2x1_equals_plain_ddp_and_a_resume_of_the_whole_job_is_exact(tmp_path, lighthouse):
    # a: the whole job; b: its first 20 iterations, then --resume to the end; d: plain DDP
    # of the same global batch. a, b's first part and d at once, each job its lighthouse.
    iters = 30
    whole = write_cfg(tmp_path / 'whole.py', iters=iters, acc=2, every=10, min_replicas=2)
    first = write_cfg(tmp_path / 'first.py', iters=20, acc=2, every=10, min_replicas=2)
    plain = write_cfg(tmp_path / 'ddp.py', iters=iters, acc=2, ft=False)
    lh_a, lh_b = lighthouse(min_replicas=2), lighthouse(min_replicas=2)
    ddp = group(plain, tmp_path / 'd', None, '', '--nproc', '2')
    a = [group(whole, tmp_path / 'a', i, lh_a.address) for i in (0, 1)]
    b = [group(first, tmp_path / 'b', i, lh_b.address) for i in (0, 1)]
    uninterrupted = succeed(*a)
    succeed(*b)
    resumed = succeed(*(group(whole, tmp_path / 'b', i, lh_b.address, '--resume') for i in (0, 1)))
    succeed(ddp)
    # no failure: the plain DDP run's weights
    assert digest(uninterrupted[0]) == digest(uninterrupted[1])
    position = {'step': iters // 2, 'batches_committed': iters}
    assert (
        assert_weights_close(tmp_path / 'a', tmp_path / 'd', iters, atol=1e-6)['replica_group']
        == position
    )
    # the resume: every group from the checkpoint, then exactly the uninterrupted job
    assert all('replica group' in out and 'resumed after 20' in out for out in resumed)
    assert digest(resumed[0]) == digest(resumed[1]) == digest(uninterrupted[0])
    assert (
        assert_weights_close(tmp_path / 'b', tmp_path / 'a', iters, atol=0)['replica_group']
        == position
    )


def _count(pattern: str, root: Path, logs: str) -> int:
    return sum(len(re.findall(pattern, p.read_text(errors='replace'))) for p in root.glob(logs))


def _wait_for(pattern: str, root: Path, logs: str, count: int = 1, timeout: float = 120) -> None:
    """Until the files ``root/logs`` (a glob) hold ``pattern`` ``count`` times."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _count(pattern, root, logs) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f'{pattern!r} not logged {count} time(s) in {root}/{logs}')


@pytest.mark.slow
@pytest.mark.parametrize(
    'strategy, kills',
    [("type='DDPStrategy'", 3), ("type='FSDPStrategy', state_dict_type='full'", 1)],
    ids=['ddp', 'fsdp'],
)
def test_a_group_killed_every_few_steps_heals_from_its_peer_the_survivor_never_stops(
    tmp_path, lighthouse, strategy, kills
):
    # 2 groups x 2 processes; group 1 loses one process, alternately rank 1 and rank 0
    # (the one holding its torchft Manager and store), a second after it healed, 3 times
    # (FSDP: the heal copies each rank's shards from the peer's same rank; once)
    nproc, iters = 2, 600
    lh = lighthouse()
    cfg = write_cfg(tmp_path / 'cfg.py', iters=iters, every=iters, strategy=strategy)
    wd, fast = tmp_path / 'wd', tmp_path / 'fast'
    # paced until the last heal (enough steps for the kills on a loaded machine), then the
    # rest at full speed
    pace = dict(SLOW='0.05', FAST_FILE=str(fast))
    reads = tmp_path / 'reads0'  # every process of group 0 that reads a sample leaves a file
    reads.mkdir()
    n = ('--nproc', str(nproc))
    g0 = group(cfg, wd, 0, lh.address, *n, '--max-restarts', '1', COUNT_DIR=str(reads), **pace)
    g1 = group(cfg, wd, 1, lh.address, *n, '--max-restarts', str(kills), **pace)
    try:
        survivors = sorted(workers(g0.pid, nproc).values())
        logs, healed = '*_replica1/*.log', r'healed from replica group 0'
        _wait_for(r'Iter\(train\) \[\d+/', wd, logs)  # the victim trains with the survivor
        for kill in range(kills):
            heals = _count(healed, wd, logs)
            rank = nproc - 1 - kill % nproc
            victim = workers(g1.pid, nproc)[rank]
            time.sleep(1.0)
            os.kill(victim, signal.SIGKILL)
            # a new attempt of the group, healed once more
            deadline = time.monotonic() + 120
            while workers(g1.pid, nproc)[rank] == victim and time.monotonic() < deadline:
                time.sleep(0.1)
            _wait_for(healed, wd, logs, count=heals + 1)
        fast.touch()
        outs = [p.finish(timeout=600) for p in (g0, g1)]
    finally:
        for p in (g0, g1):
            if p.proc.poll() is None:
                kill_tree(p.pid)
                p.proc.wait()
    for code, out in outs:
        assert code == 0, out[-4000:]
    (_, out0), (_, out1) = outs
    # the survivor: its processes the whole run, its rows continuous (from its first one:
    # on a loaded machine group 1 can start first, and group 0 then takes its state)
    assert sorted(int(p.stem) for p in reads.glob('*.txt')) == survivors
    logged = rows(out0)
    assert logged and logged == list(range(logged[0], iters + 1, 5)), out0[-3000:]
    # each relaunch healed from group 0: a log line each, a metrics row (the last one for
    # sure); the first attempt may have healed too: it started behind group 0
    heals = re.findall(
        r'replica group 1 healed from replica group 0 at step (\d+) in ([\d.]+) s', out1
    )
    assert len(heals) >= kills and all(int(step) > 0 for step, _ in heals[-kills:]), out1[-4000:]
    print('heals after the kills (step, s):', heals[-kills:])
    metrics = [
        row
        for path in sorted(wd.glob('*_replica1/metrics.csv'))
        for row in csv.DictReader(path.open())
        if row.get('replica/healed_from')
    ]
    # (an attempt killed a second after its heal may go before its row is written)
    assert metrics and {float(r['replica/healed_from']) for r in metrics} == {0.0}
    assert float(metrics[-1]['replica/heal_step']) == int(heals[-1][0])
    # every group ends with the same weights and optimizer state
    assert digest(out0) == digest(out1) and digest(out0)[0] == iters


@pytest.mark.slow
def test_named_failures_of_the_machinery(tmp_path, lighthouse):
    # a quorum that cannot form (min_replicas 2, one group), at its own lighthouse; the
    # others beside a running group 0
    lonely, lh = lighthouse(min_replicas=2), lighthouse()
    cfg = write_cfg(tmp_path / 'alone.py', iters=10, min_replicas=2, quorum_timeout=3)
    alone = group(cfg, tmp_path / 'alone', 0, lonely.address)
    long_run = write_cfg(tmp_path / 'a.py', iters=4000)
    g0 = group(long_run, tmp_path / 'wd', 0, lh.address, SLOW='0.01')
    try:
        _wait_for(r'Iter\(train\) \[\d+/', tmp_path / 'wd', '*_replica0/*.log')
        # a peer with another model, and the same id in the same work_dir (the group's lock)
        other = write_cfg(tmp_path / 'b.py', iters=4000, hidden=32)
        other_model = group(other, tmp_path / 'wd', 1, lh.address)
        locked = group(long_run, tmp_path / 'wd', 0, lh.address)
        code, out = other_model.finish()
        assert code == 1, out[-3000:]
        assert 'replica group 1 cannot heal from replica group 0: its model differs' in out, out[
            -3000:
        ]
        assert 'fc' in out or 'weight' in out
        code, out = locked.finish()
        assert code == 1
        assert 'replica group 0 is already running in' in out, out[-3000:]
        # the same id elsewhere: the quorum holds it twice
        code, out = group(long_run, tmp_path / 'elsewhere', 0, lh.address).finish()
        assert code == 1
        assert 'replica id 0 is used by two live replica groups' in out, out[-3000:]
    finally:
        kill_tree(g0.pid)
        g0.proc.wait()
    code, out = alone.finish()
    assert code == 1
    assert 'replica group 0: no quorum within 3 s (fault_tolerance.quorum_timeout)' in out, out[
        -3000:
    ]
