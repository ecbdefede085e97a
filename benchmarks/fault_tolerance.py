"""Goodput under failures: the same 2-process training with a worker SIGKILLed every K
iterations, under

- (a) ``--max-restarts`` + storage checkpoints (every ``--ckpt`` iterations, on local disk);
- (b) replica groups over torchft (``strategy.fault_tolerance``): run only when
  ``stratagem.strategies`` has it (:func:`replica_groups_missing` says why not);
- (c) (a) + peer checkpoints (``default_hooks.checkpoint.peer_interval``, every ``--peer``
  iterations, in ``/dev/shm`` and at the other rank);

each also without kills (what the tier costs per step), beside a raw torch DDP loop of the same
model, batch and optimizer in 2 processes (the step rate nothing beats). Reported per arm,
medians of ``--runs`` runs (arms interleaved run by run, the kill iterations drawn once per
run and shared by the arms): useful steps per minute of wall time (``max_iters`` / the launch's
wall time) and its ratio to the raw loop's, work lost per failure (iterations completed before
the kill that the restart trained again), recovery time (kill -> the restarted workers' first
batch: torchrun's restart, imports, the resume's load, the data's skip). Under (b) the job
is done when the survivor, group 0, exits (its wall time ends there), and the recovery is
the kill -> the relaunched group's start line, once healed; the survivor steps on alone
meanwhile, so a run too short for torchrun's relaunch makes fewer kills (a line says so:
raise ``--iters``, e.g. 600 with ``--kill-every 150`` and ``--arms b``).

``--part load``: time to resume the same state (a larger model, weights + AdamW) from a peer
copy in ``/dev/shm`` vs from a checkpoint on local disk, in one process: the disk file's
pages evicted from the page cache first (``posix_fadvise(DONTNEED)``: a read after a reboot or
on a cold node), and warm (in the page cache), interleaved rounds, medians.

``--part step``: what peer copies cost the training thread, on 2 ranks in one launch: the same
steps (DDP, or FSDP with ``--step-strategy fsdp``) with no copies, with a copy every
``--peer`` steps written synchronously (the copy, the exchange and the commit on the training
thread), and written in the background (the snapshot into CPU memory on it, the rest on the
peer writer's thread); arms interleaved round by round, medians of the time per step and of
the copy call's time on the training thread.

    python benchmarks/fault_tolerance.py [--runs 3] [--iters 120] [--kill-every 40] [--ckpt 20]
                                         [--peer 2] [--part all|goodput|load|step]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'tests'))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# the training every arm runs: 2.4M parameters (AdamW: a 28 MB checkpoint), batch 32 a rank
FEATURES, CLASSES, HIDDEN, LAYERS, BATCH = 256, 10, 1024, 3, 32
CONFIG = """
model = dict(type='MLPClassifier', in_features={features}, num_classes={classes},
             hidden={hidden}, num_layers={layers})
train_dataloader = dict(dataset=dict(type='fault_tolerance.CountedBlobs', num_samples=4096,
                                     num_features={features}, num_classes={classes}),
                        batch_size={batch}, shuffle=True, num_workers=0)
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3))
train_cfg = dict(max_iters={iters}, checkpoint_interval={ckpt}, log_interval={log})
randomness = dict(seed=0)
strategy = dict(type='DDPStrategy', checkpoint_timeout=60,
                env_kwargs=dict(dist_cfg=dict(backend='gloo', timeout=60)))
"""


def _counted_blobs():
    from stratagem.data import SyntheticClassification

    class CountedBlobs(SyntheticClassification):
        """SyntheticClassification whose every ``batch``-th read appends one byte to
        ``$COUNT_DIR/<pid>``: the file's size is the batches this process has read (one
        write a step; the monitor kills a worker at an iteration by it)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.reads, self.fd = 0, None

        def __getitem__(self, idx):
            self.reads += 1
            count = os.environ.get('COUNT_DIR')
            if count and self.reads % BATCH == 1:
                if self.fd is None:
                    path = os.path.join(count, str(os.getpid()))
                    self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.write(self.fd, b'.')
            return super().__getitem__(idx)

    return CountedBlobs


def __getattr__(name: str):  # the config's dataset, registered by its dotted path
    if name == 'CountedBlobs':
        return _counted_blobs()
    raise AttributeError(name)


# ------------------------------------------------------------------ one launch


@dataclass
class Run:
    arm: str
    kills: list[int]
    wall: float = 0.0
    start: float = 0.0  # launch -> the first batch (imports, process group, build)
    samples: int = 0  # samples of the steps that count: every step's, for replica groups
    recoveries: list[float] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    ok: bool = False
    tiers: list[str] = field(default_factory=list)
    # (b): kills after which the survivor finished before the killed group came back (its
    # relaunch then resumes the survivor's last checkpoint instead of healing)
    unrecovered: int = 0


def _env(count: Path, shm: Path) -> dict:
    from failure_helpers import clean_env

    return clean_env(
        COUNT_DIR=str(count),
        STRATAGEM_PEER_DIR=str(shm),
        PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).resolve().parent)]),
    )


def _batches(count: Path, pid: int) -> int:
    try:
        return os.path.getsize(count / str(pid))
    except OSError:
        return 0


def launch(cfg: Path, work: Path, arm: str, kills: list[int], restarts: int) -> Run:
    """``stratagem train cfg --nproc 2 --max-restarts N``; each of ``kills`` (iterations) a
    SIGKILL of rank 1 once it reads that iteration's batch."""
    import threading

    from failure_helpers import kill_tree, workers

    count, shm = work.parent / f'{work.name}-count', work.parent / f'{work.name}-shm'
    count.mkdir()
    run = Run(arm, kills)
    lines: list[str] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, '-m', 'stratagem', 'train', str(cfg), '--work-dir', str(work)]
        + ['--nproc', '2', '--max-restarts', str(restarts)],
        env=_env(count, shm),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, '')))
    reader.start()
    try:
        run.start = _first_batch(count, proc) - t0
        for at in kills:
            pids = workers(proc.pid)
            # this attempt's workers started at the iteration the last restart resumed
            resumed = _resumed_at(lines, len(run.recoveries), proc)
            while _batches(count, pids[1]) < at - resumed and proc.poll() is None:
                time.sleep(0.002)
            seen = set(os.listdir(count))  # every worker that has read a batch so far
            os.kill(pids[1], signal.SIGKILL)
            killed = time.monotonic()
            while proc.poll() is None:
                if set(os.listdir(count)) - seen:
                    run.recoveries.append(time.monotonic() - killed)
                    break
                time.sleep(0.002)
        proc.wait(timeout=900)
    finally:
        kill_tree(proc.pid)
        proc.wait()
        reader.join()
    run.wall = time.monotonic() - t0
    run.samples = int(re.search(r'max_iters=(\d+)', cfg.read_text())[1]) * 2 * BATCH
    out = ''.join(lines)
    run.ok = proc.returncode == 0
    if not run.ok:
        print(out[-3000:], flush=True)
    starts = [int(m) - 1 for m in re.findall(r'training: iterations (\d+)-', out)][1:]
    run.lost = [at - 1 - s for at, s in zip(kills, starts)]
    run.tiers = re.findall(r'resume tier: (\w+)', out)
    return run


def _attempts(out: Path) -> tuple[int, int]:
    """How many attempts of a replica group logged their start (``training: iterations``)
    in ``out`` so far, and how many healed from a peer."""
    try:
        text = out.read_text(errors='replace')
    except OSError:
        return 0, 0
    return text.count('training: iterations '), text.count(' healed from replica group ')


def _first_batch(count: Path, proc: subprocess.Popen) -> float:
    """When a process first read a batch (``time.monotonic``)."""
    while proc.poll() is None and not os.listdir(count):
        time.sleep(0.002)
    return time.monotonic()


def _resumed_at(lines: list[str], attempt: int, proc: subprocess.Popen) -> int:
    """The iterations done before attempt ``attempt`` (0: the first) started, from its
    start line (``training: iterations N-...``)."""
    while proc.poll() is None:
        found = re.findall(r'training: iterations (\d+)-', ''.join(lines))
        if len(found) > attempt:
            return int(found[attempt]) - 1
        time.sleep(0.01)
    tail = ''.join(lines)[-5000:]
    raise AssertionError(f'the run ended before its restarted attempt logged its resume:\n{tail}')


# ------------------------------------------------------------------ the raw loop


def _raw_worker(rank: int, world: int, port: int, args: tuple, scratch: str) -> None:
    from _spawn import as_torchrun_rank

    as_torchrun_rank(rank, world, port)
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stratagem.data import SyntheticClassification
    from stratagem.models import MLPClassifier

    steps, out = args
    dist.init_process_group('gloo')
    torch.manual_seed(0)
    model = DDP(MLPClassifier(FEATURES, CLASSES, HIDDEN, LAYERS))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = SyntheticClassification(4096, FEATURES, CLASSES)
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=BATCH,
        sampler=torch.utils.data.DistributedSampler(data, seed=0),
    )
    batches = iter(loader)

    def step() -> None:
        nonlocal batches
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(5):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    if rank == 0:
        Path(out).write_text(str(steps / (time.perf_counter() - t0) * 60))
    dist.destroy_process_group()


def raw_rate(steps: int, tmp: Path) -> float:
    """Steps per minute of the raw DDP loop (2 processes)."""
    from _spawn import spawn_ranks

    out = tmp / f'raw-{time.monotonic_ns()}.txt'
    spawn_ranks(_raw_worker, (steps, str(out)), world=2, base=str(tmp))
    return float(out.read_text())


# ------------------------------------------------------------------ arm (b)


def replica_groups_missing() -> str | None:
    """None when this checkout trains replica groups (``DDPStrategy(fault_tolerance=)``,
    torchft importable); else why arm (b) cannot run."""
    import inspect

    from stratagem.strategies import DDPStrategy

    if 'fault_tolerance' not in inspect.signature(DDPStrategy.__init__).parameters:
        return 'DDPStrategy takes no fault_tolerance in this checkout (replica groups: #45)'
    if importlib.util.find_spec('torchft') is None:
        return 'torchft is not installed (pip install "stratagem[torchft]")'
    return None


def arm_replica_groups(
    args: argparse.Namespace, tmp: Path, kills: list[int], index: int
) -> list[Run]:
    """Arm (b): the same training as 2 replica groups of 1 process (the same 2 processes and
    global batch), with and without kills; [] (and a line saying why) when this checkout has
    no replica groups."""
    missing = replica_groups_missing()
    if missing is not None:
        if index == 0:
            print(f'arm (b) replica groups: skipped: {missing}', flush=True)
        return []
    cfg = write_config(tmp, args, 0, replicas=True)
    runs = []
    for arm, kill in (('b replica groups', kills), ('b replica groups, no kill', [])):
        work = tmp / f'{arm.replace(" ", "_").replace(",", "")}-{index}'
        run = launch_groups(cfg, work, arm, kill)
        runs.append(run)
        print(
            f'run {index + 1} {arm:20s} kills at {kill}: ok={run.ok} wall {run.wall:6.1f} s '
            f'lost {run.lost} recovery {[round(r, 2) for r in run.recoveries]} '
            f'healed {run.tiers}' + (f' not back: {run.unrecovered}' if run.unrecovered else ''),
            flush=True,
        )
        shutil.rmtree(work, ignore_errors=True)
    return runs


def launch_groups(cfg: Path, work: Path, arm: str, kills: list[int]) -> Run:
    """``stratagem lighthouse``, then 2 groups ``stratagem train cfg --nproc 1 --replica-id I
    --lighthouse ADDR``; each of ``kills`` a SIGKILL of group 1's process once group 0 (the
    survivor, never restarted) reads that iteration's batch. Group 1's torchrun relaunches
    it (``--max-restarts``) and it heals from group 0.

    Recovery: the kill -> the relaunched group's start line (``training: iterations``),
    written once it healed from group 0, ready to train. The job is done when group 0 exits
    (it holds the final state and wrote the last checkpoint), so the wall time ends there. A
    kill whose group comes back without a heal (the survivor, alone, outran torchrun's
    relaunch and finished, or was finishing: a run too short for its kills) counts in
    ``unrecovered`` and ends the kills: that group resumed the survivor's last checkpoint."""
    import threading

    from failure_helpers import Lighthouse, kill_tree, start, workers

    run = Run(arm, kills)
    lighthouse = Lighthouse(1)
    groups: list[subprocess.Popen] = []
    outs = [work.parent / f'{work.name}-group{i}.out' for i in (0, 1)]
    counts = [work.parent / f'{work.name}-count{i}' for i in (0, 1)]
    try:
        address = lighthouse.address  # serving before the clock starts
        t0 = time.monotonic()
        for i in (0, 1):
            counts[i].mkdir()
            groups.append(
                start(
                    cfg,
                    work,
                    *('--nproc', '1', '--replica-id', str(i), '--lighthouse', address),
                    *('--max-restarts', str(len(kills) + 1 if i else 1)),
                    env=_env(counts[i], work.parent / f'{work.name}-shm'),
                    out=outs[i],
                    start_new_session=True,
                )
            )
        run.start = _first_batch(counts[0], groups[0]) - t0
        survivor = workers(groups[0].pid, 1)[0]
        ended: list[float] = []  # group 0's exit, the job's end
        watcher = threading.Thread(
            target=lambda: (groups[0].wait(), ended.append(time.monotonic())), daemon=True
        )
        watcher.start()
        for at in kills:
            if ended or groups[1].poll() is not None:
                break  # the survivor finished first: no more failures to inject
            try:
                victim = workers(groups[1].pid, 1, timeout=60)[0]
            except AssertionError:  # group 1 ended between its attempts
                break
            # group 1 trains (joined, or healed after the last kill), then group 0 is there
            while _batches(counts[1], victim) < 1 and groups[1].poll() is None:
                time.sleep(0.002)
            while _batches(counts[0], survivor) < at and not ended:
                time.sleep(0.002)
            if ended or groups[1].poll() is not None:
                break  # the survivor finished first: no more failures to inject
            attempts, heals = _attempts(outs[1])
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            run.lost.append(0)  # the survivor's steps go on: no step is trained twice
            # back: the relaunched group's start line, after its heal (or its resume)
            while groups[1].poll() is None and _attempts(outs[1])[0] == attempts:
                time.sleep(0.005)
            back = time.monotonic()
            if _attempts(outs[1])[1] > heals:
                run.recoveries.append(back - killed)
            else:  # it came back to no peer: it resumed the survivor's last checkpoint
                run.unrecovered += 1
                print(
                    f'{arm}: group 1 came back {back - killed:.1f} s after the kill at '
                    f'iteration {at} without a heal: group 0 had finished, or was finishing '
                    '(raise --iters for more kills)',
                    flush=True,
                )
                break
        codes = [groups[0].wait(timeout=900)]
        watcher.join()
        run.wall = ended[0] - t0
        codes.append(groups[1].wait(timeout=900))
        # a step trains its participants' batches: the survivor's alone while the other is
        # down (the batches a killed process read in its last, uncommitted step are in too)
        run.samples = BATCH * sum(os.path.getsize(p) for c in counts for p in c.iterdir())
        run.ok = codes == [0, 0]
        texts = [o.read_text(errors='replace') for o in outs]
        run.tiers = re.findall(r'healed from replica group (\d+)', texts[1])
        if not run.ok:
            print(texts[0][-2000:], texts[1][-2000:], flush=True)
    finally:
        for proc in groups:
            kill_tree(proc.pid)
            proc.wait()
        lighthouse.close()
        if not run.ok:
            for out in outs:
                with contextlib.suppress(OSError):
                    print(f'{out.name}:', out.read_text(errors='replace')[-2000:], flush=True)
    return run


# ------------------------------------------------------------------ the goodput part


def write_config(tmp: Path, args: argparse.Namespace, peer: int, *, replicas: bool = False) -> Path:
    text = CONFIG.format(
        features=FEATURES,
        classes=CLASSES,
        hidden=HIDDEN,
        layers=LAYERS,
        batch=BATCH,
        iters=args.iters,
        ckpt=args.ckpt,
        log=min(10, args.iters),
    )
    if peer:
        text += f'default_hooks = dict(checkpoint=dict(peer_interval={peer}))\n'
    if replicas:  # 2 groups of 1 process: the step's batch is 2 x 32, as the DDP arms'
        text = text.replace(
            "env_kwargs=dict(dist_cfg=dict(backend='gloo', timeout=60)))",
            "env_kwargs=dict(dist_cfg=dict(backend='gloo', timeout=60)),\n"
            '                fault_tolerance=dict(min_replicas=1, timeout=10, '
            'quorum_timeout=60, connect_timeout=5))',
        )
        assert 'fault_tolerance' in text
    path = tmp / f'cfg_{"replicas" if replicas else "peer" if peer else "storage"}.py'
    path.write_text(text)
    return path


def goodput(args: argparse.Namespace, tmp: Path) -> None:
    storage_cfg, peer_cfg = write_config(tmp, args, 0), write_config(tmp, args, args.peer)
    rng = random.Random(args.seed)
    runs: list[Run] = []
    raw: list[float] = []
    for i in range(args.runs):
        # one kill in each window of kill_every iterations, at a random iteration of it
        kills = [
            w + rng.randrange(2, args.kill_every)
            for w in range(0, args.iters - args.kill_every + 1, args.kill_every)
        ]
        kills = [k for k in kills if k < args.iters]
        raw.append(raw_rate(max(20, args.iters // 2), tmp))
        arms = (
            ('a storage', storage_cfg, kills),
            ('c peer', peer_cfg, kills),
            ('a storage, no kill', storage_cfg, []),
            ('c peer, no kill', peer_cfg, []),
        )
        for arm, cfg, kill in arms:
            if arm[0] not in args.arms:
                continue
            work = tmp / f'{arm.replace(" ", "_").replace(",", "")}-{i}'
            run = launch(cfg, work, arm, kill, restarts=len(kills) + 1)
            runs.append(run)
            print(
                f'run {i + 1} {arm:20s} kills at {kill}: ok={run.ok} wall {run.wall:6.1f} s '
                f'lost {run.lost} recovery {[round(r, 2) for r in run.recoveries]} '
                f'tiers {run.tiers}',
                flush=True,
            )
            shutil.rmtree(work, ignore_errors=True)
        if 'b' in args.arms:
            runs += arm_replica_groups(args, tmp, kills, i)
    report(args, runs, raw)


def report(args: argparse.Namespace, runs: list[Run], raw: list[float]) -> None:
    raw_rate_ = statistics.median(raw)
    print(
        f'\n{args.runs} runs of {args.iters} iterations (2 processes, gloo; kill every '
        f'{args.kill_every}, checkpoints every {args.ckpt}, peer copies every {args.peer}); '
        f'load average {os.getloadavg()[0]:.1f}'
    )
    print(
        f'raw DDP loop: {raw_rate_:.0f} steps/min, {raw_rate_ * 2 * BATCH:.0f} samples/min '
        f'(median of {len(raw)})'
    )
    print(
        'steps/min: of the whole wall time; trained: from the first batch on (without the '
        "launch's imports and set-up); samples/min: the samples the steps trained on, of the "
        'whole wall time (raw: 2 x 32 a step); failures: the kills made (a run whose survivor '
        "ends first makes fewer); recovery: kill -> the restarted workers' first batch, for "
        "(b) the relaunched group's start line (healed); (b)'s wall time ends at group 0's "
        "exit, the job's end"
    )
    print(
        f'{"arm":26s} {"steps/min":>9s} {"x raw":>6s} {"trained":>8s} {"x raw":>6s} '
        f'{"samples/min":>11s} {"failures":>8s} {"lost/failure":>12s} {"recovery s":>10s} '
        f'{"finished":>8s}'
    )
    for arm in dict.fromkeys(r.arm for r in runs):
        mine = [r for r in runs if r.arm == arm]
        rate = statistics.median(args.iters / r.wall * 60 for r in mine)
        trained = statistics.median(args.iters / (r.wall - r.start) * 60 for r in mine)
        samples = statistics.median(r.samples / r.wall * 60 for r in mine)
        lost = [x for r in mine for x in r.lost]
        rec = [x for r in mine for x in r.recoveries]
        print(
            f'{arm:26s} {rate:9.0f} {rate / raw_rate_:6.3f} {trained:8.0f} '
            f'{trained / raw_rate_:6.3f} {samples:11.0f} {len(lost) / len(mine):8.1f} '
            f'{statistics.median(lost) if lost else 0:12.1f} '
            f'{statistics.median(rec) if rec else float("nan"):10.2f} '
            f'{sum(r.ok for r in mine):5d}/{len(mine)}'
        )
        late = sum(r.unrecovered for r in mine)
        if late:
            print(
                f'  {arm}: {late} of {len(lost)} kills came back as the survivor finished '
                '(resumed its last checkpoint, no heal at the start; raise --iters)'
            )


# ------------------------------------------------------------------ the load part


def _evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (clean pages: it was fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _load_worker(rank: int, world: int, port: int, args: tuple, scratch: str) -> None:
    """Each rank: a DDP model (weights + AdamW), then interleaved rounds of a storage save,
    a peer copy, and the three resumes of that state; rank 0 writes the times."""
    from _spawn import as_torchrun_rank

    as_torchrun_rank(rank, world, port)
    import torch

    from stratagem.checkpoint.manifest import forget_verified
    from stratagem.checkpoint.peer import PeerCopies, peer_root
    from stratagem.models import MLPClassifier
    from stratagem.strategies import DDPStrategy

    hidden, rounds, out = args
    os.environ['STRATAGEM_PEER_DIR'] = os.path.join(scratch, 'shm')
    work = os.path.join(scratch, 'work')
    strategy = DDPStrategy(work_dir=work, env_kwargs=dict(dist_cfg=dict(backend='gloo')))
    torch.manual_seed(0)
    strategy.prepare(
        MLPClassifier(hidden, 10, hidden, 4),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
    )
    x, y = torch.randn(8, hidden), torch.randint(10, (8,))
    strategy.train_step(x, y, torch.nn.functional.cross_entropy)
    peer = PeerCopies(peer_root(work), rank, world, same_node=True)  # one machine
    meta = {'meta': {'iter': 1}}
    times: dict[str, list[float]] = {
        'save: checkpoint (disk)': [],
        'save: peer copy': [],
        'resume: peer (/dev/shm)': [],
        'resume: disk, cold': [],
        'resume: disk, warm': [],
    }
    disk = None
    for _ in range(rounds):
        for name in times:
            forget_verified()  # every load hashes every byte, as a restarted process does
            if name == 'resume: disk, cold' and rank == 0:
                _evict(Path(disk))
            torch.distributed.barrier()
            t0 = time.perf_counter()
            if name == 'save: checkpoint (disk)':
                disk = strategy.save_checkpoint('iter_1.pth', extra_ckpt=meta)
            elif name == 'save: peer copy':
                strategy.save_peer_copy(peer, extra_ckpt=meta)
            else:  # the call a restart makes: the newest found, verified, loaded
                checkpoint = strategy.load_or_resume(
                    resume=True, peer=peer if 'peer' in name else None
                )
                assert checkpoint is not None and checkpoint['meta']['iter'] == 1
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        size = os.path.getsize(disk)
        Path(out).write_text(json.dumps([size, times]))


def load_times(args: argparse.Namespace, tmp: Path) -> None:
    """Save and resume one state on 2 ranks: a checkpoint on local disk vs peer copies."""
    from _spawn import spawn_ranks

    out = tmp / 'load.txt'
    spawn_ranks(
        _load_worker, (args.load_hidden, args.load_rounds, str(out)), world=2, base=str(tmp)
    )
    size, times = json.loads(out.read_text())
    print(
        f'\nsave and resume of one state on 2 ranks ({size / 2**20:.0f} MB: MLP width '
        f'{args.load_hidden}, weights + AdamW), {args.load_rounds} interleaved rounds; '
        f'load average {os.getloadavg()[0]:.1f}'
    )
    base = statistics.median(times['resume: peer (/dev/shm)'])
    for name, values in times.items():
        med = statistics.median(values)
        print(
            f'{name:24s} median {med:6.3f} s  (min {min(values):.3f}, max {max(values):.3f})'
            + (f'  {med / base:5.2f}x peer' if name.startswith('resume') else '')
        )


# ------------------------------------------------------------------ the step part


def _step_worker(rank: int, world: int, port: int, args: tuple, scratch: str) -> None:
    """Each rank: one model; rounds of ``steps`` steps under each arm (no copies, copies
    written synchronously, in the background), the arms interleaved; rank 0 writes, per arm,
    the seconds per step of each round and of each copy call."""
    from _spawn import as_torchrun_rank

    as_torchrun_rank(rank, world, port)
    import torch
    import torch.distributed as dist

    from stratagem.checkpoint.peer import PeerCopies
    from stratagem.models import MLPClassifier
    from stratagem.strategies import build_strategy

    hidden, rounds, steps, every, kind, out = args
    strategy = build_strategy(
        dict(
            type='FSDPStrategy' if kind == 'fsdp' else 'DDPStrategy',
            work_dir=os.path.join(scratch, 'work'),
            env_kwargs=dict(dist_cfg=dict(backend='gloo')),
        )
    )
    torch.manual_seed(0)
    strategy.prepare(
        MLPClassifier(hidden, 10, hidden, 4),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
    )
    x, y = torch.randn(16, hidden), torch.randint(10, (16,))
    loss = torch.nn.functional.cross_entropy
    strategy.train_step(x, y, loss)  # the optimizer's state exists from here on
    group = dist.new_group(backend='gloo')  # the background writer's own
    arms = {
        'no copies': None,
        'copies, synchronous': PeerCopies(
            os.path.join(scratch, 'sync'), rank, world, group=group, same_node=True
        ),
        'copies, background': PeerCopies(
            os.path.join(scratch, 'bg'), rank, world, group=group, same_node=True, background=True
        ),
    }
    per_step: dict[str, list[float]] = {name: [] for name in arms}
    cpu: dict[str, list[float]] = {name: [] for name in arms}  # the training thread's own
    calls: dict[str, list[float]] = {name: [] for name in arms}
    it = 1
    for _ in range(rounds):
        for name, peer in arms.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                strategy.train_step(x, y, loss)
                it += 1
                if peer is not None and it % every == 0:
                    t_call = time.perf_counter()
                    strategy.save_peer_copy(peer, extra_ckpt={'meta': {'iter': it}})
                    calls[name].append(time.perf_counter() - t_call)
            if peer is not None:
                peer.wait()  # the round's last copy is part of its cost
            cpu[name].append((time.thread_time() - c0) / steps)
            dist.barrier()
            per_step[name].append((time.perf_counter() - t0) / steps)
    arms['copies, background'].close()
    if rank == 0:
        numel = sum(p.numel() for p in strategy.model.parameters())
        Path(out).write_text(json.dumps([numel, per_step, cpu, calls]))


def step_cost(args: argparse.Namespace, tmp: Path) -> None:
    """The time per step with no peer copies, synchronous ones and background ones."""
    from _spawn import spawn_ranks

    out = tmp / 'step.txt'
    work = (args.load_hidden, args.step_rounds, args.step_steps, args.peer, args.step_strategy)
    spawn_ranks(_step_worker, (*work, str(out)), world=2, base=str(tmp))
    numel, per_step, cpu, calls = json.loads(out.read_text())
    print(
        f'\nstep cost of peer copies on 2 ranks ({args.step_strategy}, {numel / 1e6:.1f}M '
        f'parameters{", sharded over the 2" if args.step_strategy == "fsdp" else ""}, AdamW; '
        f'a copy every {args.peer} steps), {args.step_rounds} interleaved rounds of '
        f'{args.step_steps} steps; load average {os.getloadavg()[0]:.1f}'
    )
    base = statistics.median(per_step['no copies'])
    base_cpu = statistics.median(cpu['no copies'])
    for name, values in per_step.items():
        med, own = statistics.median(values), statistics.median(cpu[name])
        call = f'  the copy call {statistics.median(calls[name]):.3f} s' if calls[name] else ''
        print(
            f'{name:20s} {med * 1e3:7.1f} ms a step  {med / base:5.2f}x   training thread '
            f'{own * 1e3:6.1f} ms CPU a step  {own / base_cpu:5.2f}x{call}'
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--runs', type=int, default=3)
    parser.add_argument('--iters', type=int, default=120)
    parser.add_argument('--kill-every', type=int, default=40)
    parser.add_argument('--ckpt', type=int, default=20)
    parser.add_argument('--peer', type=int, default=2)
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--load-hidden', type=int, default=2048)
    parser.add_argument('--load-rounds', type=int, default=5)
    parser.add_argument('--step-rounds', type=int, default=5)
    parser.add_argument('--step-steps', type=int, default=20)
    parser.add_argument('--step-strategy', choices=['ddp', 'fsdp'], default='ddp')
    parser.add_argument('--part', choices=['all', 'goodput', 'load', 'step'], default='all')
    parser.add_argument('--arms', default='abc', help='the goodput arms to run (default abc)')
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix='fault-tolerance-', dir=os.environ.get('BENCH_DIR')))
    try:
        if args.part in ('all', 'goodput'):
            goodput(args, tmp)
        if args.part in ('all', 'load'):
            load_times(args, tmp)
        if args.part in ('all', 'step'):
            step_cost(args, tmp)
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(['rm', '-rf', str(tmp)], check=False)


if __name__ == '__main__':
    main()
