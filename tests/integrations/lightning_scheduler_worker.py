"""The Trainer with lr schedulers from ``configure_optimizers`` (test_lightning_schedulers.py):
a LightningModule whose ``configure_optimizers`` returns SGD, a warmup ``SequentialLR``
(``LinearLR`` then ``StepLR``) stepped every batch, and a ``ReduceLROnPlateau``
monitoring the logged ``train_loss`` every 2 batches, fitted on our strategy of a kind
(``lightning_worker.OURS``) or on Lightning's own ``'ddp'``, with a save at step
``SAVE_AT`` and a resume from it.

    python lightning_scheduler_worker.py OUT first fsdp,deepspeed,sharded,ddp
    torchrun --nproc-per-node 2 lightning_scheduler_worker.py OUT resume fsdp,...

Every rank writes ``OUT/{kind}-{phase}-rank{r}.pt``: the lr each step used (the optimizer
that steps), the losses and the final parameters.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_worker import BATCH, OURS, SAVE_AT, STEPS, data, net, record
from torch.optim import lr_scheduler as lrs
from torch.utils.data import DataLoader, TensorDataset

from stratagem.integrations.lightning import StratagemStrategy


class Scheduled(LightningModule):
    def __init__(self, batch: int = BATCH) -> None:
        super().__init__()
        self.batch = batch
        self.net = net()
        self.losses: list = []
        self.lrs: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log('train_loss', loss, sync_dist=True)  # the plateau's monitor, one on all ranks
        self.losses.append(loss.detach().clone())
        # what this step's update uses: the optimizer that steps, not the one configured
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]['lr'])
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        warmup = lrs.SequentialLR(
            optimizer,
            [
                lrs.LinearLR(optimizer, start_factor=0.25, total_iters=2),
                lrs.StepLR(optimizer, 2, gamma=0.5),
            ],
            milestones=[2],
        )
        # 'max' of a falling loss: no improvement, so it halves the lr every other time.
        # Every 2 batches: Lightning steps a plateau after ModelCheckpoint's save of the
        # batch, so a resume would miss the update of a batch that saved (step SAVE_AT)
        plateau = lrs.ReduceLROnPlateau(optimizer, mode='max', patience=1, factor=0.5)
        return [optimizer], [
            {'scheduler': warmup, 'interval': 'step'},
            {'scheduler': plateau, 'interval': 'step', 'frequency': 2, 'monitor': 'train_loss'},
        ]

    def train_dataloader(self):
        return DataLoader(TensorDataset(*data()), batch_size=self.batch)


def fit(out: Path, kind: str, phase: str, devices: int = 2) -> None:
    """One fit of ``kind`` (``'ddp'``: Lightning's own) on ``devices`` processes, saving at
    step ``SAVE_AT`` (``first``) or resuming from there (``resume``). The per-process batch
    makes an epoch ``SAVE_AT`` steps: the save is at an epoch's end, where Lightning resumes
    exactly (its loader does not resume mid-epoch)."""
    cfg = OURS.get(kind)
    strategy: Any = StratagemStrategy(dict(cfg, work_dir=str(out / 'work'))) if cfg else kind
    every = out / f'{kind}-every'
    trainer = Trainer(
        accelerator='cpu',
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=[ModelCheckpoint(dirpath=every, every_n_train_steps=SAVE_AT, save_top_k=-1)]
        if phase == 'first'
        else [],
        enable_checkpointing=phase == 'first',
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    module = Scheduled(batch=BATCH * 2 // devices)
    ckpt = every / f'epoch=0-step={SAVE_AT}.ckpt' if phase == 'resume' else None
    trainer.fit(module, ckpt_path=ckpt)
    path = out / f'{kind}-{phase}-rank{trainer.global_rank}.pt'
    record(path, module.losses, module.net)
    result = torch.load(path)
    torch.save({**result, 'lrs': torch.tensor(module.lrs, dtype=torch.float64)}, path)


if __name__ == '__main__':
    out, phase = Path(sys.argv[1]), sys.argv[2]
    for kind in sys.argv[3].split(','):
        fit(out, kind, phase)


def launch(out: Path, kinds: tuple[str, ...]) -> None:
    """``first`` from a plain ``python`` (Lightning's launcher starts rank 1), ``resume``
    under torchrun, each fitting ``kinds`` one after the other in the same 2 processes."""
    from launcher_env import without_launcher

    root = Path(__file__).resolve().parents[2]
    env = without_launcher()
    env['PYTHONPATH'] = os.pathsep.join(
        [str(root), str(root / 'tests'), str(Path(__file__).parent)]
    )
    env.setdefault('OMP_NUM_THREADS', '1')
    script = str(Path(__file__).resolve())
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', '2']
    for cmd in (
        [sys.executable, script, str(out), 'first', ','.join(kinds)],
        [*torchrun, '--standalone', script, str(out), 'resume', ','.join(kinds)],
    ):
        done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(
                f'{" ".join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n'
                f'{done.stderr[-6000:]}'
            )
