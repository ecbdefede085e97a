"""Elastic membership: two ``stratagem train --nnodes 1:2 --rdzv-endpoint`` agents on this
machine as two nodes (one process each, c10d rendezvous). One agent is SIGKILLed with its
worker mid-run: the survivor re-forms alone and continues at world size 1 from the last
checkpoint; the agent comes back: the survivor's agent restarts its worker (its SIGTERM, a
preemption signal: the worker commits a checkpoint first) and the two go on at world size 2
from it to the end, exit status 0 on both. Every sample is read exactly once per epoch over
the whole run (reads after an attempt's last committed checkpoint excepted: they are read
again)."""

import os
import time
from pathlib import Path

import pytest
import torch

from dist_harness import free_port
from failure_helpers import CONFIG, clean_env, finish, kill_tree, start, workers, write_config
from stratagem import checkpoint as ckpt
from stratagem.cli import main

pytestmark = pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='needs Linux /proc')

N, BATCH, EPOCHS = 64, 4, 2
# no accumulation window and an even checkpoint interval: every checkpoint converts between
# world sizes 1 and 2 (a window or a position must start on the same sample at both sizes);
# the default preemption signals: the SIGTERM an agent sends the workers it restarts for a
# scale-up makes them commit a checkpoint first
ELASTIC = (
    CONFIG.replace('accumulative_counts=2', 'accumulative_counts=1')
    .replace('checkpoint_interval=5', 'checkpoint_interval=2')
    .replace('max_epochs=4', f'max_epochs={EPOCHS}')
)


def _agent(cfg: Path, work: Path, port: int, count: Path, host: bool):
    args = ('--nproc', '1', '--nnodes', '1:2', '--max-restarts', '3')
    rdzv = ('--rdzv-endpoint', f'127.0.0.1:{port}', '--rdzv-id', 'elastic-test')
    # a dead node's agent stops its keep-alive: it counts as gone after 3 s (torch: 15 s)
    conf = (
        '--rdzv-conf',
        f'is_host={int(host)},last_call_timeout=1,join_timeout=120,'
        'keep_alive_interval=1,keep_alive_max_attempt=3',
    )
    # the survivor alone (resumed at iteration 8) stops at its 21st read, in iteration 14,
    # until its agent's SIGTERM (the returning agent joined): the run cannot end before, and
    # the survivor then commits iteration 14 (56 samples: 7 iterations at world size 2)
    env = clean_env(COUNT_DIR=str(count), SLOW='0.01', HOLD_AT='21', HOLD_WORLD='1')
    return start(cfg, work, *args, *rdzv, *conf, env=env)


def _new_workers(proc, known: set, count: int, timeout: float = 120) -> dict:
    """``{pid: (rank, world size)}`` of ``count`` workers below ``proc`` not in ``known``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {p for p in workers(proc.pid, 1, timeout).values() if p not in known}
        if len(found) >= count:
            return {p: None for p in found}
        time.sleep(0.05)
    raise AssertionError('no new worker')


def _position(work: Path) -> int:
    """Samples read before the latest committed checkpoint (0 if none)."""
    latest = ckpt.find_latest_checkpoint(work)
    if latest is None:
        return 0
    meta = torch.load(latest, weights_only=True)['meta']
    return int(meta['iter']) * int(meta['world_size']) * BATCH


def _reads(count: Path, pid: int) -> list[int]:
    path = count / f'{pid}.txt'
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _wait_reads(count: Path, pid: int, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(_reads(count, pid)) < n:
        assert time.monotonic() < deadline, f'worker {pid} did not read {n} samples'
        time.sleep(0.02)


def test_a_lost_node_re_forms_at_world_size_1_and_a_returning_one_scales_up(tmp_path):
    cfg = write_config(tmp_path, ELASTIC)
    work, count = tmp_path / 'work', tmp_path / 'count'
    count.mkdir()
    port = free_port()
    a = _agent(cfg, work, port, count, host=True)
    b = _agent(cfg, work, port, count, host=False)
    b2 = None
    attempts = []  # (start position in samples, {pid}) per attempt, in order
    try:
        first = set(workers(a.pid, 1).values()) | set(workers(b.pid, 1).values())
        attempts.append((0, first))
        b_worker = next(iter(workers(b.pid, 1).values()))
        _wait_reads(count, b_worker, 4 * 5)  # in iteration 6 at world size 2 (checkpoint: 4)
        kill_tree(b.pid)  # the node is gone: its agent and its worker
        b.communicate()
        survivor = set(_new_workers(a, first, 1))
        attempts.append((_position(work), survivor))
        (w1,) = survivor
        _wait_reads(count, w1, 21)
        b2 = _agent(cfg, work, port, count, host=False)
        known = first | survivor
        both = set(_new_workers(a, known, 1)) | set(_new_workers(b2, known, 1))
        attempts.append((_position(work), both))
        code_a, out_a = finish(a, 300)
        code_b, out_b = finish(b2, 300)
    except AssertionError as err:  # what the agents said, to tell why
        said = []
        for name, p in (('a', a), ('b', b), ('b2', b2)):
            if p is not None and p.stdout is not None and not p.stdout.closed:
                kill_tree(p.pid)
                said.append(f'--- agent {name}:\n{p.communicate()[0][-3000:]}')
        raise AssertionError('\n'.join([str(err), *said])) from None
    finally:
        for p in (a, b, b2):
            if p is not None and p.poll() is None:
                kill_tree(p.pid)
    assert code_a == 0, out_a[-4000:]
    assert code_b == 0, out_b[-4000:]
    worlds = {
        pid: tuple(map(int, (count / f'{pid}.world').read_text().split()))
        for _, pids in attempts
        for pid in pids
    }
    assert [sorted(worlds[p][1] for p in pids) for _, pids in attempts] == [[2, 2], [1], [2, 2]]
    # the samples each attempt committed: from its start to the next attempt's start
    total = EPOCHS * N
    ends = [s for s, _ in attempts[1:]] + [total]
    assert attempts[1][0] > 0 and attempts[2][0] > attempts[1][0], attempts
    per_epoch: dict[int, list[int]] = {e: [] for e in range(EPOCHS)}
    for (begin, pids), end in zip(attempts, ends):
        for pid in pids:
            world = worlds[pid][1]
            done = _reads(count, pid)[: (end - begin) // world]
            assert len(done) == (end - begin) // world, (pid, begin, end)
            for j, index in enumerate(done):
                per_epoch[(begin + j * world) // N].append(index)
    for epoch, indices in per_epoch.items():
        assert sorted(indices) == list(range(N)), epoch
    assert attempts[2][0] == 14 * BATCH, attempts  # the scale-up's preemption checkpoint
    assert 'preempted by SIGTERM: checkpoint iter_14.pth committed' in out_a, out_a[-4000:]
    assert 'stratagem train: preempted' not in out_a + out_b  # the run went on past it
    final = ckpt.find_latest_checkpoint(work)
    assert final.name == f'iter_{total // (2 * BATCH)}.pth'


def test_the_elastic_command_gives_every_rendezvous_round_a_store_of_its_own(tmp_path, monkeypatch):
    """torch shares one agent's store across rounds, keys of earlier rounds included, and the
    restart count each agent gives its workers is its own (an agent that joins later starts
    at 0): workers of a re-formed round cannot agree on a fresh prefix in it."""
    from stratagem.cli import launch

    seen = []
    key = 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE'
    monkeypatch.setattr(launch, 'run_torchrun', lambda cmd, *_: seen.append(
        (cmd, os.environ.get(key))) or 0)  # fmt: skip
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    monkeypatch.delenv(key, raising=False)
    cfg = str(write_config(tmp_path))
    elastic = ['--nnodes', '1:2', '--rdzv-endpoint', '127.0.0.1:29400', '--max-restarts', '1']
    assert main(['train', cfg, '--work-dir', str(tmp_path / 'w'), *elastic]) == 0
    assert main(['train', cfg, '--work-dir', str(tmp_path / 'w'), '--nproc', '2']) == 0
    (elastic_cmd, shared), (standalone_cmd, standalone) = seen
    assert elastic_cmd[3:8] == [
        '--nnodes=1:2',
        '--rdzv-backend=c10d',
        '--rdzv-endpoint=127.0.0.1:29400',
        '--rdzv-id=stratagem',
        '--max-restarts=1',
    ]
    assert shared == '1' and key not in os.environ  # for the agents only, then restored
    assert '--standalone' in standalone_cmd and standalone is None  # one agent: its store
