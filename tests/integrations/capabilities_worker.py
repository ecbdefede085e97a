"""One launch of the capability checks of the Lightning adapters
(test_lightning_capabilities.py), under ``torchrun --nproc-per-node 2``: every run below, one
after the other, in the same 2 processes (each Fabric or Trainer finds the process group up).

    torchrun --nproc-per-node 2 capabilities_worker.py OUT

The suite runs them after lightning_worker.py's ``resume`` runs, in its torchrun launch
(``run_all``): Lightning's import costs each process seconds.

- ``fabric-{FSDPStrategy,SubFSDP}``: plain training on FSDPStrategy and on a subclass of it
  that declares nothing of its own: both must take the FSDP path.
- ``fabric-scaled-{DDPStrategy,FSDPStrategy}``: ``auto_scale_lr`` and ``accumulative_counts``
  under Fabric (DDP learns the micro batch from ``setup_dataloaders``, FSDP from
  ``micro_batch_size=``), the loop stepping every ``ACC`` micro-batches as Fabric's idiom does.
- ``fabric-no-micro-batch``: ``auto_scale_lr`` with ``fabric.setup`` before any loader: the
  error.
- ``trainer-scaled-{DDPStrategy,FSDPStrategy}``: the same under the Trainer
  (``accumulate_grad_batches``, the micro batch from its train dataloader).

Every rank writes ``OUT/<run>-rank{r}.pt``: the losses, the lr after set-up, the optimizer
steps taken, the final full parameters and how the parameters looked.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from stratagem.integrations.fabric import StratagemStrategy as FabricStratagem
from stratagem.integrations.lightning import StratagemStrategy as TrainerStratagem
from stratagem.strategies.fsdp import FSDPStrategy

STEPS, ACC, BATCH, BASE, LR = 4, 2, 4, 4, 0.1
MICRO_STEPS = STEPS * ACC  # backward calls of a scaled run
SCALE = dict(enable=True, base_batch_size=BASE)


class SubFSDP(FSDPStrategy):
    """A user's FSDPStrategy: another name, the parent's capabilities."""


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * BATCH * MICRO_STEPS, 4, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def net() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights in every run and rank
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def batch(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data()
    start = (i * 2 + rank) * BATCH
    return x[start : start + BATCH], y[start : start + BATCH]


def count_steps(optimizer: torch.optim.Optimizer) -> list[int]:
    steps = [0]
    optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    return steps


def fabric_plain(out: Path, name: str) -> None:
    cfg_type = SubFSDP if name == 'SubFSDP' else name
    fabric = Fabric(
        accelerator='cpu',
        devices=2,
        strategy=FabricStratagem(dict(type=cfg_type, work_dir=str(out))),
    )
    fabric.launch()
    module = net()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    params = list(model.module.parameters())
    held = [p for group in optimizer.param_groups for p in group['params']]
    losses = []
    for i in range(STEPS):
        x, y = batch(i, fabric.global_rank)
        loss = ((model(x) - y) ** 2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    result = {
        'losses': torch.stack(losses),
        'params': full_params(model.module),
        'dtensor': all(isinstance(p, DTensor) for p in params),
        'optimizer_holds_model_params': len(held) == len(params)
        and all(a is b for a, b in zip(held, params)),
        'strategy': type(fabric.strategy.stratagem).__name__,
    }
    torch.save(result, out / f'fabric-{name}-rank{fabric.global_rank}.pt')


def fabric_scaled(out: Path, name: str) -> None:
    from_loader = name == 'DDPStrategy'  # FSDP: the explicit micro_batch_size
    strategy = FabricStratagem(
        dict(type=name, work_dir=str(out), auto_scale_lr=SCALE),
        optim_wrapper=dict(accumulative_counts=ACC),
        micro_batch_size=None if from_loader else BATCH,
        max_iters=MICRO_STEPS,
    )
    fabric = Fabric(accelerator='cpu', devices=2, strategy=strategy)
    fabric.launch()
    if from_loader:  # the loader set up before the model: its batch size is the micro batch
        fabric.setup_dataloaders(DataLoader(TensorDataset(*data()), batch_size=BATCH))
    module = net()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    lr = optimizer.param_groups[0]['lr']
    steps = count_steps(optimizer.optimizer)
    losses = []
    for i in range(MICRO_STEPS):
        accumulating = (i + 1) % ACC != 0
        x, y = batch(i, fabric.global_rank)
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = ((model(x) - y) ** 2).mean()
            fabric.backward(loss / ACC)
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach().clone())
    result = {
        'losses': torch.stack(losses),
        'params': full_params(model.module),
        'lr': lr,
        'steps': steps[0],
    }
    torch.save(result, out / f'fabric-scaled-{name}-rank{fabric.global_rank}.pt')


def fabric_no_micro_batch(out: Path) -> None:
    strategy = FabricStratagem(dict(type='FSDPStrategy', work_dir=str(out), auto_scale_lr=SCALE))
    fabric = Fabric(accelerator='cpu', devices=2, strategy=strategy)
    fabric.launch()
    module = net()
    try:
        fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
        error = ''
    except ValueError as err:
        error = str(err)
    torch.save({'error': error}, out / f'fabric-no-micro-batch-rank{fabric.global_rank}.pt')


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.losses: list = []
        self.lr: float | None = None
        self.steps = [0]

    def on_train_start(self) -> None:
        optimizer = self.trainer.optimizers[0]
        self.lr = optimizer.param_groups[0]['lr']
        self.steps = count_steps(optimizer)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*data()), batch_size=BATCH)


def trainer_scaled(out: Path, name: str) -> None:
    trainer = Trainer(
        accelerator='cpu',
        devices=2,
        strategy=TrainerStratagem(dict(type=name, work_dir=str(out), auto_scale_lr=SCALE)),
        max_steps=STEPS,
        accumulate_grad_batches=ACC,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    module = Regression()
    trainer.fit(module)
    result = {
        'losses': torch.stack(module.losses),
        'params': full_params(module.net),
        'lr': module.lr,
        'steps': module.steps[0],
    }
    torch.save(result, out / f'trainer-scaled-{name}-rank{trainer.global_rank}.pt')


def run_all(out: Path) -> None:
    """Every run, in order, in these processes."""
    for name in ('FSDPStrategy', 'SubFSDP'):
        fabric_plain(out, name)
    for name in ('DDPStrategy', 'FSDPStrategy'):
        fabric_scaled(out, name)
    fabric_no_micro_batch(out)
    for name in ('DDPStrategy', 'FSDPStrategy'):
        trainer_scaled(out, name)


if __name__ == '__main__':
    run_all(Path(sys.argv[1]))
