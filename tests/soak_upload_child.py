"""The process the kill-during-upload soak kills (tests/checkpoint/test_ckpt_remote_soak.py).

:func:`child` (forked from a server that imported torch and stratagem once, so a restart
costs no import): resume from the newest committed checkpoint at ``prefix`` (an S3 URL; the
environment points at the server), then train to ``max_iters``, saving ``iter_N.pth`` there
after every iteration (8 MiB: most of the time goes to the upload) with
``max_keep_ckpts=3``; with ``multipart``, each upload goes up as a multipart upload of two
parts, one after the other (S3's smallest part, one part in flight), so a kill also lands
between its parts and leaves an incomplete upload. It writes ``resumed N``, then ``saving
N`` and ``saved N`` around each save to its log, so that the test knows where its SIGKILL
fell; at the end the final state to ``out``. :func:`run` with ``prefix=None`` is the
uninterrupted reference, in the test's own process.
"""

from __future__ import annotations

import io

import torch
from torch import nn


def _batch(it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + it)
    return torch.randn(4, 1024, generator=g), torch.randn(4, 1024, generator=g)


def state_bytes(model: nn.Module, optim_wrapper) -> bytes:
    buffer = io.BytesIO()
    torch.save({'model': model.state_dict(), 'optim': optim_wrapper.state_dict()}, buffer)
    return buffer.getvalue()


def run(
    prefix: str | None, max_iters: int, work_dir: str, say=print, multipart: bool = False
) -> bytes:
    from stratagem.checkpoint import location, transfer
    from stratagem.strategies import SingleDeviceStrategy

    options = None
    if multipart:  # this process's uploads above 5 MiB go up in parts of 5 MiB
        transfer.PART_BYTES = transfer.MULTIPART_BYTES = transfer.MIN_PART_BYTES
        options = dict(max_concurrency=1)  # s3fs's storage option: one part in flight

    strategy = SingleDeviceStrategy(work_dir=work_dir, env_kwargs=dict(randomness=dict(seed=1)))
    torch.manual_seed(0)
    model, optim_wrapper = strategy.prepare(
        nn.Linear(1024, 1024),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01, momentum=0.9)),
    )
    strategy.checkpointer.backend_args = options
    start = 0
    if prefix is not None:
        checkpoint = strategy.load_or_resume(resume=True, checkpoint_dir=prefix)
        start = 0 if checkpoint is None else int(checkpoint['meta']['iter'])
    say(f'resumed {start}')
    for it in range(start + 1, max_iters + 1):
        inputs, targets = _batch(it)
        optim_wrapper.update_params((model(inputs) - targets).square().mean())
        if prefix is None:
            continue
        say(f'saving {it}')
        strategy.save_checkpoint(f'{prefix}/iter_{it}.pth', extra_ckpt={'meta': {'iter': it}})
        location.apply_retention(prefix, 3, pattern='iter_*', backend_args=options)
        say(f'saved {it}')
    return state_bytes(model, optim_wrapper)


def child(
    prefix: str, max_iters: int, work_dir: str, out: str, log: str, multipart: bool = False
) -> None:
    """The killed process's body: :func:`run`, its lines appended to ``log`` as they happen
    (a file, not a pipe: a SIGKILL leaves every written line readable)."""
    with open(log, 'a', buffering=1) as file:

        def say(line: str) -> None:
            file.write(line + '\n')

        final = run(prefix, max_iters, work_dir, say, multipart)
        with open(out, 'wb') as target:
            target.write(final)
        say('done')
