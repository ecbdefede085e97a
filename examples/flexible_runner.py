"""stratagem inside mmengine's FlexibleRunner: train, then resume with resume=True.

    pip install "stratagem[mmengine]"
    python examples/flexible_runner.py [--work-dir work_dirs/flexible] [--epochs 3]
    python examples/flexible_runner.py --epochs 4 --resume      # continues at epoch 4
    torchrun --nproc-per-node 2 examples/flexible_runner.py --strategy stratagem.DDPStrategy

mmengine builds the runner, its loops, hooks and message hub; the stratagem strategy named
in ``strategy=`` builds and wraps the model, optim wrapper and schedulers, and writes the
checkpoints (atomic, with a manifest, loaded back with ``torch.load(weights_only=True)``).
"""

import argparse
import os

import torch
from mmengine.model import BaseModel
from mmengine.runner import FlexibleRunner
from torch import nn
from torch.nn import functional as F

import stratagem.integrations.mmengine  # noqa: F401  (allow-list, 'stratagem.*' names)
from stratagem.data import SyntheticClassification


class Classifier(BaseModel):
    """An mmengine model: ``forward(..., mode='loss')`` returns a dict of losses."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, inputs, labels, mode='tensor'):
        logits = self.net(inputs)
        if mode == 'loss':
            return {'loss': F.cross_entropy(logits, labels)}
        return logits


def collate(batch):
    inputs, labels = zip(*batch)
    return {'inputs': torch.stack(inputs), 'labels': torch.stack(labels)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--work-dir', default='work_dirs/flexible')
    parser.add_argument('--epochs', type=int, default=3)
    parser.add_argument('--strategy', default='stratagem.SingleDeviceStrategy')
    parser.add_argument('--resume', action='store_true')
    args = parser.parse_args()

    torch.manual_seed(0)
    runner = FlexibleRunner(
        model=Classifier(),
        work_dir=args.work_dir,
        strategy=dict(type=args.strategy),
        launcher='pytorch' if 'WORLD_SIZE' in os.environ else 'none',
        env_cfg=dict(dist_cfg=dict(backend='nccl' if torch.cuda.is_available() else 'gloo')),
        randomness=dict(seed=0),
        train_dataloader=dict(
            dataset=SyntheticClassification(num_samples=256),
            batch_size=32,
            sampler=dict(type='DefaultSampler', shuffle=True),
            collate_fn=collate,
        ),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)),
        param_scheduler=[
            dict(type='LinearLR', start_factor=0.1, by_epoch=False, end=8),
            dict(type='MultiStepLR', milestones=[2, 3], end=4),
        ],
        train_cfg=dict(by_epoch=True, max_epochs=args.epochs),
        default_hooks=dict(
            checkpoint=dict(type='CheckpointHook', interval=1),
            logger=dict(type='LoggerHook', interval=4),
        ),
        resume=args.resume,
    )
    runner.train()
    print(
        f'finished at epoch {runner.epoch}, iter {runner.iter}; checkpoints in {runner.work_dir}',
        flush=True,
    )


if __name__ == '__main__':
    main()
