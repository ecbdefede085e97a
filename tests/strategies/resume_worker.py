"""A training run for the exact-resume test, in its own process.

    python resume_worker.py WORK_DIR OUT [--stop K] [--save-at J ...] [--resume CKPT]

Trains a dropout MLP with SGD(momentum), warmup LinearLR then cosine by
iteration, accumulative_counts=3, AmpOptimWrapper(bf16) and norm clipping on
batches drawn from torch's global RNG, up to iteration K (saving a checkpoint
there; ``--save-at J``: also at iteration J on the way), optionally resuming first.
Writes weights, the lr trace (iteration -> lr) and the next RNG draw to OUT.
"""

import argparse
import sys

import torch
from torch import nn
from torch.nn import functional as F

from stratagem.strategies import SingleDeviceStrategy

MAX_ITERS = 21


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('work_dir')
    parser.add_argument('out')
    parser.add_argument('--stop', type=int, default=MAX_ITERS)
    parser.add_argument('--save-at', type=int, action='append', default=[])
    parser.add_argument('--resume')
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = SingleDeviceStrategy(
        work_dir=args.work_dir, env_kwargs=dict(randomness=dict(seed=1234))
    )
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    model, optim_wrapper, schedulers = strategy.prepare(
        model,
        optim_wrapper=dict(
            type='AmpOptimWrapper',
            dtype='bfloat16',
            accumulative_counts=3,
            optimizer=dict(type='SGD', lr=0.2, momentum=0.9),
            clip_grad=dict(type='norm', max_norm=0.5),
        ),
        param_scheduler=[
            dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=6),
            dict(
                type='CosineAnnealingLR',
                by_epoch=False,
                begin=6,
                end=MAX_ITERS,
                T_max=15,
                eta_min=0.01,
            ),
        ],
        dispatch_kwargs=dict(max_iters=MAX_ITERS),
    )
    start = 0
    if args.resume:
        start = strategy.resume(args.resume)['meta']['iter']
    lrs = {}
    for it in range(start, args.stop):
        x = torch.randn(6, 8)
        y = torch.randint(3, (6,))
        with optim_wrapper.optim_context(model):
            loss = F.cross_entropy(model(x).float(), y)
        optim_wrapper.update_params(loss)
        lrs[it] = optim_wrapper.get_lr()['lr'][0]
        for s in schedulers:
            s.step()
        if it + 1 in args.save_at:  # as a run stopped there would save
            strategy.save_checkpoint(f'iter_{it + 1}.pth', extra_ckpt={'meta': {'iter': it + 1}})
    if args.stop < MAX_ITERS:
        strategy.save_checkpoint(f'iter_{args.stop}.pth', extra_ckpt={'meta': {'iter': args.stop}})
    torch.save(
        {
            'state_dict': model.state_dict(),
            'lrs': lrs,
            'next_draw': torch.rand(4),
            'skipped': getattr(optim_wrapper, 'skipped_steps', None),
        },
        args.out,
    )


if __name__ == '__main__':
    sys.exit(main())
