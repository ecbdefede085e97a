"""Check 5 of ``stratagem doctor``: every count of every scheduler against the
run's length.

Each scheduler is built as a run builds it (``scheduler.build_param_scheduler`` with the run's
``epoch_length`` / ``max_epochs`` / ``max_iters``, on a one-parameter optimizer), so the forms a
run accepts are the forms checked: a list, one dict, a dict of lists for several optimizers,
``convert_to_iter_based`` (the counts come back in iterations), defaults of ``end`` and
``T_max``, lr, momentum and generic parameter schedulers. Read after building: ``begin``,
``end`` and the lengths each class names in ``_epoch_args`` (``T_max``, ``milestones``,
``periods``, ``total_steps``, ``step_size``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ['SchedulerChecks', 'scheduler_cfgs']

_WARMUPS = {
    'LinearLR',
    'ConstantLR',
    'LinearMomentum',
    'ConstantMomentum',
    'LinearParamScheduler',
    'ConstantParamScheduler',
}


def scheduler_cfgs(cfg: Mapping) -> list[tuple[str, Mapping]]:
    """``(where, scheduler cfg)`` for every form of ``param_scheduler``: one dict, a list, or
    a dict of lists (or dicts) keyed by optimizer name."""
    scheds = cfg.get('param_scheduler') or []
    if isinstance(scheds, Mapping) and 'type' in scheds:
        return [('param_scheduler', scheds)]
    if isinstance(scheds, Mapping):
        out = []
        for name, value in scheds.items():
            items = value if isinstance(value, (list, tuple)) else [value]
            out += [(f'param_scheduler.{name}[{i}]', s) for i, s in enumerate(items)]
        return [(w, s) for w, s in out if isinstance(s, Mapping)]
    return [(f'param_scheduler[{i}]', s) for i, s in enumerate(scheds) if isinstance(s, Mapping)]


def _dummy_optimizer(param_name: str) -> Any:
    import torch

    group: dict[str, Any] = dict(lr=0.1, momentum=0.9, weight_decay=1e-4)
    group.setdefault(param_name, 0.1)
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], **group)


class SchedulerChecks:
    """The scheduler checks of ``checks.Doctor`` (which provides ``cfg``, ``add``, the run's
    ``max_iters`` / ``max_epochs`` / ``epoch_length`` and ``notes``)."""

    cfg: Mapping
    add: Callable[[str, str, str], None]
    notes: list[str]
    max_iters: int | None
    max_epochs: int | None
    epoch_length: int | None
    findings: list

    def check_schedulers(self) -> None:
        import warnings

        from stratagem.scheduler import build_param_scheduler

        windows = []
        for where, s in scheduler_cfgs(self.cfg):
            if any(f.where.startswith(where) for f in self.findings):
                continue  # its keys are already reported
            if s.get('convert_to_iter_based') and not self.epoch_length:
                self.notes.append(f'{where}: convert_to_iter_based, epoch length unknown: skipped')
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter('ignore')
                    built = build_param_scheduler(
                        dict(s),
                        _dummy_optimizer(str(s.get('param_name', 'lr'))),
                        epoch_length=self.epoch_length,
                        max_epochs=self.max_epochs,
                        max_iters=self.max_iters,
                    )
            except Exception as err:  # noqa: BLE001 - the run would fail the same way
                self.add(where, f'cannot build {s.get("type")}: {err}', 'fix the arguments named')
                continue
            window = self._check_counts(where, s, built)
            if window is not None:
                windows.append((where, s.get('type'), _param_of(built), *window))
        self._check_overlaps(windows)

    def _limit(self, by_epoch: bool) -> tuple[int | None, str]:
        if not by_epoch:
            return self.max_iters, 'iterations'
        if self.max_epochs is None and self.max_iters and self.epoch_length:
            return -(-self.max_iters // self.epoch_length), 'epochs'
        return self.max_epochs, 'epochs'

    def _check_counts(self, where: str, s: Mapping, built: Any) -> tuple[int, int] | None:
        """Findings for ``built``'s counts; its window in iterations (None if unknown)."""
        from stratagem.scheduler import INF

        name, by_epoch = type(built).__name__, built.by_epoch
        limit, unit = self._limit(by_epoch)
        conv = ' (convert_to_iter_based)' if s.get('convert_to_iter_based') else ''
        begin, end = int(built.begin), int(built.end)
        if limit is None:
            return None
        if end != INF and end > limit:
            self.add(
                f'{where}.end',
                f'{name} ends at {end}{conv} but the run has {limit} {unit}: the schedule is '
                'cut short',
                f"set end={limit} or leave end out (it defaults to the run's length)",
            )
        if begin >= limit:
            self.add(
                f'{where}.begin',
                f'{name} begins at {begin}{conv} but the run has {limit} {unit}: it never runs',
                f'set begin below {limit}',
            )
        stop = min(end, limit)
        span = stop - begin
        for field in built.step_args:
            value = getattr(built, field, None)
            if value is not None and span > 0:
                self._check_field(where, name, field, value, begin, span, limit, unit, conv)
        scale = self.epoch_length if by_epoch else 1
        return (begin * scale, stop * scale) if scale else None

    def _check_field(
        self, where: str, name: str, field: str, value: Any, begin: int, span: int, limit: int,
        unit: str, conv: str,
    ) -> None:  # fmt: skip
        run = f'{name} runs {span} {unit} ([{begin}, {begin + span}) of a {limit}-{unit} run)'
        at = f'{where}.{field}'
        if field == 'T_max' and value > span:
            self.add(
                at,
                f'T_max={value}{conv} but {run}: the value never reaches its minimum (eta_min)',
                f'set T_max={span} or leave T_max out (it defaults to end - begin)',
            )
        elif field == 'T_max' and value < span:
            self.add(
                at,
                f'T_max={value}{conv} but {run}: past T_max the cosine rises again',
                f'set T_max={span}, or end={begin + value} (then a following scheduler takes over)',
            )
        elif field == 'milestones':
            late = sorted(m for m in value if m >= span)
            if late:
                self.add(
                    at,
                    f'milestone(s) {late}{conv} (counted from begin={begin}) are never '
                    f'reached: {run}',
                    f'use milestones below {span}',
                )
        elif field == 'step_size' and value >= span:
            self.add(
                at,
                f'step_size={value}{conv} but {run}: the value never steps',
                f'use a step_size below {span}',
            )
        elif field == 'periods' and sum(value) > span:
            self.add(
                at,
                f'periods sum to {sum(value)}{conv} but {run}: the last cycle(s) are cut short',
                f'make the periods sum to {span}',
            )
        elif field == 'total_steps' and value != span:
            what = (
                'the cycle is cut short (the lr never anneals to its minimum)'
                if value > span
                else 'the run steps past the cycle, which is an error at that step'
            )
            self.add(
                at,
                f'total_steps={value}{conv} but {run}: {what}',
                f'set total_steps={span} or leave it out (it defaults to end - begin)',
            )

    def _check_overlaps(self, windows: list[tuple]) -> None:
        # mmengine multiplies the factors of overlapping schedules of one parameter; a warmup
        # over a main schedule is the expected overlap and is not reported
        for a in range(len(windows)):
            for b in range(a + 1, len(windows)):
                (i, ta, pa, ba, ea), (j, tb, pb, bb, eb) = windows[a], windows[b]
                same = pa == pb and i.split('[')[0] == j.split('[')[0]  # one optimizer
                if not same or max(ba, bb) >= min(ea, eb) or (ta in _WARMUPS) != (tb in _WARMUPS):
                    continue
                self.add(
                    f'{i}, {j}',
                    f'{ta} [{ba}, {ea}) and {tb} [{bb}, {eb}) overlap (iterations): their '
                    'factors multiply',
                    f'start the second where the first ends (begin={ea})',
                )


def _param_of(built: Any) -> str:
    return str(getattr(built, 'param_name', 'lr'))
