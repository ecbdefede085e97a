"""The GPU figures users compare, each against its raw PyTorch loop in the same run.

The model: ``stratagem.models.TransformerLM`` at GPT-2-small's shape (12 blocks, width 768,
12 heads, sequence 1024; a 24,576-token vocabulary and an untied head: 124M parameters), bf16,
AdamW (torch's, no JIT-built ops), random tokens (nothing downloaded). Parts (``--part``):

1. ``steps``: step time of every backend against its raw loop, built side by side and run
   interleaved (each round a block of steps of each, the order reversed every other round;
   medians, the median of the per-round ratios and its spread), then freed before the next
   pair: SingleDeviceStrategy vs a raw autocast loop (and the raw loop again, the noise
   floor), DDPStrategy vs ``DistributedDataParallel`` (one GPU: the wrapper's overhead;
   ``--world N``: scaling), FSDPStrategy vs ``fully_shard`` per block with the same
   ``MixedPrecisionPolicy``, DeepSpeedStrategy ZeRO-2 vs ``deepspeed.initialize`` with the
   config it derives. Per row: ms/step, tokens/s, MFU (FLOPs of one step counted by
   ``torch.utils.flop_counter`` over the device's dense bf16 peak, ``stratagem.env.devices``).
   Goal: ≤ 1.02× raw.
2. ``compile``: SingleDeviceStrategy ``prepare(compile=True)`` vs ``torch.compile`` of the raw
   loop's model; the first step (compilation) timed apart.
3. ``checkpoint``: the model's checkpoint (weights + AdamW state, ~1.5 GB): sync
   ``save_checkpoint`` vs ``torch.save`` + fsync; the async call vs the copy floor (every
   tensor copied once into reused pinned buffers, one stream) and until committed; verified
   ``resume`` vs ``torch.load`` + ``load_state_dict``; FSDPStrategy's sharded save and resume vs
   ``get_state_dict`` + ``dcp.save`` / ``dcp.load`` + ``set_state_dict``. Goal: the async
   call at the copy floor (≤ 1.1×).
4. ``memory``: peak memory of the SingleDeviceStrategy step vs the raw loop's (each built
   alone, ``torch.cuda.max_memory_allocated``), and ``stratagem doctor``'s estimate for the
   same config (``doctor.memory.estimate_memory``) vs the measured peak. Goal: within 10%.

``all``: the four in one process (the dry run's choice: one start-up instead of four).

Every row is appended to ``OUT/rows.jsonl`` as soon as it is measured, so a part cut short
by its timeout keeps what it finished; ``summary.py`` turns the rows and the gpu tests'
JUnit file into ``summary.md`` and ``summary.csv``.

``--dry``: the same code on the CPU with a 2-block toy model, one round of 2 steps, gloo,
DeepSpeed without bf16 and ``torch.compile(backend='eager')``: a typo fails here, not on the
first GPU (``make gpu`` runs it on a machine without CUDA; CI does).

    python benchmarks/gpu/bench.py --part steps --out DIR [--world N] [--rounds 7 --steps 10]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: benchmarks/ holds _spawn.py
    sys.path.insert(0, str(HERE.parent))
from _spawn import as_torchrun_rank, free_port, spawn_ranks  # noqa: E402

PARTS = ('steps', 'compile', 'checkpoint', 'memory', 'all')
SHAPES = {
    'gpt2': dict(vocab_size=24576, dim=768, depth=12, heads=12, max_len=1024),
    'tiny': dict(vocab_size=64, dim=32, depth=2, heads=2, max_len=16),
}
STEP_GOAL, ASYNC_GOAL, MEMORY_GOAL = 1.02, 1.1, 0.10


@dataclass
class Setup:
    """One run's settings, the same in every rank."""

    shape: str
    batch: int
    seq: int
    rounds: int
    steps: int
    out: str
    dry: bool
    flops: bool = True

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available() and not self.dry:
            return torch.device('cuda', int(os.environ.get('LOCAL_RANK', 0)))
        return torch.device('cpu')

    @property
    def cuda(self) -> bool:
        return self.device.type == 'cuda'


# ------------------------------------------------------------------------ model and data
def build_model(setup: Setup) -> torch.nn.Module:
    from stratagem.models import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(**SHAPES[setup.shape])
    model.init_weights()
    return model


def model_cfg(setup: Setup) -> dict:
    return dict(type='TransformerLM', **SHAPES[setup.shape])


def amp_cfg() -> dict:
    return dict(type='AmpOptimWrapper', dtype='bfloat16', optimizer=adamw_cfg())


def adamw_cfg() -> dict:
    return dict(type='AdamW', lr=1e-4, weight_decay=0.01)


def batches(setup: Setup, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(int(os.environ.get('RANK', 0)))
    vocab = SHAPES[setup.shape]['vocab_size']
    return [
        tuple(  # type: ignore[misc]
            torch.randint(vocab, (setup.batch, setup.seq), generator=g).to(setup.device)
            for _ in range(2)
        )
        for _ in range(n)
    ]


def sync(setup: Setup) -> None:
    if setup.cuda:
        torch.cuda.synchronize()


def work_dir(setup: Setup) -> str:
    return tempfile.mkdtemp(prefix='gpu-bench-', dir=os.environ.get('GPU_BENCH_TMP'))


def quiet() -> dict:
    return dict(log_kwargs=dict(log_level='WARNING'), env_kwargs=dict(randomness=dict(seed=0)))


# ------------------------------------------------------------------------ the contestants
Step = Callable[[tuple[torch.Tensor, torch.Tensor]], None]


def raw_single(setup: Setup, compile: bool = False) -> Step:
    """The tutorial loop: zero_grad, autocast forward, backward, step."""
    model = build_model(setup).to(setup.device)
    run = torch.compile(model, **_compile_kwargs(setup)) if compile else model
    return _raw_step(run, torch.optim.AdamW(model.parameters(), **_hyper()), setup)


def _raw_step(model: torch.nn.Module, opt: torch.optim.Optimizer, setup: Setup) -> Step:
    """One raw step of ``model``: zero_grad, bf16 autocast forward, backward, step."""

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        opt.zero_grad()
        with torch.autocast(setup.device.type, dtype=torch.bfloat16):
            loss = model(*batch)['loss']
        loss.backward()
        opt.step()

    return step


def _hyper() -> dict:
    cfg = adamw_cfg()
    cfg.pop('type')
    return cfg


def _compile_kwargs(setup: Setup) -> dict:
    # the dry run checks the wiring, not inductor (minutes on a CPU)
    return dict(backend='eager') if setup.dry else {}


def ours_single(setup: Setup, compile: bool = False) -> Step:
    from stratagem.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy(work_dir=work_dir(setup), device=str(setup.device), **quiet())
    compiled: bool | dict = False
    if compile:
        compiled = _compile_kwargs(setup) or True
    model, ow = strategy.prepare(
        build_model(setup), optim_wrapper=amp_cfg(), compile=compiled, dispatch_kwargs=_dk(setup)
    )
    return _ours_step(model, ow)


def _dk(setup: Setup) -> dict:
    return dict(max_iters=10**9, train_micro_batch_size_per_gpu=setup.batch)


def _ours_step(model: Any, ow: Any) -> Step:
    """What a user of stratagem writes: optim_context + update_params."""

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        with ow.optim_context(model):
            loss = model(*batch)['loss']
        ow.update_params(loss)

    return step


def raw_ddp(setup: Setup) -> Step:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [setup.device.index] if setup.cuda else None
    model = DDP(build_model(setup).to(setup.device), device_ids=ids)
    return _raw_step(model, torch.optim.AdamW(model.parameters(), **_hyper()), setup)


def ours_ddp(setup: Setup) -> Step:
    from stratagem.strategies import DDPStrategy

    strategy = DDPStrategy(work_dir=work_dir(setup), **quiet())
    model, ow = strategy.prepare(
        build_model(setup), optim_wrapper=amp_cfg(), dispatch_kwargs=_dk(setup)
    )
    return _ours_step(model, ow)


def raw_fsdp(setup: Setup) -> Step:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(setup.device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = build_model(setup).to(setup.device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), **_hyper())

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        opt.zero_grad()
        model(*batch)['loss'].backward()
        opt.step()

    return step


def fsdp_strategy(setup: Setup, **kwargs: Any) -> Any:
    from stratagem.strategies import FSDPStrategy

    return FSDPStrategy(
        work_dir=work_dir(setup),
        model_wrapper=dict(
            auto_wrap_policy=['TransformerBlock'],
            mixed_precision=dict(param_dtype='bfloat16', reduce_dtype='float32'),
        ),
        **kwargs,
        **quiet(),
    )


def ours_fsdp(setup: Setup) -> Step:
    strategy = fsdp_strategy(setup)
    model, ow = strategy.prepare(
        build_model(setup), optim_wrapper=dict(optimizer=adamw_cfg()), dispatch_kwargs=_dk(setup)
    )
    return _ours_step(model, ow)


def _ds_precision(setup: Setup) -> dict:
    # DeepSpeed's bf16 on a CPU is not what the dry run checks: the wiring is
    return {} if setup.dry else dict(bf16=dict(enabled=True))


def raw_deepspeed(setup: Setup) -> Step:
    import deepspeed

    module = build_model(setup)
    config = dict(
        train_micro_batch_size_per_gpu=setup.batch,
        gradient_accumulation_steps=1,
        gradient_clipping=0.0,
        steps_per_print=10**13,
        zero_optimization=dict(stage=2),
        **_ds_precision(setup),
    )
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.AdamW(module.parameters(), **_hyper()), config=config
    )

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        loss = engine(*batch)['loss']
        engine.backward(loss)
        engine.step()

    return step


def ours_deepspeed(setup: Setup) -> Step:
    from stratagem.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(
        work_dir=work_dir(setup), zero_optimization=dict(stage=2), **_ds_precision(setup), **quiet()
    )
    model, ow = strategy.prepare(
        build_model(setup), optim_wrapper=dict(optimizer=adamw_cfg()), dispatch_kwargs=_dk(setup)
    )
    return _ours_step(model, ow)


# ------------------------------------------------------------------------ measuring
def emit(setup: Setup, **row: Any) -> None:
    """Append one row to OUT/rows.jsonl (rank 0) and print it."""
    if int(os.environ.get('RANK', 0)) != 0:
        return
    row = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}
    row.setdefault('device', _device_name(setup))
    Path(setup.out).mkdir(parents=True, exist_ok=True)
    with open(Path(setup.out) / 'rows.jsonl', 'a') as f:
        f.write(json.dumps(row) + '\n')
    print(json.dumps(row), flush=True)


def _device_name(setup: Setup) -> str:
    return torch.cuda.get_device_name(setup.device) if setup.cuda else 'cpu'


def block(setup: Setup, step: Step, data: list, n: int) -> float:
    """Seconds per step over ``n`` steps, the device drained before and after (and every
    rank at the same point)."""
    import torch.distributed as dist

    sync(setup)
    dist.barrier()
    start = time.perf_counter()
    for i in range(n):
        step(data[i % len(data)])
    sync(setup)
    dist.barrier()
    return (time.perf_counter() - start) / n


def step_flops(setup: Setup) -> int:
    """FLOPs of one forward + backward of the model on one batch, as torch counts them
    (0 under ``--no-flops``)."""
    if not setup.flops:
        return 0
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(setup).to(setup.device)
    x, y = batches(setup, 1)[0]
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(setup.device.type, dtype=torch.bfloat16):
            loss = model(x, y)['loss']
        loss.backward()
    del model
    return int(counter.get_total_flops())


def free(setup: Setup) -> None:
    gc.collect()
    if setup.cuda:
        torch.cuda.empty_cache()


def compare(setup: Setup, case: str, builders: dict[str, Callable[[], Step]], flops: int) -> None:
    """Build the contestants, warm them up, run interleaved rounds; one row per contestant
    that is not ``raw`` (its ratio to ``raw``)."""
    import torch.distributed as dist

    first: dict[str, float] = {}
    steps: dict[str, Step] = {}
    data = batches(setup)
    for name, build in builders.items():
        steps[name] = build()
        first[name] = block(setup, steps[name], data, 1)  # compilation, lazy allocations
        block(setup, steps[name], data, 2)
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for r in range(setup.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            times[name].append(block(setup, steps[name], data, setup.steps))
    world = dist.get_world_size()
    peak = _peak(setup)
    raw = statistics.median(times['raw'])
    for name in order:
        if name == 'raw' and len(order) > 1:
            continue
        ratios = [a / b for a, b in zip(times[name], times['raw'])]
        sec = statistics.median(times[name])
        emit(
            setup,
            part='steps' if 'compile' not in case else 'compile',
            case=case if name == 'ours' else f'{case}: {name}',
            world=world,
            ours=sec * 1e3,
            raw=raw * 1e3,
            unit='ms/step',
            ratio=statistics.median(ratios),
            spread=f'{min(ratios):.3f}-{max(ratios):.3f}',
            goal=STEP_GOAL if name == 'ours' else None,
            tokens_per_s=setup.batch * setup.seq * world / sec,
            mfu=(flops / sec / peak) if peak and flops else None,
            first_step_s=first[name],
            raw_first_step_s=first['raw'],
        )
    steps.clear()
    free(setup)


def _peak(setup: Setup) -> float | None:
    from stratagem.env.devices import peak_flops

    return peak_flops(_device_name(setup)) if setup.cuda else None


def part_steps(setup: Setup, cases: list[str]) -> None:
    import torch.distributed as dist

    flops = step_flops(setup)
    single = dist.get_world_size() == 1
    pairs: dict[str, dict[str, Callable[[], Step]]] = {
        'SingleDevice': dict(
            raw=lambda: raw_single(setup),
            ours=lambda: ours_single(setup),
            control=lambda: raw_single(setup),
        ),
        'DDP': dict(raw=lambda: raw_ddp(setup), ours=lambda: ours_ddp(setup)),
        'FSDP2': dict(raw=lambda: raw_fsdp(setup), ours=lambda: ours_fsdp(setup)),
        'DeepSpeed ZeRO-2': dict(
            raw=lambda: raw_deepspeed(setup), ours=lambda: ours_deepspeed(setup)
        ),
    }
    for case, builders in pairs.items():
        if case not in cases or (case == 'SingleDevice' and not single):
            continue
        if case.startswith('DeepSpeed') and not _has('deepspeed'):
            emit(setup, part='steps', case=case, note='skipped: deepspeed is not installed')
            continue
        compare(setup, case, builders, flops)


def part_compile(setup: Setup) -> None:
    flops = step_flops(setup)
    compare(
        setup,
        'SingleDevice + torch.compile',
        dict(raw=lambda: raw_single(setup, True), ours=lambda: ours_single(setup, True)),
        flops,
    )


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def timed(setup: Setup, fn: Callable[[], Any]) -> float:
    sync(setup)
    start = time.perf_counter()
    fn()
    sync(setup)
    return time.perf_counter() - start


def interleave(setup: Setup, pairs: dict[str, Callable[[], Any]], runs: int) -> dict:
    """Median seconds of each callable over ``runs`` alternating runs (ABAB, BABA)."""
    times: dict[str, list[float]] = {k: [] for k in pairs}
    order = list(pairs)
    for r in range(runs):
        for name in order if r % 2 == 0 else order[::-1]:
            times[name].append(timed(setup, pairs[name]))
    return {k: statistics.median(v) for k, v in times.items()}


def _fsync_save(obj: Any, path: str) -> None:
    with open(path, 'wb') as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _prepared_single(setup: Setup, **kwargs: Any) -> tuple[Any, Any, Any]:
    from stratagem.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy(
        work_dir=work_dir(setup), device=str(setup.device), **kwargs, **quiet()
    )
    model, ow = strategy.prepare(build_model(setup), optim_wrapper=amp_cfg())
    _ours_step(model, ow)(batches(setup, 1)[0])  # the optimizer state exists
    return strategy, model, ow


def part_checkpoint(setup: Setup) -> None:
    """Sync save, async call (vs the copy floor) and commit, verified resume: ours against
    torch.save / torch.load of the same state; then FSDP's sharded save against dcp."""
    runs = max(3, setup.rounds // 2)
    single_checkpoint(setup, runs)
    free(setup)  # the single-device models are gone with the call's frame
    sharded_checkpoint(setup, runs)


def single_checkpoint(setup: Setup, runs: int) -> None:
    """SingleDeviceStrategy's file against torch.save / torch.load of the same state."""
    strategy, model, ow = _prepared_single(setup)
    meta = {'meta': {'iter': 1}}
    raw_dir = work_dir(setup)
    raw_path = os.path.join(raw_dir, 'raw.pth')
    count = iter(range(10**6))

    saved: list[str] = []  # removed after the timed runs (an unlink is not a save)

    def ours_save() -> None:
        saved.append(strategy.save_checkpoint(f'iter_{next(count)}.pth', extra_ckpt=meta))

    def raw_save() -> None:
        saved.append(os.path.join(raw_dir, f'raw_{next(count)}.pth'))
        _fsync_save(dict(state_dict=model.state_dict(), optimizer=ow.state_dict()), saved[-1])

    t = interleave(setup, dict(ours=ours_save, raw=raw_save), runs)
    for path in saved:
        os.remove(path)
    _ckpt_row(setup, 'save (sync) vs torch.save + fsync', t['ours'], t['raw'])
    # the async call: the copies into pinned staging; committed: until the write is done
    async_s, amodel, aow = _prepared_single(setup, async_checkpoint=True)
    calls, commits = [], []
    warm = async_s.save_checkpoint('warm.pth', extra_ckpt=meta)  # the staging buffers pinned
    async_s.wait_for_checkpoints()
    os.remove(warm)
    for i in range(runs):
        start = time.perf_counter()
        path = async_s.save_checkpoint(f'async_{i}.pth', extra_ckpt=meta)
        calls.append(time.perf_counter() - start)
        async_s.wait_for_checkpoints()
        commits.append(time.perf_counter() - start)
        os.remove(path)
    floor = copy_floor(setup, amodel, aow, runs)
    emit(
        setup,
        part='checkpoint',
        case='async save: the call vs the copy floor',
        ours=statistics.median(calls),
        raw=floor,
        unit='s',
        ratio=statistics.median(calls) / floor,
        goal=ASYNC_GOAL,
        note='floor: every tensor copied once into reused pinned buffers',
    )
    _ckpt_row(
        setup, 'async save: committed vs torch.save + fsync', statistics.median(commits), t['raw']
    )
    path = strategy.save_checkpoint('resume.pth', extra_ckpt=meta)
    _fsync_save(dict(state_dict=model.state_dict(), optimizer=ow.state_dict()), raw_path)

    def raw_load() -> None:
        ck = torch.load(raw_path, map_location=setup.device, weights_only=True)
        model.load_state_dict(ck['state_dict'])
        ow.load_state_dict(ck['optimizer'])

    t = interleave(setup, dict(ours=lambda: strategy.resume(path), raw=raw_load), runs)
    _ckpt_row(setup, 'verified resume vs torch.load + load_state_dict', t['ours'], t['raw'])
    shutil.rmtree(raw_dir, ignore_errors=True)


def copy_floor(setup: Setup, model: Any, ow: Any, runs: int) -> float:
    """Seconds to copy every tensor of the model's and optimizer's state once into reused
    (pinned, on a GPU) host buffers: what an async save's call cannot beat."""
    tensors = [t for t in _tensors(model.state_dict()) + _tensors(ow.state_dict())]
    buffers = [torch.empty_like(t, device='cpu', pin_memory=setup.cuda) for t in tensors]

    def copy() -> None:
        for b, t in zip(buffers, tensors):
            b.copy_(t, non_blocking=setup.cuda)

    copy()  # the buffers faulted in, as the writer's are after its first save
    return statistics.median(timed(setup, copy) for _ in range(runs))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _ckpt_row(setup: Setup, case: str, ours: float, raw: float) -> None:
    emit(setup, part='checkpoint', case=case, ours=ours, raw=raw, unit='s', ratio=ours / raw)


def sharded_checkpoint(setup: Setup, runs: int) -> None:
    """FSDPStrategy's sharded save and resume vs get_state_dict + dcp.save / dcp.load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    strategy = fsdp_strategy(setup)
    model, ow = strategy.prepare(build_model(setup), optim_wrapper=dict(optimizer=adamw_cfg()))
    _ours_step(model, ow)(batches(setup, 1)[0])
    opt = ow.optimizer
    raw_dir = work_dir(setup)
    count = iter(range(10**6))

    saved: list[str] = []  # removed after the timed runs (deleting ~1.5 GB is not a save)

    def ours_save() -> None:
        saved.append(strategy.save_checkpoint(f'iter_{next(count)}', extra_ckpt={'meta': {}}))

    def raw_save() -> None:
        msd, osd = get_state_dict(model, opt)
        saved.append(f'{raw_dir}/{next(count)}')
        dcp.save(dict(model=msd, optim=osd), checkpoint_id=saved[-1])

    t = interleave(setup, dict(ours=ours_save, raw=raw_save), runs)
    _ckpt_row(setup, 'FSDP sharded save vs dcp.save', t['ours'], t['raw'])
    for path in saved:
        shutil.rmtree(path, ignore_errors=True)
    path = strategy.save_checkpoint('resume', extra_ckpt={'meta': {'iter': 1}})
    dcp.save(
        dict(zip(('model', 'optim'), get_state_dict(model, opt))), checkpoint_id=raw_dir + '/r'
    )

    def raw_load() -> None:
        msd, osd = get_state_dict(model, opt)
        state = dict(model=msd, optim=osd)
        dcp.load(state, checkpoint_id=raw_dir + '/r')
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    t = interleave(setup, dict(ours=lambda: strategy.resume(path), raw=raw_load), runs)
    _ckpt_row(setup, 'FSDP verified resume vs dcp.load + set_state_dict', t['ours'], t['raw'])
    shutil.rmtree(raw_dir, ignore_errors=True)


def part_memory(setup: Setup) -> None:
    """Peak device memory of three steps: ours vs the raw loop, each built alone; and doctor's
    estimate of the same config."""
    from stratagem.doctor.memory import estimate_memory

    measured = {}
    for name, build in (('raw', raw_single), ('ours', ours_single)):
        free(setup)
        base = torch.cuda.memory_allocated(setup.device) if setup.cuda else 0
        if setup.cuda:
            torch.cuda.reset_peak_memory_stats(setup.device)
        step, data = build(setup), batches(setup, 1)
        for _ in range(3):
            step(data[0])
        sync(setup)
        measured[name] = (
            torch.cuda.max_memory_allocated(setup.device) - base if setup.cuda else None
        )
        del step, data
    cfg = dict(
        model=model_cfg(setup), optim_wrapper=amp_cfg(), strategy=dict(type='SingleDeviceStrategy')
    )
    x, y = batches(Setup(**{**setup.__dict__, 'dry': True}), 1)[0]  # shapes only, on the CPU
    estimate = estimate_memory(cfg, 1, (x, y))
    gib = 2.0**30
    ours, raw = measured['ours'], measured['raw']
    emit(
        setup,
        part='memory',
        case='peak memory: SingleDevice vs the raw loop',
        ours=ours and ours / gib,
        raw=raw and raw / gib,
        unit='GiB',
        ratio=ours / raw if ours and raw else None,
    )
    emit(
        setup,
        part='memory',
        case="doctor's estimate vs the measured peak",
        ours=estimate.peak / gib,
        raw=ours and ours / gib,
        unit='GiB',
        ratio=estimate.peak / ours if ours else None,
        goal=f'{1 - MEMORY_GOAL:.2f}-{1 + MEMORY_GOAL:.2f}',
        note=estimate.describe(),
    )


# ------------------------------------------------------------------------ processes
def worker(rank: int, world: int, port: int, args: argparse.Namespace, scratch: str) -> None:
    """One rank: the process group (nccl on a GPU, else gloo), then the part."""
    import logging

    import torch.distributed as dist

    as_torchrun_rank(rank, world, port)
    os.environ['GPU_BENCH_TMP'] = scratch
    setup = setup_of(args)
    if setup.cuda:
        torch.cuda.set_device(setup.device)
    logging.getLogger('DeepSpeed').setLevel(logging.WARNING)
    dist.init_process_group('nccl' if setup.cuda else 'gloo', rank=rank, world_size=world)
    try:
        if args.part in ('steps', 'all'):
            part_steps(setup, args.cases)
        if args.part in ('compile', 'all'):
            part_compile(setup)
        if args.part in ('checkpoint', 'all'):
            part_checkpoint(setup)
        if args.part in ('memory', 'all'):
            part_memory(setup)
    finally:
        dist.destroy_process_group()


def setup_of(args: argparse.Namespace) -> Setup:
    shape = 'tiny' if args.dry else 'gpt2'
    return Setup(
        shape=shape,
        batch=2 if args.dry else args.batch,
        seq=SHAPES[shape]['max_len'],
        rounds=1 if args.dry else args.rounds,
        steps=2 if args.dry else args.steps,
        out=args.out,
        dry=args.dry,
        flops=not args.no_flops,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--part', choices=PARTS, required=True)
    p.add_argument('--out', required=True, help='folder for rows.jsonl')
    p.add_argument('--world', type=int, default=1, help='processes, one GPU each (steps)')
    p.add_argument(
        '--cases', nargs='+', default=['SingleDevice', 'DDP', 'FSDP2', 'DeepSpeed ZeRO-2']
    )
    p.add_argument('--batch', type=int, default=8, help='sequences per rank (of 1024 tokens)')
    p.add_argument('--rounds', type=int, default=7)
    p.add_argument('--steps', type=int, default=10, help='steps per block')
    p.add_argument(
        '--no-flops',
        action='store_true',
        help='no FLOP count, no MFU (torch.utils.flop_counter imports dynamo: seconds on a CPU)',
    )
    p.add_argument('--dry', action='store_true', help='toy model on the CPU, 1 round of 2 steps')
    args = p.parse_args(argv)
    if args.part not in ('steps', 'all') and args.world != 1:
        p.error(f'--world {args.world}: only --part steps runs on several GPUs')
    if args.world > 1 and not args.dry and args.world > torch.cuda.device_count():
        p.error(f'--world {args.world}: this machine has {torch.cuda.device_count()} GPU(s)')
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        sys.exit('bench.py: no CUDA device here; --dry runs the same code on the CPU')
    if args.world == 1:  # in this process: a hang or an error shows its own traceback
        scratch = tempfile.mkdtemp(prefix='gpu-bench-')
        try:
            worker(0, 1, free_port(), args, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    else:
        spawn_ranks(worker, args, world=args.world, prefix='gpu-bench-')


if __name__ == '__main__':
    main()
