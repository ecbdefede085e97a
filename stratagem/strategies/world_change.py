"""Resuming at another world size: where the run stands in the new iteration units.

An iteration holds ``world_size × micro batch`` samples, so when a checkpoint saved by N
processes is resumed by M, every count in iterations changes meaning. A checkpoint's ``meta``
records what is needed to convert (``world_size``, ``train_micro_batch_size_per_gpu``,
``epoch_length``, ``iter``, ``epoch``); :func:`plan_world_size_change` turns it into the new
position, or refuses when the run cannot continue exactly:

1. samples per iteration, before and after (``world_size × micro batch``);
2. the position: ``epoch × new epoch length + samples into the epoch / new samples per
   iteration`` when the run counts epochs (the data loader then skips exactly the samples
   already read), else ``iter × old/new samples per iteration``; it must be a whole number;
3. the ratio that converts every other iteration count (iteration-based schedulers, an
   iteration-counted ``max_iters``): new epoch length / old one, else the samples ratio;
4. accumulation windows must start at the same sample: a checkpoint taken mid-window, or a
   position that falls inside a window, is refused.

Without the micro batch sizes (a hand-written loop that passes no ``dispatch_kwargs``) the
units are unknown: nothing is converted and the change is only reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

__all__ = ['WorldSizeChange', 'WorldSizeChangeError', 'plan_world_size_change']


class WorldSizeChangeError(ValueError):
    """A checkpoint this world size cannot continue from exactly (nothing was loaded)."""


@dataclass
class WorldSizeChange:
    """What changes when a checkpoint saved by ``old_world`` processes resumes on ``new_world``.

    ``new_iter`` / ``ratio`` are None when the units are unknown (no micro batch size).
    """

    old_world: int
    new_world: int
    old_samples_per_iter: int | None = None
    new_samples_per_iter: int | None = None
    saved_iter: int | None = None
    new_iter: int | None = None
    ratio: Fraction | None = None
    max_iters: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)

    def rescale_schedulers(
        self, schedulers: Any, states: Any, epoch_length: int | None, filename: str
    ) -> Any:
        """The saved scheduler ``states`` (a list, or a dict of lists, shaped like
        ``schedulers``) converted to this run's iteration units, ready to load and then
        :meth:`replay_schedulers`. Raises ``ValueError`` before anything is loaded when a
        count does not convert or the replay would need an unknown epoch length."""

        def convert(scheds: list, saved: list) -> list:
            if len(scheds) != len(saved):
                raise ValueError(
                    f'{filename} holds {len(saved)} param scheduler state(s) but '
                    f'{len(scheds)} scheduler(s) were built; the param_scheduler '
                    'config changed since the checkpoint was saved'
                )
            if epoch_length is None and any(st.get('by_epoch') for st in saved):
                raise ValueError(
                    f'resuming {filename} at world size {self.new_world} (saved '
                    f'at {self.old_world}) replays the schedule, which needs '
                    "dispatch_kwargs['epoch_length'] for epoch-based schedulers"
                )
            try:
                return [
                    s.rescaled_state_dict(st, self.ratio, self.new_iter)
                    for s, st in zip(scheds, saved)
                ]
            except ValueError as err:
                raise ValueError(
                    f'cannot resume {filename} exactly at world size {self.new_world} (saved '
                    f'at {self.old_world}): {err}. Schedule by epoch (by_epoch=True or '
                    'convert_to_iter_based=True), choose iteration counts that convert, or '
                    f'resume at world size {self.old_world}'
                ) from None

        if isinstance(schedulers, Mapping):
            return {k: convert(list(schedulers[k]), list(v)) for k, v in states.items()}
        return convert(list(schedulers), list(states))

    def replay_schedulers(self, schedulers: Any, epoch_length: int | None) -> None:
        """Recompute the scheduled values as a run in the new units from its start would
        have them at ``new_iter`` (after the converted states were loaded)."""
        from stratagem.scheduler.replay import replay_schedulers

        groups = schedulers.values() if isinstance(schedulers, Mapping) else [schedulers]
        for group in groups:
            replay_schedulers(list(group), self.new_iter, epoch_length)  # type: ignore[arg-type]

    def describe(self, filename: str, auto_scale_lr: bool = False) -> str:
        """One message saying what the change did to the run."""
        text = (
            f'{filename} was saved with world size {self.old_world}; this run has {self.new_world}.'
        )
        if self.new_iter is not None:
            text += (
                f' Samples per iteration {self.old_samples_per_iter} -> '
                f'{self.new_samples_per_iter}: iteration {self.saved_iter} is iteration '
                f'{self.new_iter} here, and iteration-based schedulers are converted '
                f'(x{self.ratio}).'
            )
        if self.max_iters is not None:
            text += f' max_iters {self.max_iters[0]} -> {self.max_iters[1]}.'
        if auto_scale_lr and self.new_samples_per_iter:
            text += (
                " auto_scale_lr scaled the lr once, for the saving run's batch; the "
                'resumed lr keeps that scaling (the linear rule would multiply it by '
                f'{self.new_samples_per_iter}/{self.old_samples_per_iter} for the new '
                'batch: scale the optimizer lr yourself if you want that).'
            )
        for note in self.notes:
            text += f' Note: {note}.'
        return text

    def as_meta(self) -> dict:
        """A JSON-able record for the returned checkpoint's ``meta['world_size_change']``."""
        return {
            'world_size': [self.old_world, self.new_world],
            'samples_per_iter': [self.old_samples_per_iter, self.new_samples_per_iter],
            'iter': [self.saved_iter, self.new_iter],
            'max_iters': list(self.max_iters) if self.max_iters else None,
        }


def plan_world_size_change(
    meta: Mapping[str, Any],
    dispatch: Mapping[str, Any],
    world_size: int,
    accumulative_counts: int = 1,
    filename: str = 'the checkpoint',
    data_parallel_size: int | None = None,
) -> WorldSizeChange | None:
    """The conversion for resuming ``meta``'s checkpoint at ``world_size``; None if unchanged.

    ``dispatch`` is the strategy's ``dispatch_kwargs`` (this run's ``epoch_length``,
    ``train_micro_batch_size_per_gpu``, ``max_iters``, ``max_epochs``). Samples per iteration
    count the ranks that read different batches: ``data_parallel_size`` (default
    ``world_size``; a mesh's tensor groups read one batch), ``meta['data_parallel_size']``
    for the saving run (default its world size). Raises ``ValueError`` naming both world
    sizes and what to do when the position cannot be converted exactly.
    """
    old = int(meta.get('world_size', 1))
    old_dp = int(meta.get('data_parallel_size', old))
    new_dp = world_size if data_parallel_size is None else int(data_parallel_size)
    if old == world_size and old_dp == new_dp:
        return None
    change = WorldSizeChange(old, world_size, saved_iter=meta.get('iter'))
    micro_old = meta.get('train_micro_batch_size_per_gpu')
    micro_new = dispatch.get('train_micro_batch_size_per_gpu')
    if micro_old is None or micro_new is None or change.saved_iter is None:
        change.notes.append(
            'iteration counters, schedulers and accumulation windows keep the '
            "checkpoint's units (the micro batch size of the saving run or of "
            'this one is unknown: pass dispatch_kwargs=dict('
            'train_micro_batch_size_per_gpu=...) to convert them)'
        )
        return change
    spi_old, spi_new = old_dp * int(micro_old), new_dp * int(micro_new)
    change.old_samples_per_iter, change.new_samples_per_iter = spi_old, spi_new
    it = int(change.saved_iter)
    len_old, len_new, epoch = (
        meta.get('epoch_length'),
        dispatch.get('epoch_length'),
        meta.get('epoch'),
    )
    where = f'iteration {it}'
    if len_old and len_new and epoch is not None:
        samples = (it - int(epoch) * int(len_old)) * spi_old
        where = f'iteration {it}, {samples} samples into epoch {epoch}'
        pos = Fraction(samples, spi_new)
        new_iter = int(epoch) * int(len_new) + pos
        change.ratio = Fraction(int(len_new), int(len_old))
    else:
        new_iter = it * Fraction(spi_old, spi_new)
        change.ratio = Fraction(spi_old, spi_new)
    sizes = (
        f'it was saved by {_ranks(old_dp, old)} × {micro_old} samples = {spi_old} '
        f'samples per iteration at {where}; this run has {new_dp} × {micro_new} = {spi_new}'
    )
    if new_iter.denominator != 1:
        raise WorldSizeChangeError(
            f'cannot resume {filename} exactly at world size {world_size}: {sizes}, so that '
            'position falls inside an iteration. Resume at a world size whose samples per '
            f'iteration divide the samples read so far, at world size {old}, or from a '
            'checkpoint saved at an epoch end'
        )
    change.new_iter = int(new_iter)
    if accumulative_counts > 1 and (
        it % accumulative_counts or change.new_iter % accumulative_counts
    ):
        raise WorldSizeChangeError(
            f'cannot resume {filename} exactly at world size {world_size}: {sizes}, and with '
            f'accumulative_counts={accumulative_counts} iteration {it} becomes '
            f'{change.new_iter}, so the accumulation windows would not start at the same '
            'samples. Resume from a checkpoint saved at an update boundary that stays one '
            f'(an iteration divisible by {accumulative_counts} in both units), or at world '
            f'size {old}'
        )
    if dispatch.get('max_epochs') is None and dispatch.get('max_iters') is not None:
        max_iters = int(dispatch['max_iters'])
        converted = max_iters * change.ratio
        if converted.denominator != 1:
            raise WorldSizeChangeError(
                f'cannot resume {filename} exactly at world size {world_size}: {sizes}, and '
                f"max_iters={max_iters} (counted in the saving run's iterations) is "
                f'{float(converted):g} iterations here; count the run in epochs (max_epochs) '
                f'or resume at world size {old}'
            )
        change.max_iters = (max_iters, int(converted))
    return change


def _ranks(data_parallel: int, world: int) -> str:
    """``4 process(es)``, or ``2 data-parallel rank(s)`` when tensor groups read one batch."""
    if data_parallel == world:
        return f'{world} process(es)'
    return f'{data_parallel} data-parallel rank(s)'
