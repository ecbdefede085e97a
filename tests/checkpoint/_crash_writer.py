"""Fault-injection helper: a zygote that forks writer children for the test to SIGKILL.

Importing torch takes seconds, so the zygote imports it once and forks a child per round.
Protocol on stdin/stdout, one line each:
    "go BASE [sync|async|strategy]" -> fork a child that saves forever with counters BASE,
                 BASE+1, ...; reply its pid. ``async``: each save is snapshotted and written
                 by an ``AsyncCheckpointWriter`` thread (retention runs after the commit, on
                 that thread), while the main thread already overwrites the live tensors with
                 the next counter, so a snapshot that leaked live memory would show mixed
                 values. ``strategy``: a SingleDeviceStrategy with ``async_checkpoint=True``
                 in a user's loop (``child_strategy``).
    "reap"    -> wait for that child; reply "reaped SIGNAL EXITCODE"
    "dir PATH" -> the next children save into PATH (instead of the first argument); reply "ok"
    "exit"    -> quit
A child saves ``iter_{c}.pth`` (step c) every round, also overwrites ``latest.pth`` every third
round, then keeps the newest 3 ``iter_*`` checkpoints. Every tensor holds the value c.
"""

import os
import sys

import torch

torch.set_num_threads(1)

from stratagem.checkpoint import apply_retention, save_checkpoint  # noqa: E402
from stratagem.checkpoint.async_writer import AsyncCheckpointWriter  # noqa: E402
from stratagem.strategies import SingleDeviceStrategy  # noqa: E402

torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # a first optimizer imports
# torch._dynamo (~1.6 s): once here, not in every forked child

NUMEL = 1 << 18  # 1 MiB of float32 per tensor, 4 tensors + momentum: ~6 MiB per file


def state(counter: int) -> dict:
    value = float(counter)
    return {
        'meta': {'counter': counter, 'note': 'x' * 100},
        'state_dict': {f'layer{i}.weight': torch.full((NUMEL,), value) for i in range(4)},
        'optimizer': {
            'state': {0: {'momentum_buffer': torch.full((NUMEL // 2,), value)}},
            'param_groups': [{'lr': 0.1, 'params': [0]}],
        },
    }


def _save_round(directory: str, checkpoint: dict, counter: int) -> None:
    save_checkpoint(checkpoint, os.path.join(directory, f'iter_{counter}.pth'), step=counter)
    if counter % 3 == 0:
        save_checkpoint(checkpoint, os.path.join(directory, 'latest.pth'), step=counter)
    apply_retention(directory, 3, pattern='iter_*.pth')


def child_async(directory: str, base: int) -> None:
    counter = base
    writer = AsyncCheckpointWriter()
    live = state(counter)
    try:
        while True:
            writer.wait()
            staged = writer.snapshot(live)  # complete when it returns
            writer.submit(_save_round, directory, staged, counter)
            counter += 1
            # training goes on at once: the live state changes while the save is written
            live['meta']['counter'] = counter
            for tensor in live['state_dict'].values():
                tensor.fill_(float(counter))
            live['optimizer']['state'][0]['momentum_buffer'].fill_(float(counter))
    except BaseException as err:  # noqa: BLE001 - never reached under SIGKILL: report and fail the round
        print(f'child error: {err!r}', file=sys.stderr, flush=True)
        os._exit(3)


def build_strategy(directory: str) -> tuple:
    """The user's strategy, model and the tensors ``child_strategy`` sets: built once, in the
    zygote, before forking (its threads start only at a save, which the zygote never makes),
    so that a child is saving from its first instant and every kill lands in its saves."""
    from torch import nn

    strategy = SingleDeviceStrategy(
        work_dir=directory, async_checkpoint=True, log_kwargs=dict(log_level='ERROR')
    )
    model, wrapper = strategy.prepare(
        nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)),
    )
    wrapper.update_params(model(torch.ones(2, 512)).sum())  # creates the momentum
    tensors = list(model.parameters()) + [
        st['momentum_buffer'] for st in wrapper.optimizer.state.values()
    ]
    return strategy, tensors


def child_strategy(directory: str, base: int, built: tuple) -> None:
    """The loop of a user: set the weights and momentum to the counter, save asynchronously
    through a strategy (``built`` by ``build_strategy``), then at once overwrite every tensor
    in place (an EMA update, weight clipping, ...) before waiting for the write. A checkpoint
    that took anything after the call would hold -1 or a mix."""
    counter = base
    strategy, tensors = built
    try:
        while True:
            with torch.no_grad():
                for tensor in tensors:
                    tensor.fill_(float(counter))
            strategy.save_checkpoint(
                f'iter_{counter}.pth', extra_ckpt={'meta': {'counter': counter, 'iter': counter}}
            )
            with torch.no_grad():
                for tensor in tensors:
                    tensor.fill_(-1.0)
            strategy.wait_for_checkpoints()
            apply_retention(directory, 3, pattern='iter_*.pth')
            counter += 1
    except BaseException as err:  # noqa: BLE001 - never reached under SIGKILL: report, fail the round
        print(f'child error: {err!r}', file=sys.stderr, flush=True)
        os._exit(3)


def child(directory: str, base: int) -> None:
    counter = base
    try:
        while True:
            save_checkpoint(
                state(counter), os.path.join(directory, f'iter_{counter}.pth'), step=counter
            )
            if counter % 3 == 0:
                save_checkpoint(state(counter), os.path.join(directory, 'latest.pth'), step=counter)
            apply_retention(directory, 3, pattern='iter_*.pth')
            counter += 1
    except BaseException as err:  # noqa: BLE001 - never reached under SIGKILL: report and fail the round
        print(f'child error: {err!r}', file=sys.stderr, flush=True)
        os._exit(3)


def main() -> None:
    directory = sys.argv[1] if len(sys.argv) > 1 else None
    pid, built = None, None
    print('ready', flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == 'dir':  # one zygote serves several directories (its start-up once)
            directory, built = line[len('dir ') :].rstrip('\n'), None
            print('ok', flush=True)
        elif cmd[0] == 'go':
            mode = cmd[2] if len(cmd) > 2 else 'sync'
            if mode == 'strategy' and built is None:
                built = build_strategy(directory)
            pid = os.fork()
            if pid == 0:
                if mode == 'strategy':
                    child_strategy(directory, int(cmd[1]), built)
                run = {'sync': child, 'async': child_async}[mode]
                run(directory, int(cmd[1]))
            print(pid, flush=True)
        elif cmd[0] == 'reap':
            _, status = os.waitpid(pid, 0)
            signal = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
            print(f'reaped {signal} {code}', flush=True)
        elif cmd[0] == 'exit':
            return


if __name__ == '__main__':
    main()
