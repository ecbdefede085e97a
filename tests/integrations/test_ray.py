"""Ray Train (``stratagem.integrations.ray``, ``stratagem train --ray N``).

First tier (no Ray cluster): the refusals, ``--ray N`` / ``--ray MIN:MAX`` read and passed
to ``fit``, the drain notice as the preemption path, the checkpoint Ray hands back restored
into work_dir only when it is the newer one.

Slow tier: one local Ray cluster (2 CPUs) started by this module serves every run. A Ray run
of 2 workers equals ``stratagem train --nproc 2`` (conftest's ``uninterrupted_run``) bit for
bit; so does one of FSDPStrategy (flat, and on a (shard 1, tensor 2) mesh) the same config
under ``--nproc 2``, Ray keeping the sharded directory with its manifest; a worker SIGKILLed
mid-run (its pid from the file its dataset writes) is survived: Ray restarts the group, the
run resumes and ends on the same bits; under ``num_workers=(1, 2)`` on a cluster with room
for one worker, a run that lost a worker starts again at 1 worker and continues exactly as
``stratagem train --resume`` in one process does from the same checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip('ray.train', reason='needs Ray Train: pip install "stratagem[ray]"')

from failure_helpers import (
    CONFIG,
    clean_env,
    equal,
    final_state,
    finish,
    start,
    wait_reads,
    write_config,
)
from stratagem import checkpoint as ckpt
from stratagem.checkpoint.manifest import manifest_path
from stratagem.checkpoint.sharded import is_sharded_checkpoint
from stratagem.cli import main

pytestmark = pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='needs Linux /proc')


# ------------------------------------------------------------------------- first tier
def test_ray_flag_refuses_torchrun_flags_before_starting_ray(tmp_path, capsys):
    cfg = write_config(tmp_path)
    code = main(['train', str(cfg), '--ray', '2', '--nproc', '2', '--work-dir', str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1
    assert '--ray starts the workers itself' in err and 'drop --nproc' in err
    assert main(['train', str(cfg), '--ray', '0']) == 1
    assert '--ray 0: the number of Ray workers should be >= 1' in capsys.readouterr().err


def test_ray_flag_takes_a_count_or_an_elastic_range(tmp_path, capsys, monkeypatch):
    from stratagem.cli.train import ray_workers

    assert ray_workers('2') == 2 and ray_workers('1:4') == (1, 4) and ray_workers('3:3') == 3
    refusals = {
        '4:2': '--ray 4:2: an elastic range MIN:MAX needs 1 <= MIN <= MAX',
        '0:2': '--ray 0:2: an elastic range MIN:MAX needs 1 <= MIN <= MAX',
        '-1': '--ray -1: the number of Ray workers should be >= 1',
        'two': '--ray two: expected a number of Ray workers N',
        '1:': '--ray 1:: expected a number of Ray workers N',
        '1:2:3': '--ray 1:2:3: expected a number of Ray workers N',
    }
    for value, message in refusals.items():
        with pytest.raises(ValueError, match='^' + re.escape(message)):
            ray_workers(value)
    # the suggestion is the range the user meant
    with pytest.raises(ValueError, match=r'e\.g\. --ray 2:4'):
        ray_workers('4:2')

    cfg = write_config(tmp_path)
    assert main(['train', str(cfg), '--ray', '4:2', '--work-dir', str(tmp_path / 'w')]) == 1
    assert '--ray 4:2: an elastic range MIN:MAX' in capsys.readouterr().err
    # the range reaches fit as Ray's num_workers=(min, max); no Ray started here
    import stratagem.integrations.ray as integration

    given = []
    monkeypatch.setattr(integration, 'fit', lambda cfg, workers, **kw: given.append(workers))
    for value, workers in (('1:2', (1, 2)), ('2', 2)):
        assert main(['train', str(cfg), '--ray', value, '--work-dir', str(tmp_path / 'w')]) == 0
        assert given.pop() == workers
    with pytest.raises(SystemExit):
        main(['train', '--help'])
    assert '--ray N|MIN:MAX' in capsys.readouterr().out


def test_train_loop_config_keys_are_checked():
    from stratagem.integrations.ray import train_loop_per_worker

    with pytest.raises(ValueError, match=r"unknown key\(s\) \['work_dri'\].*valid keys"):
        train_loop_per_worker(dict(config='cfg.py', work_dri='/x'))
    with pytest.raises(ValueError, match='should be a dict with a "config" key'):
        train_loop_per_worker(dict(work_dir='/x'))


def test_the_drain_notice_stops_the_loop_as_a_preemption_signal(monkeypatch):
    import ray.train

    from stratagem.env.preemption import PreemptionConfig
    from stratagem.integrations.ray import RayPreemption

    asked = []
    drained = ray.train.PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={'n1': [1]})

    def info():
        asked.append(len(asked))
        return drained if len(asked) >= 2 else None

    monkeypatch.setattr(ray.train, 'get_preemption_info', info)
    stops = RayPreemption.from_config(PreemptionConfig(), check_every=3)
    entered = []
    # Ray runs the loop in a thread of its worker: no handler there, no error either
    thread = threading.Thread(target=lambda: entered.append(stops.__enter__()))
    thread.start()
    thread.join()
    assert entered == [stops] and stops.received is None
    done = next(it for it in range(1, 10) if stops.should_stop(it))
    # asked at iterations 3 and 6 only (a barrier: every rank at the same ones); the notice
    # at 6 stops after 6, in one process
    assert len(asked) == 2 and done == 6
    assert stops.received == 'ray node drain (nodes n1)'


def _committed(directory: Path, step: int) -> Path:
    path = directory / f'iter_{step}.pth'
    ckpt.save_checkpoint({'meta': {'iter': step}, 'w': torch.full((3,), float(step))}, path,
                         step=step)  # fmt: skip
    return path


def test_rays_checkpoint_is_restored_only_when_newer_than_ours(tmp_path):
    import ray.train

    from stratagem.integrations.ray import restore_ray_checkpoint

    reported = tmp_path / 'ray' / 'checkpoint_iter_000000010'
    reported.mkdir(parents=True)
    _committed(reported, 10)
    (reported / 'last_checkpoint').unlink()  # Ray's directory: the file and its manifest
    handed = ray.train.Checkpoint.from_directory(str(reported))
    work = tmp_path / 'work'
    # work_dir lost (a new node): Ray's copied in, verified, the pointer on it
    assert restore_ray_checkpoint(handed, work) == work / 'iter_10.pth'
    assert ckpt.find_latest_checkpoint(work) == work / 'iter_10.pth'
    assert ckpt.verify_checkpoint(work / 'iter_10.pth')['step'] == 10
    # ours newer (killed after our commit, before Ray's report): ours stays the one
    _committed(work, 15)
    assert restore_ray_checkpoint(handed, work) is None
    assert ckpt.find_latest_checkpoint(work) == work / 'iter_15.pth'
    assert restore_ray_checkpoint(None, work) is None
    # a directory that holds none of ours is refused, naming it
    (reported / 'iter_10.pth.manifest.json').unlink()
    with pytest.raises(ValueError, match='should hold one stratagem checkpoint'):
        restore_ray_checkpoint(handed, tmp_path / 'other')


# ------------------------------------------------------------------------- slow tier
N, BATCH = 64, 4


@pytest.fixture(scope='module')
def ray_cluster(tmp_path_factory):
    """A local Ray cluster of 2 CPUs; its workers import the repository and tests/ and
    record the samples they read under ``COUNT_DIR`` (``failure_data``)."""
    import ray

    count = tmp_path_factory.mktemp('ray_counts')
    saved = dict(os.environ)
    os.environ.update(clean_env(COUNT_DIR=str(count)))
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        # a client of this cluster needs its address and its auth mode (token auth, the
        # token in ~/.ray/auth_token, is the default of a local cluster)
        client = {'RAY_ADDRESS': ray.get_runtime_context().gcs_address}
        client.update((k, v) for k, v in os.environ.items() if k.startswith('RAY_AUTH'))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield client, count
    finally:
        ray.shutdown()


def _worlds(count: Path) -> dict[int, tuple[int, int]]:
    """``{pid: (rank, world size)}`` of every worker that read a sample so far."""
    return {int(p.stem): tuple(map(int, p.read_text().split())) for p in count.glob('*.world')}


def _new_worker(count: Path, known: set, rank: int, world: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid, rw in _worlds(count).items():
            if pid not in known and rw == (rank, world):
                return pid
        time.sleep(0.05)
    raise AssertionError(f'no new Ray worker of rank {rank} in a world of {world}')


def _fit_in_thread(work: Path, cfg: Path, num_workers, max_failures: int, slow: str):
    """``TorchTrainer.fit`` of the integration in a thread; returns (thread, outcome)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from stratagem.integrations.ray import train_loop_per_worker

    outcome: dict = {}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=dict(config=str(cfg), work_dir=str(work)),
        scaling_config=ScalingConfig(num_workers=num_workers),
        run_config=RunConfig(
            name='run',
            storage_path=str(work.parent / 'ray_storage'),
            failure_config=FailureConfig(max_failures=max_failures),
            worker_runtime_env={'env_vars': {'SLOW': slow}},
        ),
    )

    def run():
        try:
            outcome['result'] = trainer.fit()
        except Exception as err:  # noqa: BLE001 - the test asserts on it
            outcome['error'] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.slow
def test_ray_run_of_2_workers_equals_nproc_2_bit_for_bit(ray_cluster, uninterrupted_run, tmp_path):
    """``stratagem train --ray 2`` on the cluster at RAY_ADDRESS: the same final checkpoint
    as ``--nproc 2``, every committed checkpoint reported to Ray with its manifest."""
    client, _ = ray_cluster
    cfg, reference = uninterrupted_run
    work = tmp_path / 'work'
    code, out = finish(start(cfg, work, '--ray', '2', env=clean_env(**client)), 300)
    assert code == 0, out[-4000:]
    assert equal(final_state(work), reference)
    reported = sorted((work / 'ray').glob('*/checkpoint_iter_*'))
    assert [p.name for p in reported][-1] == 'checkpoint_iter_000000032'
    last = reported[-1]
    assert sorted(p.name for p in last.iterdir()) == ['iter_32.pth', 'iter_32.pth.manifest.json']
    assert ckpt.verify_checkpoint(last / 'iter_32.pth')['step'] == 32
    assert not (work / '.stratagem.lock').exists() and not (work / '.ray_report').exists()


@pytest.mark.slow
def test_a_sigkilled_ray_worker_is_survived_with_an_exact_resume(
    ray_cluster, uninterrupted_run, tmp_path
):
    _, count = ray_cluster
    cfg, reference = uninterrupted_run
    work = tmp_path / 'work'
    known = set(_worlds(count))
    thread, outcome = _fit_in_thread(work, cfg, 2, max_failures=1, slow='0.02')
    victim = _new_worker(count, known, rank=1, world=2)
    wait_reads(count, victim, 4 * 13)  # iteration 13: checkpoints 5 and 10 committed
    os.kill(victim, signal.SIGKILL)
    thread.join(300)
    assert not thread.is_alive() and 'error' not in outcome, outcome.get('error')
    restarted = {p for p, rw in _worlds(count).items() if p not in known and rw[1] == 2}
    assert len(restarted) == 4  # two attempts of two workers
    assert equal(final_state(work), reference)


FSDP_2D = CONFIG.replace(
    "type='auto',",
    "type='FSDPStrategy', mesh=dict(shard=1, tensor=2),\n"
    "                tensor_parallel_plan={'backbone.0': 'colwise', 'backbone.3': 'rowwise'},",
)  # the MLP's two hidden Linears split over 2 ranks (Megatron's pair), no data parallelism


def _sharded_final(work: Path, it: int) -> dict:
    from stratagem.checkpoint.sharded import read_sharded_checkpoint

    full = read_sharded_checkpoint(work / f'iter_{it}.pth')
    return {k: full[k] for k in ('state_dict', 'optimizer', 'param_schedulers')} | {
        'iter': full['meta']['iter']
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ('text', 'options', 'mesh', 'shape', 'iters'),
    [
        # 2 ranks of data parallelism: the 32 iterations of the DDP test
        (CONFIG, ['--cfg-options', 'strategy.type=FSDPStrategy'], 'mesh shard 2', (1, 2, 1), 32),
        # one rank of data: 64 iterations of 4 samples
        (FSDP_2D, [], 'mesh tensor 2', (1, 1, 2), 64),
    ],
    ids=['flat', '2d'],
)
def test_fsdp_under_ray_equals_nproc_2_bit_for_bit(
    ray_cluster, tmp_path, text, options, mesh, shape, iters
):
    """FSDPStrategy, flat and on a (shard 1, tensor 2) mesh: ``--ray 2`` ends on the bits
    ``--nproc 2`` ends on, and what Ray keeps of each save is the sharded directory with its
    manifest, verified."""
    client, _ = ray_cluster
    cfg = write_config(tmp_path, text)
    finals = {}
    for how, args, env in (
        ('nproc', ['--nproc', '2'], clean_env()),
        ('ray', ['--ray', '2'], clean_env(**client)),
    ):
        work = tmp_path / how
        code, out = finish(start(cfg, work, *args, *options, env=env), 300)
        assert code == 0, out[-4000:]
        assert f'FSDPStrategy: 0 block(s) + root sharded over 2 ranks (cpu), {mesh}' in out
        assert is_sharded_checkpoint(work / f'iter_{iters}.pth')
        finals[how] = _sharded_final(work, iters)
    assert finals['ray']['iter'] == iters
    assert equal(finals['ray'], finals['nproc'])
    reported = sorted((tmp_path / 'ray' / 'ray').glob('*/checkpoint_iter_*'))
    assert reported[-1].name == f'checkpoint_iter_{iters:09d}'
    kept = reported[-1] / f'iter_{iters}.pth'
    assert [p.name for p in reported[-1].iterdir()] == [kept.name] and kept.is_dir()
    files = sorted(p.name for p in kept.iterdir())
    assert 'manifest.json' in files and '.metadata' in files and 'extra.pth' in files
    manifest = ckpt.verify_checkpoint(kept)
    assert (manifest['step'], manifest['strategy']) == (iters, 'FSDPStrategy')
    shape = dict(zip(('replicate', 'shard', 'tensor'), shape, strict=True))
    assert manifest['world_size'] == 2 and manifest['mesh'] == shape
    assert equal(_sharded_final(reported[-1], iters), finals['nproc'])


ELASTIC = (
    CONFIG.replace('accumulative_counts=2', 'accumulative_counts=1')
    .replace('checkpoint_interval=5', 'checkpoint_interval=2')
    .replace('max_epochs=4', 'max_epochs=2')
)  # every checkpoint converts between world sizes 1 and 2 (tests/test_elastic.py)


ELASTIC_RUN = """
import sys
import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from stratagem.integrations.ray import train_loop_per_worker

cfg, work = sys.argv[1:]
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # room for one worker
TorchTrainer(
    train_loop_per_worker,
    train_loop_config=dict(config=cfg, work_dir=work),
    scaling_config=ScalingConfig(num_workers=(1, 2)),
    run_config=RunConfig(name='elastic', storage_path=work + '/ray',
                         failure_config=FailureConfig(max_failures=0)),
).fit()
"""


@pytest.mark.slow
def test_an_elastic_run_restarts_at_1_worker_with_the_sample_position_exact(ray_cluster, tmp_path):
    """``num_workers=(1, 2)``: a run of 2 workers loses one (SIGKILL); started again on a
    cluster with room for one worker, Ray's elastic mode runs 1, which resumes from the
    world-size-2 checkpoint and ends on the bits ``stratagem train --resume`` in one process
    ends on from that checkpoint.

    Not tested: Ray's own restart inside one ``fit`` shrinking the group. Ray 2.60 sizes an
    elastic group by the resources its autoscaling coordinator reserves, which on a local
    cluster are the node's total: a CPU taken by another actor after the kill still counts
    as free, so Ray asks for 2 workers again and waits for the second."""
    _, count = ray_cluster
    cfg = write_config(tmp_path, ELASTIC)
    work = tmp_path / 'work'
    known = set(_worlds(count))
    # the first attempt fails for good (max_failures=0): Ray restarts nothing by itself
    thread, outcome = _fit_in_thread(work, cfg, 2, max_failures=0, slow='0.02')
    victim = _new_worker(count, known, rank=1, world=2)
    wait_reads(count, victim, 4 * 7)  # iteration 7 of 16: checkpoint 6 committed
    os.kill(victim, signal.SIGKILL)
    thread.join(300)
    assert 'error' in outcome
    resumed_from = ckpt.find_latest_checkpoint(work)
    assert resumed_from is not None and resumed_from.name in ('iter_6.pth', 'iter_8.pth')
    reference = tmp_path / 'reference'
    reference.mkdir()
    shutil.copy(resumed_from, reference / resumed_from.name)
    shutil.copy(manifest_path(resumed_from), reference)

    known = set(_worlds(count))
    elastic = subprocess.run(
        [sys.executable, '-c', ELASTIC_RUN, str(cfg), str(work)],
        env=clean_env(COUNT_DIR=str(count)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert elastic.returncode == 0, elastic.stderr[-4000:]
    assert sorted(rw for p, rw in _worlds(count).items() if p not in known) == [(0, 1)]
    code, out = finish(start(cfg, reference, '--resume'))
    assert code == 0, out[-4000:]
    # at world size 1 the 16 iterations of 2 are 32, the position converted
    assert equal(final_state(work, 32), final_state(reference, 32))
