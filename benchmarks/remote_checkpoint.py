"""Checkpoints on S3 against the plain client: a local ``moto_server`` (started as
tests/s3_server.py starts it: 127.0.0.1, a free port, an IAM user), reached through s3fs.

For each size (``--mb``: a model of Linear(2048, 2048) layers, plain SGD, so the file is
about that many MB), interleaved rounds, the medians and ratios of:

- upload: ``location.upload_file`` of a committed local checkpoint (the file through
  ``transfer.put_file``: a multipart upload with parts in flight; then its manifest and the
  ``last_checkpoint`` pointer) vs ``s3fs.S3FileSystem.put`` of the same file (s3fs's own
  defaults: one PUT below 100 MiB, 50 MiB parts above). Reported as throughput ours / s3fs
  (goal >= 0.9).
- async save call: ``SingleDeviceStrategy(async_checkpoint=True).save_checkpoint(url)`` (the
  snapshot; the local commit and upload run on the writer thread) vs the same call to a local
  path (goal <= 1.1), ``--calls`` of each per round; the time until committed
  (``wait_for_checkpoints``) is printed beside.
- resume: ``strategy.resume(url)`` (the object read once into memory by ranged GETs,
  verified, loaded) vs ``s3fs.get`` of the file and its manifest to a local directory +
  ``strategy.resume(local)`` (verified the same way; goal <= 1.0).
- DeepSpeed resume (``--deepspeed-mb``, the model's MB; 0 skips): a ZeRO-2 directory of one
  process (torch's Adam: model states plus about 3x their size of optimizer state), resumed
  from the URL (each file DeepSpeed reads read into memory, verified, loaded from there) vs
  ``s3fs.get`` of the directory + ``strategy.resume(local)`` (verified the same way).

Objects are removed after each round (moto keeps them in memory).

    python benchmarks/remote_checkpoint.py [--mb 64 256] [--rounds 5] [--calls 3]
        [--deepspeed-mb 64]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'tests'))


def _model(mb: int) -> nn.Module:
    torch.manual_seed(0)
    layers = max(1, round(mb / 16))  # Linear(2048, 2048): 16 MiB of weights
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(layers)])


def _strategy(work: Path, mb: int, *, async_save: bool):
    from stratagem.strategies import SingleDeviceStrategy

    s = SingleDeviceStrategy(
        work_dir=str(work), async_checkpoint=async_save, log_kwargs=dict(log_level='WARNING')
    )
    model, _ = s.prepare(_model(mb), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)))
    return s, model


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def _one_size(mb: int, rounds: int, calls: int, bucket: str, tmp: Path) -> dict[str, list[float]]:
    import s3fs

    from stratagem.checkpoint import location

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    times: dict[str, list[float]] = {
        k: []
        for k in ('put', 'upload', 'call_local', 'call_s3', 'done_local', 'done_s3', 'get_load')
    }
    times['resume'] = []
    sync, _ = _strategy(tmp / 'sync', mb, async_save=False)
    local_ckpt = Path(sync.save_checkpoint(str(tmp / 'staged' / 'iter_1.pth')))
    size = local_ckpt.stat().st_size
    saver, _ = _strategy(tmp / 'async', mb, async_save=True)
    loader, _ = _strategy(tmp / 'load', mb, async_save=False)
    for i in range(rounds + 1):  # round 0 warms up (connections, staging buffers)
        got: dict[str, list[float]] = {}
        prefix = f'{bucket}/{mb}mb/r{i}'
        for who in ('s3', 'ours') if i % 2 else ('ours', 's3'):
            if who == 's3':
                got['put'] = [_timed(fs.put, str(local_ckpt), f'{prefix}/plain.pth')]
            else:
                url = f's3://{prefix}/up/iter_1.pth'
                got['upload'] = [_timed(location.upload_file, local_ckpt, url)]
        for k in range(calls):  # the call is short and noisy: several per round
            for where in ('s3', 'local') if (i + k) % 2 else ('local', 's3'):
                target = f's3://{prefix}/async{k}/iter_1.pth'
                if where == 'local':
                    target = str(tmp / f'a{i}' / f'{k}' / 'iter_1.pth')
                gc.collect()  # the same start for both: no collection inside the timed call
                time.sleep(0.5)  # the server settles after the uploads above
                t = time.perf_counter()
                saver.save_checkpoint(target)
                got.setdefault(f'call_{where}', []).append(time.perf_counter() - t)
                saver.wait_for_checkpoints()
                got.setdefault(f'done_{where}', []).append(time.perf_counter() - t)
        url = f's3://{prefix}/up/iter_1.pth'

        def get_and_load(url=url, i=i) -> None:
            local = tmp / f'got{i}' / 'iter_1.pth'
            local.parent.mkdir()
            key = url[len('s3://') :]
            fs.get([key, f'{key}.manifest.json'], [str(local), f'{local}.manifest.json'])
            loader.resume(str(local))

        for who in ('ours', 'get') if i % 2 else ('get', 'ours'):
            if who == 'ours':
                got['resume'] = [_timed(loader.resume, url)]
            else:
                got['get_load'] = [_timed(get_and_load)]
        fs.rm(prefix, recursive=True)
        shutil.rmtree(tmp / f'a{i}', ignore_errors=True)
        shutil.rmtree(tmp / f'got{i}', ignore_errors=True)
        if i:
            for key, values in got.items():
                times[key].extend(values)
    saver.wait_for_checkpoints()
    times['size'] = [size]
    return times


def _deepspeed_resume(mb: int, rounds: int, bucket: str, tmp: Path) -> dict[str, list[float]]:
    """DeepSpeed's directory at a URL resumed, vs downloaded by s3fs and resumed locally."""
    import socket

    import s3fs

    from stratagem.strategies import build_strategy

    with socket.socket() as probe:  # a one-process group, as torchrun would start it
        probe.bind(('127.0.0.1', 0))
        port = probe.getsockname()[1]
    os.environ.update(
        RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', LOCAL_WORLD_SIZE='1',
        MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port),
    )  # fmt: skip
    s = build_strategy(
        dict(
            type='DeepSpeedStrategy',
            work_dir=str(tmp / 'ds'),
            zero_optimization=dict(stage=2),
            log_kwargs=dict(log_level='WARNING'),
        )
    )
    model, ow = s.prepare(
        _model(mb),
        optim_wrapper=dict(optimizer=dict(type='Adam', lr=0.01)),
        dispatch_kwargs=dict(max_iters=10, train_micro_batch_size_per_gpu=4),
    )
    ow.update_params(model(torch.randn(4, 2048)).square().mean())
    key = f'{bucket}/deepspeed{mb}/iter_1'
    s.save_checkpoint(f's3://{key}')
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    times: dict[str, list[float]] = {'resume': [], 'get_load': [], 'size': [fs.du(key)]}

    def get_and_load(local: Path) -> None:
        fs.get(key, str(local), recursive=True)
        s.resume(str(local))

    for i in range(rounds + 1):  # round 0 warms up
        got: dict[str, float] = {}
        for who in ('ours', 'get') if i % 2 else ('get', 'ours'):
            gc.collect()
            if who == 'ours':
                got['resume'] = _timed(s.resume, f's3://{key}')
            else:
                got['get_load'] = _timed(get_and_load, tmp / f'ds_got{i}')
        shutil.rmtree(tmp / f'ds_got{i}', ignore_errors=True)
        if i:
            for k, value in got.items():
                times[k].append(value)
    fs.rm(key, recursive=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        '--mb', type=int, nargs='*', default=[64, 256], help='file sizes (none: skip)'
    )
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--calls', type=int, default=3, help='async save calls per round and side')
    parser.add_argument(
        '--deepspeed-mb', type=int, default=64, help="DeepSpeed resume's model MB (0: skip)"
    )
    args = parser.parse_args()
    from s3_server import S3Server

    server = S3Server().start()
    try:
        os.environ.update(server.environment())
        import s3fs

        bucket = 'bench-remote'
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        base = Path(os.environ.get('BENCH_DIR') or tempfile.gettempdir())
        for mb in args.mb:
            tmp = Path(tempfile.mkdtemp(prefix='remote_bench_', dir=base))
            try:
                times = _one_size(mb, args.rounds, args.calls, bucket, tmp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            _report(mb, times, args.rounds)
        if args.deepspeed_mb:
            tmp = Path(tempfile.mkdtemp(prefix='remote_bench_', dir=base))
            try:
                times = _deepspeed_resume(args.deepspeed_mb, args.rounds, bucket, tmp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(
                f'--- DeepSpeed ZeRO-2 directory, {med["size"] / 2**20:.0f} MiB, medians of '
                f'{args.rounds} interleaved rounds\nresume: ours {med["resume"]:.3f} s, '
                f's3fs.get + local resume {med["get_load"]:.3f} s, ratio '
                f'{med["resume"] / med["get_load"]:.2f} (goal <= 1.0); load average '
                f'{os.getloadavg()[0]:.2f}'
            )
    finally:
        server.stop()


def _report(mb: int, times: dict[str, list[float]], rounds: int) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    size = times['size'][0] / 2**20
    print(f'--- {size:.0f} MiB checkpoint, medians of {rounds} interleaved rounds')
    print(
        f'upload: ours {med["upload"]:.3f} s ({size / med["upload"]:.0f} MiB/s), s3fs.put '
        f'{med["put"]:.3f} s ({size / med["put"]:.0f} MiB/s); throughput ours / s3fs '
        f'{med["put"] / med["upload"]:.2f} (goal >= 0.9)'
    )
    print(
        f'async save call ({len(times["call_s3"])} each): to S3 {med["call_s3"] * 1000:.1f} ms, '
        f'local '
        f'{med["call_local"] * 1000:.1f} ms, ratio {med["call_s3"] / med["call_local"]:.2f} '
        f'(goal <= 1.1); committed: S3 {med["done_s3"]:.3f} s, local {med["done_local"]:.3f} s'
    )
    print(
        f'resume: ours {med["resume"]:.3f} s, s3fs.get + local resume {med["get_load"]:.3f} s, '
        f'ratio {med["resume"] / med["get_load"]:.2f} (goal <= 1.0)'
    )
    print(f'load average {os.getloadavg()[0]:.2f}')


if __name__ == '__main__':
    main()
