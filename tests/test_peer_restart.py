"""Peer checkpoints through real failures (slow tier): a 2-process ``stratagem train`` run with
``default_hooks.checkpoint.peer_interval``, a worker SIGKILLed mid-run, compared bit for bit
(weights, optimizer state, schedulers) with the same run uninterrupted (no peer copies: they
change nothing in the training):

- under ``--max-restarts 1`` torchrun restarts both workers, which resume from the peer
  copies (newer than the newest checkpoint), as rank 0's log line says;
- a run killed without restarts, rank 0's own copy removed: ``--resume`` takes the peer tier,
  rank 0 getting its copy back from its holder; killed again, every copy removed from
  ``/dev/shm``'s stand-in: ``--resume`` falls back to storage;
- the first case under FSDPStrategy, whose copies hold each rank's shards.
"""

import os
import shutil
import signal

import pytest

from failure_helpers import (
    CONFIG,
    clean_env,
    equal,
    final_state,
    finish,
    start,
    wait_reads,
    workers,
    write_config,
)
from stratagem.checkpoint.peer import peer_root

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='needs Linux /proc'),
]

# copies every 3 iterations (some mid accumulation window: ACC=2), checkpoints every 5
PEER_CONFIG = CONFIG + 'default_hooks = dict(checkpoint=dict(peer_interval=3))\n'


def _tier_lines(out: str) -> list[str]:
    return [line.split('INFO: ', 1)[-1] for line in out.splitlines() if 'resume tier:' in line]


def _killed(cfg, work, env, at_read, *args):
    """Start the run, SIGKILL rank 1 at its ``at_read``-th read (4 per iteration); returns
    the launch (not yet finished)."""
    proc = start(cfg, work, '--nproc', '2', *args, env=env)
    pids = workers(proc.pid)
    wait_reads(env['COUNT_DIR'], pids[1], at_read)
    os.kill(pids[1], signal.SIGKILL)
    return proc


def test_a_killed_worker_restarts_from_the_peer_copies_bit_exact(uninterrupted_run, tmp_path):
    _, want = uninterrupted_run
    cfg = write_config(tmp_path, PEER_CONFIG)
    work, count = tmp_path / 'work', tmp_path / 'count'
    count.mkdir()
    env = clean_env(COUNT_DIR=str(count), SLOW='0.01', STRATAGEM_PEER_DIR=str(tmp_path / 'shm'))
    # killed in iteration 23: the newest checkpoint iter_20, the newest copies iteration 21
    # (mid accumulation window)
    proc = _killed(cfg, work, env, 4 * 22 + 2, '--max-restarts', '1')
    code, out = finish(proc)
    assert code == 0, out[-4000:]
    (tier,) = _tier_lines(out)
    assert tier.startswith(
        'resume tier: peer (peer copies of iteration 21: at least as new as the newest '
        'storage checkpoint iter_20.pth (iteration 20))'
    ), out[-4000:]
    assert 'training: iterations 22-32 (resumed after 21)' in out
    assert equal(final_state(work), want)


def test_resume_takes_a_copy_from_its_holder_then_falls_back_to_storage(
    uninterrupted_run, tmp_path, monkeypatch
):
    _, want = uninterrupted_run
    cfg = write_config(tmp_path, PEER_CONFIG)
    work, count = tmp_path / 'work', tmp_path / 'count'
    count.mkdir()
    env = clean_env(COUNT_DIR=str(count), SLOW='0.01', STRATAGEM_PEER_DIR=str(tmp_path / 'shm'))
    monkeypatch.setenv('STRATAGEM_PEER_DIR', env['STRATAGEM_PEER_DIR'])
    root = peer_root(work)
    # killed in iteration 14: checkpoint iter_10, copies of iteration 12
    code, out = finish(_killed(cfg, work, env, 4 * 13 + 2))
    assert code != 0
    shutil.rmtree(root / 'own' / 'rank0')  # rank 0's own copy lost; rank 1 holds one
    # resumed at 12; killed again in iteration 17 (its 5th iteration): checkpoint iter_15,
    # copies of iteration 15
    code, out = finish(_killed(cfg, work, env, 4 * 4 + 2, '--resume'))
    assert code != 0
    (tier,) = _tier_lines(out)
    assert tier.startswith(
        'resume tier: peer (peer copies of iteration 12: at least as new as the newest '
        'storage checkpoint iter_10.pth (iteration 10); rank(s) [0] from their holder)'
    ), out[-4000:]
    shutil.rmtree(root)  # every copy gone (a lost node, in one machine's terms)
    code, out = finish(start(cfg, work, '--nproc', '2', '--resume', env=env))
    assert code == 0, out[-4000:]
    assert _tier_lines(out) == ['resume tier: storage (no peer copies)'], out[-4000:]
    assert 'training: iterations 16-32 (resumed after 15)' in out
    assert equal(final_state(work), want)


def test_a_killed_fsdp_worker_restarts_from_its_shards_peer_copies_bit_exact(tmp_path):
    # FSDP's copies hold each rank's own shards (saved in full: state_dict_type='full', so
    # the final checkpoint is one file to compare); the reference is the same run uninterrupted
    fsdp = "strategy = dict(type='FSDPStrategy', state_dict_type='full',"
    text = CONFIG.replace("strategy = dict(type='auto',", fsdp)
    assert text != CONFIG
    ref = tmp_path / 'ref'
    ref.mkdir()
    cfg = write_config(ref, text + 'default_hooks = dict(checkpoint=dict(peer_interval=3))\n')
    env = clean_env(STRATAGEM_PEER_DIR=str(tmp_path / 'shm_ref'))
    code, out = finish(start(cfg, ref / 'work', '--nproc', '2', env=env))
    assert code == 0, out[-4000:]
    want = final_state(ref / 'work')
    work, count = tmp_path / 'work', tmp_path / 'count'
    count.mkdir()
    env = clean_env(COUNT_DIR=str(count), SLOW='0.01', STRATAGEM_PEER_DIR=str(tmp_path / 'shm'))
    # killed in iteration 23: the newest checkpoint iter_20, the newest copies iteration 21
    code, out = finish(_killed(cfg, work, env, 4 * 22 + 2, '--max-restarts', '1'))
    assert code == 0, out[-4000:]
    (tier,) = _tier_lines(out)
    assert tier.startswith('resume tier: peer (peer copies of iteration 21'), out[-4000:]
    assert 'training: iterations 22-32 (resumed after 21)' in out
    assert equal(final_state(work), want)
