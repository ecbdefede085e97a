"""stratagem inside a hand-written training loop.

    python examples/embed_in_your_loop.py [--work-dir work_dirs/embed] [--iters 120]

The strategy builds and wraps the model, the optim wrapper (accumulation,
clipping) and the schedulers; the loop stays yours. Run it twice with
``--resume`` to continue from the latest checkpoint.
"""

import argparse

import torch

from stratagem.data import SyntheticClassification
from stratagem.strategies import build_strategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--work-dir', default='work_dirs/embed')
    parser.add_argument('--iters', type=int, default=120)
    parser.add_argument('--resume', action='store_true')
    args = parser.parse_args()

    strategy = build_strategy(
        dict(type='auto', work_dir=args.work_dir, env_kwargs=dict(randomness=dict(seed=0)))
    )
    model, optim_wrapper, schedulers = strategy.prepare(
        dict(type='MLPClassifier', in_features=16, num_classes=4, hidden=32),
        optim_wrapper=dict(
            optimizer=dict(type='SGD', lr=0.05, momentum=0.9),
            accumulative_counts=2,
            clip_grad=dict(type='norm', max_norm=5.0),
        ),
        param_scheduler=[
            dict(type='LinearLR', start_factor=0.1, by_epoch=False, end=20),
            dict(type='CosineAnnealingLR', by_epoch=False, begin=20, T_max=args.iters - 20),
        ],
        dispatch_kwargs=dict(max_iters=args.iters),
    )
    start = 0
    ckpt = strategy.load_or_resume(resume=args.resume)
    if ckpt is not None:
        start = ckpt['meta']['iter']

    data = SyntheticClassification(num_samples=4096, seed=0)
    for it in range(start, args.iters):
        idx = torch.randint(len(data), (32,))
        x, y = data.inputs[idx], data.targets[idx]
        with optim_wrapper.optim_context(model):
            loss = model(x, y)['loss']
        optim_wrapper.update_params(loss)
        for s in schedulers:
            s.step()
        if (it + 1) % 20 == 0:
            print(
                f'iter {it + 1:4d} loss {loss.item():.4f} lr {optim_wrapper.get_lr()["lr"][0]:.4f}'
            )
            strategy.save_checkpoint(f'iter_{it + 1}.pth', extra_ckpt={'meta': {'iter': it + 1}})


if __name__ == '__main__':
    main()
