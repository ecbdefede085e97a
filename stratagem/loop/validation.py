"""Validation and the best checkpoint.

Validation (when ``val_dataloader`` is given) runs after every ``train_cfg.val_interval``
epochs (``by_epoch``) or iterations from ``val_begin`` on, and at the end: :func:`validate`
averages every scalar of the model's output over the whole set, across ranks, each sample once;
logged as ``val/<name>`` (log line, ``metrics.csv``, TensorBoard) after the iteration's train
row, as mmengine does. ``save_best`` (:class:`BestCheckpoint`) then keeps
``best_{name}_{epoch|iter}_{N}.pth``: a second full checkpoint of that moment, excluded from
``max_keep_ckpts``' count and never deleted by it; the previous best is deleted
(``checkpoint.delete_checkpoint``) once the new one is committed. Every checkpoint's
``meta['best']`` carries the best so far, for a resume.

Under a pipeline (FSDPStrategy's ``mesh.pipeline``) each rank holds its stages only: a batch's
value is ``loss``, the model's ``loss(outputs, targets)`` on the last stage's outputs, through
``strategy.eval_step`` (torch's ``schedule.eval``; ``step.eval_values``), the same on every
pipeline rank, and averaged as above.

Both are checked before the first training step (:meth:`Validation.output_names`, one forward
on the rank's first validation batch, then :meth:`BestCheckpoint.check`): a ``save_best`` that
names no validation value, or a model that returns none, stops the run before it trains.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from stratagem.strategies.model_api import call_model

from .batches import build_dataset
from .plan import BestPlan, ValidationPlan, infer_rule
from .step import eval_values, scalars

if TYPE_CHECKING:
    from .checkpoints import Checkpoints

__all__ = ['BestCheckpoint', 'Validation', 'batch_scalars', 'validate']


def validate(
    model: torch.nn.Module,
    loader: Any,
    weights: list[int],
    device: torch.device,
    autocast: bool = False,
    values: Callable[[Any], Mapping[str, Any]] | None = None,
) -> dict[str, float]:
    """Means of every scalar the model returns over the whole validation set, on every rank.

    ``loader`` yields this rank's batches and ``weights`` their sample counts
    (``data.validation_batches``: 0 for a filler batch). Each scalar is taken as its batch's
    mean: the sums of mean × count are added over the ranks (one ``all_reduce``) and divided
    by the total count, so every sample weighs the same, whatever the shard and batch sizes.
    The model runs in eval mode under ``torch.no_grad`` and is put back in train mode;
    ``autocast`` (``val_cfg.fp16``): under ``torch.autocast``, float16 on CUDA, else bfloat16.
    ``values``: one batch's scalars (:func:`step.eval_values` under a pipeline); default: those
    of the model's output.
    """
    from stratagem import env

    dtype = torch.float32 if device.type == 'mps' else torch.float64
    sums: dict[str, torch.Tensor] = {}
    model.eval()
    try:
        half = torch.float16 if device.type == 'cuda' else torch.bfloat16
        with torch.no_grad(), torch.autocast(device.type, dtype=half, enabled=autocast):
            for batch, weight in zip(loader, weights):
                for name, value in batch_scalars(model, batch, device, values).items():
                    total = sums.setdefault(name, torch.zeros((), dtype=dtype, device=device))
                    total.add_(torch.as_tensor(value, device=device).to(dtype), alpha=weight)
    finally:
        model.train()
    count = torch.tensor(float(sum(weights)), dtype=dtype, device=device)
    reduced = env.all_reduce(torch.stack([*sums.values(), count]))
    means = (reduced[:-1] / reduced[-1]).tolist()
    return dict(zip(sums, means))


def batch_scalars(
    model: torch.nn.Module,
    batch: Any,
    device: torch.device,
    values: Callable[[Any], Mapping[str, Any]] | None = None,
) -> Mapping[str, Any]:
    """The scalars the model returns for one validation batch (the caller sets eval mode and
    no_grad), through ``values`` where given (:func:`validate`'s); a ValueError when there is
    none. ``stratagem doctor`` runs it on the meta model."""
    got = scalars(call_model(model, batch, device)) if values is None else values(batch)
    if not got:
        raise ValueError(
            'the model returned no scalar in validation (a loss tensor or a dict '
            'of scalars such as loss and acc is averaged and logged)'
        )
    return got


class Validation:
    """This rank's validation shard and when it runs. ``seed``: the run's shuffling seed
    (``val_dataloader.sampler.seed`` wins); ``history``: ``(iter, {name: mean})`` per
    validation; ``lines``: the last one's log lines, until the loop writes them after the
    train row (:meth:`take`)."""

    def __init__(
        self,
        plan: ValidationPlan,
        strategy: Any,
        seed: int,
        device: torch.device,
        epoch_length: int,
        max_iters: int,
        by_epoch: bool,
    ) -> None:
        from stratagem.data import validation_batches

        self.plan, self.device, self.strategy = plan, device, strategy
        self.epoch_length, self.max_iters, self.by_epoch = epoch_length, max_iters, by_epoch
        dataset = build_dataset(plan.dataset)
        batches = validation_batches(
            len(dataset),  # type: ignore[arg-type]
            strategy.data_parallel_rank,
            strategy.data_parallel_size,
            plan.batch_size,
            shuffle=plan.shuffle,
            seed=seed if plan.seed is None else int(plan.seed),
        )
        self.loader = DataLoader(
            dataset, batch_sampler=[b for b, _ in batches], **plan.loader_kwargs
        )
        self.weights = [w for _, w in batches]
        self.history: list[tuple[int, dict[str, float]]] = []
        self.lines: list[str] = []

    def output_names(self, model: torch.nn.Module) -> list[str]:
        """The names validation will average, from one forward on this rank's first batch
        through :func:`validate` (every rank runs it: a forward may be a collective). Run at
        the start, so that a ``save_best`` naming none of them stops the run before it trains;
        the RNG streams are left as they were (reading a batch draws a loader seed), so a
        resumed run still equals an uninterrupted one."""
        devices = [self.device] if self.device.type not in ('cpu', 'meta') else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            batch = next(iter(self.loader))
            return list(
                validate(
                    model,
                    [batch],
                    [1],
                    self.device,
                    self.plan.autocast,
                    eval_values(self.strategy, model),
                )
            )

    def due(self, it: int) -> bool:
        """After iteration ``it``: every ``val_interval`` epochs (``by_epoch``) or iterations
        from ``val_begin`` on, and at the end, as mmengine's train loops."""
        if it == self.max_iters:
            return True
        if self.by_epoch:
            if it % self.epoch_length:
                return False
            it //= self.epoch_length
        return it >= self.plan.begin and it % self.plan.interval == 0

    def run(self, model: torch.nn.Module, it: int) -> dict[str, float]:
        """Validate after iteration ``it``: the means, kept in :attr:`history`, and their log
        line, kept for :meth:`take`."""
        values = validate(
            model,
            self.loader,
            self.weights,
            self.device,
            self.plan.autocast,
            eval_values(self.strategy, model),
        )
        self.history.append((it, values))
        n = len(self.weights)
        epoch = (it - 1) // self.epoch_length + 1
        where = f'Epoch(val) [{epoch}][{n}/{n}]' if self.by_epoch else f'Iter(val) [{n}/{n}]'
        self.lines = [
            f'{where} iter {it}/{self.max_iters}'
            + ''.join(f' val/{k} {v:.4f}' for k, v in values.items())
        ]
        return values

    def take(self) -> tuple[dict[str, float], list[str]] | None:
        """The last validation's means and lines, once (None when none is waiting)."""
        if not self.lines:
            return None
        lines, self.lines = self.lines, []
        return self.history[-1][1], lines


class BestCheckpoint:
    """``default_hooks.checkpoint.save_best``: the best validation value so far, its rule and
    its file (restored on resume from the checkpoint's ``meta['best']``)."""

    def __init__(self, plan: BestPlan) -> None:
        self.metric: str = plan.metric
        self.rule: str | None = plan.rule
        self.keys = (plan.greater_keys, plan.less_keys)
        self.by_epoch: bool = plan.by_epoch
        self.score: float | None = None
        self.filename: str | None = None

    def restore(self, meta: Mapping) -> None:
        saved = meta.get('best')
        if isinstance(saved, Mapping) and self.metric in ('auto', saved.get('metric')):
            self.metric, self.rule = saved['metric'], saved['rule']
            self.score, self.filename = saved['score'], saved['checkpoint']

    def check(self, names: Any) -> None:
        """``save_best`` against the names of the model's validation values (``'auto'``
        becomes the first), its rule inferred when none is given: a ValueError naming the
        key and the names there are. Run at the start (:meth:`Validation.output_names`) and
        by ``stratagem doctor``, before any training."""
        names = list(names)
        if self.metric == 'auto':
            self.metric = names[0]
        if self.metric not in names:
            raise ValueError(
                f'default_hooks.checkpoint.save_best={self.metric!r} is not a validation '
                f"value: the model's validation output has {names}"
            )
        if self.rule is None:
            self.rule = infer_rule(self.metric, *self.keys)

    def due(self, values: Mapping[str, float]) -> bool:
        """Whether ``values`` hold a new best (``'auto'`` becomes their first name)."""
        self.check(values)
        value = values[self.metric]
        if math.isnan(value):
            return False
        if self.score is None:
            return True
        return value > self.score if self.rule == 'greater' else value < self.score

    def save(self, it: int, values: Mapping[str, float], checkpoints: Checkpoints) -> str:
        """Save the new best after iteration ``it`` and then delete the previous one (the new
        one committed first); returns the line that says so."""
        previous, self.score = self.filename, values[self.metric]
        self.filename = self.name_for(it, checkpoints.epoch_length)
        checkpoints.save(self.filename, it)
        if previous and previous != self.filename:
            checkpoints.delete(previous)
        return f'best {self.metric} {self.score:.4f}: {self.filename}'

    def name_for(self, it: int, epoch_length: int) -> str:
        """mmengine's ``best_{metric}_{epoch|iter}_{N}.pth``."""
        metric = self.metric.replace('/', '_')
        if self.by_epoch and it % epoch_length == 0:
            return f'best_{metric}_epoch_{it // epoch_length}.pth'
        return f'best_{metric}_iter_{it}.pth'

    def meta(self) -> dict:
        """``{'best': {metric, rule, score, checkpoint}}`` for a checkpoint's meta ({}
        before the first validation)."""
        if self.score is None:
            return {}
        return {
            'best': {
                'metric': self.metric,
                'rule': self.rule,
                'score': self.score,
                'checkpoint': self.filename,
            }
        }
