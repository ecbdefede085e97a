"""One launch of the Lightning checks (test_fabric.py, test_lightning.py,
test_lightning_backends.py): Fabric and the Trainer, each on our StratagemStrategy and on
Lightning's own 'ddp', one after the other in the same 2 processes (the second Fabric or
Trainer finds the processes started and the process group up, and uses them).

    python lightning_worker.py OUT first    # Lightning's launcher: 10 steps, save at 5
    torchrun --nproc-per-node 2 lightning_worker.py OUT resume   # resume at 5, to 10
    python lightning_worker.py OUT first fabric,trainer fsdp,ddp   # parts, then kinds
    torchrun ... lightning_worker.py OUT resume fabric,trainer ours,ddp CAPS   # and then
        capabilities_worker.py's runs into CAPS (their failure there, in CAPS/failed.rank<r>.txt)

A kind is one of ``OURS`` (our strategy of that cfg) or ``'ddp'`` (Lightning's own). Every
rank writes ``OUT/{fabric,trainer}-{kind}-{phase}-rank{r}.pt``: the losses of the steps it
ran and the final parameters (whole, under the module's own names).
``lightning_scheduler_worker.py`` runs its model, data and ``record`` with lr schedulers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stratagem.integrations.fabric import StratagemStrategy as FabricStratagem
from stratagem.integrations.lightning import StratagemStrategy as TrainerStratagem

STEPS, SAVE_AT, BATCH = 10, 5, 4
# our strategies by kind; 'ddp' is Lightning's own, the reference
OURS = {
    'ours': dict(type='DDPStrategy'),
    'fsdp': dict(type='FSDPStrategy'),
    'deepspeed': dict(type='DeepSpeedStrategy', zero_optimization=dict(stage=2)),
    'sharded': dict(type='ShardedDDPStrategy'),
}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * BATCH * SAVE_AT, 4, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def net() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights in every run and rank
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def record(path: Path, losses: list, model: nn.Module) -> None:
    """Every rank calls it: FSDP's sharded parameters are gathered (a collective)."""
    from torch.distributed.tensor import DTensor

    params = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        params[k.removeprefix('module.')] = v.detach().clone()  # a DDP wrapper's prefix
    torch.save({'losses': torch.stack(losses), 'params': params}, path)


def fabric_run(out: Path, kind: str, phase: str) -> None:
    strategy = (
        FabricStratagem(dict(OURS[kind], work_dir=str(out / 'work'))) if kind in OURS else 'ddp'
    )
    fabric = Fabric(accelerator='cpu', devices=2, strategy=strategy)
    fabric.launch()
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = data()
    ckpt = out / f'fabric-{kind}.ckpt'
    state = {'model': model, 'optimizer': optimizer, 'step': 0}
    if phase == 'resume':
        remainder = fabric.load(ckpt, state)
        assert state['step'] == SAVE_AT, state['step']
        assert 'step' not in remainder
    losses = []
    while state['step'] < STEPS:
        i = (state['step'] % SAVE_AT) * 2 * BATCH + fabric.global_rank * BATCH
        loss = ((model(x[i : i + BATCH]) - y[i : i + BATCH]) ** 2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
        state['step'] += 1
        if phase == 'first' and state['step'] == SAVE_AT:
            fabric.save(ckpt, state)
    record(out / f'fabric-{kind}-{phase}-rank{fabric.global_rank}.pt', losses, model.module)


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.losses: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*data()), batch_size=BATCH)


def trainer_run(out: Path, kind: str, phase: str) -> None:
    strategy = (
        TrainerStratagem(dict(OURS[kind], work_dir=str(out / 'work'))) if kind in OURS else 'ddp'
    )
    every = out / f'trainer-{kind}-every'  # keeps all: the resume reads step 5
    latest = out / f'trainer-{kind}-latest'  # keeps one: step 5 removed at step 10
    callbacks = [
        ModelCheckpoint(dirpath=every, every_n_train_steps=SAVE_AT, save_top_k=-1),
        ModelCheckpoint(dirpath=latest, every_n_train_steps=SAVE_AT, save_top_k=1, mode='max'),
    ]
    trainer = Trainer(
        accelerator='cpu',
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=callbacks if phase == 'first' else [],
        enable_checkpointing=phase == 'first',
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    module = Regression()
    ckpt = every / f'epoch=0-step={SAVE_AT}.ckpt' if phase == 'resume' else None
    trainer.fit(module, ckpt_path=ckpt)
    record(out / f'trainer-{kind}-{phase}-rank{trainer.global_rank}.pt', module.losses, module.net)


def capabilities(out: Path) -> None:
    """capabilities_worker.py's runs into ``out``; their failure into ``out/failed.txt``
    (rank 0's), so that this launch's own checks stand apart from them."""
    import traceback

    from capabilities_worker import run_all

    out.mkdir(exist_ok=True)
    try:
        run_all(out)
    except Exception:  # noqa: BLE001 - test_lightning_capabilities.py reports it
        rank = os.environ.get('RANK', '0')
        (out / f'failed.rank{rank}.txt').write_text(traceback.format_exc())


if __name__ == '__main__':
    out, phase = Path(sys.argv[1]), sys.argv[2]
    parts = sys.argv[3].split(',') if len(sys.argv) > 3 else ['fabric', 'trainer']
    kinds = sys.argv[4].split(',') if len(sys.argv) > 4 else ['ours', 'ddp']
    for part in parts:
        for kind in kinds:
            (fabric_run if part == 'fabric' else trainer_run)(out, kind, phase)
    if len(sys.argv) > 5:
        capabilities(Path(sys.argv[5]))


_LAUNCHED: dict[str, Path] = {}


CAPABILITIES = 'capabilities'  # launch_both's folder of capabilities_worker.py's runs


def launch_both(tmp_path_factory: Any, kinds: tuple[str, ...] = ('ours', 'ddp')) -> Path:
    """Both launches of Fabric and the Trainer on ``kinds``, once per test session and kinds
    (test_fabric.py and test_lightning.py read the same files): ``first`` from a plain
    ``python`` (Lightning's launcher starts rank 1), ``resume`` under torchrun. Returns the
    directory they wrote to. The default kinds' torchrun launch then runs
    capabilities_worker.py's runs (test_lightning_capabilities.py) into ``CAPABILITIES``
    there: one launch of Lightning's processes less."""
    from launcher_env import without_launcher

    key = ','.join(kinds)
    if key in _LAUNCHED:
        return _LAUNCHED[key]
    out = Path(tmp_path_factory.mktemp('lightning'))
    root = Path(__file__).resolve().parents[2]
    env = without_launcher()
    env['PYTHONPATH'] = os.pathsep.join([str(root), str(root / 'tests')])
    env.setdefault('OMP_NUM_THREADS', '1')
    script = str(Path(__file__).resolve())
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', '2']
    torchrun.append('--standalone')  # a free port of its own
    then = [str(out / CAPABILITIES)] if kinds == ('ours', 'ddp') else []
    for cmd in (
        [sys.executable, script, str(out), 'first', 'fabric,trainer', key],
        [*torchrun, script, str(out), 'resume', 'fabric,trainer', key, *then],
    ):
        done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(
                f'{" ".join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n'
                f'{done.stderr[-6000:]}'
            )
    _LAUNCHED[key] = out
    return out


def load_results(
    out: Path, name: str, kinds: tuple[str, ...] = ('ours', 'ddp')
) -> dict[tuple[str, str, int], dict]:
    """``{(kind, phase, rank): {'losses', 'params'}}`` of ``name`` ('fabric' / 'trainer')."""
    return {
        (kind, phase, rank): torch.load(out / f'{name}-{kind}-{phase}-rank{rank}.pt')
        for kind in kinds
        for phase in ('first', 'resume')
        for rank in (0, 1)
    }
